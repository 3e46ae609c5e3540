"""Experiment 4, rope-decay: per curve (base, scaling), start and end of the bound, where it first
halves, and its mean over the far distances; the linear-interpolation check."""
from collections import defaultdict

from common import fmt, join, num, percent, save_figure

TITLE = "4. RoPE long-term decay"


def curve_name(base, scaling, factor):
    name = "base %s" % fmt(base, 9)
    return name if scaling == "none" else name + ", %s x%s" % (scaling, fmt(factor, 9))


def analyse(rows, meta):
    o = meta["options"]["rope_decay"]
    points = defaultdict(dict)
    for r in rows:
        if num(r, "dim") == o["dim"]:
            points[(num(r, "base"), r["scaling"], num(r, "factor"))][int(num(r, "distance"))] = \
                num(r, "decay")
    curves = []
    for (base, scaling, factor), by_distance in points.items():  # sweep order
        top = max(by_distance)
        decay = [by_distance[m] for m in range(top + 1)]
        far = [v / decay[0] for v in decay[top // 4:]]
        half = next((m for m, v in enumerate(decay) if v <= 0.5 * decay[0]), None)
        curves.append({"name": curve_name(base, scaling, factor), "base": base,
                       "scaling": scaling, "factor": factor, "max_distance": top,
                       "decay_at_0": decay[0], "decay_at_max": decay[-1],
                       "relative_at_max": decay[-1] / decay[0],
                       # The bound oscillates, so one end point can rank the bases by accident:
                       # the mean over the far three quarters of the distances ranks them.
                       "mean_relative_far": sum(far) / len(far),
                       "first_distance_at_half": half, "decay": decay})
    return {"dim": o["dim"], "curves": curves}


def figures(summary, meta):
    return [("rope_decay.png",
             "Upper bound of |sum_i h_i e^{i m theta_i}| / (d/2) against relative distance m, "
             "d = %d: bases (left) and scalings with factor 4 (right)" % summary["dim"])]


def paragraphs(summary, meta):
    curves, dim = summary["curves"], summary["dim"]
    if not curves:
        return ["No rows with d = %d in the CSV." % dim]
    top = curves[0]["max_distance"]
    facts = ["%s: %s -> %s (%s)%s" % (
        c["name"], fmt(c["decay_at_0"], 4), fmt(c["decay_at_max"]), percent(c["relative_at_max"]),
        ", half reached at distance %d" % c["first_distance_at_half"]
        if c["first_distance_at_half"] is not None else ", never below half within %d" % top)
        for c in curves]
    out = ["The bound (1/(d/2)) sum_j |sum_{i<j} e^{i m theta_i}| for d = %d, from distance 0 to "
           "%d (start -> end, end as a share of the start): %s." % (dim, top, join(facts))]
    unscaled = [c for c in curves if c["scaling"] == "none"]
    if unscaled:
        fastest = min(unscaled, key=lambda c: c["mean_relative_far"])
        slowest = max(unscaled, key=lambda c: c["mean_relative_far"])
        out.append(
            "Among the unscaled bases, %s is lowest on average over distances %d to %d and %s "
            "highest: a larger base slows the rotation of every pair, so the decay stretches over "
            "longer distances. NTK-aware scaling raises the base (to %s), and YaRN (original "
            "context %d) interpolates only the slow pairs, keeping the fast ones." % (
                fastest["name"], top // 4, top, slowest["name"],
                fmt(10000 * 4.0 ** (dim / (dim - 2)), 4),
                meta["run"]["yarn_original_max_position"]))
    by_name = {c["name"]: c for c in curves}
    linear, plain = by_name.get("base 10000, linear x4"), by_name.get("base 10000")
    if linear and plain and top >= 4:
        m = top // 4
        out.append("Check of linear interpolation (frequencies divided by 4): its bound at "
                   "distance %d is %s, and the unscaled base-10000 bound at distance %d is %s."
                   % (4 * m, fmt(linear["decay"][4 * m], 6), m, fmt(plain["decay"][m], 6)))
    return out


def plot(directory, rows, summary):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for c in sorted(summary["curves"], key=lambda c: (c["scaling"], c["base"])):
        x = range(len(c["decay"]))
        if c["scaling"] == "none":
            axes[0].plot(x, c["decay"], label=c["name"])
        if c["scaling"] != "none" or c["base"] == 10000:
            axes[1].plot(x, c["decay"], label=c["name"])
    for ax, title in zip(axes, ["bases", "scalings (factor 4)"]):
        ax.set_xlabel("relative distance m")
        ax.set_title("RoPE decay bound, d = %d: %s" % (summary["dim"], title))
        ax.grid(True, alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("(1/(d/2)) sum_j |sum_{i<j} exp(i m theta_i)|")
    save_figure(fig, directory, "rope_decay.png")
