#!/usr/bin/env python3
"""The analysis of the experiments and their report, from the measurements alone:

    /usr/bin/python3 experiments/analysis/report.py RESULTS [--no-plots]

For each experiment with output under RESULTS, in report order (the five of linrope-experiments,
each RESULTS/<stem>/<stem>.csv and <stem>.json; then the training experiment, RESULTS/training/,
its CSVs and training.json), it writes into that experiment's directory
  summary.json        every derived number the report quotes (fits, means over seeds, ...),
  <figures>.png/.svg  the plots (not with --no-plots, nor without matplotlib),
  report_section.md   the experiment's section, its prose written from summary.json,
then RESULTS/REPORT.md, the sections in report order. Every file is written under a temporary
name and renamed. The experiment programs never read any of this: the data flow one way, from
them to here. An experiment whose metadata says its sweep was interrupted gets a section saying
so, and its figures and summary.json (drawn from an earlier, complete CSV) are removed; without
plots, so are the figures older than an experiment's metadata (drawn from an earlier run).

    /usr/bin/python3 experiments/analysis/report.py --training DIR [--no-plots]

does the same for the training experiment's output in DIR alone (`python3 -m training --out DIR`),
without a REPORT.md.

Exit status 0 (without matplotlib too: one line on stderr says the plots were not made); 1 if an
experiment's analysis failed (one line on stderr each; its section says why, the others are
written); 2 for a bad command line.
"""
import importlib
import os
import sys

from common import duration, fmt, read_json, read_rows, write_atomic, write_json

PROGRAM_EXPERIMENTS = ["scaling", "normalization", "favor_error", "rope_decay", "rope_relative"]
EXPERIMENTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER = ("# linrope experiments\n\n"
          "Written by `experiments/analysis/report.py` from the CSV and JSON that each experiment "
          "wrote (`linrope-experiments` for sections 1-5, `python3 -m training` for the training "
          "experiment); each section's first line says when, where and how its data were "
          "measured.\n\n")
USAGE = "usage: report.py RESULTS [--no-plots]  |  report.py --training DIR [--no-plots]\n"


def provenance(meta):
    commit = meta["git_commit"][:12] + (" with local changes" if meta.get("git_dirty") else "")
    isa = meta["isa"][0] if meta["isa"] else "baseline"
    widest = meta["machine"]["isa"][0] if meta["machine"]["isa"] else None
    if widest and widest != isa:
        isa += " on a CPU with " + widest
    return ("Run %s, --%s mode, commit %s, %s (%d cores, %d threads, built for %s, load average "
            "%s before the run), %s; %d points measured, %d resumed." % (
                meta["date"], meta["options"]["mode"], commit, meta["machine"]["cpu"],
                meta["machine"]["cores"], meta["openmp"]["threads"], isa,
                fmt(meta["load_average_before"]), duration(meta["duration_s"]),
                meta["points_measured"], meta["points_resumed"]))


def figure_lines(stem, directory, figures, plot_note):
    """The figures that exist, and a note when any is missing (plot_note says why)."""
    md, missing = "", False
    for name, caption in figures:
        if os.path.exists(os.path.join(directory, name)):
            md += "![%s](%s/%s)\n\n*%s*\n\n" % (caption, stem, name, caption)
        else:
            missing = True
    if missing:
        md += "> Some plots were not generated%s. The CSV holds every number.\n\n" % (
            ": " + plot_note if plot_note else "")
    return md


def render(stem, directory, title, meta, figures, paragraphs, plot_note):
    links = ("Data: [`{0}/{0}.csv`]({0}/{0}.csv), metadata: [`{0}/{0}.json`]({0}/{0}.json)"
             .format(stem))
    if meta["status"] == "complete":
        links += ", derived numbers: [`{0}/summary.json`]({0}/summary.json)".format(stem)
    md = "## %s\n\n_%s_ %s.\n\n" % (title, provenance(meta), links)
    return md + figure_lines(stem, directory, figures, plot_note) + "".join(
        p + "\n\n" for p in paragraphs)


def is_figure(name):
    return os.path.splitext(name)[1] in (".png", ".svg")


def remove_derived(directory):
    """summary.json and the figures: what an earlier analysis drew from an earlier CSV."""
    for name in os.listdir(directory):
        if name == "summary.json" or is_figure(name):
            os.remove(os.path.join(directory, name))


def remove_stale_figures(directory, metadata):
    """The figures older than the metadata (written when a run ends): drawn from an earlier run's
    CSV, they would be linked beside findings they no longer match when no plots are made."""
    written = os.path.getmtime(metadata)
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if is_figure(name) and os.path.getmtime(path) < written:
            os.remove(path)


def program_section(stem, directory, plot_note):
    """The section of one experiment of linrope-experiments (summary, plots, prose)."""
    meta = read_json(os.path.join(directory, stem + ".json"))
    if meta["status"] != "complete":
        # Figures and findings drawn from part of a sweep would read as results: none are made.
        remove_derived(directory)
        paragraph = (
            "Interrupted by %s after %d of %d points; the CSV holds those points only, so this "
            "section has no figures or findings. Run the same command with `--resume` "
            "(`linrope-experiments %s --resume` with the same options, or the same "
            "`bash scripts/experiments.sh` command with `--resume`) to measure the rest." % (
                meta["signal"], meta["points_saved"], meta["points_total"], meta["experiment"]))
        return render(stem, directory, meta["experiment"] + ": interrupted, incomplete", meta,
                      [], [paragraph], None)
    module = importlib.import_module(stem)
    rows = read_rows(directory, stem)
    summary = module.analyse(rows, meta)
    write_json(os.path.join(directory, "summary.json"), summary)
    if plot_note is None:
        module.plot(directory, rows, summary)
    else:
        remove_stale_figures(directory, os.path.join(directory, stem + ".json"))
    return render(stem, directory, module.TITLE, meta, module.figures(summary, meta),
                  module.paragraphs(summary, meta), plot_note)


def training_section(directory, plot_note, link_prefix):
    # The training package reads its runs into its own types (training.results, which needs
    # torch and linrope): imported only when there is a training output to analyse.
    if EXPERIMENTS_DIR not in sys.path:
        sys.path.append(EXPERIMENTS_DIR)
    from training import report as training_report

    return training_report.section(directory, plot_note, link_prefix)


def failed_section(name, stem, why):
    return ("## %s\n\n> The analysis failed: %s. The data are in `%s/`; "
            "`/usr/bin/python3 experiments/analysis/report.py RESULTS` writes this section "
            "again.\n\n" % (name, why, stem))


def plots_unavailable():
    """None if matplotlib can draw, else why not (one line)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401  (the backend's own imports can fail too)
    except ImportError as error:
        return "%s (%s)" % (error, sys.executable)
    return None


def main(argv):
    args = [a for a in argv[1:] if a != "--no-plots"]
    plots = "--no-plots" not in argv
    training_only = args[:1] == ["--training"]
    if training_only:
        args = args[1:]
    if len(args) != 1 or args[0].startswith("-"):
        sys.stderr.write(USAGE)
        return 2
    results = args[0]
    if not os.path.isdir(results):
        sys.stderr.write("report.py: %s is not a directory\n" % results)
        return 2
    plot_note = plots_unavailable() if plots else "run with --no-plots"
    if plots and plot_note:
        sys.stderr.write("report.py: plots not made: %s\n" % plot_note)

    if training_only:
        jobs = [("training", results, "training.json")]
    else:
        jobs = [(stem, os.path.join(results, stem), stem + ".json")
                for stem in PROGRAM_EXPERIMENTS + ["training"]]
    sections, status = [], 0
    for stem, directory, metadata in jobs:
        if not os.path.exists(os.path.join(directory, metadata)):
            continue  # not run (yet), or stopped before its first point finished
        try:
            if stem == "training":
                md = training_section(directory, plot_note, "" if training_only else "training/")
            else:
                md = program_section(stem, directory, plot_note)
        except Exception as error:  # one experiment's failure leaves the others' sections
            why = "%s: %s" % (type(error).__name__, error)
            sys.stderr.write("report.py: %s: analysis failed: %s\n" % (stem, why))
            md, status = failed_section(stem.replace("_", "-"), stem, why), 1
        write_atomic(os.path.join(directory, "report_section.md"), md)
        sections.append(md)
    if not training_only:
        if not sections:
            sections = ["No experiment output under `%s` (each experiment writes its own "
                        "directory there).\n" % results]
        write_atomic(os.path.join(results, "REPORT.md"), HEADER + "".join(sections))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv))
