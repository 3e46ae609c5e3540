#!/usr/bin/python3
"""An upper bound on what MultiheadAttention's layout copies cost the study's training step: the
step as it is ("copies": q, k and v split into [B, H, n, head_dim] by view, transpose and
contiguous, the output merged back by transpose and reshape, and their gradients the same way)
against the same step with the split a free reinterpretation (x.view(B, H, n, head_dim), no
transpose) and the merge a view ("none"). The second computes the wrong numbers with the same
work, so the ratio bounds what kernels reading PyTorch's [B, n, H, d] layout could save; it is
not a model to train. Each side runs in its own process (the patch is process-wide), --pairs
pairs alternated, each --steps steps after --warm-up, one thread, CPU time.

  cd /tmp && PYTHONPATH=<tree>/build/release/python:<tree>/experiments \\
      /usr/bin/python3 <tree>/bench/head_copies_bound.py [--variant favor-numerator_only]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def parse_args():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", default="favor-numerator_only")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warm-up", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--side", choices=("copies", "none"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 1 or args.pairs < 1:
        parser.error(f"--steps is {args.steps} and --pairs {args.pairs} but expected >= 1")
    return args


def without_copies():
    """MultiheadAttention's split and merge made views: the same shapes, no copies."""
    import linrope.torch.layers as layers
    attention = layers.MultiheadAttention

    def heads(self, x, n):
        return x.view(x.shape[0], self.num_heads, n, self.head_dim)

    def merged_as_view(method):
        def call(self, *args, **kwargs):
            out, cache = method(self, *args, **kwargs)
            b, h, n, d = out.shape
            # forward() then takes out.transpose(1, 2).reshape(b, n, h d): a view of this
            return out.view(b, n, h, d).transpose(1, 2), cache
        return call

    attention._heads = heads
    attention._linear = merged_as_view(attention._linear)
    attention._softmax = merged_as_view(attention._softmax)


def one_side(args):
    """This process's steps: their CPU milliseconds, as JSON on stdout."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import linrope
    import torch
    from profile_step import make_run, parse_args as step_args
    from training.data import load_corpus
    torch.set_num_threads(1)
    linrope.set_num_threads(1)
    if args.side == "none":
        without_copies()
    run = make_run(step_args(["--contexts", str(args.context)]), args.variant, args.context,
                   load_corpus())
    times = []
    for i in range(args.warm_up + args.steps):
        run.config.steps += 1
        start = time.process_time()
        run.train()
        if i >= args.warm_up:
            times.append(1e3 * (time.process_time() - start))
    print(json.dumps(times))


def main():
    args = parse_args()
    if args.side:
        return one_side(args)
    own = [sys.executable, os.path.abspath(__file__), "--variant", args.variant, "--context",
           str(args.context), "--steps", str(args.steps), "--warm-up", str(args.warm_up)]
    ratios = []
    for pair in range(args.pairs):
        medians = {}
        for side in ("copies", "none") if pair % 2 == 0 else ("none", "copies"):
            done = subprocess.run(own + ["--side", side], capture_output=True, text=True,
                                  check=True)
            times = json.loads(done.stdout.splitlines()[-1])
            medians[side] = statistics.median(times)
            print(f"pair {pair + 1}, {side}: median step {medians[side]:.1f} ms, mean "
                  f"{statistics.fmean(times):.1f} ms", flush=True)
        ratios.append(medians["copies"] / medians["none"])
    print(f"{args.variant}, context {args.context}: copies / none, median steps, per pair: "
          + ", ".join(f"{r:.3f}" for r in ratios) + f" (median {statistics.median(ratios):.3f})")


if __name__ == "__main__":
    main()
