"""The training step of one decoder layer (attention + MLP, the training's shape, batch 1,
forward + backward) against context length, for softmax + RoPE, elu+1 and FAVOR+ (both
numerator_only), on every core; and the context length at which each linear variant's step
becomes faster than softmax's (interpolated on log length between the two measured lengths
where the order changes). Median of `repeats` after one warm-up step."""
import math
import os
import statistics
import sys
import time

import torch

import linrope

from analysis.common import write_atomic  # experiments/analysis

from .model import Block, VARIANTS
from .sweep import _csv

VARIANTS_TIMED = ("softmax-rope", "elu-numerator_only", "favor-numerator_only")


def time_step(block, x, repeats):
    times = []
    for i in range(repeats + 1):
        started = time.perf_counter()
        block(x).sum().backward()
        if i:  # the first call warms caches and allocations
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def crossover(lengths, softmax, linear):
    """The length from which linear stays faster than softmax up to the longest measured:
    lengths[0] when it is faster at every length, the crossing interpolated on log length
    otherwise, None when it is not faster at the longest."""
    if not linear or linear[-1] >= softmax[-1]:
        return None
    i = len(lengths) - 1
    while i > 0 and linear[i - 1] < softmax[i - 1]:
        i -= 1
    if i == 0:
        return lengths[0]
    (n0, s0, l0), (n1, s1, l1) = ((lengths[j], softmax[j], linear[j]) for j in (i - 1, i))
    r0, r1 = math.log(l0 / s0), math.log(l1 / s1)
    return math.exp(math.log(n0) + (math.log(n1) - math.log(n0)) * r0 / (r0 - r1))


def run(out, mode, model, resume=False, quiet=False):
    from .plans import MODES
    plan = MODES[mode]["step_time"]
    path = os.path.join(out, "step_time.csv")
    lengths = list(plan["lengths"])
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
        args = dict(VARIANTS[variant])
        if args["attention"] == "linear":
            args["num_features"] = 2 * (model["d_model"] // model["heads"])
        torch.manual_seed(0)
        block = Block(model["d_model"], model["heads"], args)
        for n in lengths:
            x = torch.randn(1, n, model["d_model"], requires_grad=True)
            seconds = time_step(block, x, plan["repeats"])
            rows.append(dict(variant=variant, length=n, seconds=seconds, tokens_per_s=n / seconds,
                             threads=threads, repeats=plan["repeats"], load_average_before=load))
            if not quiet:
                sys.stderr.write("step_time: %s n=%d %.2f ms\n" % (variant, n, 1e3 * seconds))
    write_atomic(path, _csv(rows, ["variant", "length", "seconds", "tokens_per_s", "threads",
                                   "repeats", "load_average_before"]))
