"""Every number the training report quotes, derived once from a training output directory's
tables (summary.json): per cell -- a task, setting, variant, learning rate and budget -- the
mean, range and per-seed values over its seeds.

Per task and setting (char_lm's training context, MQAR's (length, pairs) settings): the
learning-rate grid (the first seed's final bpc or accuracy at every rate, at the grid's budget),
each variant's chosen rate (plans.chosen_lr, the rule the plan chose by), its cell there
(plans.cell_runs: the largest budget), the lr check (other rates at that budget, where run), and
the cells with W redrawn. MQAR's cells add the steps to 0.9 and 0.99 accuracy and the state
size. Then the one-layer step times, the decoding cost against position and the text
samples."""
import json
import math
import os
import statistics

from analysis.common import crossover, num, read_rows  # experiments/analysis

from .mqar import settings_name
from .plans import cell_runs, chosen_lr, grid_runs
from .results import read_tables
from .train import RECALL_THRESHOLDS
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


def _per_seed(runs, value):
    """{seed: value(run)} and its spread."""
    per_seed = {str(r.seed): value(r) for r in runs}
    return per_seed, spread(per_seed.values())


def _cell(runs):
    """The summary of one cell's runs (results.Result, one per seed)."""
    first = runs[0]
    s = dict(seeds=len(runs), diverged=sum(not r.complete for r in runs),
             diverged_steps=[r.summary["diverged_step"] for r in runs if not r.complete],
             clip_share=spread(r.summary["clip_share"] for r in runs),
             tokens_per_s=spread(r.summary["tokens_per_s"] for r in runs), lr=first.lr,
             steps=first.budget, state_floats=first.summary.get("state_floats"))
    if first.task == "char_lm":
        context = first.context
        s["final_bpc_per_seed"], s["final_bpc"] = _per_seed(
            runs, lambda r: _last_final(r, context))
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
        s["final_accuracy_per_seed"], s["final_accuracy"] = _per_seed(
            runs, lambda r: r.final_accuracy())
        for threshold in RECALL_THRESHOLDS:
            name = "steps_to_%g" % threshold
            s[name + "_per_seed"], s[name] = _per_seed(runs, lambda r: r.summary.get(name))
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


def _grid_value(result):
    """What a grid reports of a run: char_lm's final bpc, MQAR's final accuracy (None if it
    diverged)."""
    if result.task == "char_lm":
        return result.final_bpc() if math.isfinite(result.final_bpc()) else None
    return result.final_accuracy()


def _rates(runs):
    return {"%g" % r.lr: _grid_value(r) for r in sorted(runs, key=lambda r: r.lr)}


def _setting(results, task, setting):
    """One setting's (char_lm's context, MQAR's settings) grid (the first seed at the grid's
    budget, every rate tried; grid_steps that budget), each variant's chosen rate
    (plans.chosen_lr), its cell at that rate (plans.cell_runs), the lr check (the first seed at
    the cell's budget at other rates), and apart, the cells with W redrawn of variants also
    trained with W fixed."""
    here = [r for r in results if r.task == task and r.setting == setting]
    grid, best, cells, redrawn, lr_check = {}, {}, {}, {}, {}
    grid_steps = None
    variants = {r.variant for r in here}
    for v in in_catalogue_order(variants):
        runs = cell_runs(results, task, setting, v)
        if not runs:  # several rates at its budget and none chosen (no grid run)
            continue
        cell = _cell(runs)
        if v.redraw_interval and v.replace(redraw_interval=0) in variants:
            redrawn[v.name] = cell
            continue
        best[v.name], cells[v.name] = chosen_lr(results, task, setting, v), cell
        own = grid_runs(results, task, setting, v)
        if own:
            grid[v.name] = _rates(own)
            grid_steps = own[0].budget
        checked = [r for r in here if r.variant == v and r.budget == runs[0].budget
                   and r.seed == runs[0].seed]
        if len({r.lr for r in checked}) > 1 and (not own or own[0].budget != runs[0].budget):
            lr_check[v.name] = _rates(checked)
    return dict(grid=grid, grid_steps=grid_steps, best_lr=best, cells=cells, redrawn=redrawn,
                lr_check=lr_check)


def setting_name(task, setting):
    """summary.json's key of a setting: char_lm's context ("256"), MQAR's settings ("64x4")."""
    return str(setting) if task == "char_lm" else settings_name(setting)


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
    for task in ("char_lm", "mqar"):
        settings = sorted({r.setting for r in results if r.task == task})
        if settings:
            summary[task] = {setting_name(task, setting): _setting(results, task, setting)
                             for setting in settings}
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
