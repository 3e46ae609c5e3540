#!/usr/bin/python3
"""One causal linear attention call of the study's shape through linrope.torch, forward then
backward, timed alone (CPU time, this process's one thread): what `perf record` profiles, and
with --compare-saved the same call with save_features off and on, alternated per pair, so that a
slower minute of the shared machine slows both sides.

Defaults: the study's model (d_model 64, 4 heads: head dim 16), context 1024 at 4096 tokens a
step (batch 4), FAVOR+ with 2 x head dim = 32 features, eq. 19 (numerator_only), RoPE on the
features.

  cd /tmp && OMP_NUM_THREADS=1 PYTHONPATH=<tree>/build/release/python \\
      /usr/bin/python3 <tree>/bench/study_attention.py [--map elu+1 --features 16] [--compare-saved]
  OMP_NUM_THREADS=1 perf record -- /usr/bin/python3 bench/study_attention.py --calls 1500
"""
import argparse
import statistics
import time

import torch

import linrope
import linrope.torch as lt


def parse_args():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--map", default="favor+", help="feature map (linrope.FeatureMap kind)")
    parser.add_argument("--features", type=int,
                        help="num_features (FAVOR+'s m; default 2 x d, the study's)")
    parser.add_argument("--placement", default="numerator_only")
    parser.add_argument("--shape", default="4,4,1024,16", help="B,H,n,d of q, k and v")
    parser.add_argument("--calls", type=int, default=150, help="forward + backward pairs timed")
    parser.add_argument("--compare-saved", action="store_true",
                        help="time save_features=False and True alternated, and their ratio")
    args = parser.parse_args()
    if args.calls < (2 if args.compare_saved else 1):
        parser.error(f"--calls is {args.calls} but expected at least 1 (2 with --compare-saved)")
    return args


def main():
    args = parse_args()
    torch.set_num_threads(1)
    linrope.set_num_threads(1)  # linrope's count is its own, not torch's
    batch, heads, n, d = (int(s) for s in args.shape.split(","))
    if args.features is None:
        args.features = 2 * d
    feature_map = linrope.FeatureMap(kind=args.map, input_dim=d, num_features=args.features,
                                     seed=1)
    width = d if args.placement == "before_map" else feature_map.output_dim
    rope = linrope.Rope(width, rotary_dim=width - width % 2)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, n, d, generator=generator, requires_grad=True)
               for _ in range(3))
    d_out = torch.randn(batch, heads, n, d, generator=generator)

    def call(save):  # one forward + backward; its (forward, backward) CPU seconds
        start = time.process_time()
        out = lt.linear_attention(q, k, v, feature_map, causal=True, placement=args.placement,
                                  rope=rope, save_features=save)
        middle = time.process_time()
        out.backward(d_out)
        return middle - start, time.process_time() - middle

    sides = (False, True) if args.compare_saved else (False,)
    times = {save: [] for save in sides}
    for _ in range(5):  # warm-up: the block cache, the thread's scratch
        for save in sides:
            call(save)
    for i in range(args.calls):
        for save in (sides if i % 2 == 0 else sides[::-1]):
            times[save].append(call(save))
    shape = f"{args.map} m = {args.features}, {args.placement}, [{args.shape}]"
    for save in sides:
        forward = 1e3 * statistics.median(f for f, _ in times[save])
        backward = 1e3 * statistics.median(b for _, b in times[save])
        print(f"{shape}, save_features={save}: forward {forward:.3f} ms, backward "
              f"{backward:.3f} ms (medians of {args.calls})")
    if args.compare_saved:
        ratios = [sum(a) / sum(b) for a, b in zip(times[False], times[True])]
        low, _, high = statistics.quantiles(ratios)
        print(f"plain / saved, forward + backward, per pair: median "
              f"{statistics.median(ratios):.3f} (quartiles {low:.3f}-{high:.3f})")


if __name__ == "__main__":
    main()
