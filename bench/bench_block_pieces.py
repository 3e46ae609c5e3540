#!/usr/bin/python3
"""linrope.torch's GELU and RMSNorm against PyTorch's, alone, one thread: per size (elements of
[rows x 128] float32 tensors, the study's d_model), the median time of

  forward + backward   y = f(x); y.backward(g), g a dense tensor as a model's gradients are
                       (y.sum().backward() would hand both sides a stride-0 gradient, on which
                       PyTorch's backward kernels take a slow path 7-35x linrope's; linrope's
                       autograd Function against
                       F.gelu, and against RMSNorm's expression x * rsqrt(mean(x^2) + eps) * w)
  forward alone        under torch.no_grad() (a decoding step's one row is 128-512 elements)

in microseconds, and the ratio PyTorch / linrope. Both sides in one process, alternated call by
call, so that a slower minute of a shared machine slows both.

  cd /tmp && PYTHONPATH=<tree>/build/release/python /usr/bin/python3 \\
      <tree>/bench/bench_block_pieces.py [--sizes 128,512,4096,16384,65536] [--repeats 200]
"""
import argparse
import statistics
import time


def alternated(one, other, repeats):
    """Median microseconds of one() and of other(), called in turn `repeats` times each."""
    times = ([], [])
    for _ in range(repeats):
        for f, taken in zip((one, other), times):
            start = time.perf_counter()
            f()
            taken.append(time.perf_counter() - start)
    return tuple(1e6 * statistics.median(t) for t in times)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=lambda s: [int(v) for v in s.split(",")],
                        default=[128, 512, 4096, 16384, 65536])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    import torch

    import linrope
    import linrope.torch as lt
    from linrope.torch.functional import rms_norm_expression
    torch.set_num_threads(1)
    linrope.set_num_threads(1)
    print("| elements | piece | pass | linrope us | PyTorch us | PyTorch / linrope |")
    print("|---|---|---|---|---|---|")
    for size in args.sizes:
        x = torch.randn(max(size // 128, 1), min(size, 128), requires_grad=True)
        w = torch.ones(x.shape[-1], requires_grad=True)
        g = torch.randn(x.shape)
        pieces = {"GELU": (lambda: lt.gelu(x), lambda: torch.nn.functional.gelu(x)),
                  "RMSNorm": (lambda: lt.rms_norm(x, w), lambda: rms_norm_expression(x, w, 1e-6))}
        for piece, (ours, theirs) in pieces.items():
            both = alternated(lambda: ours().backward(g), lambda: theirs().backward(g),
                              args.repeats)
            with torch.no_grad():
                forward = alternated(ours, theirs, args.repeats)
            for name, (mine, torch_side) in (("forward + backward", both), ("forward", forward)):
                print(f"| {x.numel()} | {piece} | {name} | {mine:.1f} | {torch_side:.1f} | "
                      f"{torch_side / mine:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
