#!/usr/bin/env python3
"""Plots for linrope-experiments.

    /usr/bin/python3 experiments/plot.py <experiment> <dir>

reads <dir>/<experiment>.csv (and .json) and writes PNGs into <dir>, each through a temporary file
and a rename so that an interrupted run never leaves a truncated image. Exits non-zero (the last
line of stderr says why) if matplotlib is missing or the data cannot be plotted.
"""
import csv
import json
import math
import os
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

PLACEMENT_STYLE = {"none": ":", "before_map": "-.", "numerator_only": "-", "full": "--"}
PLACEMENT_MARKER = {"none": "x", "before_map": "^", "numerator_only": "o", "full": "s"}
PLACEMENTS = ["none", "before_map", "numerator_only", "full"]


def read_rows(directory, stem):
    with open(os.path.join(directory, stem + ".csv"), newline="") as f:
        return list(csv.DictReader(f))


def read_summary(directory, stem):
    path = os.path.join(directory, stem + ".json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f).get("summary", {})


def save(fig, directory, name):
    """Writes name (a .png, for the report) and the same figure as .svg (vector, for papers),
    each to a temporary name first and then renamed, so an interrupted run leaves no half file."""
    try:
        for path, fmt in ((name, "png"), (os.path.splitext(name)[0] + ".svg", "svg")):
            final = os.path.join(directory, path)
            temporary = os.path.join(directory, ".%s.tmp-%d" % (path, os.getpid()))
            try:
                fig.savefig(temporary, format=fmt, dpi=110, bbox_inches="tight")
                os.replace(temporary, final)
            finally:
                if os.path.exists(temporary):
                    os.remove(temporary)
    finally:
        plt.close(fig)


def num(row, key):
    try:
        return float(row[key])
    except (KeyError, ValueError):
        return float("nan")


def mean_std(values):
    a = np.array(values, dtype=float)
    a = a[np.isfinite(a)]
    if a.size == 0:
        return float("nan"), float("nan")
    return float(a.mean()), float(a.std(ddof=1)) if a.size > 1 else 0.0


# ---- 1. scaling --------------------------------------------------------------------------------
def curve_style(method, fmap, placement):
    if method == "softmax_naive":
        return dict(color="black", linestyle="--", marker="D")
    if method == "softmax_streaming":
        return dict(color="black", linestyle="-", marker="o")
    color = {"elu+1": "tab:blue", "favor+": "tab:red"}.get(fmap, "tab:green")
    return dict(color=color, linestyle=PLACEMENT_STYLE.get(placement, "-"),
                marker=PLACEMENT_MARKER.get(placement, "."))


def curve_label(method, fmap, placement):
    if method.startswith("softmax"):
        return method.replace("_", " ")
    return "linear %s %s" % (fmap, placement)


def plot_scaling(directory):
    rows = read_rows(directory, "scaling")
    summary = read_summary(directory, "scaling")
    heads_count = defaultdict(int)
    for r in rows:
        heads_count[r["heads"]] += 1
    heads = max(heads_count, key=heads_count.get)
    slopes = {}
    for f in summary.get("fits", []):
        slopes[(f["method"], f["map"], f["placement"], bool(f["causal"]), f["causal_method"])] = f["slope"]
    curves = defaultdict(list)
    for r in rows:
        if r["heads"] != heads:
            continue
        key = (r["method"], r["map"], r["placement"], r["causal"] == "1", r["causal_method"])
        curves[key].append((num(r, "n"), num(r, "time_ms"), num(r, "extra_mib")))
    fit_min = summary.get("fit_min_n", 2048)

    for column, ylabel, name, title in [
            (1, "median time per call [ms]", "scaling_time.png", "time"),
            (2, "peak RSS beyond inputs/outputs [MiB]", "scaling_memory.png", "memory")]:
        fig, axes = plt.subplots(1, 2, figsize=(15, 6.5), sharey=True)
        for ax, causal in zip(axes, [False, True]):
            for key in sorted(curves):
                if key[3] != causal:
                    continue
                points = sorted(curves[key])
                n = np.array([p[0] for p in points])
                y = np.array([p[column] for p in points])
                ok = np.isfinite(y) & (y > 0)
                if not ok.any():
                    continue
                label = curve_label(*key[:3])
                if key[4] != "none" and len({k[4] for k in curves if k[3]}) > 1:
                    label += " " + key[4]
                if column == 1:
                    slope = slopes.get(key)
                    if slope is not None and slope == slope:
                        label += " (slope %.2f)" % slope
                style = curve_style(*key[:3])
                if key[4] == "chunked":
                    style["markerfacecolor"] = "none"
                ax.loglog(n[ok], y[ok], label=label, markersize=4, linewidth=1.2, **style)
            if column == 1:
                ax.axvline(fit_min, color="grey", linewidth=0.6, alpha=0.5)
            ax.set_title("%s, %s, H = %s" % (title, "causal" if causal else "non-causal", heads))
            ax.set_xlabel("sequence length n")
            ax.grid(True, which="both", alpha=0.25)
            ax.legend(fontsize=7, loc="upper left")
        axes[0].set_ylabel(ylabel)
        save(fig, directory, name)


# ---- 2. normalization -------------------------------------------------------------------------
def plot_normalization(directory):
    rows = read_rows(directory, "normalization")
    inputs = list(dict.fromkeys(r["input"] for r in rows))
    maps = list(dict.fromkeys(r["map"] for r in rows))
    groups = defaultdict(list)
    for r in rows:
        groups[(r["input"], r["map"], r["placement"], r["causal"] == "1", int(r["n"]))].append(r)
    lengths = sorted({k[4] for k in groups})

    def grid(name, column, ylabel, logy, exact_column=None, causal_set=(False, True)):
        fig, axes = plt.subplots(len(maps), len(inputs), figsize=(3.4 * len(inputs), 2.8 * len(maps)),
                                 squeeze=False, sharex=True)
        for i, fmap in enumerate(maps):
            for j, inp in enumerate(inputs):
                ax = axes[i][j]
                for placement in PLACEMENTS:
                    for causal in causal_set:
                        xs, ms, ss = [], [], []
                        for n in lengths:
                            rs = groups.get((inp, fmap, placement, causal, n), [])
                            if not rs:
                                continue
                            m, s = mean_std([num(r, column) for r in rs])
                            xs.append(n), ms.append(m), ss.append(s)
                        if not xs:
                            continue
                        ax.errorbar(xs, ms, yerr=ss, capsize=2, markersize=3, linewidth=1,
                                    color={"none": "tab:gray", "before_map": "tab:green",
                                           "numerator_only": "tab:blue", "full": "tab:red"}[placement],
                                    linestyle="--" if causal else "-",
                                    marker=PLACEMENT_MARKER[placement],
                                    label=placement + (" causal" if causal else ""))
                if exact_column:
                    for causal in causal_set:
                        xs, ms = [], []
                        for n in lengths:
                            rs = groups.get((inp, fmap, "none", causal, n), [])
                            if rs:
                                xs.append(n), ms.append(mean_std([num(r, exact_column) for r in rs])[0])
                        ax.plot(xs, ms, color="black", linestyle="--" if causal else "-",
                                linewidth=1.5, label="exact softmax" + (" causal" if causal else ""))
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
        save(fig, directory, name)

    grid("normalization_denominators.png", "den_nonpositive_frac", "fraction den <= 0", False)
    grid("normalization_error.png", "rel_error", "rel. error vs RoPE softmax", True)
    grid("normalization_output_norm.png", "out_row_norm_mean", "mean output row norm", True,
         exact_column="exact_row_norm_mean")


# ---- 3. favor-error ---------------------------------------------------------------------------
def plot_favor_error(directory):
    rows = read_rows(directory, "favor_error")
    groups = defaultdict(list)
    for r in rows:
        groups[(r["scale"], r["features"], r["sampling"], int(r["m"]))].append(r)
    scales = sorted({k[0] for k in groups}, key=float)
    variants = sorted({k[1:3] for k in groups})
    style = {("positive", "orthogonal"): ("tab:blue", "-", "o"), ("positive", "iid"): ("tab:blue", "--", "s"),
             ("trig", "orthogonal"): ("tab:red", "-", "o"), ("trig", "iid"): ("tab:red", "--", "s")}
    n = rows[0]["n"] if rows else "?"
    d = rows[0]["d"] if rows else "?"
    for column, ylabel, name in [("kernel_mse", "MSE of phi(q).phi(k) vs exp(q.k/sqrt d)", "favor_kernel_mse.png"),
                                 ("attn_rel_error", "relative error of attention output", "favor_attention_error.png")]:
        fig, axes = plt.subplots(1, len(scales), figsize=(6.5 * len(scales), 5), squeeze=False)
        for ax, scale in zip(axes[0], scales):
            for v in variants:
                ms = sorted(k[3] for k in groups if k[:3] == (scale,) + v)
                stats = [mean_std([num(r, column) for r in groups[(scale, v[0], v[1], m)]]) for m in ms]
                color, ls, marker = style.get(v, ("tab:green", "-", "."))
                ax.errorbar(ms, [s[0] for s in stats], yerr=[s[1] for s in stats], color=color,
                            linestyle=ls, marker=marker, capsize=3, label="%s, %s" % v)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("random features m")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.25)
            ax.legend()
            ax.set_title("FAVOR+ L = %s, d = %s, q/k entries N(0, %s^2)" % (n, d, scale))
        save(fig, directory, name)


# ---- 4. rope-decay ----------------------------------------------------------------------------
def plot_rope_decay(directory):
    rows = read_rows(directory, "rope_decay")
    curves = defaultdict(list)
    for r in rows:
        curves[(r["base"], r["scaling"], r["factor"])].append((int(r["distance"]), num(r, "decay")))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for (base, scaling, factor), points in sorted(curves.items(), key=lambda kv: (kv[0][1], float(kv[0][0]))):
        points.sort()
        x = [p[0] for p in points]
        y = [p[1] for p in points]
        if scaling == "none":
            axes[0].plot(x, y, label="base %s" % base)
        if scaling != "none" or base == "10000":
            axes[1].plot(x, y, label="base %s, %s" % (base, scaling if scaling == "none" else "%s x%s" % (scaling, factor)))
    d = rows[0]["dim"] if rows else "?"
    for ax, title in zip(axes, ["bases", "scalings (factor 4)"]):
        ax.set_xlabel("relative distance m")
        ax.set_title("RoPE decay bound, d = %s: %s" % (d, title))
        ax.grid(True, alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("(1/(d/2)) sum_j |sum_{i<j} exp(i m theta_i)|")
    save(fig, directory, "rope_decay.png")


# ---- 5. rope-relative -------------------------------------------------------------------------
def plot_rope_relative(directory):
    rows = read_rows(directory, "rope_relative")
    fig, ax = plt.subplots(figsize=(7, 5))
    for precision, color in [("float", "tab:orange"), ("double", "tab:purple")]:
        points = sorted((num(r, "max_position"), num(r, "max_rel_dev"), num(r, "mean_rel_dev"))
                        for r in rows if r["precision"] == precision)
        if not points:
            continue
        x = [p[0] for p in points]
        ax.loglog(x, [max(p[1], 1e-300) for p in points], color=color, marker="o", label=precision + " max")
        ax.loglog(x, [max(p[2], 1e-300) for p in points], color=color, marker=".", linestyle="--",
                  label=precision + " mean")
    ax.axhline(2.0 ** -24, color="tab:orange", linewidth=0.6, alpha=0.5)
    ax.axhline(2.0 ** -53, color="tab:purple", linewidth=0.6, alpha=0.5)
    ax.set_xlabel("largest position (m, n uniform in [0, this])")
    ax.set_ylabel("|<R_m q, R_n k> - <q, R_(n-m) k>| / (|q||k|)")
    ax.set_title("RoPE relative-position identity (thin lines: unit roundoff)")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend()
    save(fig, directory, "rope_relative.png")


PLOTTERS = {"scaling": plot_scaling, "normalization": plot_normalization,
            "favor_error": plot_favor_error, "rope_decay": plot_rope_decay,
            "rope_relative": plot_rope_relative}


def main(argv):
    if len(argv) != 3 or argv[1].replace("-", "_") not in PLOTTERS:
        sys.stderr.write("usage: plot.py {%s} DIR\n" % ",".join(sorted(PLOTTERS)))
        return 2
    PLOTTERS[argv[1].replace("-", "_")](argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
