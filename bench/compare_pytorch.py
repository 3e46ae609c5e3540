#!/usr/bin/python3
"""linrope against PyTorch: the same attention computations, timed. A benchmark only: the
agreement of both sides with the float64 reference is python/tests/test_against_pytorch.py's
(bench/torch_side.py's competitors included, so that each times the function its name says).

What it does, in order:
  1. Our timings: runs build/bench/bench_linear once (every case, 5 randomly interleaved
     repetitions, Google Benchmark median of real time) unless --bench-json gives a saved run;
     prints every case with GFLOP/s, its fraction of machine/peak_fma and of machine/sgemm_1024
     (both measured in that run), the log-log slope of time against n, the softmax/linear
     crossovers (experiments/analysis/common.py's crossover) and the speed targets.
  2. PyTorch timings of every computation in bench/torch_side.py's COMPETITORS (batch 1, 8
     heads, d = 64, m = 256, float32, n in 1024, 4096, 16384; median of 5 calls, 3 at
     n = 16384, after one warm-up call) and one table: ours, PyTorch, ratio.
  3. Forward + backward, the same problem: PyTorch's forward call plus loss.backward() by
     autograd (q, k, v requiring grad, their .grad reset before each call; median as in 2.), and
     ours, bench_linear's forward time plus its backward time (linear_backward/...,
     softmax_backward/...) from the run of 1.; causal linear: our default forward, the scan. One
     table: ours fwd, bwd, fwd+bwd, PyTorch fwd+bwd, ratio, and the targets (at n = 4096, faster
     than PyTorch autograd by >= 4x on FAVOR+ causal chunked, >= 5x on elu+1 causal chunked, >= 2x
     on softmax causal). Then our backward / forward time for every backward timed, the log-log
     slope of the backward's time from n/4 to n, and their targets (<= 2.5x for FAVOR+ eq. 19 and
     full, causal and not, at n = 16384; <= 3x for elu+1 causal and softmax causal at n = 4096;
     slope in [0.9, 1.15]).
A target is printed beside what was measured ("met?"); it says how fast, never whether right.

Shorter runs: --sizes (the PyTorch sizes), --bench-filter (a regex of bench_linear cases; a
target whose cases did not run prints "not timed"), --skip-forward (no forward PyTorch timings,
table or targets), --skip-backward (no forward + backward timings, table or targets),
--skip-torch-timing (ours only), --bench-json (a saved run). Forward + backward at n = 1024 and
4096 only:
  /usr/bin/python3 bench/compare_pytorch.py --skip-forward --sizes 1024,4096 --bench-filter \
    '^(machine/(peak_fma|sgemm)|linear(_backward)?/(elu|favor)/(none|numerator_only|full)/[a-z]+/n:(1024|4096|16384)/|softmax(_backward)?/(noncausal|causal)/n:(1024|4096)/)'

PyTorch is written the way a PyTorch user would write it (bench/torch_side.py):
  softmax        (q * scale) @ k^T, masked_fill with a triu mask when causal, softmax, @ v
  linear         phi(q), phi(k) in PyTorch (elu+1: F.elu(x) + 1; FAVOR+: exp(x' W^T - |x'|^2/2)
                 / sqrt(m), x' = x d^-1/4), then einsum: S = phi(k)^T v, z = sum phi(k)
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
  * torch.set_num_threads(T) and OMP_NUM_THREADS=T for bench_linear, T = --threads (default:
    OMP_NUM_THREADS, else the number of CPUs).
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
import importlib.util
import json
import math
import os
import re
import subprocess
import time

from torch_side import CHUNK, COMPETITORS, loaded_blas, reexec_with_tunables

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The benchmarked problem.
BATCH, HEADS, DIM, FEATURES = 1, 8, 64, 256
SIZES = [1024, 4096, 16384]


def load_analysis_common():
    """experiments/analysis/common.py, by path (experiments/ is no package): its power-law fit
    and crossover are the ones the experiments' report uses."""
    path = os.path.join(ROOT, "experiments", "analysis", "common.py")
    spec = importlib.util.spec_from_file_location("analysis_common", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


analysis = load_analysis_common()


def parse_args():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # The README's commands build into build/release; a hand-made benchmark tree is build-bench.
    default_build = next((os.path.join(ROOT, d) for d in ("build/release", "build-bench")
                          if os.path.exists(os.path.join(ROOT, d, "bench", "bench_linear"))),
                         os.path.join(ROOT, "build/release"))
    parser.add_argument("--build-dir", default=default_build,
                        help="build tree holding bench/bench_linear "
                             "(default: build/release, else build-bench)")
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
    parser.add_argument("--skip-torch-timing", action="store_true",
                        help="time ours only (the tables show PyTorch as not timed)")
    parser.add_argument("--skip-forward", action="store_true",
                        help="no PyTorch forward timings, forward table or forward targets")
    parser.add_argument("--skip-backward", action="store_true",
                        help="no PyTorch forward + backward timings, forward + backward table "
                             "or backward targets")
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

import torch  # noqa: E402  (after the re-exec: glibc reads its tunables at start-up)

torch.set_num_threads(args.threads)
torch.set_grad_enabled(False)


def say(*parts):
    print(*parts, flush=True)


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
    if args.save_json:  # written whole, then renamed: a reader never sees half a file
        with open(args.save_json + ".tmp", "w") as f:
            json.dump(data, f, indent=1)
        os.replace(args.save_json + ".tmp", args.save_json)
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
    """The log-log slope of time against n over (n, time) points."""
    return analysis.fit_loglog([n for n, _ in points], [t for _, t in points])["slope"]


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
        lt, st = [t(f"{lin}/n:{n}") for n in common], [t(f"{soft}/n:{n}") for n in common]
        if len(common) >= 2 and all(lt + st):
            crossings[label] = analysis.describe_crossover(analysis.crossover(common, lt, st))
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


def temporaries(competitor, n, backward):
    """Bytes of the large temporaries of one PyTorch call at n (forward, or forward + backward
    by autograd), to skip what would not fit in --max-gb."""
    bh = BATCH * HEADS
    m = FEATURES if competitor.attention == "favor+" else DIM
    if competitor.form == "matmul":
        # Scores and their softmax, 2 x scores per call, but the peak over the calls of
        # time_call reaches ~6x under the tunables (freed scores are not reused; see the
        # docstring). With the backward, 9.2x and 10.4x were measured (n = 2048 and 1024, 7
        # calls, ru_maxrss): 11x. Causal adds the n x n mask.
        return (11 if backward else 6) * bh * n * n * 4 + (n * n if competitor.causal else 0)
    if competitor.form == "cumsum":
        # The [B,H,n,m,d_v] prefix sums, and the copy einsum makes of them for its bmm; with the
        # backward, their gradients too: 6.3x the prefix sums measured (FAVOR+, n = 1024 and
        # 2048, 7 calls), 7x taken.
        return (7 if backward else 2) * bh * n * m * DIM * 4
    if competitor.form == "chunked":
        # Measured with the backward: 11-12x (FAVOR+, n = 1024 and 2048), 13x taken.
        return (13 if backward else 1) * bh * n * (CHUNK + 2 * m) * 4
    return 0  # einsum: [B,H,m,d_v] states only


def torch_cases(n, w, backward=False):
    """(competitor, call, bytes of large temporaries) for one n, every torch_side competitor.

    backward: each call runs the forward and the backward of L = sum(d_out * out) by autograd
    (q, k, v require grad; their .grad reset first), as a training step would."""
    gen = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(BATCH, HEADS, n, DIM, generator=gen) for _ in range(3))
    if not backward:
        return [(c, lambda c=c: c(q, k, v, w), temporaries(c, n, False)) for c in COMPETITORS]
    d_out = torch.randn(BATCH, HEADS, n, DIM, generator=gen)
    leaves = [x.requires_grad_() for x in (q, k, v)]

    def step(competitor):
        for x in leaves:
            x.grad = None  # as optimizer.zero_grad(set_to_none=True)
        with torch.enable_grad():
            loss = (competitor(*leaves, w) * d_out).sum()
            loss.backward()

    return [(c, lambda c=c: step(c), temporaries(c, n, True)) for c in COMPETITORS]


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
        for competitor, fn, needs in torch_cases(n, w, backward):
            key = competitor.key
            if needs > args.max_gb * 1e9:
                results[(key, n)] = "skipped: needs %.1f GB" % (needs / 1e9)
            elif key in previous and previous[key][1] * (n / previous[key][0]) ** (
                    2 if competitor.attention == "softmax" else 1) > 60e3:
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
            theirs = (torch_results.get((torch_key, n), "not timed") if torch_key
                      else "n/a (no eq. 19)")
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
            ("linear/elu/none/chunked", "elu/chunked", 5.0,
             "PyTorch chunked causal (ours chunked)"),
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
    say("| " + " | ".join(["backward"] + [f"n={n}" for n in sizes]
                          + [f"slope {a}..{b}" for a, b in pairs]) + " |")
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
    say("# linrope vs PyTorch — %s, %d threads, load average %s\n"
        % (time.strftime("%Y-%m-%d %H:%M"), args.threads,
           " ".join(f"{x:.2f}" for x in os.getloadavg())))
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
