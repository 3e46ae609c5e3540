#!/usr/bin/python3
"""Every linrope.matmul call of the study's training step, timed inside the step and then alone
on the same shapes (hot, fresh NumPy inputs), per shape: whether the products of
linrope.torch.Linear run as fast in a step as in bench_gemm, and which shapes are the slow ones.
One thread; --steps steps after --warm-up, the medians per shape, and the total per step both
ways.

  cd /tmp && PYTHONPATH=<tree>/build/release/python:<tree>/experiments /usr/bin/python3 \\
      <tree>/bench/step_gemms.py [--variant elu-numerator_only] [--context 256]
"""
import argparse
import collections
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_step import make_run, steps  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", default="elu-numerator_only")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warm-up", type=int, default=2)
    args = parser.parse_args()
    args.task, args.threads = "char_lm", 1
    import numpy as np
    import torch

    import linrope
    from training.data import load_corpus
    torch.set_num_threads(1)
    linrope.set_num_threads(1)
    run = make_run(args, args.variant, args.context, load_corpus())
    steps(run, args.warm_up)
    matmul, in_step = linrope.matmul, collections.defaultdict(list)

    def timed(a, b, transpose_a=False, transpose_b=False, out=None, accumulate=False):
        start = time.perf_counter()
        result = matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b, out=out,
                        accumulate=accumulate)
        in_step[(a.shape, b.shape, transpose_a, transpose_b)].append(time.perf_counter() - start)
        return result

    linrope.matmul = timed  # linrope.torch.functional looks it up at each call
    try:
        steps(run, args.steps)
    finally:
        linrope.matmul = matmul
    print(f"# {args.variant}, context {args.context}, d_model {args.d_model}, {args.layers} "
          f"layers, {args.steps} steps")
    print("| a | b | op(a), op(b) | calls/step | in the step: ms (GFLOP/s) | alone: ms (GFLOP/s) |")
    print("|---|---|---|---|---|---|")
    totals = [0.0, 0.0]
    rng = np.random.default_rng(0)
    for (a_shape, b_shape, t_a, t_b), times in sorted(in_step.items(), key=lambda kv: -sum(kv[1])):
        a = rng.standard_normal(a_shape, dtype=np.float32)
        b = rng.standard_normal(b_shape, dtype=np.float32)
        alone = []
        for _ in range(7):
            start = time.perf_counter()
            matmul(a, b, transpose_a=t_a, transpose_b=t_b)
            alone.append(time.perf_counter() - start)
        m, k = (a_shape[1], a_shape[0]) if t_a else a_shape
        n = b_shape[0] if t_b else b_shape[1]
        calls = len(times) / args.steps
        mine, hot = statistics.median(times), statistics.median(alone)
        totals[0] += mine * calls
        totals[1] += hot * calls
        print(f"| {a_shape} | {b_shape} | {'a^T' if t_a else 'a'}, {'b^T' if t_b else 'b'} | "
              f"{calls:g} | {1e3 * mine:.2f} ({2 * m * n * k / mine / 1e9:.0f}) | "
              f"{1e3 * hot:.2f} ({2 * m * n * k / hot / 1e9:.0f}) |")
    print(f"# per step: {1e3 * totals[0]:.0f} ms in the step, {1e3 * totals[1]:.0f} ms alone")


if __name__ == "__main__":
    main()
