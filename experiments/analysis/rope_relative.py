"""Experiment 5, rope-relative: per precision, the deviation at the smallest and largest position
range and the worst."""
from common import fmt, join, num, save_figure

TITLE = "5. RoPE relative-position identity"


def analyse(rows, meta):
    o = meta["options"]["rope_relative"]
    summary = {"dim": o["dim"], "samples": o["samples"], "precisions": {}}
    for precision in ("float", "double"):
        rs = sorted((r for r in rows if r["precision"] == precision and num(r, "dim") == o["dim"]),
                    key=lambda r: num(r, "max_position"))
        if not rs:
            continue
        worst = max(rs, key=lambda r: num(r, "max_rel_dev"))
        summary["precisions"][precision] = {
            "max_positions": [num(r, "max_position") for r in rs],
            "max_rel_dev": [num(r, "max_rel_dev") for r in rs],
            "mean_rel_dev": [num(r, "mean_rel_dev") for r in rs],
            "worst_rel_dev": num(worst, "max_rel_dev"),
            "worst_at_max_position": num(worst, "max_position"),
            "worst_abs_dev": max(num(r, "max_abs_dev") for r in rs)}
    return summary


def figures(summary, meta):
    return [("rope_relative.png",
             "Largest deviation |<R_m q, R_n k> - <q, R_(n-m) k>| / (|q||k|) over random pairs, "
             "against the largest position")]


def paragraphs(summary, meta):
    parts = []
    for precision, p in summary["precisions"].items():
        first, last = p["max_rel_dev"][0], p["max_rel_dev"][-1]
        growth = last / first if first > 0 else float("nan")
        trend = ""
        if growth == growth and first > 0:
            trend = (", growing %sx from the smallest range" % fmt(growth, 2) if growth > 10
                     else ", within a factor %s of the smallest range"
                     % fmt(max(growth, 1 / growth), 2))
        parts.append("%s: %s for positions up to %d and %s up to %d%s (worst %s, absolute %s)" % (
            precision, fmt(first), p["max_positions"][0], fmt(last), p["max_positions"][-1], trend,
            fmt(p["worst_rel_dev"]), fmt(p["worst_abs_dev"])))
    return ["Over %d random pairs per range (d = %d, positions uniform up to the largest), the "
            "identity held to (largest deviation relative to |q||k|): %s. For scale, one rounding "
            "is 2^-24 = 6.0e-8 in float and 2^-53 = 1.1e-16 in double."
            % (summary["samples"], summary["dim"], join(parts))]


def plot(directory, rows, summary):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for precision, color in [("float", "tab:orange"), ("double", "tab:purple")]:
        p = summary["precisions"].get(precision)
        if not p:
            continue
        ax.loglog(p["max_positions"], [max(v, 1e-300) for v in p["max_rel_dev"]], color=color,
                  marker="o", label=precision + " max")
        ax.loglog(p["max_positions"], [max(v, 1e-300) for v in p["mean_rel_dev"]], color=color,
                  marker=".", linestyle="--", label=precision + " mean")
    ax.axhline(2.0 ** -24, color="tab:orange", linewidth=0.6, alpha=0.5)
    ax.axhline(2.0 ** -53, color="tab:purple", linewidth=0.6, alpha=0.5)
    ax.set_xlabel("largest position (m, n uniform in [0, this])")
    ax.set_ylabel("|<R_m q, R_n k> - <q, R_(n-m) k>| / (|q||k|)")
    ax.set_title("RoPE relative-position identity (thin lines: unit roundoff)")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend()
    save_figure(fig, directory, "rope_relative.png")
