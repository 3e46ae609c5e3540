"""The training experiment's analysis, called by experiments/analysis/report.py (which writes
REPORT.md): from a training output directory's CSVs and training.json, summary.json (every number
the report quotes, summary.py), the plots (plots.py) and the REPORT.md section, its sentences
written from summary.json (cells by variant name, read back into variants.Variant). The training
run itself (python3 -m training) writes only the CSVs and the JSON."""
import json
import os

from analysis.common import write_json  # experiments/analysis

from .plots import plot
from .results import read_tables
from .answers import opening, previous_study
from .summary import spread, summarise
from .variants import DEFAULT_FEATURE_FACTOR, FEATURE_MAPS, Variant, from_name
from .wording import REFERENCE, compare, describe, format_spread, placement


def _linear(kind, placement=None):
    """The name of the linear variant of map `kind` at `placement` (None: no denominator)."""
    return Variant("linear", kind, placement or "numerator_only",
                   denominator=placement is not None).name


def _denominator_cell(s):
    """The worst layer's shares of non-positive and of tiny denominators over every training
    step (mean over seeds), or a dash (softmax, no denominator)."""
    if not s["layers"] or not any(d["nonpositive_share"]["n"] for d in s["layers"].values()):
        return "-"

    def worst(key):
        return max(d[key]["mean"] for d in s["layers"].values() if d[key]["n"])
    return "%.1f%% / %.1f%%" % (100 * worst("nonpositive_share"), 100 * worst("tiny_share"))


def _ranked(cells, kind):
    """The cells of map `kind`'s variants that have a final bpc, best first."""
    names = [v for v in cells if from_name(v).feature_map == kind and cells[v]["final_bpc"]["n"]]
    return sorted(names, key=lambda v: cells[v]["final_bpc"]["mean"])


def _table(cells, context):
    ref = cells.get(REFERENCE)
    lines = ["| variant | best lr | final val bpc | vs softmax + RoPE (paired) | diverged | "
             "den <= 0 / tiny (worst layer) | bpc at %d / %d | tokens/s |" % (
                 2 * context, 4 * context), "|---|---|---|---|---|---|---|---|"]
    for v, s in cells.items():
        ext = s["extrapolation"]
        lines.append("| %s | %g | %s | %s | %d of %d | %s | %s / %s | %.0f |" % (
            describe(v), s["lr"], format_spread(s["final_bpc"]),
            "-" if v == REFERENCE or not ref else compare(s, ref), s["diverged"],
            s["seeds"], _denominator_cell(s), format_spread(ext.get(str(2 * context), spread([]))),
            format_spread(ext.get(str(4 * context), spread([]))), s["tokens_per_s"]["mean"]))
    return "\n".join(lines)


def _placements(cells):
    sentences = []
    for kind, names in FEATURE_MAPS.items():
        ranking = _ranked(cells, kind)
        if len(ranking) < 2:
            continue
        first = cells[ranking[0]]
        sentences.append("for %s, **%s** (%.3f), then %s" % (
            names.label, placement(ranking[0]), first["final_bpc"]["mean"], "; ".join(
                "%s %s" % (placement(v), compare(cells[v], first)) for v in ranking[1:])))
    return sentences


def _full(cells, threshold):
    out = []
    for kind, names in FEATURE_MAPS.items():
        f, n = cells.get(_linear(kind, "full")), cells.get(_linear(kind, "numerator_only"))
        if not f or not n:
            continue
        text = "%s: full %s" % (names.label, "diverged in %d of %d seeds (at step %s)" % (
            f["diverged"], f["seeds"], ", ".join(map(str, f["diverged_steps"])))
            if f["diverged"] else "never diverged")
        text += ", ended %s bpc from numerator_only" % compare(f, n)
        if f["layers"]:
            text += "; its denominators: " + ", ".join(
                "layer %s smallest %.3g, %.2f%% non-positive, %.2f%% tiny" % (
                    layer, d["den_min"], 100 * d["nonpositive_share"]["mean"],
                    100 * d["tiny_share"]["mean"]) for layer, d in f["layers"].items())
            text += " (numerator_only's smallest: %s)" % ", ".join(
                "%.3g" % d["den_min"] for d in n["layers"].values())
        nodenom = cells.get(_linear(kind))
        if nodenom and nodenom["final_bpc"]["n"]:
            text += (". Without a denominator (RoPE on the features, an RMSNorm per head): %s "
                     "bpc from full, %s from numerator_only" % (compare(nodenom, f),
                                                                compare(nodenom, n)))
        out.append(text)
    if not out:
        return None
    return ("**Full normalisation, and dropping the denominator.** " + ". ".join(out) +
            ". Shares are over every denominator of every training step; tiny means |den| < %g."
            % threshold)


def _softmax_gap(cells):
    if REFERENCE not in cells or not cells[REFERENCE]["final_bpc"]["n"]:
        return None
    ref = cells[REFERENCE]
    parts = []
    for kind, names in FEATURE_MAPS.items():
        ranking = _ranked(cells, kind)
        if ranking:
            parts.append("%s at its best (%s) %s" % (names.label, placement(ranking[0]),
                                                     compare(cells[ranking[0]], ref)))
    nopos = cells.get(Variant("softmax", rope=False).name)
    if nopos and nopos["final_bpc"]["n"]:
        parts.append("softmax without positions %s" % compare(nopos, ref))
    return "**Against softmax + RoPE** (%.3f bpc), paired by seed: %s." % (
        ref["final_bpc"]["mean"], "; ".join(parts))


def _sensitivity(lm):
    grid, best = lm["grid"], lm["best_lr"]
    if not any(len(g) > 1 for g in grid.values()):
        return None
    rates = sorted({float(r) for g in grid.values() for r in g})
    edge = [v for v in best if best[v] in (rates[0], rates[-1])]
    diverged = ["%s at %s" % (describe(v), ", ".join(r for r, x in g.items() if x is None))
                for v, g in grid.items() if any(x is None for x in g.values())]
    spreads = sorted(((max(x for x in g.values() if x is not None) -
                       min(x for x in g.values() if x is not None), v)
                      for v, g in grid.items() if any(x is not None for x in g.values())),
                     reverse=True)
    text = ("**Learning rate.** The grid (%s, the first seed) picked: %s. Final bpc across the "
            "grid varies most for %s and least for %s." % (
                ", ".join("%g" % r for r in rates),
                ", ".join("%s %g" % (describe(v), best[v]) for v in best),
                ", ".join("%s (%.3f)" % (describe(v), d) for d, v in spreads[:2]),
                ", ".join("%s (%.3f)" % (describe(v), d) for d, v in spreads[-2:])))
    if edge:
        text += (" At the grid's edge (the best may lie beyond it): %s." %
                 ", ".join(describe(v) for v in edge))
    if diverged:
        text += " Diverged in the grid: %s." % "; ".join(diverged)
    return text


def _long_context(char_lm):
    contexts = sorted(char_lm, key=int)
    if len(contexts) < 2:
        return None
    short, long = char_lm[contexts[0]]["cells"], char_lm[contexts[-1]]["cells"]
    changes = []
    for kind, names in FEATURE_MAPS.items():
        at_long = _ranked(long, kind)
        at_short = [v for v in _ranked(short, kind) if v in at_long]
        if len(at_long) >= 2:
            changes.append("%s: %s at %s (at %s: %s)%s" % (
                names.label, ", ".join(placement(v) for v in at_long), contexts[-1], contexts[0],
                ", ".join(placement(v) for v in at_short),
                " -- **the order changes**" if at_long != at_short else ""))
        elif at_long:
            changes.append("%s: %s alone at %s" % (
                names.label, placement(at_long[0]), contexts[-1]))
    ref_s, ref_l = short.get(REFERENCE), long.get(REFERENCE)
    gaps = []
    if ref_s and ref_l:
        for v in long:
            if v != REFERENCE and v in short:
                gaps.append("%s %s -> %s" % (describe(v),
                                             compare(short[v], ref_s).split(" ")[0],
                                             compare(long[v], ref_l).split(" ")[0]))
    text = "**Long context** (%s against %s; the same tokens per step, the learning rate of %s): " \
           "the placements trained at both, best first: %s." % (
               contexts[-1], contexts[0], contexts[0], "; ".join(changes) or "n/a")
    if gaps:
        text += " The gap to softmax + RoPE (paired mean) from %s to %s: %s." % (
            contexts[0], contexts[-1], ", ".join(gaps))
    return text


def _extrapolation(cells, context):
    ext = []
    for v, s in cells.items():
        e = s["extrapolation"]
        if all(str(m * context) in e and e[str(m * context)]["n"] for m in (1, 4)):
            ext.append((e[str(4 * context)]["mean"], e[str(context)]["mean"], v))
    if not ext:
        return None
    ext.sort()
    return ("**Extrapolation from %d** (validation bpc at the training context -> at 4x it, best "
            "at 4x first): " % context + ", ".join(
                "%s %.3f -> %.3f (%+.3f)" % (describe(v), at_1x, at_4x, at_4x - at_1x)
                for at_4x, at_1x, v in ext) + ".")


def _redraws(lm):
    if not lm["redrawn"]:
        return None
    parts = []
    for name, r in lm["redrawn"].items():
        redrawn = from_name(name)
        fixed_name = redrawn.replace(redraw_interval=0).name
        fixed = lm["cells"].get(fixed_name)
        if fixed:
            parts.append("%s: redrawn every %d steps %s, %s bpc against W fixed (%s)" % (
                describe(fixed_name), redrawn.redraw_interval, format_spread(r["final_bpc"]),
                compare(r, fixed), format_spread(fixed["final_bpc"])))
    return "**Feature redraws** (FAVOR+'s two best placements, at their best rate): " + \
        "; ".join(parts) + "."


def _steps(s):
    """'1200 (900-1500, 2 seeds)', or how many seeds never reached it."""
    missing = s["seeds"] - s["n"] if "seeds" in s else 0
    if not s["n"]:
        return "never"
    text = format_spread(s, 0)
    return text + (" (%d not)" % missing if missing else "")


def _reached(cell, threshold):
    return _steps(dict(cell["steps_to_%g" % threshold], seeds=cell["seeds"]))


def _setting_label(name):
    """'64x4' -> 'length 64, 4 pairs' ('+' between settings trained in turn)."""
    return " then ".join("length %s, %s pairs" % tuple(part.split("x"))
                         for part in name.split("+"))


def _mqar_table(name, m):
    lines = ["| variant | lr | state floats (all layers) | final accuracy | steps to 0.9 | "
             "steps to 0.99 | diverged |", "|---|---|---|---|---|---|---|"]
    for v, s in m["cells"].items():
        lines.append("| %s | %g | %s | %s | %s | %s | %d of %d |" % (
            describe(v), s["lr"], s["state_floats"] if s["state_floats"] is not None else "-",
            format_spread(s["final_accuracy"]), _reached(s, 0.9), _reached(s, 0.99),
            s["diverged"], s["seeds"]))
    return ("MQAR (Zoology's multi-query associative recall) at %s (each run until its "
            "held-out accuracy reaches the stop accuracy or its step cap, %s steps): final "
            "query accuracy on held-out sequences, mean over seeds (range), each variant at "
            "its best rate; the steps to 0.9 and 0.99 are the first evaluated steps there. "
            "State floats: what one sequence's decoding caches hold at the length trained "
            "(softmax: every key and value so far):\n\n" % (
                _setting_label(name), ", ".join(sorted({"%d" % s["steps"] for s in
                                                        m["cells"].values() if s["steps"]})))
            + "\n".join(lines))


def _recall(name, m):
    """The sentences on one setting: softmax's recall, the best linear variant's, and what
    the short convolution, the decay and more features change (paired by seed)."""
    cells = m["cells"]
    pairs = int(name.split("+")[-1].split("x")[1])
    words = []
    soft = cells.get(REFERENCE)
    if soft and soft["final_accuracy"]["n"]:
        words.append("softmax + RoPE %s" % format_spread(soft["final_accuracy"]))
    linear = [v for v in cells if from_name(v).linear and cells[v]["final_accuracy"]["n"]]
    if linear:
        best = max(linear, key=lambda v: (cells[v]["final_accuracy"]["mean"],
                                          -(cells[v]["state_floats"] or 0)))
        words.append("the best linear variant, %s, %s with %s state floats" % (
            describe(best), format_spread(cells[best]["final_accuracy"]),
            cells[best]["state_floats"]))
    for v in cells:
        variant = from_name(v)
        for label, base in (("the short convolution", variant.replace(short_conv=0)),
                            ("the decay", variant.replace(decay=None)),
                            ("%dx the features" % variant.feature_factor,
                             variant.replace(feature_factor=DEFAULT_FEATURE_FACTOR))):
            if base != variant and base.name in cells and not (
                    label == "the decay" and variant.short_conv):
                words.append("%s adds to %s %s" % (label, describe(base.name), compare(
                    cells[v], cells[base.name], "final_accuracy")))
    if not words:
        return None
    text = "; ".join(words)
    return ("**Recall at %s.** " % _setting_label(name) + text[0].upper() + text[1:] +
            ". Guessing among the sequence's values would score 1/pairs = %.3f." % (1 / pairs))


def _mqar(mq):
    out = []
    for name, m in mq.items():
        out.append(_mqar_table(name, m))
        recall = _recall(name, m)
        if recall:
            out.append(recall)
    return out


def _decoding(summary):
    decoding = summary.get("decoding")
    if not decoding:
        return None
    parts = []
    for context, per in decoding.items():
        for v, d in per.items():
            if not d["positions"]:
                continue
            parts.append("%s (trained at %s): %.2f ms per token at position %d, %.2f ms at %d; "
                         "caches %.1f KiB -> %.1f KiB" % (
                             describe(v), context, 1e3 * d["seconds_per_token"][0],
                             d["positions"][0], 1e3 * d["seconds_per_token"][-1],
                             d["positions"][-1], d["cache_bytes"][0] / 1024,
                             d["cache_bytes"][-1] / 1024))
    return ("**Decoding** (`python3 -m training.generate`, a character at a time through the "
            "caches, batch 1, one thread): " + "; ".join(parts) + ".")


def _samples(summary):
    samples = summary.get("samples")
    if not samples:
        return None
    rows = ["| variant | sample (prompt, then %d characters at temperature %g) | words in the "
            "training text |" % (len(samples[0]["text"]) - len(samples[0]["prompt"]),
                                 samples[0]["temperature"]), "|---|---|---|"]
    for s in samples:
        text = s["text"].replace("|", "\\|").replace("\n", " / ")
        known = ("%d of %d" % (s["known_words"], s["words"]) if s.get("words") is not None
                 else "-")
        rows.append("| %s | %s | %s |" % (describe(s["variant"]), text, known))
    return ("Samples from the final model of each variant's first seed (context %d, its chosen "
            "rate; one prompt, one sampling seed), with how many of the sampled words (letter "
            "runs, the last cut-off one left out) occur in the training text:\n\n"
            % samples[0]["context"] + "\n".join(rows))


def _step_time(st):
    ratio = {v: st["seconds"][REFERENCE][-1] / st["seconds"][v][-1] for v in st["crossover"]}

    def crossing(c):  # analysis.common.crossover's
        if c["kind"] == "not_reached":
            return "not within the lengths measured"
        if c["kind"] == "faster_throughout":
            return "already at n = %d, the shortest length measured" % c["n"]
        return "from n = %.0f" % c["n"]

    return ("**Step time of one layer** (the training's layer shape, forward + backward, batch 1, "
            "%d threads; the 1-minute load average was %.2f when it began): at n = %d, %s. In "
            "this one-layer timing linear attention is faster than softmax: %s. (The whole "
            "model's training throughput is the tokens/s columns above, two runs at once.)" % (
                st["threads"], st["load_average_before"], st["lengths"][-1], ", ".join(
                    "%s takes %.2fx softmax + RoPE's time" % (describe(v), 1 / r)
                    for v, r in ratio.items()),
                "; ".join("%s %s" % (describe(v), crossing(c))
                          for v, c in st["crossover"].items())))


def corpus_name(meta):
    """How the captions name the text: Austen's novels, or the file given with --text."""
    return (meta.get("corpus") or {}).get("name") or "text (training.json missing)"


def findings(summary, meta):
    out = []
    corpus = corpus_name(meta)
    for context, lm in sorted(summary.get("char_lm", {}).items(), key=lambda kv: int(kv[0])):
        context = int(context)
        cells = lm["cells"]
        out.append("### Character-level %s, context %d\n\nEach variant at its best learning "
                   "rate (the grid's, or at longer contexts the shortest context's), mean over "
                   "seeds with the range in brackets; differences are paired by seed (the same "
                   "seed trains every variant on the same batches):\n\n%s" % (
                       corpus, context, _table(cells, context)))
        for paragraph in (_sensitivity(lm),
                          ("**Which placement trains best** (final validation bpc, each at its "
                           "best rate; the others as differences from the best): " +
                           "; ".join(_placements(cells)) + ".") if _placements(cells) else None,
                          _full(cells, meta.get("stats_threshold", 1e-3)),
                          _softmax_gap(cells), _extrapolation(cells, context), _redraws(lm)):
            if paragraph:
                out.append(paragraph)
    long = _long_context(summary.get("char_lm", {}))
    if long:
        out.append(long)
    if summary.get("mqar"):
        out.append("### MQAR")
        out += _mqar(summary["mqar"])
    if summary.get("decoding") or summary.get("samples"):
        out.append("### The models in use")
        out += [p for p in (_decoding(summary), _samples(summary)) if p]
    if summary.get("step_time"):
        out.append(_step_time(summary["step_time"]))
    return out


def section(out, plot_note=None, link_prefix="training/"):
    """Writes out/summary.json and, when plot_note is None, the plots; returns the section's
    markdown, its links prefixed with link_prefix (the directory's path from REPORT.md's).
    plot_note says why there are no plots (--no-plots, matplotlib missing)."""
    meta_path = os.path.join(out, "training.json")
    meta = {}
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
    summary = summarise(out)
    write_json(os.path.join(out, "summary.json"), summary)
    figures = plot(out, summary, corpus_name(meta), read_tables(out)) \
        if plot_note is None else []
    md = "## Training: numerator-only against full normalisation\n\n"
    if meta:
        processes = meta.get("processes", 1)  # under torchrun
        # "data" or "sequence" parallel; training.json files older than the mode have neither.
        how = "torchrun, %s parallel" % meta["parallel"] if meta.get("parallel") else "torchrun"
        at_once = ("each run on %d processes (%s)" % (processes, how) if processes > 1 else
                   "%s runs at once" % meta["jobs"])
        md += ("_Run %s, --%s, commit %s%s, %s (%s cores; %s, %s thread each), "
               "%.0f min; command: `%s`._ Data: %s; derived numbers: [`summary.json`]"
               "(%ssummary.json).\n\n" % (
                   meta["date"], meta["mode"], (meta["git_commit"] or "unknown")[:12],
                   " with local changes" if meta["git_dirty"] else "", meta["machine"]["cpu"],
                   meta["machine"]["cores"], at_once, meta["threads"],
                   meta["duration_s"] / 60, meta["command"], ", ".join(
                       "[`{0}`]({1}{0})".format(name, link_prefix) for name in (
                           "runs.csv", "curves.csv", "layers.csv", "evaluations.csv",
                           "step_time.csv", "decode.csv", "samples.json", "training.json")),
                   link_prefix))
    md += "".join(p + "\n\n" for p in opening(summary, meta, previous_study(out, meta)))
    for name, caption in figures:
        md += "![%s](%s%s)\n\n*%s*\n\n" % (caption, link_prefix, name, caption)
    if plot_note is not None:
        md += "> The plots were not generated: %s. The CSVs hold every number.\n\n" % plot_note
    return md + "".join(p + "\n\n" for p in findings(summary, meta))
