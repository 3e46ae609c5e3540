"""The training step of one decoder layer (attention + MLP, the training's shape, batch 1,
forward + backward) against context length, for softmax + RoPE, elu+1 and FAVOR+ (both
numerator_only), on every core, to step_time.csv: median of `repeats` after one warm-up step.
The analysis (summary.py) finds where each linear variant's step becomes faster than softmax's
(analysis.common.crossover)."""
import os
import statistics
import sys
import time

import torch

import linrope

from analysis.common import write_csv  # experiments/analysis

from .model import Block, attention_arguments
from .variants import from_name

VARIANTS_TIMED = tuple(map(from_name, ("softmax-rope", "elu-numerator_only",
                                       "favor-numerator_only")))
COLUMNS = ["variant", "length", "seconds", "tokens_per_s", "threads", "repeats",
           "load_average_before"]


def time_step(block, x, repeats):
    times = []
    for i in range(repeats + 1):
        started = time.perf_counter()
        block(x).sum().backward()
        if i:  # the first call warms caches and allocations
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def run(out, settings, model, resume=False, quiet=False):
    """settings: the plan's step_time (lengths, repeats); model: its d_model and heads."""
    path = os.path.join(out, "step_time.csv")
    lengths = list(settings["lengths"])
    if resume and os.path.exists(path):
        with open(path) as f:
            if f.read().count("\n") == 1 + len(lengths) * len(VARIANTS_TIMED):
                return
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    linrope.set_num_threads(threads)
    rows = []
    load = os.getloadavg()[0]  # other work on the cores distorts the times: recorded, not hidden
    for variant in VARIANTS_TIMED:
        torch.manual_seed(0)
        block = Block(model["d_model"], model["heads"],
                      attention_arguments(variant, model["d_model"], model["heads"]))
        for n in lengths:
            x = torch.randn(1, n, model["d_model"], requires_grad=True)
            seconds = time_step(block, x, settings["repeats"])
            rows.append(dict(variant=variant.name, length=n, seconds=seconds,
                             tokens_per_s=n / seconds, threads=threads,
                             repeats=settings["repeats"], load_average_before=load))
            if not quiet:
                sys.stderr.write("step_time: %s n=%d %.2f ms\n" % (variant.name, n, 1e3 * seconds))
    write_csv(path, rows, COLUMNS)
