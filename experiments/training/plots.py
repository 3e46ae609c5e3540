"""The training report's plots (PNG, written atomically), drawn from the runs (results.Result)
and summary.json; each returned with its caption. Captions name the corpus the runs trained on."""
import collections
import math
import os
import statistics

from .step_time import VARIANTS_TIMED
from .variants import FEATURE_MAPS, SOFTMAX_ROPE, from_name

PLACEMENT_COLOURS = {"none": "tab:gray", "before_map": "tab:orange",
                     "numerator_only": "tab:blue", "full": "tab:red"}
MAP_MARKERS = {"elu+1": "s", "favor+": "o", "1+cos": "^"}


EXTRAS_COLOURS = {(True, False): "tab:purple", (False, True): "tab:olive",
                  (True, True): "tab:pink"}  # (short convolution, decay)


def colour(variant):
    """The placement's colour (the same in every map's panel); no denominator green; a short
    convolution, a decay or both a colour each, whatever the placement (the char_lm plan adds
    them to its best linear variant alone); softmax black (RoPE) or brown (no positions)."""
    if not variant.linear:
        return "black" if variant.rope else "tab:brown"
    if variant.extras:
        return EXTRAS_COLOURS[bool(variant.short_conv), variant.decay is not None]
    if not variant.denominator:
        return "tab:green"
    return PLACEMENT_COLOURS[variant.placement]


def marker(variant):
    return MAP_MARKERS.get(variant.feature_map, "*")


def _families(variants):
    """(panel title, its variants): softmax, then each map's."""
    families = [("softmax", [v for v in variants if not v.linear])] + [
        (names.label, [v for v in variants if v.feature_map == kind])
        for kind, names in FEATURE_MAPS.items()]
    return [f for f in families if f[1]]


def _groups(variants):
    """_families, each map's with softmax + RoPE for scale."""
    with_softmax = [SOFTMAX_ROPE] if SOFTMAX_ROPE in variants else []
    return [(label, names if label == "softmax" else names + with_softmax)
            for label, names in _families(variants)]


def _band(rows, key, x="step"):
    by_step = collections.defaultdict(list)
    for r in rows:
        if r[key] is not None:
            by_step[r[x]].append(r[key])
    steps = sorted(by_step)
    return (steps, [statistics.fmean(by_step[s]) for s in steps],
            [min(by_step[s]) for s in steps], [max(by_step[s]) for s in steps])


def _records(results, cell, name):
    """The rows of record `name` (curves, layers, evaluations) of every run of a cell, each with
    the tokens its run had trained on by then ("tokens": the step times the run's tokens per
    step; the step itself for tables without them)."""
    return [dict(row, tokens=row["step"] * (r.summary.get("tokens_per_step") or 1))
            for r in results if r.cell == cell for row in r.records[name]]


def plot(out, summary, corpus, results):
    """Draws every plot the summary has data for, the runs' records (results.Result) giving the
    curves; returns [(file name, caption)]."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
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
        cells = {from_name(name): cell for name, cell in lm["cells"].items()}
        groups = _groups(list(cells))
        fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 3.4), sharey=True,
                                 squeeze=False)
        for ax, (label, names) in zip(axes[0], groups):
            for v in names:
                lr = cells[v]["lr"]
                cell = ("char_lm", context, v, lr, cells[v]["steps"])
                val = [dict(e, bpc=e["value"]) for e in _records(results, cell, "evaluations")
                       if e["length"] == context]
                for rows, key, style in ((_records(results, cell, "curves"), "train_loss", ":"),
                                         (val, "bpc", "-")):
                    steps, mean, low, high = _band(rows, key, "tokens")
                    if key == "train_loss":
                        mean, low, high = ([x / math.log(2) for x in y] for y in (mean, low, high))
                    ax.plot(steps, mean, style, color=colour(v),
                            label="%s (lr %g)" % (v.describe(), lr) if key == "bpc" else None)
                    ax.fill_between(steps, low, high, color=colour(v), alpha=0.2, linewidth=0)
            ax.set_title(label)
            ax.set_xlabel("characters trained on")
            ax.legend(fontsize=6)
        axes[0][0].set_ylabel("bits per character")
        finals = [c["final_bpc"] for c in cells.values() if c["final_bpc"]["n"]]
        if finals:  # the finals in view; the first steps' ~6 bpc would flatten them
            axes[0][0].set_ylim(min(f["min"] for f in finals) - 0.15,
                                max(f["max"] for f in finals) + 0.9)
        save(fig, "char_lm_curves_%d.png" % context, "Character-level %s, context %d, each "
             "variant at its chosen learning rate: validation bpc (solid) and training bpc "
             "(dotted) against the characters trained on; line: mean over seeds, band: min to "
             "max." % (corpus, context))

        if any(len(g) > 1 for g in lm["grid"].values()):
            families = _families([v for v in cells if v.name in lm["grid"]])
            fig, axes = plt.subplots(1, len(families), figsize=(3.6 * len(families), 3.2),
                                     sharey=True, squeeze=False)
            for ax, (label, names) in zip(axes[0], families):
                for v in names:
                    grid = lm["grid"][v.name]
                    rates = sorted(grid, key=float)
                    ax.plot([float(r) for r in rates],
                            [grid[r] if grid[r] is not None else math.nan for r in rates], "-",
                            marker=marker(v), color=colour(v), label=v.describe())
                    for r in rates:  # diverged: an x at the top of the panel
                        if grid[r] is None:
                            ax.plot([float(r)], [1.0], "x", color=colour(v),
                                    transform=ax.get_xaxis_transform())
                ax.set_xscale("log")
                rates = sorted({float(r) for v in names for r in lm["grid"][v.name]})
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
                    color=colour(v), label=v.describe())
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
        cells = {from_name(name): cell for name, cell in lm[context]["cells"].items()}
        families = [f for f in _families(list(cells)) if f[0] != "softmax"]
        if families:
            fig, axes = plt.subplots(len(families), 3, figsize=(12, 2.6 * len(families)),
                                     squeeze=False)
            layer_ids = sorted({i for r in results for i in r.layer_ids()})
            for row, (label, names) in zip(axes, families):
                for v in names:
                    rows = _records(results, ("char_lm", int(context), v, cells[v]["lr"],
                                              cells[v]["steps"]), "layers")
                    for layer in layer_ids:
                        layer_rows = [r for r in rows if r["layer"] == layer]
                        for ax, key in zip(row, ("den_min", "nonpositive_share", "grad_norm")):
                            steps, mean, low, _ = _band(layer_rows, key)
                            if key == "den_min":
                                mean = low  # the smallest over the seeds too
                            ax.plot(steps, mean, "-" if layer == layer_ids[0] else "--",
                                    color=colour(v), linewidth=1,
                                    label=v.describe() if layer == layer_ids[0] else None)
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
        settings = list(summary["mqar"])
        fig, axes = plt.subplots(1, len(settings), figsize=(4.2 * len(settings), 3.6),
                                 sharey=True, squeeze=False)
        for ax, name in zip(axes[0], settings):
            for v, c in summary["mqar"][name]["cells"].items():
                acc, floats = c["final_accuracy"], c["state_floats"]
                if not acc["n"] or not floats:
                    continue
                variant = from_name(v)
                # The placement's colour, hollow with the short convolution.
                shade = colour(variant.replace(short_conv=0))
                ax.errorbar([floats], [acc["mean"]], yerr=[[acc["mean"] - acc["min"]],
                                                           [acc["max"] - acc["mean"]]],
                            marker=marker(variant), color=shade, linestyle="none",
                            markerfacecolor="none" if variant.short_conv else shade,
                            markersize=7 if variant.feature_factor > 2 else 5,
                            label=variant.describe())
            pairs = int(name.split("+")[-1].split("x")[1])
            ax.axhline(1 / pairs, color="gray", linestyle=":", linewidth=1, label="1/pairs")
            ax.set_xscale("log")
            ax.set_ylim(0, 1.05)
            ax.set_title(name.replace("x", " tokens, ").replace("+", "; ") + " pairs",
                         fontsize=9)
            ax.set_xlabel("state floats (decoding caches, one sequence)")
            ax.legend(fontsize=5, loc="best", framealpha=0.5)
        axes[0][0].set_ylabel("final query accuracy")
        save(fig, "mqar_accuracy.png", "MQAR: held-out accuracy of each variant at its best "
             "rate against the floats its decoding caches hold for one sequence (mean over "
             "seeds, bars: min to max; hollow: with the short convolution; large: more "
             "features); dotted: 1/pairs.")

    if "step_time" in summary:
        st = summary["step_time"]
        fig, ax = plt.subplots(figsize=(5, 3.4))
        for v in VARIANTS_TIMED:
            ax.plot(st["lengths"], [1e3 * s for s in st["seconds"][v.name]], "o-",
                    color=colour(v), label=v.describe())
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
            for name, d in per.items():
                v = from_name(name)
                label = "%s (trained at %s)" % (v.describe(), context)
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
