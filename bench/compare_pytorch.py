#!/usr/bin/python3
"""linrope against PyTorch: the same attention computations, checked for agreement, then timed.

What it does, in order:
  1. Agreement: on a small case (batch 1, 2 heads, n = 200, d = 64, m = 256) every computation is
     run by linrope (its Python package, the batched [B, H, n, d] calls) and by PyTorch on the
     same q, k, v and, for FAVOR+, the same projection W (the feature map's); prints
     max|ours - torch| / max|torch| per computation and exits 1 if any exceeds 1e-3.
     Then the gradients of L = sum(d_out * out), one d_out for both sides: ours from the
     package's *_backward calls (the batched C++ backward), PyTorch's by autograd through its
     implementations below (loss = (out * d_out).sum(); loss.backward()); prints
     max|ours - torch| / max|torch| for dq, dk and dv, beside PyTorch's and our own distance to
     PyTorch's float64 gradients, and exits 1 if any exceeds 1e-3. Cases: every forward case,
     placement full too (rotated features in the denominator as well), and one head of n = 1100,
     which our causal backward cuts into one segment per thread.
     Why 1e-3, for both: float32 rounding on either side stays near 1e-6 (measured up to 3.5e-6,
     and 3.5e-4 for PyTorch's own float32 FAVOR+ full causal gradients, whose denominators come
     close to 0), while the smallest bug worth catching, one key too many or too few in a row's
     sum, a lost term of the quotient rule, moves a row by ~1/n of the maximum, 5e-3 at n = 200.
  2. Our timings: runs build/bench/bench_linear once (every case, 5 randomly interleaved
     repetitions, Google Benchmark median of real time) unless --bench-json gives a saved run;
     prints every case with GFLOP/s, its fraction of machine/peak_fma and of machine/sgemm_1024
     (both measured in that run), the log-log slope of time against n, the softmax/linear
     crossover and the targets.
  3. PyTorch timings (batch 1, 8 heads, d = 64, m = 256, float32, n in 1024, 4096, 16384; median
     of 5 calls, 3 at n = 16384, after one warm-up call) and one table: ours, PyTorch, ratio.
  4. Forward + backward, the same problem: PyTorch's forward call plus loss.backward() by
     autograd (q, k, v requiring grad, their .grad reset before each call; median as in 3.), and
     ours, bench_linear's forward time plus its backward time (linear_backward/...,
     softmax_backward/...) from the run of 2.; causal linear: our default forward, the scan. One
     table: ours fwd, bwd, fwd+bwd, PyTorch fwd+bwd, ratio, and the targets (at n = 4096, faster
     than PyTorch autograd by >= 4x on FAVOR+ causal chunked, >= 5x on elu+1 causal chunked, >= 2x
     on softmax causal). Then our backward / forward time for every backward timed, the log-log
     slope of the backward's time from n/4 to n, and their targets (<= 2.5x for FAVOR+ eq. 19 and
     full, causal and not, at n = 16384; <= 3x for elu+1 causal and softmax causal at n = 4096;
     slope in [0.9, 1.15]).

Shorter runs: --sizes (the PyTorch sizes), --bench-filter (a regex of bench_linear cases; a
target whose cases did not run prints "not timed"), --skip-forward (no forward PyTorch timings,
table or targets), --skip-backward (the script as it was before the gradients), --skip-check,
--check-only, --bench-json (a saved run). Forward + backward at n = 1024 and 4096 only:
  /usr/bin/python3 bench/compare_pytorch.py --skip-forward --sizes 1024,4096 --bench-filter \
    '^(machine/(peak_fma|sgemm)|linear(_backward)?/(elu|favor)/(none|numerator_only|full)/[a-z]+/n:(1024|4096|16384)/|softmax(_backward)?/(noncausal|causal)/n:(1024|4096)/)'

PyTorch is written the way a PyTorch user would write it:
  softmax        (q * scale) @ k^T, masked_fill with a triu mask when causal, softmax, @ v
  linear         phi(q), phi(k) in PyTorch (elu+1: F.elu(x) + 1; FAVOR+: exp(x' W^T - |x'|^2/2)
                 / sqrt(m), x' = x d^-1/4, the same W), then einsum: S = phi(k)^T v, z = sum phi(k)
  causal cumsum  the prefix-sum form: cumsum over n of phi(k_j) v_j^T, O(n m d_v) memory
  causal chunked quadratic (tril-masked) inside chunks of 64, plus the state of the earlier chunks
                 (exclusive cumsum over chunks of phi(K_c)^T V_c), all batched PyTorch ops
PyTorch has no implementation of RoPE on the features in the numerator only (RoFormer eq. 19), so
our speed is compared with placement `none`; our numerator_only rows are listed on their own.

Environment, so that PyTorch runs at its best:
  * libopenblas0-openmp must be installed (apt-get install python3-torch libopenblas0-openmp):
    Debian's torch does its GEMMs through libblas.so.3, which is otherwise the reference BLAS,
    ~20x slower. The script checks which BLAS is loaded and says so.
  * GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736: without it
    glibc returns every large temporary to the kernel and it is page-faulted afresh on the next
    call (PyTorch 1.5-3x slower). The script re-executes itself with it when it is not set. Our
    binaries run without it (the environment a user has; it does not help linrope's kernels).
  * torch.set_num_threads(T), linrope.set_num_threads(T) and OMP_NUM_THREADS=T for
    bench_linear, T = --threads (default: OMP_NUM_THREADS, else the number of CPUs).
The linrope package is imported from <build dir>/python (built with -DLINROPE_BUILD_PYTHON=ON),
else from wherever `import linrope` finds it (scripts/common.sh links a build's package).
Cases skipped: a PyTorch computation needing more than --max-gb GB (default 20, for a 24 GiB
machine) of memory, or predicted (from the previous size) to take more than 60 s per call; they
print as "skipped". With the defaults every case up to n = 4096 runs. At n = 16384 the FAVOR+
cumsum form runs (2 x 8.6 GB of prefix sums; skipped with --max-gb below 17.2), and softmax is
skipped: under the tunables above glibc does not reuse the freed scores for the next call's, and
the peak grows over the timed calls to ~6x the scores (measured: 12.6 GB for 2.15 GB of scores at
n = 8192), 52 GB at n = 16384, where the kernel kills the process.
Forward + backward: autograd keeps more (peaks measured with ru_maxrss over 7 calls under the
tunables): softmax ~10x the scores, the cumsum form ~6.3x its prefix sums (at n = 16384 FAVOR+'s
is skipped, 60 GB, and elu+1's runs, 15 GB), the chunked form ~12x its blocks.
"""

import argparse
import gc
import json
import math
import os
import re
import subprocess
import sys
import time

from torch_side import (CHUNK, EPS, linear_causal_chunked, loaded_blas, phi_favor,
                        reexec_with_tunables, torch_softmax)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The benchmarked problem.
BATCH, HEADS, DIM, FEATURES = 1, 8, 64, 256
SIZES = [1024, 4096, 16384]
TOLERANCE = 1e-3
GRAD_TOLERANCE = 1e-3


def parse_args():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # The README's commands build into build/release; a hand-made benchmark tree is build-bench.
    default_build = next((os.path.join(ROOT, d) for d in ("build/release", "build-bench")
                          if os.path.exists(os.path.join(ROOT, d, "bench", "bench_linear"))),
                         os.path.join(ROOT, "build/release"))
    parser.add_argument("--build-dir", default=default_build,
                        help="build tree holding bench/bench_linear and the linrope package "
                             "(python/) (default: build/release, else build-bench)")
    parser.add_argument("--threads", type=int,
                        default=int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count()))
    parser.add_argument("--bench-json",
                        help="use this saved bench_linear JSON instead of running it")
    parser.add_argument("--save-json", help="write the bench_linear JSON of this run here")
    parser.add_argument("--repetitions", type=int, default=5, help="bench_linear repetitions")
    parser.add_argument("--bench-filter",
                        help="run only the bench_linear cases matching this regex "
                             "(--benchmark_filter; keep machine/ in it: the report needs it)")
    parser.add_argument("--max-gb", type=float, default=20.0,
                        help="skip PyTorch cases needing more memory than this (GB)")
    parser.add_argument("--skip-check", action="store_true", help="skip the agreement check")
    parser.add_argument("--check-only", action="store_true", help="only the agreement check")
    parser.add_argument("--skip-torch-timing", action="store_true")
    parser.add_argument("--skip-forward", action="store_true",
                        help="no PyTorch forward timings, forward table or forward targets")
    parser.add_argument("--skip-backward", action="store_true",
                        help="no gradient check, PyTorch forward + backward timings, "
                             "forward + backward table or backward targets (the script as it "
                             "was before the gradients)")
    parser.add_argument("--wait-load", type=float, default=0.0,
                        help="before each timing phase, wait (up to --wait-max s) until the "
                             "1-minute load average is below this (0: do not wait); other work "
                             "on the machine disturbs the timings")
    parser.add_argument("--wait-max", type=float, default=600.0)
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)),
                        help="comma-separated n for the PyTorch table")
    return parser.parse_args()


args = parse_args()
reexec_with_tunables()

import numpy as np  # noqa: E402  (after the re-exec: glibc reads its tunables at start-up)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

torch.set_num_threads(args.threads)
torch.set_grad_enabled(False)


def import_linrope():
    """The linrope package of --build-dir (else the one `import linrope` finds), on --threads
    threads: its own count, which `import torch` does not lower."""
    sys.path.insert(0, os.path.join(args.build_dir, "python"))
    try:
        import linrope
    except ImportError as error:
        sys.exit(f"compare_pytorch.py: cannot import linrope ({error}); build it with "
                 f"-DLINROPE_BUILD_PYTHON=ON into {args.build_dir}, or pass --build-dir")
    linrope.set_num_threads(args.threads)
    return linrope


linrope = None  # the package, imported by main() when the agreement checks run


def say(*parts):
    print(*parts, flush=True)


# ---------------------------------------------------------------------------------------------
# The PyTorch side. Tensors are [B, H, n, d]; features [B, H, n, m].

def phi_elu(x):
    return F.elu(x) + 1


def linear_noncausal(fq, fk, v, fq_num=None, fk_num=None):
    """fq_num/fk_num: rotated features for the numerator (eq. 19); the plain ones by default."""
    fq_num = fq if fq_num is None else fq_num
    fk_num = fk if fk_num is None else fk_num
    s = torch.einsum("bhnm,bhnd->bhmd", fk_num, v)
    num = torch.einsum("bhnm,bhmd->bhnd", fq_num, s)
    den = torch.einsum("bhnm,bhm->bhn", fq, fk.sum(-2))
    return num / (den.unsqueeze(-1) + EPS)


def linear_causal_cumsum(fq, fk, v, fq_num=None, fk_num=None):
    fq_num = fq if fq_num is None else fq_num
    fk_num = fk if fk_num is None else fk_num
    s = torch.einsum("bhnm,bhnd->bhnmd", fk_num, v).cumsum_(2)  # [B,H,n,m,d_v]: every prefix
    num = torch.einsum("bhnm,bhnmd->bhnd", fq_num, s)
    den = (fq * fk.cumsum(2)).sum(-1)
    return num / (den.unsqueeze(-1) + EPS)


def rope_interleaved(x, base=10000.0):
    """RoPE on the last dim, interleaved pairs (2i, 2i+1), row p at position p, angles in double.

    The same as linrope's default Rope (base 10000, RopeLayout::Interleaved)."""
    n, r = x.shape[-2], x.shape[-1]
    theta = base ** (-torch.arange(0, r // 2, dtype=torch.float64) * 2 / r)
    angle = torch.arange(n, dtype=torch.float64).unsqueeze(-1) * theta
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


# ---------------------------------------------------------------------------------------------
# Agreement on a small case.

def our_map(kind, seed=11):
    """linrope's feature map: elu+1, or FAVOR+ with FEATURES orthogonal features drawn from seed."""
    if kind == "favor":
        return linrope.FeatureMap("favor+", DIM, num_features=FEATURES, orthogonal=True, seed=seed)
    return linrope.FeatureMap("elu+1", DIM)


def our_projection(seed=11):
    """FAVOR+'s W [m x d] (double in linrope) as float32, so that PyTorch builds the same
    features."""
    return torch.from_numpy(our_map("favor", seed).projection.astype(np.float32))


def run_ours(q, k, v, kind, causal, placement="none", method="chunked", seed=11, d_out=None):
    """Our output for q, k, v (torch float32 [1, heads, n, d]) by the linrope package's batched
    calls, or with d_out our (dq, dk, dv). softmax: scale 1/sqrt(d), no rope; elu and favor:
    RoPE (placements other than none) interleaved, base 10000, of width d for before_map and m
    otherwise, the causal method given, chunks of CHUNK."""
    arrays = [x.numpy() for x in (q, k, v)]
    if kind == "softmax":
        call, backward, options = linrope.softmax_attention, linrope.softmax_attention_backward, {}
    else:
        feature_map = our_map(kind, seed)
        width = DIM if placement == "before_map" else feature_map.output_dim
        call, backward = linrope.linear_attention, linrope.linear_attention_backward
        arrays.append(feature_map)
        options = dict(placement=placement, method=method, chunk_size=CHUNK,
                       rope=None if placement == "none" else linrope.Rope(width))
    if d_out is None:
        return torch.from_numpy(call(*arrays, causal=causal, **options))
    arrays.insert(3, d_out.numpy())
    return tuple(torch.from_numpy(g) for g in backward(*arrays, causal=causal, **options))


def check_agreement():
    say("## Agreement on a small case (batch 1, 2 heads, n = 200, d = 64, m = 256, float32)\n")
    say("max|ours - torch| / max|torch| per computation; a failure is > %g\n" % TOLERANCE)
    n, heads = 200, 2
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, heads, n, DIM, generator=gen) for _ in range(3))
    worst = 0.0
    failures = []
    w = our_projection()
    features = {"elu": (phi_elu(q), phi_elu(k)), "favor": (phi_favor(q, w), phi_favor(k, w))}
    cases = [("softmax non-causal", ("softmax", False), torch_softmax(q, k, v, False)),
             ("softmax causal (masked)", ("softmax", True), torch_softmax(q, k, v, True))]
    for kind, label in (("elu", "elu+1"), ("favor", "favor+")):
        fq, fk = features[kind]
        rq, rk = rope_interleaved(fq), rope_interleaved(fk)
        cases += [
            (f"{label} non-causal (einsum)", (kind, False), linear_noncausal(fq, fk, v)),
            (f"{label} causal: ours chunked vs torch cumsum", (kind, True),
             linear_causal_cumsum(fq, fk, v)),
            (f"{label} causal: ours scan vs torch cumsum", (kind, True, "none", "scan"),
             linear_causal_cumsum(fq, fk, v)),
            (f"{label} causal: ours chunked vs torch chunked", (kind, True),
             linear_causal_chunked(fq, fk, v)),
            (f"{label} numerator_only non-causal (eq. 19 written here)",
             (kind, False, "numerator_only"), linear_noncausal(fq, fk, v, rq, rk)),
            (f"{label} numerator_only causal (eq. 19 written here, cumsum)",
             (kind, True, "numerator_only"), linear_causal_cumsum(fq, fk, v, rq, rk)),
            (f"{label} numerator_only causal: ours scan (eq. 19 written here, cumsum)",
             (kind, True, "numerator_only", "scan"), linear_causal_cumsum(fq, fk, v, rq, rk)),
        ]
    say("| computation | max rel. diff |\n|---|---|")
    for name, call, expected in cases:
        ours = run_ours(q, k, v, *call)
        diff = float((ours - expected).abs().max() / expected.abs().max())
        worst = max(worst, diff)
        flag = "" if diff <= TOLERANCE else "  **FAILED**"
        if diff > TOLERANCE:
            failures.append(name)
        say(f"| {name} | {diff:.2e}{flag} |")
    say("")
    if failures:
        say("AGREEMENT CHECK FAILED (> %g): %s" % (TOLERANCE, "; ".join(failures)))
        sys.exit(1)
    say(f"All agree (worst {worst:.2e}).\n")


def torch_linear(kind, form, placement="none"):
    """PyTorch's linear attention as a function of (q, k, v, w), w used by FAVOR+ only.

    form: einsum (non-causal), cumsum or chunked (causal); placement none, numerator_only (eq. 19
    written here: rotated features in the numerator) or full (rotated features everywhere)."""
    def attention(q, k, v, w):
        phi = phi_elu if kind == "elu" else (lambda x: phi_favor(x, w))
        fq, fk = phi(q), phi(k)
        num = (None, None)
        if placement != "none":
            rq, rk = rope_interleaved(fq), rope_interleaved(fk)
            if placement == "full":
                fq, fk = rq, rk
            else:
                num = (rq, rk)
        if form == "chunked":
            assert placement == "none"
            return linear_causal_chunked(fq, fk, v)
        return (linear_noncausal if form == "einsum" else linear_causal_cumsum)(fq, fk, v, *num)
    return attention


def torch_gradients(fn, q, k, v, w, d_out, dtype):
    """dL/dq, dL/dk, dL/dv of L = sum(d_out * fn(q, k, v, w)) by autograd, computed in dtype."""
    with torch.enable_grad():
        leaves = [x.detach().to(dtype, copy=True).requires_grad_() for x in (q, k, v)]
        loss = (fn(*leaves, w.to(dtype)) * d_out.to(dtype)).sum()
        loss.backward()
    return [x.grad for x in leaves]


def check_gradients():
    say("## Agreement of the gradients (L = sum(d_out * out); the same q, k, v, W and one d_out "
        "on both sides)\n")
    say("Batch 1, 2 heads, n = 200, d = 64, m = 256, float32 (the last row: 1 head, n = 1100, "
        "which our causal backward cuts into one segment per thread). Ours: the linrope "
        "package (batched *_backward); PyTorch: autograd through its implementations above. "
        "max|ours - torch| / max|torch| per gradient; a failure is > %g. The last two columns "
        "(the worst of dq, dk, dv) measure rounding: PyTorch's float32 gradients and ours "
        "against PyTorch's in float64 from the same inputs.\n" % GRAD_TOLERANCE)
    softmax = [(f"softmax {'causal (masked)' if c else 'non-causal'}", ("softmax", c),
                lambda q, k, v, w, c=c: torch_softmax(q, k, v, c)) for c in (False, True)]
    cases = [(label, call, fn, 200, 2) for label, call, fn in softmax]
    for kind, label in (("elu", "elu+1"), ("favor", "favor+")):
        cases += [(label + " " + text, call, fn, 200, 2) for text, call, fn in (
            ("non-causal (einsum)", (kind, False), torch_linear(kind, "einsum")),
            ("causal: ours (default) vs torch cumsum", (kind, True, "none", "scan"),
             torch_linear(kind, "cumsum")),
            ("causal: ours chunked vs torch chunked", (kind, True, "none", "chunked"),
             torch_linear(kind, "chunked")),
            ("numerator_only non-causal (eq. 19 written here)", (kind, False, "numerator_only"),
             torch_linear(kind, "einsum", "numerator_only")),
            ("numerator_only causal: ours (default) vs torch cumsum",
             (kind, True, "numerator_only", "scan"), torch_linear(kind, "cumsum", "numerator_only")),
            ("numerator_only causal: ours chunked vs torch cumsum",
             (kind, True, "numerator_only", "chunked"),
             torch_linear(kind, "cumsum", "numerator_only")),
            ("full non-causal (written here)", (kind, False, "full"),
             torch_linear(kind, "einsum", "full")),
            ("full causal: ours (default) vs torch cumsum", (kind, True, "full", "scan"),
             torch_linear(kind, "cumsum", "full")))]
    cases.append(("favor+ numerator_only causal, 1 head, n = 1100: ours (default, in segments) "
                  "vs torch cumsum", ("favor", True, "numerator_only", "scan"),
                  torch_linear("favor", "cumsum", "numerator_only"), 1100, 1))
    say("| computation | dq | dk | dv | torch f32 vs f64 | ours vs f64 |\n|---|---|---|---|---|---|")
    worst, failures, inputs = 0.0, [], {}
    for label, call, fn, n, heads in cases:
        if (n, heads) not in inputs:  # q, k, v, d_out per shape, seeded by it
            gen = torch.Generator().manual_seed(5 + n + heads)
            inputs[(n, heads)] = [torch.randn(1, heads, n, DIM, generator=gen)
                                  for _ in range(4)]
        q, k, v, d_out = inputs[(n, heads)]
        ours = run_ours(q, k, v, *call, d_out=d_out)
        w = our_projection() if call[0] == "favor" else torch.zeros(FEATURES, DIM)
        expected = torch_gradients(fn, q, k, v, w, d_out, torch.float32)
        exact = torch_gradients(fn, q, k, v, w, d_out, torch.float64)
        diffs = [float((o - e).abs().max() / e.abs().max()) for o, e in zip(ours, expected)]
        def against_exact(grads):
            return max(float((g.double() - x).abs().max() / x.abs().max())
                       for g, x in zip(grads, exact))
        floor, mine = against_exact(expected), against_exact(ours)
        worst = max([worst] + diffs)
        bad = [g for g, diff in zip(("dq", "dk", "dv"), diffs) if diff > GRAD_TOLERANCE]
        if bad:
            failures.append(f"{label} ({', '.join(bad)})")
        say(f"| {label} | " + " | ".join(f"{diff:.2e}" for diff in diffs)
            + f" | {floor:.2e} | {mine:.2e} |" + ("  **FAILED**" if bad else ""))
    say("")
    if failures:
        say("GRADIENT CHECK FAILED (> %g): %s" % (GRAD_TOLERANCE, "; ".join(failures)))
        sys.exit(1)
    say(f"All gradients agree (worst {worst:.2e}).\n")


# ---------------------------------------------------------------------------------------------
# Our timings, from bench_linear.

def load_average():
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def quiet_machine(phase):
    """Waits for a low load if asked to, then says what the load was when the phase began."""
    if args.wait_load > 0:
        deadline = time.time() + args.wait_max
        while os.getloadavg()[0] >= args.wait_load and time.time() < deadline:
            time.sleep(10)
    say(f"[{time.strftime('%H:%M:%S')}] {phase}: load average {load_average()}")

def our_env():
    env = dict(os.environ)
    env.pop("GLIBC_TUNABLES", None)
    env["OMP_NUM_THREADS"] = str(args.threads)
    return env


def run_bench():
    if args.bench_json:
        with open(args.bench_json) as f:
            return json.load(f)
    binary = os.path.join(args.build_dir, "bench", "bench_linear")
    command = [binary, "--benchmark_min_time=0.05", "--benchmark_format=json",
               f"--benchmark_repetitions={args.repetitions}",
               # Repetitions of all cases shuffled together: a burst of other work on the machine
               # then spoils one repetition of several cases, not every repetition of one case.
               "--benchmark_enable_random_interleaving=true",
               "--benchmark_report_aggregates_only=true"]
    if args.bench_filter:
        command.append(f"--benchmark_filter={args.bench_filter}")
    quiet_machine("bench_linear")
    say("Running: OMP_NUM_THREADS=%d %s" % (args.threads, " ".join(command)))
    start = time.time()
    result = subprocess.run(command, check=True, env=our_env(), stdout=subprocess.PIPE, text=True)
    say("(%.0f s)\n" % (time.time() - start))
    data = json.loads(result.stdout)
    if args.save_json:
        with open(args.save_json, "w") as f:
            json.dump(data, f, indent=1)
    return data


UNIT_MS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}


def medians(data):
    """name -> {"ms": median real time, "gflops": median GFLOP/s, ...} per benchmark."""
    table = {}
    for b in data["benchmarks"]:
        if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
            continue
        name = b.get("run_name", b["name"])
        name = re.sub(r"/real_time$", "", name)
        entry = {"ms": b["real_time"] * UNIT_MS[b.get("time_unit", "ns")]}
        for key in ("GFLOP/s", "items_per_second", "GB/s"):  # already rates, in these units
            if key in b:
                entry[key] = b[key]
        table[name] = entry
    return table


def slope(points):
    xs = [math.log(n) for n, _ in points]
    ys = [math.log(t) for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def crossover(linear, softmax):
    """Smallest n where linear beats softmax, from the measured sizes; log-log interpolation."""
    if linear[0][1] < softmax[0][1]:
        return f"<= {linear[0][0]} (linear already faster at the smallest size)"
    for (n0, l0), (n1, l1), (_, s0), (_, s1) in zip(linear, linear[1:], softmax, softmax[1:]):
        if l1 < s1:
            # log t = a + b log n on each side; solve for equal times.
            r0, r1 = math.log(l0 / s0), math.log(l1 / s1)
            return "~%d (between %d and %d)" % (
                round(math.exp(math.log(n0) + r0 / (r0 - r1) * (math.log(n1) - math.log(n0)))),
                n0, n1)
    return f"> {linear[-1][0]} (softmax faster at every measured size)"


def report_bench(ours):
    peak = ours["machine/peak_fma"]["GFLOP/s"]
    sgemm = ours["machine/sgemm_1024"]["GFLOP/s"]
    say("## Our figures (bench_linear, median of %d repetitions, real time, %d threads)\n"
        % (args.repetitions, args.threads))
    say(f"machine/peak_fma {peak:.1f} GFLOP/s, machine/sgemm_1024 {sgemm:.1f} GFLOP/s, "
        + ", ".join(f"{k} {v['GB/s']:.1f} GB/s" for k, v in ours.items() if "GB/s" in v) + "\n")
    say("| case | ms | GFLOP/s | of peak_fma | of sgemm_1024 | tokens/s |")
    say("|---|---|---|---|---|---|")
    def order(name):  # registration order survives random interleaving only through this
        n = re.search(r"/n:(\d+)$", name)
        return (re.sub(r"/n:\d+$", "", name), int(n.group(1)) if n else 0)

    for name in sorted(ours, key=order):
        e = ours[name]
        if name.startswith("machine/"):
            continue
        g = e.get("GFLOP/s", 0.0)
        ms = f"{e['ms'] * 1e3:.2f} us" if e["ms"] < 0.1 else f"{e['ms']:.2f}"
        say(f"| {name} | {ms} | {g:.3g} | {g / peak:.1%} | {g / sgemm:.1%} "
            f"| {e.get('items_per_second', 0):.3g} |")
    say("")

    def t(name):
        return ours[name]["ms"] if name in ours else None

    fit_name = "linear/favor/numerator_only/noncausal/n:%d"
    fit = [(n, t(fit_name % n)) for n in (2048, 4096, 8192, 16384, 32768) if t(fit_name % n)]
    s = slope(fit) if len(fit) >= 2 else float("nan")
    say(f"Log-log slope of time vs n, favor+ numerator_only non-causal, n = 2048..32768: {s:.3f}\n")

    def sizes_of(prefix):
        return {int(m.group(1)) for m in (re.fullmatch(re.escape(prefix) + r"/n:(\d+)", name)
                                          for name in ours) if m}

    say("Crossover (linear faster than exact softmax), from every n at which both were timed:\n")
    crossings = {}
    for label, lin, soft in (
            ("favor+ numerator_only non-causal vs softmax non-causal",
             "linear/favor/numerator_only/noncausal", "softmax/noncausal"),
            ("favor+ none non-causal vs softmax non-causal",
             "linear/favor/none/noncausal", "softmax/noncausal"),
            ("elu+1 numerator_only non-causal vs softmax non-causal",
             "linear/elu/numerator_only/noncausal", "softmax/noncausal"),
            ("favor+ numerator_only causal scan (the default) vs softmax causal",
             "linear/favor/numerator_only/scan", "softmax/causal"),
            ("favor+ numerator_only causal chunked vs softmax causal",
             "linear/favor/numerator_only/chunked", "softmax/causal"),
            ("elu+1 numerator_only causal scan (the default) vs softmax causal",
             "linear/elu/numerator_only/scan", "softmax/causal"),
            ("elu+1 numerator_only causal chunked vs softmax causal",
             "linear/elu/numerator_only/chunked", "softmax/causal"),
            # Fewer features. At equal FLOP rates the scan (8 m d FLOPs a token against softmax's
            # 2 n d) crosses at n = 4 m; the chunked form, by RESULTS.md's useful-FLOP count
            # (masked tiles skipped), near 4.75 m + 48.
            *((f"favor+ numerator_only causal {method}, m = {m} (FLOP model: ~{model(m):.0f})"
               " vs softmax causal", f"linear/favor/numerator_only/{method}/m:{m}",
               "softmax/causal")
              for method, model in (("scan", lambda m: 4 * m), ("chunked", lambda m: 4.75 * m + 48))
              for m in (64, 128, 192))):
        common = sorted(sizes_of(lin) & sizes_of(soft))
        lp = [(n, t(f"{lin}/n:{n}")) for n in common]
        sp = [(n, t(f"{soft}/n:{n}")) for n in common]
        if len(common) >= 2 and all(x for _, x in lp + sp):
            crossings[label] = crossover(lp, sp)
            say(f"- {label}: {crossings[label]}")
    say("")
    return {"peak": peak, "sgemm": sgemm, "slope": s, "t": t, "crossings": crossings}


# ---------------------------------------------------------------------------------------------
# PyTorch timings and the table.

def time_call(fn, reps):
    fn()  # warm-up: first-touch of the buffers, OpenMP pool start
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    return times[len(times) // 2]


def torch_cases(n, w, backward=False):
    """(key, function, bytes of large temporaries) for one n.

    backward: each function runs the forward and the backward of L = sum(d_out * out) by autograd
    (q, k, v require grad; their .grad reset first), as a training step would."""
    gen = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(BATCH, HEADS, n, DIM, generator=gen) for _ in range(3))
    bh = BATCH * HEADS
    scores = bh * n * n * 4
    # Softmax: scores and their softmax, 2 x scores per call, but the peak over the calls of
    # time_call reaches ~6x under the tunables (freed scores are not reused; see the docstring).
    # With the backward, 9.2x and 10.4x were measured (n = 2048 and 1024, 7 calls, ru_maxrss):
    # 11x.
    forms = [("softmax/noncausal", lambda q, k, v: torch_softmax(q, k, v, False), 6 * scores,
              11 * scores),
             ("softmax/causal", lambda q, k, v: torch_softmax(q, k, v, True), 6 * scores + n * n,
              11 * scores + n * n)]
    for kind, m, phi in (("elu", DIM, phi_elu), ("favor", FEATURES, lambda x: phi_favor(x, w))):
        prefix_sums = bh * n * m * DIM * 4
        chunked = bh * n * (CHUNK + 2 * m) * 4
        forms += [
            (f"{kind}/noncausal", lambda q, k, v, phi=phi: linear_noncausal(phi(q), phi(k), v),
             0, 0),
            # The [B,H,n,m,d_v] prefix sums, and the copy einsum makes of them for its bmm; with
            # the backward, their gradients too: 6.3x the prefix sums measured (FAVOR+, n = 1024
            # and 2048, 7 calls), 7x taken.
            (f"{kind}/cumsum", lambda q, k, v, phi=phi: linear_causal_cumsum(phi(q), phi(k), v),
             2 * prefix_sums, 7 * prefix_sums),
            # Measured with the backward: 11-12x (FAVOR+, n = 1024 and 2048), 13x taken.
            (f"{kind}/chunked", lambda q, k, v, phi=phi: linear_causal_chunked(phi(q), phi(k), v),
             chunked, 13 * chunked)]
    if not backward:
        return [(key, lambda f=f: f(q, k, v), forward) for key, f, forward, _ in forms]
    d_out = torch.randn(BATCH, HEADS, n, DIM, generator=gen)
    leaves = [x.requires_grad_() for x in (q, k, v)]

    def step(f):
        for x in leaves:
            x.grad = None  # as optimizer.zero_grad(set_to_none=True)
        with torch.enable_grad():
            loss = (f(*leaves) * d_out).sum()
            loss.backward()

    return [(key, lambda f=f: step(f), train) for key, f, _, train in forms]


def torch_timings(sizes, backward=False):
    what = "forward + backward (autograd), " if backward else ""
    say("## PyTorch timings" + (": forward + backward (autograd)" if backward else "") + "\n")
    blas = loaded_blas()
    say("PyTorch %s, %d threads, BLAS loaded: %s" % (torch.__version__, torch.get_num_threads(),
                                                     ", ".join(blas) or "none found"))
    if not any("openblas" in b for b in blas):
        say("WARNING: PyTorch is not using OpenBLAS (install libopenblas0-openmp): its GEMMs "
            "run on the reference BLAS and every PyTorch figure below is ~20x too slow.")
    say("GLIBC_TUNABLES=%s\n" % os.environ.get("GLIBC_TUNABLES"))
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(FEATURES, DIM, generator=gen)  # timing only: any W of the right shape will do
    results, previous = {}, {}
    for n in sizes:
        reps = 3 if n >= 16384 else 5
        quiet_machine(f"PyTorch {what}n = {n}")
        for key, fn, temporaries in torch_cases(n, w, backward):
            if temporaries > args.max_gb * 1e9:
                results[(key, n)] = "skipped: needs %.1f GB" % (temporaries / 1e9)
            elif key in previous and previous[key][1] * (n / previous[key][0]) ** (
                    2 if key.startswith("softmax") else 1) > 60e3:
                results[(key, n)] = "skipped: predicted > 60 s per call"
            else:
                results[(key, n)] = time_call(fn, reps)
                previous[key] = (n, results[(key, n)])
            value = results[(key, n)]
            say(f"  torch {key:20s} n={n:6d}: "
                + (f"{value:10.2f} ms" if isinstance(value, float) else value))
            gc.collect()
    say("")
    return results


def comparison_table(ours, torch_results, sizes):
    t = ours["t"]
    rows = [("softmax non-causal: matmul + softmax", "softmax/noncausal", "softmax/noncausal"),
            ("softmax causal: matmul + mask + softmax", "softmax/causal", "softmax/causal"),
            ("elu+1 non-causal: einsum", "linear/elu/none/noncausal", "elu/noncausal"),
            ("elu+1 causal: ours chunked / torch cumsum", "linear/elu/none/chunked", "elu/cumsum"),
            ("elu+1 causal: ours chunked / torch chunked", "linear/elu/none/chunked",
             "elu/chunked"),
            ("elu+1 causal: ours scan (the default) / torch chunked", "linear/elu/none/scan",
             "elu/chunked"),
            ("favor+ non-causal: einsum", "linear/favor/none/noncausal", "favor/noncausal"),
            ("favor+ causal: ours chunked / torch cumsum", "linear/favor/none/chunked",
             "favor/cumsum"),
            ("favor+ causal: ours chunked / torch chunked", "linear/favor/none/chunked",
             "favor/chunked"),
            ("favor+ causal: ours scan (the default) / torch chunked", "linear/favor/none/scan",
             "favor/chunked"),
            ("elu+1 numerator_only non-causal (ours only)", "linear/elu/numerator_only/noncausal",
             None),
            ("elu+1 numerator_only causal chunked (ours only)",
             "linear/elu/numerator_only/chunked", None),
            ("favor+ numerator_only non-causal (ours only)",
             "linear/favor/numerator_only/noncausal", None),
            ("favor+ numerator_only causal chunked (ours only)",
             "linear/favor/numerator_only/chunked", None),
            ("favor+ numerator_only causal scan (ours only)",
             "linear/favor/numerator_only/scan", None)]
    say("## linrope vs PyTorch (batch 1, 8 heads, d = 64, m = 256 for favor+, float32, "
        f"{args.threads} threads; ms, median)\n")
    say("Ours: placement `none` (PyTorch has no eq. 19 implementation); our numerator_only is "
        "listed separately. Ratio = PyTorch / ours (> 1: ours faster).\n")
    say("| computation | n | ours (ms) | PyTorch (ms) | ratio |\n|---|---|---|---|---|")
    ratios = {}
    for label, our_key, torch_key in rows:
        for n in sizes:
            mine = t(f"{our_key}/n:{n}")
            theirs = torch_results.get((torch_key, n)) if torch_key else "n/a (no eq. 19)"
            if isinstance(theirs, float) and mine:
                ratio = theirs / mine
                ratios[(our_key, torch_key, n)] = ratio
                say(f"| {label} | {n} | {mine:.2f} | {theirs:.2f} | {ratio:.2f}x |")
            else:
                say(f"| {label} | {n} | {mine:.2f} | {theirs} | - |" if mine else
                    f"| {label} | {n} | - | {theirs} | - |")
    say("")
    return ratios


def targets(ours, ratios, sizes):
    t, peak = ours["t"], ours["peak"]

    bench = ours["table"]
    say("## Targets\n")
    say("| target | measured | met? |\n|---|---|---|")

    def row(target, measured, met):
        say(f"| {target} | {measured} | {'yes' if met else 'NO'} |")

    def timed(values):  # a target none of whose cases ran (--bench-filter) is not judged
        return {key: value for key, value in values.items() if value is not None}

    def rate(name):
        return bench[name]["GFLOP/s"] / peak if name in bench else None

    def ratio(a, b):
        return t(a) / t(b) if t(a) and t(b) else None

    def judged(target, measured, values, met):
        if values:
            row(target, measured, met)
        else:
            say(f"| {target} | not timed | - |")

    fr = timed({n: rate(f"linear/favor/numerator_only/noncausal/n:{n}") for n in SIZES})
    judged("FAVOR+ numerator-only non-causal >= 50% of fp32 peak",
           ", ".join(f"n={n}: {f:.1%}" for n, f in fr.items()), fr,
           all(f >= 0.5 for f in fr.values()))
    for method, placement in (("chunked", "numerator_only"), ("chunked", "none"),
                              ("scan", "numerator_only"), ("scan", "none")):
        cr = timed({n: ratio(f"linear/favor/{placement}/{method}/n:{n}",
                             f"linear/favor/{placement}/noncausal/n:{n}") for n in SIZES})
        judged(f"FAVOR+ causal {method} <= 1.5x non-causal ({placement})",
               ", ".join(f"n={n}: {r:.2f}x" for n, r in cr.items()), cr,
               all(r <= 1.5 for r in cr.values()))
    for ours_key, key, goal, what in (
            ("linear/elu/none/noncausal", "elu/noncausal", 3.0, "PyTorch non-causal (einsum)"),
            ("linear/elu/none/chunked", "elu/chunked", 5.0, "PyTorch chunked causal (ours chunked)"),
            ("linear/elu/none/scan", "elu/chunked", 5.0, "PyTorch chunked causal (ours scan)")):
        rs = {n: ratios.get((ours_key, key, n)) for n in sizes}
        row(f"elu+1 linear >= {goal:g}x faster than {what}",
            ", ".join(f"n={n}: {r:.2f}x" if r else f"n={n}: -" for n, r in rs.items()),
            all(r and r >= goal for r in rs.values()))
    sf = timed({f"{c} n={n}": rate(f"softmax/{c}/n:{n}")
                for c in ("noncausal", "causal") for n in SIZES})
    judged("streaming softmax >= 50% of peak", ", ".join(f"{k}: {f:.1%}" for k, f in sf.items()),
           sf, all(f >= 0.5 for f in sf.values()))
    s = ours["slope"]
    judged("linear log-log slope in [0.95, 1.1] (2k..32k)", f"{s:.3f}", not math.isnan(s),
           0.95 <= s <= 1.1)
    # Judged on each form a user gets by default (causal: the scan); the chunked form is shown.
    lin_1024 = timed({lbl: t(f"{lin}/n:1024") < t(f"{soft}/n:1024")
                      if t(f"{lin}/n:1024") and t(f"{soft}/n:1024") else None
                      for lbl, lin, soft in (
        ("favor+ num_only non-causal", "linear/favor/numerator_only/noncausal",
         "softmax/noncausal"),
        ("elu+1 num_only non-causal", "linear/elu/numerator_only/noncausal", "softmax/noncausal"),
        ("favor+ num_only causal scan", "linear/favor/numerator_only/scan", "softmax/causal"),
        ("elu+1 num_only causal scan", "linear/elu/numerator_only/scan", "softmax/causal"))})
    chunked_1024 = timed({lbl: t(f"{lin}/n:1024") < t("softmax/causal/n:1024")
                          if t(f"{lin}/n:1024") and t("softmax/causal/n:1024") else None
                          for lbl, lin in (
        ("favor+ num_only causal chunked", "linear/favor/numerator_only/chunked"),
        ("elu+1 num_only causal chunked", "linear/elu/numerator_only/chunked"))})
    judged("linear overtakes exact softmax at n <= 1024 (default forms; chunked not required)",
           "; ".join(f"{k}: {'faster' if v else 'slower'} at 1024"
                     for k, v in {**lin_1024, **chunked_1024}.items()),
           lin_1024, all(lin_1024.values()))
    say("")


# ---------------------------------------------------------------------------------------------
# Training: forward + backward. Ours: the forward and the backward benchmark of the same problem
# from the one bench_linear run, added; a causal forward is the scan (the default, what a training
# loop calls), whose backward is bench_linear's one causal form.

TRAINING_ROWS = [
    # (label, our forward, our backward, PyTorch case)
    ("softmax non-causal: matmul + softmax", "softmax/noncausal", "softmax_backward/noncausal",
     "softmax/noncausal"),
    ("softmax causal: matmul + mask + softmax", "softmax/causal", "softmax_backward/causal",
     "softmax/causal"),
    *((f"{label} non-causal: einsum", f"linear/{kind}/none/noncausal",
       f"linear_backward/{kind}/none/noncausal", f"{kind}/noncausal")
      for kind, label in (("elu", "elu+1"), ("favor", "favor+"))),
    *((f"{label} causal: ours / torch {form}", f"linear/{kind}/none/scan",
       f"linear_backward/{kind}/none/causal", f"{kind}/{form}")
      for kind, label in (("elu", "elu+1"), ("favor", "favor+")) for form in ("chunked", "cumsum")),
]


def training_table(ours, torch_results, sizes):
    t = ours["t"]
    say("## linrope vs PyTorch, forward + backward (batch 1, 8 heads, d = 64, m = 256 for favor+, "
        f"float32, {args.threads} threads; ms, median)\n")
    say("Ours: bench_linear's forward + backward times (placement `none`; causal: the default "
        "scan forward). PyTorch: the forward call plus loss.backward() by autograd, "
        "loss = (out * d_out).sum(), q, k, v requiring grad. Ratio = PyTorch / ours "
        "(> 1: ours faster).\n")
    say("| computation | n | ours fwd | ours bwd | ours fwd+bwd | PyTorch fwd+bwd | ratio |\n"
        "|---|---|---|---|---|---|---|")
    ratios = {}
    for label, forward, backward, torch_key in TRAINING_ROWS:
        for n in sizes:
            f, b = t(f"{forward}/n:{n}"), t(f"{backward}/n:{n}")
            theirs = torch_results.get((torch_key, n), "not timed")
            if not (f and b):
                say(f"| {label} | {n} | - | - | - | " + (f"{theirs:.2f}" if isinstance(
                    theirs, float) else theirs) + " | - |")
                continue
            if isinstance(theirs, float):
                ratios[(torch_key, n)] = theirs / (f + b)
                say(f"| {label} | {n} | {f:.2f} | {b:.2f} | {f + b:.2f} | {theirs:.2f} "
                    f"| {theirs / (f + b):.2f}x |")
            else:
                say(f"| {label} | {n} | {f:.2f} | {b:.2f} | {f + b:.2f} | {theirs} | - |")
    say("")
    return ratios


def backward_ratios(ours):
    """Our backward time / forward time per case and size, and the log-log slope of the backward's
    time from n/4 to n; returns {(backward name, n): ratio} and {(backward name, n): slope}."""
    t, bench = ours["t"], ours["table"]
    cases = sorted({re.sub(r"/n:\d+$", "", name) for name in bench
                    if name.startswith(("linear_backward/", "softmax_backward/"))})
    sizes = sorted({int(name.rsplit(":", 1)[1]) for name in bench
                    if name.startswith(("linear_backward/", "softmax_backward/"))})
    pairs = [(n // 4, n) for n in sizes if n // 4 in sizes]
    say("## Our backward / forward time (bench_linear, the same run)\n")
    say("Forward of a causal linear case: the scan (the default). Slope: log-log slope of the "
        "backward's time from n/4 to n.\n")
    say("| backward | " + " | ".join(f"n={n}" for n in sizes) + " | "
        + " | ".join(f"slope {a}..{b}" for a, b in pairs) + " |")
    say("|---|" + "---|" * (len(sizes) + len(pairs)))
    ratios, slopes = {}, {}
    for case in cases:
        forward = (case.replace("_backward", "").replace("/causal", "/scan")
                   if case.startswith("linear") else case.replace("_backward", ""))
        cells = []
        for n in sizes:
            if t(f"{case}/n:{n}") and t(f"{forward}/n:{n}"):
                ratios[(case, n)] = t(f"{case}/n:{n}") / t(f"{forward}/n:{n}")
                cells.append(f"{ratios[(case, n)]:.2f}x")
            else:
                cells.append("-")
        for a, b in pairs:
            if t(f"{case}/n:{a}") and t(f"{case}/n:{b}"):
                slopes[(case, b)] = slope([(a, t(f"{case}/n:{a}")), (b, t(f"{case}/n:{b}"))])
                cells.append(f"{slopes[(case, b)]:.3f}")
            else:
                cells.append("-")
        say(f"| {case} | " + " | ".join(cells) + " |")
    say("")
    return ratios, slopes


def training_targets(train_ratios, bwd_ratios, slopes):
    say("## Targets: forward + backward\n")
    say("| target | measured | met? |\n|---|---|---|")

    def judged(target, values, goal, at_least):
        if not values:
            say(f"| {target} | not timed | - |")
            return
        met = all(v >= goal if at_least else v <= goal for v in values.values())
        say(f"| {target} | " + ", ".join(f"{k}: {v:.2f}x" for k, v in values.items())
            + f" | {'yes' if met else 'NO'} |")

    def pick(table, keys):
        return {label: table[key] for label, key in keys if key in table}

    for goal, key, what in ((4.0, "favor/chunked", "FAVOR+ causal (torch chunked)"),
                            (5.0, "elu/chunked", "elu+1 causal (torch chunked)"),
                            (2.0, "softmax/causal", "softmax causal")):
        judged(f"fwd+bwd >= {goal:g}x faster than PyTorch autograd, {what}, n = 4096",
               pick(train_ratios, [("n=4096", (key, 4096))]), goal, True)
    n = 16384
    judged(f"backward <= 2.5x forward, FAVOR+ eq. 19 and full, n = {n}",
           pick(bwd_ratios, [(f"{p} {c}", (f"linear_backward/favor/{p}/{c}", n))
                             for p in ("numerator_only", "full")
                             for c in ("causal", "noncausal")]), 2.5, False)
    judged("backward <= 3x forward, elu+1 causal and softmax causal, n = 4096",
           pick(bwd_ratios, [(f"elu+1 {p}", (f"linear_backward/elu/{p}/causal", 4096))
                             for p in ("none", "numerator_only")]
                + [("softmax", ("softmax_backward/causal", 4096))]), 3.0, False)
    # The slope over the largest n/4 -> n pair timed, every linear backward.
    largest = max((b for _, b in slopes), default=None)
    linear_slopes = {case.replace("linear_backward/", ""): v for (case, b), v in slopes.items()
                     if b == largest and case.startswith("linear_backward/")}
    if linear_slopes:
        lo, hi = min(linear_slopes.values()), max(linear_slopes.values())
        met = 0.9 <= lo and hi <= 1.15
        say(f"| log-log slope of our linear backward's time, n = {largest // 4}..{largest}, "
            f"in [0.9, 1.15] | {lo:.3f} ({min(linear_slopes, key=linear_slopes.get)}) .. "
            f"{hi:.3f} ({max(linear_slopes, key=linear_slopes.get)}) | "
            f"{'yes' if met else 'NO'} |")
    else:
        say("| log-log slope of our linear backward's time in [0.9, 1.15] | not timed | - |")
    say("")


def main():
    global linrope
    say("# linrope vs PyTorch — %s, %d threads, load average %s\n"
        % (time.strftime("%Y-%m-%d %H:%M"), args.threads,
           " ".join(f"{x:.2f}" for x in os.getloadavg())))
    if not args.skip_check:
        linrope = import_linrope()
        check_agreement()
        if not args.skip_backward:
            check_gradients()
    if args.check_only:
        return
    table = medians(run_bench())
    ours = report_bench(table)
    ours["table"] = table
    sizes = [int(x) for x in args.sizes.split(",")]
    if not args.skip_forward:
        torch_results = {} if args.skip_torch_timing else torch_timings(sizes)
        ratios = comparison_table(ours, torch_results, sizes)
        targets(ours, ratios, sizes)
    if not args.skip_backward:
        torch_train = {} if args.skip_torch_timing else torch_timings(sizes, backward=True)
        train_ratios = training_table(ours, torch_train, sizes)
        bwd_ratios, slopes = backward_ratios(ours)
        training_targets(train_ratios, bwd_ratios, slopes)
    say("Load average at the end: %s" % load_average())


if __name__ == "__main__":
    main()
