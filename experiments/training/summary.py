"""Every number the training report quotes, derived once from a training output directory's
CSVs (summary.json): per cell -- a task, context, variant, FAVOR+'s features, redraws and
learning rate -- the mean, range and per-seed values over its seeds.

char_lm, per training context: the learning-rate grid (the first seed's final bpc at every
rate), each variant's best rate (plans.best_lr, the rule the plan chose by), the cells at the best
rate with W fixed, and those with W redrawn. mqar: a cell per variant and feature count. Then the
one-layer step times, the decoding cost against position and the text samples."""
import collections
import json
import math
import os
import statistics

from analysis.common import read_rows  # experiments/analysis

from .model import VARIANTS
from .plans import best_lr
from .step_time import VARIANTS_TIMED, crossover


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


def paired(a, b):
    """{seed: a's value - b's} over the seeds where both are finite: the same seed draws the
    same batches for every variant, so the difference is paired."""
    return {s: a[s] - b[s] for s in sorted(set(a) & set(b), key=int)
            if a[s] is not None and b[s] is not None
            and math.isfinite(a[s]) and math.isfinite(b[s])}


def cell_name(variant, feature_factor):
    return variant if int(feature_factor) == 2 or not variant.startswith("favor") else \
        "%s-m%dx" % (variant, int(feature_factor))


def _cell_key(row):
    return (row["task"], int(row["context"]), row["variant"], int(row["feature_factor"]),
            int(row["redraw_interval"]), float(row["lr"]))


def _as_result(run, finals):
    """A runs.csv row as plans.best_lr reads a run (its config, status and final evaluations)."""
    config = dict(task=run["task"], context=int(run["context"]), variant=run["variant"],
                  redraw_interval=int(run["redraw_interval"]), lr=float(run["lr"]),
                  seed=int(run["seed"]))
    return dict(config=config, summary=dict(status=run["status"]),
                records=dict(evaluations=[dict(final=True, length=int(e["length"]),
                                               value=_num(e["value"])) for e in finals]))


def _cell(task, runs, evaluations, layers):
    """The summary of one cell's runs (one per seed)."""
    seeds = [r["seed"] for r in runs]
    finals = [e for e in evaluations if e["final"] == "True"]
    s = dict(seeds=len(runs), diverged=sum(r["status"] == "diverged" for r in runs),
             diverged_steps=[int(r["diverged_step"]) for r in runs if r["status"] == "diverged"],
             clip_share=spread(_num(r["clip_share"]) for r in runs),
             tokens_per_s=spread(_num(r["tokens_per_s"]) for r in runs),
             lr=float(runs[0]["lr"]))
    if task == "char_lm":
        context = int(runs[0]["context"])
        per_seed = {seed: None for seed in seeds}
        for e in finals:
            if int(e["length"]) == context:
                per_seed[e["seed"]] = _num(e["value"])
        s["final_bpc_per_seed"] = per_seed
        s["final_bpc"] = spread(v for v in per_seed.values() if v is not None)
        best = collections.defaultdict(lambda: math.inf)
        for e in evaluations:
            if int(e["length"]) == context:
                best[e["seed"]] = min(best[e["seed"]], _num(e["value"]))
        s["best_bpc"] = spread(best.values())
        s["extrapolation"] = {
            str(n): spread(_num(e["value"]) for e in finals if int(e["length"]) == n)
            for n in sorted({int(e["length"]) for e in finals})}
    else:
        settings = sorted({(int(e["length"]), int(e["pairs"])) for e in finals})
        s["accuracy"] = {"%d/%d" % (n, p): spread(
            _num(e["value"]) for e in finals if (int(e["length"]), int(e["pairs"])) == (n, p))
            for n, p in settings}
        s["accuracy_per_seed"] = {seed: statistics.fmean(
            _num(e["value"]) for e in finals if e["seed"] == seed) if any(
            e["seed"] == seed for e in finals) else None for seed in seeds}
    den = {}
    numbered = {k[len("layer"):-len("_den_min")] for r in runs for k in r
                if k.startswith("layer") and k.endswith("_den_min") and r[k] != ""}
    for layer in sorted(numbered | {r["layer"] for r in layers}, key=int):
        key = "layer%s_" % layer
        den[layer] = dict(
            den_min=min((_num(r[key + "den_min"]) for r in runs if r.get(key + "den_min")),
                        default=math.nan),
            nonpositive_share=spread(_num(r.get(key + "nonpositive_share", "")) for r in runs),
            tiny_share=spread(_num(r.get(key + "tiny_share", "")) for r in runs),
            grad_norm=spread(_num(r["grad_norm"]) for r in layers if r["layer"] == layer))
    s["layers"] = den
    return s


def _ordered(variants):
    return [v for v in VARIANTS if v in variants]


def summarise(out):
    runs, evaluations = _rows(out, "runs"), _rows(out, "evaluations")
    layers, steps = _rows(out, "layers"), _rows(out, "step_time")
    by_cell = collections.defaultdict(list)
    for r in runs:
        by_cell[_cell_key(r)].append(r)
    ev_by_cell, layers_by_cell = collections.defaultdict(list), collections.defaultdict(list)
    for e in evaluations:
        ev_by_cell[_cell_key(e)].append(e)
    for row in layers:
        layers_by_cell[_cell_key(row)].append(row)

    def cell(key):
        return _cell(key[0], by_cell[key], ev_by_cell[key], layers_by_cell[key])

    summary = {}
    char_lm = {}
    for context in sorted({k[1] for k in by_cell if k[0] == "char_lm"}):
        keys = [k for k in by_cell if k[:2] == ("char_lm", context)]
        results = [_as_result(r, [e for e in ev_by_cell[k] if e["final"] == "True"
                                  and e["seed"] == r["seed"]]) for k in keys for r in by_cell[k]]
        fixed = [k for k in keys if not k[4]]
        variants = _ordered({k[2] for k in fixed})
        grid, chosen, cells = {}, {}, {}
        for v in variants:
            mine = [k for k in fixed if k[2] == v]
            first = min(int(r["seed"]) for k in mine for r in by_cell[k])
            grid[v] = {}
            for k in sorted(mine, key=lambda k: k[5]):
                at_first = [r for r in by_cell[k] if int(r["seed"]) == first]
                if at_first:
                    value = [e for e in ev_by_cell[k] if e["final"] == "True" and
                             int(e["seed"]) == first and int(e["length"]) == context]
                    grid[v]["%g" % k[5]] = _num(value[-1]["value"]) if value and \
                        at_first[0]["status"] == "complete" else None
            chosen[v] = best_lr(results, v, context)
            cells[v] = cell(next(k for k in mine if k[5] == chosen[v]))
        redrawn = {}
        for k in sorted(k for k in keys if k[4]):
            redrawn[k[2]] = dict(cell(k), redraw_interval=k[4])
        char_lm[str(context)] = dict(grid=grid, best_lr={v: chosen[v] for v in variants},
                                     cells=cells, redrawn=redrawn)
    if char_lm:
        summary["char_lm"] = char_lm
    mqar_keys = sorted((k for k in by_cell if k[0] == "mqar"),
                       key=lambda k: (list(VARIANTS).index(k[2]), k[3], k[5]))
    mqar = {cell_name(k[2], k[3]): dict(cell(k), variant=k[2], feature_factor=k[3])
            for k in mqar_keys}
    if mqar:
        summary["mqar"] = mqar
    if steps:
        lengths = sorted({int(r["length"]) for r in steps})
        times = {v: [_num(r["seconds"]) for r in steps if r["variant"] == v]
                 for v in VARIANTS_TIMED}
        summary["step_time"] = dict(
            lengths=lengths, seconds=times, threads=int(steps[0]["threads"]),
            load_average_before=_num(steps[0]["load_average_before"]),
            crossover={v: crossover(lengths, times["softmax-rope"], times[v])
                       for v in VARIANTS_TIMED[1:]})
    decode = _rows(out, "decode")
    if decode:
        summary["decoding"] = _decoding(decode)
    samples = os.path.join(out, "samples.json")
    if os.path.exists(samples):
        with open(samples) as f:
            summary["samples"] = json.load(f)
    return summary


def _decoding(rows):
    """Per (context, variant): the time per token and cache bytes at the first and last
    windows, and the positions measured."""
    out = {}
    for context in sorted({int(r["context"]) for r in rows}):
        per = {}
        for v in _ordered({r["variant"] for r in rows if int(r["context"]) == context}):
            mine = [r for r in rows if int(r["context"]) == context and r["variant"] == v]
            per[v] = dict(positions=[int(r["position"]) for r in mine],
                          seconds_per_token=[_num(r["seconds_per_token"]) for r in mine],
                          cache_bytes=[int(r["cache_bytes"]) for r in mine])
        out[str(context)] = per
    return out
