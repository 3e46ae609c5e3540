"""Experiment 1, scaling: log-log slopes, crossovers against softmax, memory; time and memory
plots. Curves are those with the run's H and d (a resumed CSV may hold other sizes)."""
import math
from collections import defaultdict

from common import crossover, describe_crossover, fit_loglog, fmt, join, num, save_figure

TITLE = "1. Scaling: time and peak memory against sequence length"
KEY = ("method", "map", "placement", "causal", "causal_method")


def curve_name(key):
    method, fmap, placement, causal, causal_method = key
    name = "linear %s %s" % (fmap, placement) if method == "linear" else method
    if not causal:
        return name
    return name + (" (causal)" if causal_method == "none" else " (causal, %s)" % causal_method)


def analyse(rows, meta):
    o = meta["options"]["scaling"]
    heads, dim, fit_min = o["heads"], o["dim"], o["fit_min_n"]
    points, one_head = defaultdict(list), []
    for r in rows:
        if num(r, "d") != dim:
            continue
        if num(r, "heads") != heads:
            if num(r, "heads") == 1:
                one_head.append(r)
            continue
        key = (r["method"], r["map"], r["placement"], r["causal"] == "1", r["causal_method"])
        points[key].append((num(r, "n"), num(r, "time_ms"), num(r, "extra_mib")))
    curves = []
    for key in sorted(points):
        n, t, extra = (list(v) for v in zip(*sorted(points[key])))
        fit = fit_loglog(n, t, fit_min)
        curves.append(dict(zip(KEY, key), name=curve_name(key), n=n, time_ms=t, extra_mib=extra,
                           slope=fit["slope"], intercept=fit["intercept"], r2=fit["r2"],
                           fit_points=fit["points"]))
    by_key = {tuple(c[k] for k in KEY): c for c in curves}
    crossovers = []
    for c in curves:
        if c["method"] != "linear":
            continue
        for baseline in ("softmax_streaming", "softmax_naive"):
            other = by_key.get((baseline, "none", "rope", c["causal"], "none"))
            if other is None:
                continue
            common_n = sorted(set(c["n"]) & set(other["n"]))
            if not common_n:
                continue
            fast = [c["time_ms"][c["n"].index(n)] for n in common_n]
            slow = [other["time_ms"][other["n"].index(n)] for n in common_n]
            x = crossover(common_n, fast, slow, fit_min)
            crossovers.append(dict({k: c[k] for k in KEY}, curve=c["name"], against=baseline,
                                   kind=x["kind"], n=x["n"], text=describe_crossover(x)))
    # Causal linear attention by each method measured, at the largest n both have.
    methods = []
    for c in curves:
        if c["method"] != "linear" or not c["causal"] or c["causal_method"] == "scan":
            continue
        scan = by_key.get(("linear", c["map"], c["placement"], True, "scan"))
        common_n = sorted(set(c["n"]) & set(scan["n"])) if scan else []
        if common_n:
            n = common_n[-1]
            methods.append({"map": c["map"], "placement": c["placement"],
                            "causal_method": c["causal_method"], "n": n,
                            "time_ratio_to_scan": c["time_ms"][c["n"].index(n)] /
                            scan["time_ms"][scan["n"].index(n)]})
    linear_slopes = [c["slope"] for c in curves
                     if c["method"] == "linear" and math.isfinite(c["slope"])]
    interpolated = [x["n"] for x in crossovers
                    if x["against"] == "softmax_streaming" and x["kind"] == "interpolated"]
    return {
        "heads": heads, "dim": dim, "fit_min_n": fit_min,
        "curves": curves,
        "crossovers": crossovers,
        "causal_methods_against_scan": methods,
        "linear_slope_range": [min(linear_slopes), max(linear_slopes)] if linear_slopes else None,
        "streaming_crossover_range": [min(interpolated), max(interpolated)] if interpolated
        else None,
        "one_head": [{"map": r["map"], "placement": r["placement"], "causal": r["causal"] == "1",
                      "causal_method": r["causal_method"], "n": num(r, "n"),
                      "time_ms": num(r, "time_ms"), "peak_rss_mib": num(r, "peak_rss_mib"),
                      "extra_mib": num(r, "extra_mib"), "io_mib": num(r, "io_mib")}
                     for r in one_head],
    }


def figures(summary, meta):
    return [("scaling_time.png",
             "Median time per call against n (log-log), H = %d, d = %d; the legend gives each "
             "curve's fitted slope" % (summary["heads"], summary["dim"])),
            ("scaling_memory.png", "Peak resident memory beyond the inputs and outputs")]


def paragraphs(summary, meta):
    o, run = meta["options"]["scaling"], meta["run"]
    by_key = {tuple(c[k] for k in KEY): c for c in summary["curves"]}
    methods = o["causal_methods"]  # the report quotes the first one asked for

    def quoted(causal):  # the curves each paragraph quotes, in that order
        method = methods[0] if causal else "none"
        keys = [(m, "none", "rope", causal, "none") for m in ("softmax_naive", "softmax_streaming")]
        keys += [("linear", fmap, "numerator_only", causal, method) for fmap in ("elu+1", "favor+")]
        return [by_key[k] for k in keys if k in by_key]

    quoted_curves = quoted(False) + quoted(True)
    out = []
    text = ("Setup: %d heads, d = %d, batch 1, float, median of %d repetitions on %d threads; "
            "FAVOR+ with m = %d orthogonal features; softmax with RoPE of width d. Log-log slopes "
            "fitted over n >= %s: " % (o["heads"], o["dim"], o["reps"],
                                       meta["openmp"]["threads"], o["favor_features"],
                                       fmt(o["fit_min_n"], 6)))
    text += join("%s %s" % (c["name"], fmt(c["slope"])) for c in quoted_curves)
    if summary["linear_slope_range"]:
        lo, hi = summary["linear_slope_range"]
        text += (". Over all linear curves (both maps, four placements, causal or not) the slopes "
                 "span %s to %s (1 is linear, 2 quadratic)." % (fmt(lo), fmt(hi)))
    out.append(text)
    cores = meta["machine"]["cores"]
    load = (run["load_average_start"], run["load_average_end"])
    if None not in load and max(load) > cores:
        out.append("The machine was shared during this run: load average %s at the start and %s "
                   "at the end, on %d cores. Absolute times include waiting for other processes; "
                   "compare curves within this run rather than across machines."
                   % (fmt(load[0]), fmt(load[1]), cores))

    quoted_names = {c["name"] for c in quoted_curves}
    crossings = [x for x in summary["crossovers"]
                 if x["against"] == "softmax_streaming" and x["curve"] in quoted_names]
    if crossings:
        text = ("Crossover (where linear attention becomes faster than streaming softmax, log-log "
                "interpolation between measured lengths): ")
        text += join("%s: %s" % (x["curve"], x["text"]) for x in crossings)
        if summary["streaming_crossover_range"]:
            lo, hi = summary["streaming_crossover_range"]
            text += (". Over every placement the interpolated crossovers lie between n ~ %s and "
                     "n ~ %s." % (fmt(lo), fmt(hi)))
        out.append(text)

    if summary["causal_methods_against_scan"]:
        out.append("Causal linear attention by method, time relative to the scan at the largest "
                   "n both measured: %s." % join(
                       "%s %s %s %sx (n = %d)" % (x["map"], x["placement"], x["causal_method"],
                                                  fmt(x["time_ratio_to_scan"]), x["n"])
                       for x in summary["causal_methods_against_scan"]))

    if not run["memory_measured"]:
        out.append("Peak memory was not measured: this kernel does not support resetting the "
                   "high-water mark through /proc/self/clear_refs.")
    elif quoted_curves:
        text = "Memory beyond inputs and outputs at the largest measured n: "
        text += join("%s %s MiB at n = %s" % (c["name"], fmt(c["extra_mib"][-1]),
                                              fmt(c["n"][-1], 7)) for c in quoted_curves)
        naive_n = min(o["naive_max"], max(o["lengths"]))
        text += (". (The naive kernel holds one n x n float matrix per thread: %s MiB each at "
                 "n = %d, %d threads.)" % (fmt(4.0 * naive_n * naive_n / 2**20, 4), naive_n,
                                           min(meta["openmp"]["threads"], o["heads"])))
        out.append(text)
        one_head = [p for p in summary["one_head"]
                    if p["placement"] in ("numerator_only", "full")]
        if one_head:
            text = ("One head, n = %s, d = %d (inputs and output %s MiB): peak RSS of the process "
                    "/ memory beyond inputs and outputs: "
                    % (fmt(one_head[0]["n"], 8), o["dim"], fmt(one_head[0]["io_mib"], 4)))
            text += join("%s %s%s %s / %s MiB" % (
                p["map"], p["placement"],
                " causal (%s)" % p["causal_method"] if p["causal"] else "",
                fmt(p["peak_rss_mib"], 4), fmt(p["extra_mib"])) for p in one_head)
            out.append(text + ".")
    if run["skipped_points"]:
        out.append("%d points were skipped for lack of memory (listed in scaling.json)."
                   % len(run["skipped_points"]))
    return out


STYLE = {"none": ":", "before_map": "-.", "numerator_only": "-", "full": "--"}
MARKER = {"none": "x", "before_map": "^", "numerator_only": "o", "full": "s"}


def curve_style(c):
    if c["method"] == "softmax_naive":
        style = dict(color="black", linestyle="--", marker="D")
    elif c["method"] == "softmax_streaming":
        style = dict(color="black", linestyle="-", marker="o")
    else:
        style = dict(color={"elu+1": "tab:blue", "favor+": "tab:red"}.get(c["map"], "tab:green"),
                     linestyle=STYLE.get(c["placement"], "-"),
                     marker=MARKER.get(c["placement"], "."))
    if c["causal_method"] == "chunked":
        style["markerfacecolor"] = "none"
    return style


def plot(directory, rows, summary):
    import matplotlib.pyplot as plt
    import numpy as np

    for column, ylabel, name, title in [
            ("time_ms", "median time per call [ms]", "scaling_time.png", "time"),
            ("extra_mib", "peak RSS beyond inputs/outputs [MiB]", "scaling_memory.png", "memory")]:
        fig, axes = plt.subplots(1, 2, figsize=(15, 6.5), sharey=True)
        for ax, causal in zip(axes, [False, True]):
            for c in summary["curves"]:
                if c["causal"] != causal:
                    continue
                n, y = np.array(c["n"]), np.array(c[column], dtype=float)
                ok = np.isfinite(y) & (y > 0)
                if not ok.any():
                    continue
                label = c["name"]
                if column == "time_ms" and np.isfinite(c["slope"]):
                    label += " (slope %.2f)" % c["slope"]
                ax.loglog(n[ok], y[ok], label=label, markersize=4, linewidth=1.2,
                          **curve_style(c))
            if column == "time_ms":
                ax.axvline(summary["fit_min_n"], color="grey", linewidth=0.6, alpha=0.5)
            ax.set_title("%s, %s, H = %d" % (title, "causal" if causal else "non-causal",
                                             summary["heads"]))
            ax.set_xlabel("sequence length n")
            ax.grid(True, which="both", alpha=0.25)
            ax.legend(fontsize=7, loc="upper left")
        axes[0].set_ylabel(ylabel)
        save_figure(fig, directory, name)
