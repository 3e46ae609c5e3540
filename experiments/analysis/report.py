#!/usr/bin/env python3
"""The analysis of one experiment of linrope-experiments, which runs it after each experiment:

    /usr/bin/python3 experiments/analysis/report.py <experiment> <dir> [--no-plots]

reads <dir>/<stem>.csv and <stem>.json (the measurements and metadata the program wrote) and
writes, each through a temporary name and a rename:
  summary.json        every derived number the report quotes (fits, means over seeds, ...),
  <figures>.png/.svg  the plots (not with --no-plots),
  report_section.md   the experiment's section of REPORT.md, its prose written from summary.json.
Exit status 0; 3 if the section was written but the plots could not be made (the last line of
stderr says why, e.g. matplotlib missing); anything else is a failure.
"""
import importlib
import os
import sys

from common import duration, fmt, read_json, read_rows, write_atomic, write_json

EXPERIMENTS = ["scaling", "normalization", "favor_error", "rope_decay", "rope_relative"]
PLOTS_FAILED = 3


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


def render(stem, directory, title, meta, figures, paragraphs, plot_note):
    links = ("Data: [`{0}/{0}.csv`]({0}/{0}.csv), metadata: [`{0}/{0}.json`]({0}/{0}.json)"
             .format(stem))
    if meta["status"] == "complete":
        links += ", derived numbers: [`{0}/summary.json`]({0}/summary.json)".format(stem)
    md = "## %s\n\n_%s_ %s.\n\n" % (title, provenance(meta), links)
    missing = False
    for name, caption in figures:
        if os.path.exists(os.path.join(directory, name)):
            md += "![%s](%s/%s)\n\n*%s*\n\n" % (caption, stem, name, caption)
        else:
            missing = True
    if missing:
        md += "> Some plots were not generated%s. The CSV holds every number.\n\n" % (
            ": " + plot_note if plot_note else "")
    return md + "".join(p + "\n\n" for p in paragraphs)


def main(argv):
    args = [a for a in argv[1:] if a != "--no-plots"]
    plots = "--no-plots" not in argv
    if len(args) != 2 or args[0].replace("-", "_") not in EXPERIMENTS:
        sys.stderr.write("usage: report.py {%s} DIR [--no-plots]\n" % ",".join(EXPERIMENTS))
        return 2
    stem, directory = args[0].replace("-", "_"), args[1]
    meta = read_json(os.path.join(directory, stem + ".json"))
    section = os.path.join(directory, "report_section.md")
    if meta["status"] != "complete":
        # Figures and findings drawn from part of a sweep would read as results: none are made.
        paragraph = (
            "Interrupted by %s after %d of %d points; the CSV holds those points only, so this "
            "section has no figures or findings. Run `linrope-experiments %s --resume` with the "
            "same options to measure the rest and write it." % (
                meta["signal"], meta["points_saved"],
                meta["points_total"], meta["experiment"]))
        write_atomic(section, render(stem, directory, meta["experiment"] +
                                     ": interrupted, incomplete", meta, [], [paragraph], None))
        summary = os.path.join(directory, "summary.json")
        if os.path.exists(summary):
            os.remove(summary)  # it described the earlier, complete CSV
        return 0

    module = importlib.import_module(stem)
    rows = read_rows(directory, stem)
    summary = module.analyse(rows, meta)
    write_json(os.path.join(directory, "summary.json"), summary)
    status, plot_note = 0, "run with --no-plots"
    if plots:
        plot_note = None
        try:
            import matplotlib

            matplotlib.use("Agg")
            module.plot(directory, rows, summary)
        except ImportError as error:
            status, plot_note = PLOTS_FAILED, "%s (%s)" % (error, sys.executable)
    write_atomic(section, render(stem, directory, module.TITLE, meta,
                                 module.figures(summary, meta),
                                 module.paragraphs(summary, meta), plot_note))
    if status == PLOTS_FAILED:
        sys.stderr.write(plot_note + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv))
