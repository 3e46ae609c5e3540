"""The training report's plots (PNG, written atomically), drawn from the CSVs and summary.json;
each returned with its caption. Captions name the corpus the runs trained on."""
import collections
import math
import os
import statistics

from .model import VARIANTS, describe
from .summary import _num, _rows

FAMILIES = (("elu+1", "elu"), ("FAVOR+", "favor"), ("1+cos", "cos"))
PLACEMENT_COLOURS = {"none": "tab:gray", "before_map": "tab:orange",
                     "numerator_only": "tab:blue", "full": "tab:red"}
FAMILY_MARKERS = {"elu+1": "s", "favor+": "o", "1+cos": "^"}


def colour(variant):
    """The placement's colour (the same in every map's panel); no denominator green; softmax
    black (RoPE) or brown (no positions)."""
    spec = VARIANTS[variant]
    if spec["attention"] == "softmax":
        return "black" if spec["rope"] else "tab:brown"
    if not spec.get("denominator", True):
        return "tab:green"
    return PLACEMENT_COLOURS[spec["placement"]]


def marker(variant):
    return FAMILY_MARKERS.get(VARIANTS[variant].get("feature_map"), "*")


def _groups(variants):
    """(panel title, its variants): softmax, then each map's with softmax + RoPE for scale."""
    groups = [("softmax", [v for v in variants if v.startswith("softmax")])] + [
        (label, [v for v in variants if v.startswith(prefix + "-")] +
         [v for v in variants if v == "softmax-rope"]) for label, prefix in FAMILIES]
    return [g for g in groups if g[1] and not (g[0] != "softmax" and len(g[1]) == 1 and
                                                g[1][0] == "softmax-rope")]


def _band(rows, key):
    by_step = collections.defaultdict(list)
    for r in rows:
        if r.get(key, "") != "":
            by_step[int(r["step"])].append(_num(r[key]))
    steps = sorted(by_step)
    return (steps, [statistics.fmean(by_step[s]) for s in steps],
            [min(by_step[s]) for s in steps], [max(by_step[s]) for s in steps])


def _in_cell(rows, context, variant, lr, redraw=0):
    return [r for r in rows if r["task"] == "char_lm" and int(r["context"]) == context
            and r["variant"] == variant and float(r["lr"]) == lr
            and int(r["redraw_interval"]) == redraw]


def plot(out, summary, corpus):
    """Draws every plot the summary has data for; returns [(file name, caption)]."""
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

    for context, lm in summary.get("char_lm", {}).items():
        context = int(context)
        cells = lm["cells"]
        groups = _groups(list(cells))
        fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 3.4), sharey=True,
                                 squeeze=False)
        for ax, (label, names) in zip(axes[0], groups):
            for v in names:
                lr = cells[v]["lr"]
                val = [dict(e, bpc=e["value"]) for e in _in_cell(evaluations, context, v, lr)
                       if int(e["length"]) == context]
                for rows, key, style in ((_in_cell(curves, context, v, lr), "train_loss", ":"),
                                         (val, "bpc", "-")):
                    steps, mean, low, high = _band(rows, key)
                    if key == "train_loss":
                        mean, low, high = ([x / math.log(2) for x in y] for y in (mean, low, high))
                    ax.plot(steps, mean, style, color=colour(v),
                            label="%s (lr %g)" % (describe(v), lr) if key == "bpc" else None)
                    ax.fill_between(steps, low, high, color=colour(v), alpha=0.2, linewidth=0)
            ax.set_title(label)
            ax.set_xlabel("step")
            ax.legend(fontsize=6)
        axes[0][0].set_ylabel("bits per character")
        finals = [c["final_bpc"] for c in cells.values() if c["final_bpc"]["n"]]
        if finals:  # the finals in view; the first steps' ~6 bpc would flatten them
            axes[0][0].set_ylim(min(f["min"] for f in finals) - 0.15,
                                max(f["max"] for f in finals) + 0.9)
        save(fig, "char_lm_curves_%d.png" % context, "Character-level %s, context %d, each "
             "variant at its best learning rate: validation bpc (solid) and training bpc "
             "(dotted) against step; line: mean over seeds, band: min to max." % (
                 corpus, context))

        if any(len(g) > 1 for g in lm["grid"].values()):
            families = [(label, [v for v in cells if v.startswith(prefix)])
                        for label, prefix in (("softmax", "softmax"),) + FAMILIES]
            families = [f for f in families if f[1]]
            fig, axes = plt.subplots(1, len(families), figsize=(3.6 * len(families), 3.2),
                                     sharey=True, squeeze=False)
            for ax, (label, names) in zip(axes[0], families):
                for v in names:
                    rates = sorted(lm["grid"][v], key=float)
                    ax.plot([float(r) for r in rates],
                            [lm["grid"][v][r] if lm["grid"][v][r] is not None else math.nan
                             for r in rates], "-", marker=marker(v), color=colour(v),
                            label=describe(v))
                    for r in rates:  # diverged: an x at the top of the panel
                        if lm["grid"][v][r] is None:
                            ax.plot([float(r)], [1.0], "x", color=colour(v),
                                    transform=ax.get_xaxis_transform())
                ax.set_xscale("log")
                rates = sorted({float(r) for v in names for r in lm["grid"][v]})
                ax.set_xticks(rates, ["%g" % r for r in rates])
                ax.minorticks_off()
                ax.set_title(label)
                ax.set_xlabel("peak learning rate")
                ax.legend(fontsize=5, loc="best", framealpha=0.5)
            axes[0][0].set_ylabel("final validation bpc")
            save(fig, "lr_sensitivity_%d.png" % context, "Learning-rate sensitivity, "
                 "character-level %s, context %d: final validation bpc of the grid's seed at "
                 "each peak learning rate (x at the top: diverged)." % (corpus, context))

        fig, ax = plt.subplots(figsize=(6, 3.6))
        for v, c in cells.items():
            ext = c["extrapolation"]
            xs = [int(n) for n in ext if ext[n]["n"]]
            ax.plot(xs, [ext[str(n)]["mean"] for n in xs], "-", marker=marker(v),
                    color=colour(v), label=describe(v))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("evaluation context (characters; trained at %d)" % context)
        ax.set_ylabel("validation bpc")
        ax.legend(fontsize=6, ncol=2)
        save(fig, "char_lm_extrapolation_%d.png" % context, "Length extrapolation, "
             "character-level %s, trained at context %d: validation bpc of the final models at "
             "1x, 2x and 4x the training context (mean over seeds)." % (corpus, context))

    lm = summary.get("char_lm", {})
    if lm:
        context = min(lm, key=int)
        cells = lm[context]["cells"]
        families = [(label, prefix) for label, prefix in FAMILIES
                    if any(v.startswith(prefix + "-") for v in cells)]
        if families:
            fig, axes = plt.subplots(len(families), 3, figsize=(12, 2.6 * len(families)),
                                     squeeze=False)
            layer_ids = sorted({r["layer"] for r in layers}, key=int)
            for row, (label, prefix) in zip(axes, families):
                for v in [v for v in cells if v.startswith(prefix + "-")]:
                    for layer in layer_ids:
                        mine = [r for r in _in_cell(layers, int(context), v, cells[v]["lr"])
                                if r["layer"] == layer]
                        for ax, key in zip(row, ("den_min", "nonpositive_share", "grad_norm")):
                            steps, mean, low, _ = _band(mine, key)
                            if key == "den_min":
                                mean = low  # the smallest over the seeds too
                            ax.plot(steps, mean, "-" if layer == layer_ids[0] else "--",
                                    color=colour(v), linewidth=1,
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
            save(fig, "denominators.png", "Character-level %s, context %s, each variant at its "
                 "best learning rate, per layer during training (first layer solid, second "
                 "dashed): the smallest denominator of the batch (smallest over seeds), the share "
                 "of non-positive denominators and the attention block's gradient norm (means "
                 "over seeds). No-denominator variants have none." % (corpus, context))

    if "mqar" in summary:
        names = list(summary["mqar"])
        settings = list(next(iter(summary["mqar"].values()))["accuracy"])
        fig, ax = plt.subplots(figsize=(8, 3.4))
        width = 0.8 / max(1, len(settings))
        for i, setting in enumerate(settings):
            acc = [summary["mqar"][n]["accuracy"][setting] for n in names]
            means = [a["mean"] for a in acc]
            ax.bar([j + i * width for j in range(len(names))], means, width,
                   yerr=[[m - a["min"] for m, a in zip(means, acc)],
                         [a["max"] - m for m, a in zip(means, acc)]],
                   label="length %s, %s pairs" % tuple(setting.split("/")))
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))])
        ax.set_xticklabels(names, rotation=45, ha="right", fontsize=7)
        ax.set_ylabel("query accuracy")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=7)
        save(fig, "mqar_accuracy.png", "MQAR: accuracy on held-out sequences per variant (m4x: "
             "FAVOR+ with 4 x head dim features, else 2 x) and (length, pairs) (mean over seeds, "
             "bars: min to max).")

    if "step_time" in summary:
        from .step_time import VARIANTS_TIMED
        st = summary["step_time"]
        fig, ax = plt.subplots(figsize=(5, 3.4))
        for v in VARIANTS_TIMED:
            ax.plot(st["lengths"], [1e3 * s for s in st["seconds"][v]], "o-", color=colour(v),
                    label=describe(v))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length")
        ax.set_ylabel("ms per step (forward + backward)")
        ax.legend(fontsize=7)
        save(fig, "step_time.png", "One decoder layer's training step (batch 1) against "
             "context length, %d threads, median." % st["threads"])

    if "decoding" in summary:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
        styles = ["-", "--", ":"]
        for style, (context, per) in zip(styles, summary["decoding"].items()):
            for v, d in per.items():
                label = "%s (trained at %s)" % (describe(v), context)
                axes[0].plot(d["positions"], [1e3 * s for s in d["seconds_per_token"]], style,
                             color=colour(v), label=label)
                axes[1].plot(d["positions"], [b / 2 ** 20 for b in d["cache_bytes"]], style,
                             color=colour(v), label=label)
        axes[0].set_ylabel("ms per token (median of 32)")
        axes[1].set_ylabel("cache MiB (all layers)")
        for ax in axes:
            ax.set_xlabel("position")
            ax.set_xscale("log", base=2)
            ax.legend(fontsize=6)
        axes[1].set_yscale("log")
        save(fig, "decoding.png", "Decoding the trained %s models a character at a time (batch "
             "1, one thread) up to 8 x their training context: time per token and the bytes the "
             "caches hold (linear: the attention state; softmax: every key and value so far)."
             % corpus)
    return figures
