#!/usr/bin/python3
"""linrope.torch against plain PyTorch: the layer's forward + backward, and the binding's overhead.
A benchmark only: python/tests/test_against_pytorch.py checks that the PyTorch layer timed here
is linrope's layer (the same projections and heads) around attention that agrees with the float64
reference.

1. Forward + backward, n in --sizes: linrope.torch.MultiheadAttention (batch 1, embed_dim 512,
   8 heads of 64, float32, causal, rope=False) against the same layer in plain PyTorch
   (bench/torch_side.py's torch_layer: its four nn.Linear copied) around torch_side's competitors
   "favor/chunked" (FAVOR+ features with the linrope layer's W, feature_map.projection, then
   chunked causal linear attention, chunks of 64) and "softmax/causal" ((q / sqrt(64)) @ k^T,
   triu-masked, softmax, @ v). x [1, n, 512] requiring grad, grads reset (set_to_none),
   (layer(x) * d_out).sum().backward(); median of --repetitions calls (<= 3 at n >= 16384) after a
   warm-up. Speed-up = PyTorch / linrope. Also: linrope's favor+ numerator_only (RoFormer eq. 19,
   which PyTorch lacks) and the projections alone (attention = identity on v; linrope's layer
   runs them on linrope.torch.Linear, PyTorch's on nn.Linear), each side's subtracted from its
   layer for the attention's own speed-up (approximate). A case is
   skipped when the previous n predicts > 60 s per call, a PyTorch case also when its memory
   (autograd keeps ~10x the n x n scores of all heads for softmax, 11-12x the chunked form's
   blocks, 13x taken) exceeds --max-gb.
2. Binding overhead at n = 256: linrope.torch.linear_attention (FAVOR+ causal, m = 256, placement
   numerator_only with a Rope(256) on the features, and none) and softmax_attention (causal) on
   q, k, v [1, 8, 256, 64] requiring grad, then out.backward(d_out), --overhead-calls times.
   linrope._core._kernel_seconds() (time inside the C++ kernels) is read around the loop:
   overhead = (wall - kernel) / kernel, target < 10%. The layer is listed too (its projections,
   on linrope.matmul, count as kernel time).

Environment, as compare_pytorch.py (its docstring says why): re-executed with GLIBC_TUNABLES
(mmap_max=0, trim_threshold) before torch is imported; PyTorch's BLAS must be OpenBLAS
(libopenblas0-openmp; the reference BLAS is ~20x slower), checked; torch and linrope both run
--threads threads (default OMP_NUM_THREADS, else the CPUs). linrope: PYTHONPATH, else
build/release/python.
  PYTHONPATH=build/release/python /usr/bin/python3 bench/bench_torch_layer.py --sizes 1024,4096
"""
import argparse
import copy
import json
import os
import sys
import time

from torch_side import BY_KEY, CHUNK, loaded_blas, reexec_with_tunables, torch_layer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMBED, HEADS, FEATURES = 512, 8, 256
HEAD_DIM = EMBED // HEADS
OVERHEAD_N, WARM_UP = 256, 20
PROJECTIONS = "projections alone"


def sizes(text):
    return [int(n) for n in text.split(",")]


def parse_args():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=sizes, default="1024,2048,4096,8192,16384",
                        help="comma-separated n of the layer table")
    parser.add_argument("--threads", type=int,
                        default=int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count()))
    parser.add_argument("--max-gb", type=float, default=20.0,
                        help="skip PyTorch cases predicted to need more memory (GB)")
    parser.add_argument("--repetitions", type=int, default=5,
                        help="timed calls per case (the median; at most 3 at n >= 16384)")
    parser.add_argument("--overhead-calls", type=int, default=200)
    parser.add_argument("--skip-layer", action="store_true", help="no layer table")
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--json", help="write every result here")
    return parser.parse_args()


args = parse_args()
reexec_with_tunables()

import torch  # noqa: E402  (after the re-exec: glibc reads its tunables at start-up)

sys.path.append(os.path.join(ROOT, "build", "release", "python"))  # after PYTHONPATH's
try:
    import linrope.torch  # noqa: E402
except ImportError as error:
    sys.exit(f"bench_torch_layer.py: cannot import linrope.torch ({error}); build it, or set "
             f"PYTHONPATH to the directory holding the linrope package")
from linrope import _core  # noqa: E402


def say(*parts):
    print(*parts, flush=True)


def load_average():
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# ---------------------------------------------------------------------------------------------
# The layers: linrope's, and the same in plain PyTorch around bench/torch_side.py's attention.

def layer_cases():
    """(case, linrope layer or None, PyTorch layer or None, PyTorch's bytes at n)."""
    torch.manual_seed(0)
    mha = linrope.torch.MultiheadAttention
    favor = mha(EMBED, HEADS, attention="linear", causal=True, feature_map="favor+",
                num_features=FEATURES, placement="none", rope=False)
    w = torch.from_numpy(favor.feature_map.projection).float()  # float64 [m, d]: the same W
    softmax = mha(EMBED, HEADS, attention="softmax", causal=True, rope=False)
    eq19 = mha(EMBED, HEADS, attention="linear", causal=True, feature_map="favor+",
               num_features=FEATURES, placement="numerator_only", rope=True)
    # The same layer keeping its features for the backward (linrope.LinearSaved), against the
    # same PyTorch layer.
    favor_saving = copy.deepcopy(favor)
    favor_saving.save_features = True
    favor_chunked, softmax_causal = BY_KEY["favor/chunked"], BY_KEY["softmax/causal"]
    favor_twin = torch_layer(favor, lambda q, k, v: favor_chunked(q, k, v, w))
    return [
        ("favor+ causal", favor, favor_twin, lambda n: 13 * HEADS * n * (CHUNK + 2 * FEATURES) * 4),
        ("favor+ causal, save_features", favor_saving, favor_twin,
         lambda n: 13 * HEADS * n * (CHUNK + 2 * FEATURES) * 4),
        ("softmax causal", softmax, torch_layer(softmax, softmax_causal),
         lambda n: 10 * HEADS * n * n * 4 + n * n),
        ("favor+ numerator_only causal", eq19, None, None),
        (PROJECTIONS, torch_layer(favor, lambda q, k, v: v, own_projections=True),
         torch_layer(favor, lambda q, k, v: v), lambda n: 0)]


def step(layer, x, d_out):
    """A training step's forward + backward, grads reset as optimizer.zero_grad() does."""
    layer.zero_grad(set_to_none=True)
    x.grad = None
    out = layer(x)
    (out * d_out).sum().backward()
    return out


def medians_ms(calls, reps):
    """The median time of each call, their repetitions interleaved: other work on the (shared)
    machine then slows one repetition of each side, not every repetition of one."""
    for call in calls:
        call()  # warm-up: first touch of the buffers, the OpenMP pool
    times = [[] for _ in calls]
    for _ in range(reps):
        for call, seen in zip(calls, times):
            start = time.perf_counter()
            call()
            seen.append((time.perf_counter() - start) * 1e3)
    return [sorted(seen)[reps // 2] for seen in times]


def layer_table(cases):
    say(f"## Layer forward + backward (batch 1, embed_dim {EMBED}, {HEADS} heads of {HEAD_DIM}, "
        f"m = {FEATURES}, float32, causal, {args.threads} threads; ms, median)\n")
    rows, previous = [], {}  # previous: (side, case) -> (n, ms) of its last timing
    for n in args.sizes:
        reps = min(args.repetitions, 3) if n >= 16384 else args.repetitions
        load = os.getloadavg()  # the machine is shared: what else ran is part of the figures
        say(f"[{time.strftime('%H:%M:%S')}] n = {n}: load average {load_average()}")
        gen = torch.Generator().manual_seed(n)
        x = torch.randn(1, n, EMBED, generator=gen).requires_grad_()
        d_out = torch.randn(1, n, EMBED, generator=gen)
        for case, ours, theirs, memory in cases:
            row = {"n": n, "case": case, "load_average": load, "linrope": "-", "torch": "-"}
            sides = [(side, layer) for side, layer in (("linrope", ours), ("torch", theirs))
                     if layer is not None]
            timed = {}
            for side, layer in sides:
                n0, ms = previous.get((side, case), (n, 0.0))
                if side == "torch" and memory(n) > args.max_gb * 1e9:
                    row[side] = f"skipped: needs ~{memory(n) / 1e9:.1f} GB > --max-gb"
                elif ms * (n / n0) ** (2 if "softmax" in case else 1) > 60e3:
                    row[side] = "skipped: predicted > 60 s per call"
                else:
                    timed[side] = lambda layer=layer: step(layer, x, d_out)
            for side, ms in zip(timed, medians_ms(list(timed.values()), reps)):
                row[side], previous[(side, case)] = ms, (n, ms)
            for side, _ in sides:
                value = row[side]
                say(f"  {side:7s} {case:30s} n={n:6d}: "
                    + (f"{value:10.2f} ms" if isinstance(value, float) else value))
            rows.append(row)
        this_n = rows[-len(cases):]
        projections = next(r for r in this_n if r["case"] == PROJECTIONS)
        for row in this_n:
            if isinstance(row["linrope"], float) and isinstance(row["torch"], float):
                row["speedup"] = row["torch"] / row["linrope"]
                if row is not projections and all(
                        isinstance(projections[side], float) for side in ("linrope", "torch")):
                    row["attention_speedup"] = ((row["torch"] - projections["torch"])
                                                / (row["linrope"] - projections["linrope"]))
    say("\n| n | case | linrope (ms) | PyTorch (ms) | speed-up | attention alone |\n"
        "|---|---|---|---|---|---|")
    for row in rows:
        cells = [f"{row[side]:.2f}" if isinstance(row[side], float) else row[side]
                 for side in ("linrope", "torch")]
        cells += [f"{row[key]:.2f}x" if key in row else "-"
                  for key in ("speedup", "attention_speedup")]
        say(f"| {row['n']} | {row['case']} | " + " | ".join(cells) + " |")
    say(f"\nSpeed-up = PyTorch / linrope (> 1: linrope faster); attention alone: each side minus "
        f"its own {PROJECTIONS} (linrope.torch.Linear, nn.Linear) in the {PROJECTIONS} row.\n")
    return rows


# ---------------------------------------------------------------------------------------------
# The binding's overhead: wall time of whole calls against the time inside the C++ kernels.

def overhead_cases():
    gen, shape = torch.Generator().manual_seed(2), (1, HEADS, OVERHEAD_N, HEAD_DIM)
    q, k, v = (torch.randn(shape, generator=gen).requires_grad_() for _ in range(3))
    d_out = torch.randn(shape, generator=gen)
    fm = linrope.FeatureMap(kind="favor+", input_dim=HEAD_DIM, num_features=FEATURES, seed=0)
    rope, lt = linrope.Rope(FEATURES), linrope.torch

    def attention_step(attention):
        def call():
            q.grad = k.grad = v.grad = None
            attention(q, k, v).backward(d_out)
        return call

    torch.manual_seed(0)
    layer = lt.MultiheadAttention(EMBED, HEADS, attention="linear", causal=True,
                                  feature_map="favor+", num_features=FEATURES,
                                  placement="numerator_only", rope=True)
    x = torch.randn(1, OVERHEAD_N, EMBED, generator=gen).requires_grad_()
    x_out = torch.randn(1, OVERHEAD_N, EMBED, generator=gen)
    return [
        ("linear_attention favor+ causal numerator_only", attention_step(
            lambda q, k, v: lt.linear_attention(q, k, v, fm, causal=True,
                                                placement="numerator_only", rope=rope))),
        ("linear_attention favor+ causal none", attention_step(
            lambda q, k, v: lt.linear_attention(q, k, v, fm, causal=True, placement="none"))),
        ("softmax_attention causal", attention_step(
            lambda q, k, v: lt.softmax_attention(q, k, v, causal=True))),
        ("MultiheadAttention favor+ numerator_only (with projections)",
         lambda: step(layer, x, x_out))]


def overhead_table():
    calls = args.overhead_calls
    say(f"## Binding overhead (n = {OVERHEAD_N}, B = 1, H = {HEADS}, d = {HEAD_DIM}, "
        f"m = {FEATURES}, float32, forward + backward, {calls} calls after {WARM_UP} warm-up "
        f"calls)\n\n[{time.strftime('%H:%M:%S')}] load average {load_average()}\n\n"
        "| call | wall (s) | kernel (s) | wall / call (us) | kernel / call (us) | overhead |\n"
        "|---|---|---|---|---|---|")
    rows = []
    for case, call in overhead_cases():
        for _ in range(WARM_UP):  # the allocator's free lists, the OpenMP pool
            call()
        kernel0, wall0 = _core._kernel_seconds(), time.perf_counter()
        for _ in range(calls):
            call()
        wall, kernel = time.perf_counter() - wall0, _core._kernel_seconds() - kernel0
        rows.append({"case": case, "calls": calls, "wall_s": wall, "kernel_s": kernel,
                     "overhead": (wall - kernel) / kernel})
        say(f"| {case} | {wall:.4f} | {kernel:.4f} | {wall / calls * 1e6:.1f} "
            f"| {kernel / calls * 1e6:.1f} | {rows[-1]['overhead']:.1%} |")
    say("\nOverhead = (wall - kernel) / kernel, target < 10% for the attention functions; the "
        "layer's four projections run on linrope.matmul, whose time counts as the kernels'.\n")
    return rows


def main():
    torch.set_num_threads(args.threads)
    linrope.set_num_threads(args.threads)
    blas = loaded_blas()
    say(f"# linrope.torch against plain PyTorch — {time.strftime('%Y-%m-%d %H:%M')}, "
        f"load average {load_average()}\n\nPyTorch {torch.__version__} "
        f"({torch.get_num_threads()} threads), linrope {linrope.get_num_threads()} threads "
        f"(OpenMP: {linrope.openmp}); BLAS loaded: {', '.join(blas) or 'none found'}; "
        f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES')}\n")
    if not any("openblas" in b for b in blas):
        say("WARNING: PyTorch is not using OpenBLAS (install libopenblas0-openmp): its GEMMs run "
            "on the reference BLAS and every PyTorch figure below is ~20x too slow.\n")
    results = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "args": vars(args),
               "torch": torch.__version__, "blas": blas, "load_average_start": os.getloadavg()}
    if not args.skip_layer:
        results["layer"] = layer_table(layer_cases())
    if not args.skip_overhead:
        results["overhead"] = overhead_table()
    results["load_average_end"] = os.getloadavg()
    say(f"Load average at the end: {load_average()}")
    if args.json:  # written whole, then renamed: a reader never sees half a file
        with open(args.json + ".tmp", "w") as f:
            json.dump(results, f, indent=1)
        os.replace(args.json + ".tmp", args.json)


if __name__ == "__main__":
    try:
        main()
    except Exception as error:  # one readable line, not a traceback
        sys.exit(f"bench_torch_layer.py: {type(error).__name__}: {error}")
