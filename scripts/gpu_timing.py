"""Times linrope.torch's native path on one device: forward, and forward + backward, of
MultiheadAttention (causal linear attention, favor+ with RoPE, chunks of 64 and of 256) against
the same layer with softmax attention (RoPE, then scaled_dot_product_attention where PyTorch has
it, else the native blocked softmax) and against a bare softmax + RoPE (linrope.torch.rope_apply
on q and k, then torch.nn.functional.scaled_dot_product_attention; absent on PyTorch < 2.0).
Writes one CSV row per (case, n, pass) with the median of the repetitions, the file rewritten
after each size.

    python3 scripts/gpu_timing.py --device cuda --out gpu_timing.csv
    python3 scripts/gpu_timing.py --device cpu --sizes 256,512 --repeats 3 --out cpu.csv

Repetitions are interleaved (case by case within each repetition), so that a change of load
during the run touches every case alike. A case that runs out of memory is recorded as such and
the larger sizes of that case are skipped.
"""
import argparse
import csv
import os
import statistics
import sys
import tempfile
import time

import torch

import linrope
import linrope.torch as lt

COLUMNS = ["device", "dtype", "torch", "case", "n", "batch", "heads", "head_dim", "pass",
           "median_ms", "min_ms", "repeats", "status"]
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--sizes", default="1024,2048,4096,8192,16384,32768",
                        help="sequence lengths, comma-separated")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", required=True, help="the CSV file to write")
    args = parser.parse_args(argv)
    try:
        args.sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes is {args.sizes!r} but expected comma-separated integers")
    if min(args.sizes) < 1 or args.repeats < 1:
        parser.error("--sizes and --repeats must be >= 1")
    return args


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def layer_case(attention, args, device, dtype, chunk_size=None):
    embed = args.heads * args.head_dim
    layer = lt.MultiheadAttention(embed, args.heads, attention, causal=True, rope=True,
                                  device=device, dtype=dtype)
    if chunk_size is not None:
        layer.chunk_size = chunk_size

    def inputs(n):
        return [torch.randn(args.batch, n, embed, device=device, dtype=dtype,
                            requires_grad=True)]
    return inputs, layer


def sdpa_case(args, device, dtype):
    sdpa = getattr(torch.nn.functional, "scaled_dot_product_attention", None)
    if sdpa is None:
        return None
    rope = linrope.Rope(args.head_dim)

    def inputs(n):
        shape = (args.batch, args.heads, n, args.head_dim)
        return [torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
                for _ in range(3)]

    def call(q, k, v):
        return sdpa(lt.rope_apply(q, rope), lt.rope_apply(k, rope), v, is_causal=True)
    return inputs, call


def time_once(call, tensors, backward, device):
    for t in tensors:
        t.grad = None
    synchronize(device)
    start = time.perf_counter()
    out = call(*tensors)
    if backward:
        out.backward(torch.ones_like(out))
    synchronize(device)
    return (time.perf_counter() - start) * 1e3


def out_of_memory(error):
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


def run(args):
    """Times every case at every size, rewriting args.out after each size, so that a run stopped
    early (gpu_check.sh's time limit) leaves the sizes it finished."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    # The layer's chunk (64, the C++ default) and a larger one: on a GPU the chunks' products are
    # cheap and each chunk costs the state's recurrence a step.
    cases = {"layer-linear": layer_case("linear", args, device, dtype),
             "layer-linear-c256": layer_case("linear", args, device, dtype, chunk_size=256),
             "layer-softmax": layer_case("softmax", args, device, dtype)}
    bare = sdpa_case(args, device, dtype)
    if bare is not None:
        cases["sdpa+rope"] = bare
    rows, failed = [], set()
    common = dict(device=str(device), dtype=args.dtype, torch=torch.__version__,
                  batch=args.batch, heads=args.heads, head_dim=args.head_dim)
    for n in args.sizes:
        for backward in (False, True):
            which = "forward+backward" if backward else "forward"
            tensors, times = {}, {}
            with torch.set_grad_enabled(backward):
                for name in cases:
                    if name in failed:
                        continue
                    make, call = cases[name]
                    try:
                        tensors[name] = make(n)
                        time_once(call, tensors[name], backward, device)  # warm-up
                        times[name] = []
                    except RuntimeError as error:  # torch.cuda.OutOfMemoryError is one
                        if not out_of_memory(error):
                            raise
                        failed.add(name)
                        tensors.pop(name, None)
                        rows.append(dict(common, case=name, n=n, median_ms="", min_ms="",
                                         repeats=0, status="out of memory", **{"pass": which}))
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                for _ in range(args.repeats):
                    for name in times:
                        times[name].append(time_once(cases[name][1], tensors[name], backward,
                                                     device))
            for name, ms in times.items():
                rows.append(dict(common, case=name, n=n, median_ms=f"{statistics.median(ms):.4f}",
                                 min_ms=f"{min(ms):.4f}", repeats=len(ms), status="ok",
                                 **{"pass": which}))
                print(f"{name:17s} n={n:6d} {which:17s} {statistics.median(ms):10.3f} ms",
                      flush=True)
            del tensors
            if device.type == "cuda":
                torch.cuda.empty_cache()
        write_csv(rows, args.out)
    return rows


def write_csv(rows, path):
    """Written to a temporary name beside path, then renamed: a reader never sees half a file."""
    directory = os.path.dirname(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(dir=directory, suffix=".csv.tmp")
    try:
        with os.fdopen(handle, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # "native" is what "auto" runs on a GPU; on a CPU it times the native path, not the kernels.
    with lt.backend("native"):
        rows = run(args)
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
