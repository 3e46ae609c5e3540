"""Experiment 3, favor-error: means over seeds per (features, sampling, m, scale), the kernel MSE's
log-log slope against m, orthogonal against iid and positive against trig at the largest m."""
from collections import defaultdict

from common import fit_loglog, fmt, join, mean, num, save_figure, std

TITLE = "3. FAVOR+ approximation error against the number of features"


def analyse(rows, meta):
    o = meta["options"]["favor_error"]
    cells = defaultdict(list)
    for r in rows:
        if num(r, "n") == o["length"] and num(r, "d") == o["dim"]:
            cells[(r["features"], r["sampling"], num(r, "scale"), int(num(r, "m")))].append(r)
    variants = list(dict.fromkeys((r["features"], r["sampling"]) for r in rows))
    curves = []
    for scale in o["scales"]:
        for features, sampling in variants:
            ms = sorted(k[3] for k in cells if k[:3] == (features, sampling, scale))
            points = []
            for m in ms:
                rs = cells[(features, sampling, scale, m)]
                mse = [num(r, "kernel_mse") for r in rs]
                attn = [num(r, "attn_rel_error") for r in rs]
                points.append({"m": m, "seeds": len(rs),
                               "kernel_mse_mean": mean(mse), "kernel_mse_std": std(mse),
                               "kernel_rel_mse_mean": mean([num(r, "kernel_rel_mse") for r in rs]),
                               "attn_rel_error_mean": mean(attn),
                               "attn_rel_error_std": std(attn)})
            fit = fit_loglog([p["m"] for p in points], [p["kernel_mse_mean"] for p in points])
            curves.append({"features": features, "sampling": sampling, "scale": scale,
                           "mse_slope_vs_m": fit["slope"], "points": points})
    return {"length": o["length"], "dim": o["dim"], "curves": curves}


def figures(summary, meta):
    return [("favor_kernel_mse.png",
             "MSE of phi(q).phi(k) against exp(q.k/sqrt(d)) on sampled pairs (mean +- std over "
             "seeds), one panel per input scale"),
            ("favor_attention_error.png",
             "Relative error of the attention output against exact softmax attention (mean +- "
             "std over seeds)")]


def paragraphs(summary, meta):
    o = meta["options"]["favor_error"]
    out = ["L = %d, d = %d, q and k entries N(0, s^2) for each scale s, v entries N(0, 1); %d "
           "sampled (q, k) pairs; %d seeds (each redraws the inputs and W); m counts random "
           "projections (trig features output 2m values)." % (o["length"], o["dim"], o["pairs"],
                                                              o["seeds"])]
    m_lo, m_hi = min(o["features"]), max(o["features"])
    curve = {(c["features"], c["sampling"], c["scale"]): c for c in summary["curves"]}

    def point(features, sampling, scale, m):
        c = curve.get((features, sampling, scale))
        return next((p for p in c["points"] if p["m"] == m), None) if c else None

    for scale in o["scales"]:
        parts = []
        for c in summary["curves"]:
            if c["scale"] != scale:
                continue
            a = point(c["features"], c["sampling"], scale, m_lo)
            b = point(c["features"], c["sampling"], scale, m_hi)
            if a and b:
                slope = c["mse_slope_vs_m"]
                parts.append("%s %s %s -> %s +- %s (slope %s%s)" % (
                    c["features"], c["sampling"], fmt(a["kernel_mse_mean"]),
                    fmt(b["kernel_mse_mean"]), fmt(b["kernel_mse_std"], 2), fmt(slope),
                    ", not falling as 1/m over this range: the squared errors of a few pairs "
                    "dominate, see the std" if slope > -0.5 else ""))
        text = ("Scale s = %s. Kernel MSE from m = %d to m = %d (log-log slope against m; -1 is "
                "the Monte Carlo rate): %s. At m = %d: "
                % (fmt(scale, 9), m_lo, m_hi, join(parts), m_hi))
        parts = []
        for features in ("positive", "trig"):
            orth = point(features, "orthogonal", scale, m_hi)
            iid = point(features, "iid", scale, m_hi)
            if orth and iid:
                ratio = iid["kernel_mse_mean"] / orth["kernel_mse_mean"]
                parts.append("%s features, orthogonal kernel MSE %s, attention error %s "
                             "(orthogonal) vs %s (iid)" % (
                                 features, "%sx lower than iid" % fmt(ratio) if ratio >= 1
                                 else "%sx higher than iid" % fmt(1 / ratio),
                                 fmt(orth["attn_rel_error_mean"]), fmt(iid["attn_rel_error_mean"])))
        pos = point("positive", "orthogonal", scale, m_hi)
        trig = point("trig", "orthogonal", scale, m_hi)
        if pos and trig:
            positive_wins = pos["attn_rel_error_mean"] < trig["attn_rel_error_mean"]
            winner = "positive" if positive_wins else "trig"
            parts.append("%s features give the smaller attention error (orthogonal: %s positive vs "
                         "%s trig)" % (winner, fmt(pos["attn_rel_error_mean"]),
                                       fmt(trig["attn_rel_error_mean"])))
        out.append(text + join(parts) + ".")
    return out


STYLE = {("positive", "orthogonal"): ("tab:blue", "-", "o"),
         ("positive", "iid"): ("tab:blue", "--", "s"),
         ("trig", "orthogonal"): ("tab:red", "-", "o"), ("trig", "iid"): ("tab:red", "--", "s")}


def plot(directory, rows, summary):
    import matplotlib.pyplot as plt

    scales = sorted({c["scale"] for c in summary["curves"]})
    for column, ylabel, name in [
            ("kernel_mse", "MSE of phi(q).phi(k) vs exp(q.k/sqrt d)", "favor_kernel_mse.png"),
            ("attn_rel_error", "relative error of attention output",
             "favor_attention_error.png")]:
        fig, axes = plt.subplots(1, len(scales), figsize=(6.5 * len(scales), 5), squeeze=False)
        for ax, scale in zip(axes[0], scales):
            for c in summary["curves"]:
                if c["scale"] != scale:
                    continue
                variant = (c["features"], c["sampling"])
                color, linestyle, marker = STYLE.get(variant, ("tab:green", "-", "."))
                ax.errorbar([p["m"] for p in c["points"]],
                            [p[column + "_mean"] for p in c["points"]],
                            yerr=[p[column + "_std"] for p in c["points"]], color=color,
                            linestyle=linestyle, marker=marker, capsize=3,
                            label="%s, %s" % variant)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("random features m")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.25)
            ax.legend()
            ax.set_title("FAVOR+ L = %d, d = %d, q/k entries N(0, %s^2)"
                         % (summary["length"], summary["dim"], fmt(scale, 9)))
        save_figure(fig, directory, name)
