"""Experiment 2, normalization: means over seeds per (input, map, placement, causal, n), the
denominator findings, accuracy tables at the largest n, output-norm growth; three figure grids."""
from collections import defaultdict

from common import fmt, join, mean, num, percent, save_figure, std

TITLE = "2. Normalisation: RoPE in the numerator only (RoFormer eq. 19) against the alternatives"
PLACEMENTS = ["none", "before_map", "numerator_only", "full"]
MEASURES = {"rel_error": "rel_error", "nonpositive": "den_nonpositive_frac",
            "below": "den_below_frac", "den_min": "den_min", "out_norm": "out_row_norm_mean",
            "exact_norm": "exact_row_norm_mean"}


def group_rows(rows, dim):
    groups = defaultdict(list)
    for r in rows:
        if num(r, "d") == dim:
            groups[(r["input"], r["map"], r["placement"], r["causal"] == "1",
                    int(num(r, "n")))].append(r)
    return groups


def analyse(rows, meta):
    o = meta["options"]["normalization"]
    groups = []
    for key, rs in sorted(group_rows(rows, o["dim"]).items()):
        values = {m: [num(r, column) for r in rs] for m, column in MEASURES.items()}
        groups.append({
            "input": key[0], "map": key[1], "placement": key[2], "causal": key[3], "n": key[4],
            "seeds": len(rs),
            "rel_error_mean": mean(values["rel_error"]), "rel_error_std": std(values["rel_error"]),
            "den_nonpositive_frac_mean": mean(values["nonpositive"]),
            "den_nonpositive_frac_max": max(values["nonpositive"]),
            "den_below_frac_mean": mean(values["below"]),
            "den_min": min(values["den_min"]),
            "out_row_norm_mean": mean(values["out_norm"]),
            "exact_row_norm_mean": mean(values["exact_norm"])})
    lengths = sorted({g["n"] for g in groups})
    placements = {}
    for placement in ("numerator_only", "full"):
        gs = [g for g in groups if g["placement"] == placement]
        if not gs:
            continue
        worst = max(gs, key=lambda g: g["den_nonpositive_frac_mean"])
        placements[placement] = {
            "configurations": len(gs),
            "with_nonpositive": sum(g["den_nonpositive_frac_max"] > 0 for g in gs),
            "den_min": min(g["den_min"] for g in gs),
            "worst_nonpositive_frac": worst["den_nonpositive_frac_mean"],
            "worst_at": {k: worst[k] for k in ("input", "map", "causal", "n")}}
    # Most accurate placement per map at the largest n, counted over inputs and causal settings.
    wins = defaultdict(lambda: defaultdict(int))
    if lengths:
        best = {}
        for g in groups:
            if g["n"] != lengths[-1]:
                continue
            k = (g["map"], g["input"], g["causal"])
            if k not in best or g["rel_error_mean"] < best[k]["rel_error_mean"]:
                best[k] = g
        for (fmap, _, _), g in best.items():
            wins[fmap][g["placement"]] += 1
    return {"dim": o["dim"], "lengths": lengths,
            # In the order of the sweep (the CSV's), for tables and figures.
            "inputs": list(dict.fromkeys(g["input"] for g in rows)),
            "maps": list(dict.fromkeys(g["map"] for g in rows)),
            "groups": groups, "denominators": placements,
            "best_placement_wins": {m: dict(sorted(w.items())) for m, w in wins.items()}}


def figures(summary, meta):
    return [("normalization_denominators.png",
             "Fraction of non-positive denominators against n (mean over seeds), per map and "
             "input"),
            ("normalization_error.png",
             "Relative error against exact RoPE softmax attention (mean +- std over seeds); solid "
             "non-causal, dashed causal"),
            ("normalization_output_norm.png",
             "Mean row norm of the output against n; black: exact RoPE softmax")]


def paragraphs(summary, meta):
    o = meta["options"]["normalization"]
    groups = summary["groups"]
    if not groups:
        return ["No rows with d = %d in the CSV." % o["dim"]]
    find = {(g["input"], g["map"], g["placement"], g["causal"], g["n"]): g for g in groups}
    inputs, maps = summary["inputs"], summary["maps"]
    seeds = max(g["seeds"] for g in groups)
    n_min, n_max = summary["lengths"][0], summary["lengths"][-1]
    out = [("Single head, d = %d, double precision, %d seeds; maps elu+1 (m = d), favor+ (m = %d "
            "orthogonal positive features) and 1+cos (m = d + 1); numerator_only and full put RoPE "
            "of width m on the features, before_map RoPE of width d on q and k. Inputs: gaussian "
            "(q, k, v entries N(0, 1)), q_equals_k, random_walk (AR(1) with rho = 0.99, unit "
            "variance), sinusoids (periods 60 to 6000 positions), repeated_token (one token at "
            "every position). Reference: exact softmax attention with RoPE of width d, scale "
            "1/sqrt(d).") % (o["dim"], seeds, o["favor_features"])]

    den = summary["denominators"]
    if "numerator_only" in den and "full" in den:
        nu, fu = den["numerator_only"], den["full"]
        if nu["with_nonpositive"] == 0:
            text = ("Numerator-only kept every denominator positive (smallest %s over all %d "
                    "input/map/causal/length configurations)"
                    % (fmt(nu["den_min"]), nu["configurations"]))
        else:
            text = ("Numerator-only had non-positive denominators in %d of %d configurations "
                    "(smallest %s)" % (nu["with_nonpositive"], nu["configurations"],
                                       fmt(nu["den_min"])))
        if fu["with_nonpositive"] == 0:
            text += ", and so did full normalisation here (smallest %s)." % fmt(fu["den_min"])
        else:
            w = fu["worst_at"]
            text += (", while full normalisation had non-positive denominators in %d of %d "
                     "configurations, worst %s of the rows (%s, %s, %s, n = %d); its smallest "
                     "denominator was %s." % (
                         fu["with_nonpositive"], fu["configurations"],
                         percent(fu["worst_nonpositive_frac"]), w["map"], w["input"],
                         "causal" if w["causal"] else "non-causal", w["n"], fmt(fu["den_min"])))
        shares = ["%s%s %s" % (m, " causal" if causal else "",
                               percent(find[("gaussian", m, "full", causal, n_max)]
                                       ["den_nonpositive_frac_mean"]))
                  for m in maps for causal in (False, True)
                  if ("gaussian", m, "full", causal, n_max) in find]
        if shares:
            text += (" On Gaussian inputs at n = %d, the share of non-positive full-normalisation "
                     "denominators was: %s." % (n_max, join(shares, ", ")))
        out.append(text)

    for causal in (False, True):
        table = ("Relative error against exact RoPE softmax attention, %s, n = %d, mean +- std "
                 "over seeds:\n\n| input | placement | %s |\n|---|---|%s\n" % (
                     "causal" if causal else "non-causal", n_max, " | ".join(maps),
                     "---|" * len(maps)))
        for inp in inputs:
            for placement in PLACEMENTS:
                cells = []
                for m in maps:
                    g = find.get((inp, m, placement, causal, n_max))
                    cells.append("%s +- %s" % (fmt(g["rel_error_mean"]), fmt(g["rel_error_std"], 2))
                                 if g else "")
                table += "| %s | %s | %s |\n" % (inp, placement, " | ".join(cells))
        out.append(table)

    wins = summary["best_placement_wins"]
    out.append("Most accurate placement at n = %d (lowest mean error), counted over the %d inputs "
               "x 2 causal settings: %s." % (
                   n_max, len(inputs),
                   join("%s (%s)" % (m, join(("%s %d" % kv for kv in wins.get(m, {}).items()),
                                             ", ")) for m in maps)))

    if n_max > n_min:
        parts = []
        a, b = (find.get(("gaussian", "favor+", "none", False, n)) for n in (n_min, n_max))
        if a and b:
            parts.append("exact RoPE softmax %s -> %s" % (fmt(a["exact_row_norm_mean"]),
                                                          fmt(b["exact_row_norm_mean"])))
        for m in maps:
            for placement in ("numerator_only", "full"):
                a, b = (find.get(("gaussian", m, placement, False, n)) for n in (n_min, n_max))
                if a and b:
                    parts.append("%s %s %s -> %s (x%s)" % (
                        m, placement, fmt(a["out_row_norm_mean"]), fmt(b["out_row_norm_mean"]),
                        fmt(b["out_row_norm_mean"] / a["out_row_norm_mean"])))
        out.append("Output norm from n = %d to n = %d (Gaussian, non-causal, mean row norm): %s."
                   % (n_min, n_max, join(parts)))
    return out


COLOR = {"none": "tab:gray", "before_map": "tab:green", "numerator_only": "tab:blue",
         "full": "tab:red"}
MARKER = {"none": "x", "before_map": "^", "numerator_only": "o", "full": "s"}


def plot(directory, rows, summary):
    import matplotlib.pyplot as plt

    find = {(g["input"], g["map"], g["placement"], g["causal"], g["n"]): g
            for g in summary["groups"]}
    inputs, maps = summary["inputs"], summary["maps"]
    lengths = summary["lengths"]
    raw = group_rows(rows, summary["dim"])

    def grid(name, column, ylabel, logy, exact_column=None):
        fig, axes = plt.subplots(len(maps), len(inputs),
                                 figsize=(3.4 * len(inputs), 2.8 * len(maps)), squeeze=False,
                                 sharex=True)
        for i, fmap in enumerate(maps):
            for j, inp in enumerate(inputs):
                ax = axes[i][j]
                for placement in PLACEMENTS:
                    for causal in (False, True):
                        ns = [n for n in lengths if (inp, fmap, placement, causal, n) in raw]
                        if not ns:
                            continue
                        values = [[num(r, column) for r in raw[(inp, fmap, placement, causal, n)]]
                                  for n in ns]
                        ax.errorbar(ns, [mean(v) for v in values], yerr=[std(v) for v in values],
                                    capsize=2, markersize=3, linewidth=1, color=COLOR[placement],
                                    linestyle="--" if causal else "-", marker=MARKER[placement],
                                    label=placement + (" causal" if causal else ""))
                if exact_column:
                    for causal in (False, True):
                        ns = [n for n in lengths if (inp, fmap, "none", causal, n) in find]
                        ax.plot(ns, [find[(inp, fmap, "none", causal, n)][exact_column]
                                     for n in ns],
                                color="black", linestyle="--" if causal else "-", linewidth=1.5,
                                label="exact softmax" + (" causal" if causal else ""))
                ax.set_xscale("log")
                if logy:
                    ax.set_yscale("log")
                ax.grid(True, which="both", alpha=0.25)
                if i == 0:
                    ax.set_title(inp, fontsize=9)
                if j == 0:
                    ax.set_ylabel("%s\n%s" % (fmap, ylabel), fontsize=8)
                if i == len(maps) - 1:
                    ax.set_xlabel("n", fontsize=8)
                ax.tick_params(which="both", labelsize=7)
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=8)
        fig.tight_layout(rect=(0, 0.07, 1, 1))
        save_figure(fig, directory, name)

    grid("normalization_denominators.png", "den_nonpositive_frac", "fraction den <= 0", False)
    grid("normalization_error.png", "rel_error", "rel. error vs RoPE softmax", True)
    grid("normalization_output_norm.png", "out_row_norm_mean", "mean output row norm", True,
         exact_column="exact_row_norm_mean")
