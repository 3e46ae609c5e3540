"""Every number the training report quotes, derived once from a training output directory's
tables (summary.json): per cell -- a task, context, variant and learning rate -- the mean, range
and per-seed values over its seeds.

char_lm, per training context: the learning-rate grid (the first seed's final bpc at every
rate), each variant's best rate (plans.best_lr, the rule the plan chose by), the cells at the best
rate with W fixed, and those with W redrawn. mqar: a cell per variant. Then the one-layer step
times, the decoding cost against position and the text samples."""
import json
import math
import os
import statistics

from analysis.common import crossover, num, read_rows  # experiments/analysis

from .plans import best_lr, grid_runs
from .results import read_tables
from .step_time import VARIANTS_TIMED
from .variants import SOFTMAX_ROPE, in_catalogue_order


def _rows(out, name):
    """The CSV's rows, or none when the run did not write it (--no-step-time, --no-decode)."""
    return read_rows(out, name) if os.path.exists(os.path.join(out, name + ".csv")) else []


def spread(values):
    """mean, min, max and count of the finite values (None counts as missing; NaN mean when
    there are none)."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return dict(mean=math.nan, min=math.nan, max=math.nan, n=0)
    return dict(mean=statistics.fmean(values), min=min(values), max=max(values), n=len(values))


def paired(a, b):
    """{seed: a's value - b's} over the seeds where both are finite: the same seed draws the
    same batches for every variant, so the difference is paired."""
    return {s: a[s] - b[s] for s in sorted(set(a) & set(b), key=int)
            if a[s] is not None and b[s] is not None
            and math.isfinite(a[s]) and math.isfinite(b[s])}


def _last_final(result, length):
    values = [e["value"] for e in result.finals(length)]
    return values[-1] if values else None


def _cell(runs):
    """The summary of one cell's runs (results.Result, one per seed)."""
    first = runs[0]
    s = dict(seeds=len(runs), diverged=sum(not r.complete for r in runs),
             diverged_steps=[r.summary["diverged_step"] for r in runs if not r.complete],
             clip_share=spread(r.summary["clip_share"] for r in runs),
             tokens_per_s=spread(r.summary["tokens_per_s"] for r in runs), lr=first.lr)
    if first.task == "char_lm":
        context = first.context
        s["final_bpc_per_seed"] = {str(r.seed): _last_final(r, context) for r in runs}
        s["final_bpc"] = spread(s["final_bpc_per_seed"].values())
        s["best_bpc"] = spread(min((e["value"] for e in r.records["evaluations"]
                                    if e["length"] == context and e["value"] is not None),
                                   default=math.inf) for r in runs)
        lengths = sorted({e["length"] for r in runs for e in r.finals()})
        s["extrapolation"] = {str(n): spread(e["value"] for r in runs for e in r.finals(n))
                              for n in lengths}
    else:
        settings = sorted({(e["length"], e["pairs"]) for r in runs for e in r.finals()})
        s["accuracy"] = {"%d/%d" % (n, p): spread(
            e["value"] for r in runs for e in r.finals(n) if e["pairs"] == p)
            for n, p in settings}
        s["accuracy_per_seed"] = {str(r.seed): statistics.fmean(
            e["value"] for e in r.finals()) if r.finals() else None for r in runs}
    s["layers"] = {}
    for layer in sorted({i for r in runs for i in r.layer_ids()}):
        totals = ["layer%d_%s" % (layer, name) for name in ("den_min", "nonpositive_share",
                                                            "tiny_share")]
        s["layers"][str(layer)] = dict(
            den_min=min((r.summary[totals[0]] for r in runs
                         if r.summary.get(totals[0]) is not None), default=math.nan),
            nonpositive_share=spread(r.summary.get(totals[1]) for r in runs),
            tiny_share=spread(r.summary.get(totals[2]) for r in runs),
            grad_norm=spread(row["grad_norm"] for r in runs for row in r.records["layers"]
                             if row["layer"] == layer))
    return s


def _char_lm(results, context):
    """One training context's grid, best rates, cells (W fixed) and redrawn cells."""
    variants = in_catalogue_order({r.variant for r in results})
    grid, best, cells, redrawn = {}, {}, {}, {}
    for v in variants:
        rate = best_lr(results, v, context)
        cell = _cell([r for r in results if r.variant == v and r.lr == rate])
        if v.redraw_interval:
            redrawn[v.name] = cell
            continue
        best[v.name], cells[v.name] = rate, cell
        grid[v.name] = {"%g" % r.lr: r.final_bpc() if math.isfinite(r.final_bpc()) else None
                        for r in sorted(grid_runs(results, v, context), key=lambda r: r.lr)}
    return dict(grid=grid, best_lr=best, cells=cells, redrawn=redrawn)


def _step_time(rows):
    lengths = sorted({int(r["length"]) for r in rows})
    times = {v.name: [num(r, "seconds") for r in rows if r["variant"] == v.name]
             for v in VARIANTS_TIMED}
    return dict(lengths=lengths, seconds=times, threads=int(rows[0]["threads"]),
                load_average_before=num(rows[0], "load_average_before"),
                crossover={v: crossover(lengths, times[v], times[SOFTMAX_ROPE.name])
                           for v in times if v != SOFTMAX_ROPE.name})


def summarise(out):
    results = read_tables(out)
    summary = {}
    contexts = sorted({r.context for r in results if r.task == "char_lm"})
    if contexts:
        summary["char_lm"] = {str(context): _char_lm(
            [r for r in results if r.task == "char_lm" and r.context == context], context)
            for context in contexts}
    mqar = [r for r in results if r.task == "mqar"]
    cells = sorted({r.cell for r in mqar}, key=lambda cell: (
        in_catalogue_order({r.variant for r in mqar}).index(cell[2]), cell[3]))
    if cells:
        summary["mqar"] = {cell[2].name: _cell([r for r in mqar if r.cell == cell])
                           for cell in cells}
    steps = _rows(out, "step_time")
    if steps:
        summary["step_time"] = _step_time(steps)
    decode = _rows(out, "decode")
    if decode:
        summary["decoding"] = _decoding(decode)
    samples = os.path.join(out, "samples.json")
    if os.path.exists(samples):
        with open(samples) as f:
            summary["samples"] = json.load(f)
    return summary


def _decoding(rows):
    """Per (context, variant): the time per token and cache bytes at each window measured."""
    out = {}
    for context in sorted({int(r["context"]) for r in rows}):
        at_context = [r for r in rows if int(r["context"]) == context]
        per_variant = {}
        for r in at_context:
            per_variant.setdefault(r["variant"], []).append(r)
        out[str(context)] = {v: dict(positions=[int(r["position"]) for r in rows],
                                     seconds_per_token=[num(r, "seconds_per_token") for r in rows],
                                     cache_bytes=[int(r["cache_bytes"]) for r in rows])
                             for v, rows in per_variant.items()}
    return out
