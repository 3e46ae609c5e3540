#!/usr/bin/python3
"""The study's training step with the pieces of its blocks on linrope's kernels against the same
step with some of them on PyTorch's, alternated step by step in one process. The pieces
(--pieces, default all three):

  linear  linrope.torch.Linear (linrope's GEMM: the attention's q, k, v and output projections,
          the MLP, the output layer) against nn.Linear.forward on the very same modules
  gelu    linrope.torch.GELU (linrope.gelu) against nn.GELU.forward
  norm    linrope.torch.RMSNorm (linrope.rms_norm) against the same expression in PyTorch,
          x * rsqrt(mean(x^2) + eps) * weight (the study's model before it used linrope's)

The parameters are the same on both sides, so the optimiser is untouched. (MultiheadAttention's
HeadRMSNorm, in the variants without a denominator, is PyTorch's on both sides.)

On this shared 2-core machine a step's time moves by up to 2x from one minute to the next, more
than the change measured; alternating single steps of the two models (each its own train.Run of
profile_step.py, the same seed) puts both under the same minute, and the ratio of each pair is
read instead of the ratio of two medians. Per variant and context: the median CPU step time of
each side (time.process_time, one thread), and the median and range of the per-pair ratios
torch / linrope (the speed-up of the step).

  cd /tmp && PYTHONPATH=<tree>/build/release/python:<tree>/experiments \\
      /usr/bin/python3 <tree>/bench/step_pieces.py --d-model 128 --layers 4 --contexts 256,1024 \\
      [--pieces linear,gelu,norm]
"""
import argparse
import os
import statistics
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_step import VARIANTS, make_run, say, steps  # noqa: E402


def on_torch(run, pieces):
    """The run's modules of the given pieces compute with PyTorch's operators instead (the same
    modules and parameters: an instance's forward replaced); returns how many were replaced."""
    import linrope.torch as lt
    from linrope.torch.functional import rms_norm_expression
    from torch import nn

    def torch_rms_norm(module, x):  # as the study's model wrote it before linrope.torch.RMSNorm
        return rms_norm_expression(x, module.weight, module.eps)

    torch_forward = {"linear": (lt.Linear, nn.Linear.forward),
                     "gelu": (lt.GELU, nn.GELU.forward),
                     "norm": (lt.RMSNorm, torch_rms_norm)}
    count = 0
    for module in run.model.modules():
        for piece in pieces:
            kind, forward = torch_forward[piece]
            if isinstance(module, kind):
                module.forward = types.MethodType(forward, module)
                count += 1
    return count


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", type=lambda s: s.split(","), default=VARIANTS.split(","))
    parser.add_argument("--pieces", type=lambda s: s.split(","), default=["linear", "gelu", "norm"],
                        help="what the PyTorch side computes with PyTorch's operators")
    parser.add_argument("--contexts", type=lambda s: [int(c) for c in s.split(",")],
                        default=[256, 1024])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=12, help="alternated step pairs per case")
    parser.add_argument("--warm-up", type=int, default=2)
    args = parser.parse_args()
    args.task, args.threads = "char_lm", 1
    unknown = set(args.pieces) - {"linear", "gelu", "norm"}
    if unknown:
        sys.exit(f"step_pieces.py: --pieces has {', '.join(sorted(unknown))}; expected some of "
                 f"linear, gelu, norm")
    import linrope
    import torch
    from training.data import load_corpus
    torch.set_num_threads(1)
    linrope.set_num_threads(1)
    corpus = load_corpus()
    say(f"# d_model {args.d_model}, {args.layers} layers, {args.heads} heads, one thread, "
        f"{args.pairs} alternated pairs of steps; on PyTorch: {', '.join(args.pieces)}; "
        f"OPENBLAS_CORETYPE "
        f"{os.environ.get('OPENBLAS_CORETYPE', 'unset')}; load average "
        f"{' '.join('%.2f' % x for x in os.getloadavg())}")
    say("| variant | context | pieces on PyTorch: ms/step (CPU) | on linrope: ms/step | "
        "speed-up, median of pairs (range) |")
    say("|---|---|---|---|---|")
    for context in args.contexts:
        for variant in args.variants:
            ours, theirs = (make_run(args, variant, context, corpus) for _ in range(2))
            if not on_torch(theirs, args.pieces):
                sys.exit("step_pieces.py: the model has none of the pieces to compare")
            for run in (ours, theirs):
                steps(run, args.warm_up)
            pairs = []
            for i in range(args.pairs):
                # Alternate which goes first, so that neither always follows the other.
                first, second = (ours, theirs) if i % 2 == 0 else (theirs, ours)
                a, b = steps(first, 1)[0][1], steps(second, 1)[0][1]
                pairs.append((a, b) if first is ours else (b, a))
            mine = statistics.median(p[0] for p in pairs)
            torch_side = statistics.median(p[1] for p in pairs)
            ratios = sorted(t / m for m, t in pairs)
            say(f"| {variant} | {context} | {1e3 * torch_side:.1f} | {1e3 * mine:.1f} | "
                f"**{statistics.median(ratios):.2f}x** ({ratios[0]:.2f}-{ratios[-1]:.2f}) |")
    say(f"# load average at the end {' '.join('%.2f' % x for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
