#!/usr/bin/python3
"""What MultiheadAttention's heads layout costs the study's training step, three ways:
  * "copies": the layer as it was before its heads became views (session 12): q, k and v split
    into [B, H, n, head_dim] by view, transpose and contiguous, the output (then C-contiguous)
    merged back by transpose and reshape, a copy, and their gradients the same way;
  * "views": the layer as it is: the split a view that the kernels read in place (HeadsLayout
    BNHD: each slice's rows gathered in the thread that runs it), their output in that layout,
    the merge a view;
  * "none": a bound, not a model to train: the split a free reinterpretation
    (x.view(B, H, n, head_dim), no transpose: wrong numbers, the same work) and the merge a view,
    so that nothing is copied or gathered at all.
Each side runs in its own process (the patches are process-wide), --rounds rounds, the sides'
order rotated each round, each side --steps steps after --warm-up, one thread, CPU time; printed per
round: each side's median step, and copies / views and views / none. With --layer, one attention
layer alone instead of the step, forward + backward, the sides alternated within one process.

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

SIDES = ("copies", "views", "none")


def parse_args():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", default="favor-numerator_only")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warm-up", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layer", action="store_true",
                        help="one attention layer alone, the sides alternated in one process")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 1 or args.rounds < 1:
        parser.error(f"--steps is {args.steps} and --rounds {args.rounds} but expected >= 1")
    return args


def merged_as_view(method):
    """method (MultiheadAttention._linear or _softmax) with its output reinterpreted so that
    forward()'s out.transpose(1, 2).reshape(b, n, h d) is a view of it."""
    def call(self, *args, **kwargs):
        out, cache = method(self, *args, **kwargs)
        b, h, n, d = out.shape
        return out.contiguous().view(b, n, h, d).transpose(1, 2), cache
    return call


ORIGINAL = {}


def patch(side):
    """MultiheadAttention's split (and merge) as `side` makes them (undoing any earlier patch)."""
    import linrope.torch.layers as layers
    attention = layers.MultiheadAttention
    if not ORIGINAL:
        ORIGINAL.update((name, getattr(attention, name))
                        for name in ("_heads", "_linear", "_softmax"))
    for name, method in ORIGINAL.items():
        setattr(attention, name, method)
    if side == "copies":
        def heads(self, x, n):
            return x.view(x.shape[0], n, self.num_heads, self.head_dim).transpose(1, 2).contiguous()
        attention._heads = heads
    elif side == "none":
        def heads(self, x, n):
            return x.view(x.shape[0], self.num_heads, n, self.head_dim)
        attention._heads = heads
        attention._linear = merged_as_view(ORIGINAL["_linear"])
        attention._softmax = merged_as_view(ORIGINAL["_softmax"])


def one_layer(args):
    """--layer: the first attention layer of the study's model alone, forward + backward on
    random input of the step's shape, the three sides alternated in this process (their order
    rotated every iteration), --steps iterations after --warm-up; per side the median CPU ms,
    and the median and quartiles of the per-iteration ratios."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import linrope
    import torch
    from linrope.torch import MultiheadAttention
    from profile_step import make_run, parse_args as step_args
    from training.data import load_corpus
    torch.set_num_threads(1)
    linrope.set_num_threads(1)
    run = make_run(step_args(["--contexts", str(args.context)]), args.variant, args.context,
                   load_corpus())
    layer = next(m for m in run.model.modules() if isinstance(m, MultiheadAttention))
    shape = (run.config.batch_size, args.context, layer.embed_dim)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=generator, requires_grad=True)
    g = torch.randn(*shape, generator=generator)
    times = {side: [] for side in SIDES}
    for i in range(args.warm_up + args.steps):
        for side in SIDES[i % 3:] + SIDES[:i % 3]:
            patch(side)
            x.grad = None
            layer.zero_grad(set_to_none=True)
            start = time.process_time()
            layer(x).backward(g)
            if i >= args.warm_up:
                times[side].append(1e3 * (time.process_time() - start))
    patch("views")
    print(f"{args.variant}, context {args.context}, one layer {list(shape)}, forward + backward, "
          f"{args.steps} iterations:")
    for side in SIDES:
        print(f"  {side}: median {statistics.median(times[side]):.3f} ms")
    for a, b in (("copies", "views"), ("views", "none")):
        ratios = [x / y for x, y in zip(times[a], times[b])]
        q1, median, q3 = statistics.quantiles(ratios, n=4)
        print(f"  {a} / {b}: median {median:.3f} (quartiles {q1:.3f}-{q3:.3f})")


def one_side(args):
    """This process's steps: their CPU milliseconds, as JSON on stdout."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import linrope
    import torch
    from profile_step import make_run, parse_args as step_args, steps
    from training.data import load_corpus
    torch.set_num_threads(1)
    linrope.set_num_threads(1)
    patch(args.side)
    run = make_run(step_args(["--contexts", str(args.context)]), args.variant, args.context,
                   load_corpus())
    steps(run, args.warm_up)
    print(json.dumps([1e3 * cpu for _, cpu in steps(run, args.steps)]))


def main():
    args = parse_args()
    if args.layer:
        return one_layer(args)
    if args.side:
        return one_side(args)
    own = [sys.executable, os.path.abspath(__file__), "--variant", args.variant, "--context",
           str(args.context), "--steps", str(args.steps), "--warm-up", str(args.warm_up)]
    ratios = {"copies / views": [], "views / none": []}
    for round_ in range(args.rounds):
        medians = {}
        for side in SIDES[round_ % 3:] + SIDES[:round_ % 3]:
            done = subprocess.run(own + ["--side", side], capture_output=True, text=True,
                                  check=True)
            times = json.loads(done.stdout.splitlines()[-1])
            medians[side] = statistics.median(times)
            print(f"round {round_ + 1}, {side}: median step {medians[side]:.1f} ms, mean "
                  f"{statistics.fmean(times):.1f} ms", flush=True)
        ratios["copies / views"].append(medians["copies"] / medians["views"])
        ratios["views / none"].append(medians["views"] / medians["none"])
    for name, values in ratios.items():
        print(f"{args.variant}, context {args.context}: {name}, median steps, per round: "
              + ", ".join(f"{r:.3f}" for r in values)
              + f" (median {statistics.median(values):.3f})")


if __name__ == "__main__":
    main()
