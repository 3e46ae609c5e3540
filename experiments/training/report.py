"""The training experiment's analysis, called by experiments/analysis/report.py (which writes
REPORT.md): from a training output directory's CSVs and training.json, summary.json (every number
the report quotes), the plots (PNG) and the REPORT.md section, its sentences written from
summary.json. The training run itself (python3 -m training) writes only the CSVs and the JSON."""
import collections
import json
import math
import os
import statistics

from analysis.common import read_rows, write_json  # experiments/analysis

from .model import VARIANTS, describe
from .step_time import VARIANTS_TIMED, crossover

FAMILIES = (("elu+1", "elu"), ("FAVOR+", "favor"), ("1+cos", "cos"))


def _rows(out, name):
    """The CSV's rows, or none when the run did not write it (--no-step-time, one task)."""
    return read_rows(out, name) if os.path.exists(os.path.join(out, name + ".csv")) else []


def _num(text):
    return float(text) if text not in ("", None) else math.nan


def spread(values):
    """mean, min, max and count of the finite values (NaN mean when there are none)."""
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return dict(mean=math.nan, min=math.nan, max=math.nan, n=0)
    return dict(mean=statistics.fmean(values), min=min(values), max=max(values), n=len(values))


def fmt(s, digits=3):
    """'2.345 (2.301-2.389, 2 seeds)' or 'diverged' when no seed finished."""
    if not s["n"]:
        return "n/a"
    if s["n"] == 1:
        return "%.*f" % (digits, s["mean"])
    return "%.*f (%.*f-%.*f, %d seeds)" % (digits, s["mean"], digits, s["min"], digits, s["max"],
                                           s["n"])


def _variants_in(rows):
    present = {r["variant"] for r in rows}
    return [v for v in VARIANTS if v in present]


def summarise(out):
    runs, evaluations = _rows(out, "runs"), _rows(out, "evaluations")
    layers, curves, steps = _rows(out, "layers"), _rows(out, "curves"), _rows(out, "step_time")
    summary = {}
    for task in ("char_lm", "mqar"):
        task_runs = [r for r in runs if r["task"] == task]
        if not task_runs:
            continue
        per_variant = {}
        for variant in _variants_in(task_runs):
            mine = [r for r in task_runs if r["variant"] == variant]
            ev = [e for e in evaluations if e["task"] == task and e["variant"] == variant]
            s = dict(seeds=len(mine), diverged=sum(r["status"] == "diverged" for r in mine),
                     diverged_steps=[int(r["diverged_step"]) for r in mine
                                     if r["status"] == "diverged"],
                     clip_share=spread(_num(r["clip_share"]) for r in mine),
                     tokens_per_s=spread(_num(r["tokens_per_s"]) for r in mine),
                     final_train_loss=spread(_num(r["final_train_loss"]) for r in mine))
            finals = [e for e in ev if e["final"] == "True"]
            if task == "char_lm":
                context = min(int(e["length"]) for e in ev) if ev else 0
                s["context"] = context
                s["final_bpc"] = spread(_num(e["value"]) for e in finals
                                        if int(e["length"]) == context)
                best = collections.defaultdict(lambda: math.inf)
                for e in ev:
                    if int(e["length"]) == context:
                        best[e["seed"]] = min(best[e["seed"]], _num(e["value"]))
                s["best_bpc"] = spread(best.values())
                s["extrapolation"] = {
                    str(n): spread(_num(e["value"]) for e in finals if int(e["length"]) == n)
                    for n in sorted({int(e["length"]) for e in finals})}
            else:
                s["accuracy"] = {"%s/%s" % (n, p): spread(
                    _num(e["value"]) for e in finals if (e["length"], e["pairs"]) == (n, p))
                    for n, p in sorted({(e["length"], e["pairs"]) for e in finals},
                                       key=lambda x: int(x[0]))}
                s["mean_accuracy"] = spread(statistics.fmean(
                    _num(e["value"]) for e in finals if e["seed"] == seed)
                    for seed in {e["seed"] for e in finals})
            den = {}
            for layer in sorted({r["layer"] for r in layers if r["task"] == task}):
                key = "layer%s_" % layer
                den[layer] = dict(
                    den_min=min((_num(r[key + "den_min"]) for r in mine
                                 if r.get(key + "den_min")), default=math.nan),
                    nonpositive_share=spread(_num(r.get(key + "nonpositive_share", ""))
                                             for r in mine),
                    tiny_share=spread(_num(r.get(key + "tiny_share", "")) for r in mine),
                    grad_norm=spread(_num(r["grad_norm"]) for r in layers
                                     if (r["task"], r["variant"], r["layer"]) ==
                                     (task, variant, layer)))
            s["layers"] = den
            per_variant[variant] = s
        summary[task] = per_variant
    if steps:
        lengths = sorted({int(r["length"]) for r in steps})
        times = {v: [_num(r["seconds"]) for r in steps if r["variant"] == v]
                 for v in VARIANTS_TIMED}
        summary["step_time"] = dict(
            lengths=lengths, seconds=times, threads=int(steps[0]["threads"]),
            load_average_before=_num(steps[0]["load_average_before"]),
            crossover={v: crossover(lengths, times["softmax-rope"], times[v])
                       for v in VARIANTS_TIMED[1:]})
    summary["curves_rows"] = len(curves)
    return summary


# ---- plots ---------------------------------------------------------------------------------
PLACEMENT_COLOURS = {"none": "tab:gray", "before_map": "tab:orange",
                     "numerator_only": "tab:blue", "full": "tab:red"}
FAMILY_MARKERS = {"elu+1": "s", "favor+": "o", "1+cos": "^"}


def _colour(variant):
    """The placement's colour (the same in every map's panel); softmax black / brown."""
    spec = VARIANTS[variant]
    if spec["attention"] == "softmax":
        return "black" if spec["rope"] else "tab:brown"
    return PLACEMENT_COLOURS[spec["placement"]]


def _marker(variant):
    return FAMILY_MARKERS.get(VARIANTS[variant].get("feature_map"), "*")


def _mean_band(rows, key, variant, task):
    by_step = collections.defaultdict(list)
    for r in rows:
        if (r["task"], r["variant"]) == (task, variant) and r.get(key, "") != "":
            by_step[int(r["step"])].append(_num(r[key]))
    steps = sorted(by_step)
    return (steps, [statistics.fmean(by_step[s]) for s in steps],
            [min(by_step[s]) for s in steps], [max(by_step[s]) for s in steps])


def plot(out, summary):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    curves, evaluations, layers = (_rows(out, n) for n in ("curves", "evaluations", "layers"))
    figures = []

    def save(fig, name, caption):
        fig.tight_layout()
        path = os.path.join(out, name)
        fig.savefig(path + ".tmp.png", dpi=80)
        plt.close(fig)
        os.replace(path + ".tmp.png", path)
        figures.append((name, caption))

    if "char_lm" in summary:
        variants = list(summary["char_lm"])
        context = next(iter(summary["char_lm"].values()))["context"]
        val = [dict(e, bpc=e["value"]) for e in evaluations
               if e["task"] == "char_lm" and int(e["length"]) == context]
        groups = [("softmax", [v for v in variants if v.startswith("softmax")])] + [
            (label, [v for v in variants if v.startswith(prefix + "-")] +
             [v for v in variants if v == "softmax-rope"]) for label, prefix in FAMILIES]
        groups = [g for g in groups if g[1]]
        fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 3.4), sharey=True,
                                 squeeze=False)
        for ax, (label, names) in zip(axes[0], groups):
            for v in names:
                for rows, key, style in ((curves, "train_loss", ":"), (val, "bpc", "-")):
                    steps, mean, low, high = _mean_band(rows, key, v, "char_lm")
                    if key == "train_loss":
                        mean, low, high = ([x / math.log(2) for x in y] for y in (mean, low, high))
                    ax.plot(steps, mean, style, color=_colour(v),
                            label=describe(v) if key == "bpc" else None)
                    ax.fill_between(steps, low, high, color=_colour(v), alpha=0.2, linewidth=0)
            ax.set_title(label)
            ax.set_xlabel("step")
            ax.legend(fontsize=7)
        axes[0][0].set_ylabel("bits per character")
        finals = [summary["char_lm"][v]["final_bpc"] for v in variants
                  if summary["char_lm"][v]["final_bpc"]["n"]]
        if finals:  # the finals in view; the first steps' ~6 bpc would flatten them
            axes[0][0].set_ylim(min(f["min"] for f in finals) - 0.15,
                                max(f["max"] for f in finals) + 0.9)
        save(fig, "char_lm_curves.png", "Character-level Austen: validation bpc (solid) and "
             "training bpc (dotted) against step; line: mean over seeds, band: min to max.")

        fig, ax = plt.subplots(figsize=(6, 3.6))
        for v in variants:
            ext = summary["char_lm"][v]["extrapolation"]
            xs = [int(n) for n in ext if ext[n]["n"]]
            ax.plot(xs, [ext[str(n)]["mean"] for n in xs], "-", marker=_marker(v),
                    color=_colour(v), label=describe(v))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("evaluation context (characters; trained at %d)" % context)
        ax.set_ylabel("validation bpc")
        ax.legend(fontsize=6, ncol=2)
        save(fig, "char_lm_extrapolation.png", "Length extrapolation: validation bpc of the "
             "final models at 1x, 2x and 4x the training context (mean over seeds).")

    task = "char_lm" if "char_lm" in summary else "mqar"
    families = [(label, prefix) for label, prefix in FAMILIES
                if any(v.startswith(prefix + "-") for v in summary.get(task, {}))]
    if families:
        fig, axes = plt.subplots(len(families), 3, figsize=(12, 2.6 * len(families)),
                                 squeeze=False)
        layer_ids = sorted({r["layer"] for r in layers if r["task"] == task}, key=int)
        for row, (label, prefix) in zip(axes, families):
            for v in [v for v in summary[task] if v.startswith(prefix + "-")]:
                for layer in layer_ids:
                    mine = [r for r in layers if (r["task"], r["variant"], r["layer"]) ==
                            (task, v, layer)]
                    for ax, key in zip(row, ("den_min", "nonpositive_share", "grad_norm")):
                        steps, mean, low, _ = _mean_band(mine, key, v, task)
                        if key == "den_min":
                            mean = low  # the smallest over the seeds too
                        ax.plot(steps, mean, "-" if layer == layer_ids[0] else "--",
                                color=_colour(v), linewidth=1,
                                label=describe(v) if layer == layer_ids[0] else None)
            row[0].set_yscale("symlog", linthresh=1e-3)
            row[2].set_yscale("log")
            row[0].set_ylabel(label)
            row[0].legend(fontsize=6)
        for ax, title in zip(axes[0], ("smallest denominator (symlog)",
                                       "share of denominators <= 0",
                                       "attention block gradient norm")):
            ax.set_title(title, fontsize=9)
        for ax in axes[-1]:
            ax.set_xlabel("step")
        save(fig, "denominators.png", "%s, per layer during training (first layer solid, second "
             "dashed): the smallest denominator of the batch (smallest over seeds), the share of "
             "non-positive denominators and the attention block's gradient norm (means over "
             "seeds)." % (
                 "Character-level Austen" if task == "char_lm" else "MQAR"))

    if "mqar" in summary:
        variants = list(summary["mqar"])
        settings = list(next(iter(summary["mqar"].values()))["accuracy"])
        fig, ax = plt.subplots(figsize=(8, 3.4))
        width = 0.8 / max(1, len(settings))
        for i, setting in enumerate(settings):
            means = [summary["mqar"][v]["accuracy"][setting]["mean"] for v in variants]
            lows = [m - summary["mqar"][v]["accuracy"][setting]["min"]
                    for m, v in zip(means, variants)]
            highs = [summary["mqar"][v]["accuracy"][setting]["max"] - m
                     for m, v in zip(means, variants)]
            ax.bar([j + i * width for j in range(len(variants))], means, width,
                   yerr=[lows, highs], label="length %s, %s pairs" % tuple(setting.split("/")))
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(variants))])
        ax.set_xticklabels(variants, rotation=45, ha="right", fontsize=7)
        ax.set_ylabel("query accuracy")
        ax.legend(fontsize=7)
        save(fig, "mqar_accuracy.png", "MQAR: accuracy on held-out sequences per variant and "
             "length (mean over seeds, bars: min to max).")

    if "step_time" in summary:
        st = summary["step_time"]
        fig, ax = plt.subplots(figsize=(5, 3.4))
        for v in VARIANTS_TIMED:
            ax.plot(st["lengths"], [1e3 * s for s in st["seconds"][v]], "o-", color=_colour(v),
                    label=describe(v))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length")
        ax.set_ylabel("ms per step (forward + backward)")
        ax.legend(fontsize=7)
        save(fig, "step_time.png", "One decoder layer's training step (batch 1) against "
             "context length, %d threads, median." % st["threads"])
    return figures


# ---- the section ---------------------------------------------------------------------------
def _placement_ranking(task_summary, prefix, key):
    names = [v for v in task_summary if v.startswith(prefix + "-") and
             task_summary[v][key]["n"]]
    return sorted(names, key=lambda v: task_summary[v][key]["mean"])


def _separated(a, b):
    """Whether the seed ranges of a and b do not overlap (the difference exceeds the spread)."""
    return a["n"] > 1 and b["n"] > 1 and (a["max"] < b["min"] or b["max"] < a["min"])


def _denominator_cell(s):
    """The worst layer's shares of non-positive and of tiny denominators over every training
    step (mean over seeds), or a dash for softmax."""
    if not s["layers"] or not any(d["nonpositive_share"]["n"] for d in s["layers"].values()):
        return "-"
    worst = lambda key: max(d[key]["mean"] for d in s["layers"].values() if d[key]["n"])
    return "%.1f%% / %.1f%%" % (100 * worst("nonpositive_share"), 100 * worst("tiny_share"))


def _gap_words(a, b):
    if a["n"] < 2 or b["n"] < 2:
        return "from one seed, so of unknown significance"
    return ("larger than the seed spread (the ranges do not overlap)" if _separated(a, b) else
            "within the seed spread (the ranges overlap)")


def findings(summary, meta):
    out = []
    lm = summary.get("char_lm", {})
    if lm:
        context = next(iter(lm.values()))["context"]
        lines = ["| variant | final val bpc | best val bpc | diverged | clipped steps | "
                 "den <= 0 / tiny (worst layer) | bpc at 2x / 4x context | tokens/s |",
                 "|---|---|---|---|---|---|---|---|"]
        for v, s in lm.items():
            ext = s["extrapolation"]
            lines.append("| %s | %s | %s | %d of %d | %.0f%% | %s | %s / %s | %.0f |" % (
                describe(v), fmt(s["final_bpc"]), fmt(s["best_bpc"]), s["diverged"], s["seeds"],
                100 * s["clip_share"]["mean"], _denominator_cell(s),
                fmt(ext.get(str(2 * context), spread([]))),
                fmt(ext.get(str(4 * context), spread([]))), s["tokens_per_s"]["mean"]))
        out.append("Character-level language modelling on %s (training context %d; "
                   "validation: mean bpc over every position of consecutive held-out windows). "
                   "Mean over seeds, with the range in brackets:\n\n%s" % (
                       (meta.get("corpus") or {}).get("name", "the text"), context,
                       "\n".join(lines)))
        sentences = []
        for label, prefix in FAMILIES:
            ranking = _placement_ranking(lm, prefix, "final_bpc")
            if len(ranking) < 2:
                continue
            best, second = lm[ranking[0]]["final_bpc"], lm[ranking[1]]["final_bpc"]
            sentences.append(
                "for %s, %s trains best (%.3f bpc), then %s; the gap to the next, %.3f bpc, is %s"
                % (label, VARIANTS[ranking[0]]["placement"], best["mean"],
                   ", ".join("%s %.3f" % (VARIANTS[v]["placement"], lm[v]["final_bpc"]["mean"])
                             for v in ranking[1:]),
                   second["mean"] - best["mean"],
                   _gap_words(best, second)))
        if sentences:
            out.append("**Which placement trains best.** By final validation bpc: " +
                       "; ".join(sentences) + ".")
        full = []
        for label, prefix in FAMILIES:
            f, n = lm.get(prefix + "-full"), lm.get(prefix + "-numerator_only")
            if not f or not n:
                continue
            text = "%s: full %s" % (label, "diverged in %d of %d seeds (at step %s)" % (
                f["diverged"], f["seeds"], ", ".join(map(str, f["diverged_steps"])))
                if f["diverged"] else "never diverged")
            if f["final_bpc"]["n"] and n["final_bpc"]["n"]:
                text += " and ended %+.3f bpc from numerator_only" % (
                    f["final_bpc"]["mean"] - n["final_bpc"]["mean"])
            worst = [(layer, d) for layer, d in f["layers"].items()]
            if worst:
                text += "; its denominators: " + ", ".join(
                    "layer %s smallest %.3g, %.2f%% non-positive, %.2f%% tiny" % (
                        layer, d["den_min"], 100 * d["nonpositive_share"]["mean"],
                        100 * d["tiny_share"]["mean"]) for layer, d in worst)
                text += " (numerator_only: smallest %s)" % ", ".join(
                    "%.3g" % d["den_min"] for d in n["layers"].values())
            full.append(text)
        if full:
            out.append("**Full normalisation.** " + ". ".join(full) + ". Shares are over every "
                       "denominator of every training step; tiny means |den| < %g." %
                       meta.get("stats_threshold", 1e-3))
        if "softmax-rope" in lm and lm["softmax-rope"]["final_bpc"]["n"]:
            ref = lm["softmax-rope"]["final_bpc"]["mean"]
            linear = [v for v in lm if VARIANTS[v]["attention"] == "linear" and
                      lm[v]["final_bpc"]["n"]]
            if linear:
                best = min(linear, key=lambda v: lm[v]["final_bpc"]["mean"])
                out.append("**Against softmax + RoPE** (%.3f bpc): the best linear variant, %s, "
                           "is %+.3f bpc from it; softmax without positions %s." % (
                               ref, describe(best), lm[best]["final_bpc"]["mean"] - ref,
                               "is %+.3f" % (lm["softmax-nopos"]["final_bpc"]["mean"] - ref)
                               if "softmax-nopos" in lm and lm["softmax-nopos"]["final_bpc"]["n"]
                               else "was not run"))
        ext = []
        for v, s in lm.items():
            e = s["extrapolation"]
            if all(str(m * context) in e and e[str(m * context)]["n"] for m in (1, 4)):
                ext.append((e[str(4 * context)]["mean"], e[str(context)]["mean"], v))
        if ext:
            ext.sort()
            out.append("**Extrapolation** (validation bpc at the training context -> at 4x it, "
                       "best at 4x first): " + ", ".join(
                           "%s %.3f -> %.3f (%+.3f)" % (describe(v), one, four, four - one)
                           for four, one, v in ext) + ".")
    mq = summary.get("mqar", {})
    if mq:
        settings = list(next(iter(mq.values()))["accuracy"])
        lines = ["| variant | " + " | ".join("length %s, %s pairs" % tuple(s.split("/"))
                                           for s in settings) + " | diverged |",
                 "|---|" + "---|" * (len(settings) + 1)]
        for v, s in mq.items():
            lines.append("| %s | %s | %d of %d |" % (
                describe(v), " | ".join(fmt(s["accuracy"][k]) for k in settings), s["diverged"],
                s["seeds"]))
        chance = ", ".join("1/%s = %.3f" % (k.split("/")[1], 1 / int(k.split("/")[1]))
                           for k in settings)
        out.append("MQAR (Zoology's multi-query associative recall), query accuracy on "
                   "held-out sequences of each length (choosing a value of the sequence at "
                   "random would score %s):\n\n%s" % (chance, "\n".join(lines)))
        above = []
        for k in settings:
            best = max(mq, key=lambda v: mq[v]["accuracy"][k]["mean"]
                       if mq[v]["accuracy"][k]["n"] else -1.0)
            above.append("length %s: best %s, %.3f against %.3f" % (
                k.split("/")[0], describe(best), mq[best]["accuracy"][k]["mean"],
                1 / int(k.split("/")[1])))
        recalled = [k for k in settings if any(
            mq[v]["accuracy"][k]["n"] and mq[v]["accuracy"][k]["mean"] > 1 / int(k.split("/")[1])
            for v in mq)]
        out.append("**Recall.** %s (%s)." % (
            "Some variant beat guessing among the sequence's values at length %s" %
            ", ".join(k.split("/")[0] for k in recalled) if recalled else
            "No variant beat guessing among the sequence's values at any length at this budget, "
            "so MQAR does not separate the variants here", "; ".join(above)))
    st = summary.get("step_time")
    if st:
        ratio = {v: st["seconds"]["softmax-rope"][-1] / st["seconds"][v][-1]
                 for v in VARIANTS_TIMED[1:]}

        def crossing(c):
            if c is None:
                return "not within the lengths measured"
            if c == st["lengths"][0]:
                return "already at n = %d, the shortest length measured" % c
            return "from n = %.0f" % c

        out.append("**Step time of one layer** (the training's layer shape, forward + backward, "
                   "batch 1, %d threads; the 1-minute load average was %.2f when it began): at "
                   "n = %d, %s. In this one-layer timing linear attention is faster than softmax: "
                   "%s. (The whole model's training throughput at the training context is the "
                   "tokens/s column above.)" % (
                       st["threads"], st["load_average_before"], st["lengths"][-1], ", ".join(
                           "%s takes %.2fx softmax + RoPE's time" % (describe(v), 1 / r)
                           for v, r in ratio.items()),
                       "; ".join("%s %s" % (describe(v), crossing(c))
                                 for v, c in st["crossover"].items())))
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
    figures = plot(out, summary) if plot_note is None else []
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
                           "step_time.csv", "training.json")), link_prefix))
    for name, caption in figures:
        md += "![%s](%s%s)\n\n*%s*\n\n" % (caption, link_prefix, name, caption)
    if plot_note is not None:
        md += "> The plots were not generated: %s. The CSVs hold every number.\n\n" % plot_note
    return md + "".join(p + "\n\n" for p in findings(summary, meta))
