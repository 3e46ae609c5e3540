#!/usr/bin/python3
"""Sequence parallelism on one machine: linrope.torch.distributed, timed and its bytes counted.

The script launches its worker processes through linrope.torch.launch (P in --processes; gloo,
init_method tcp://127.0.0.1:<free port>, a --collective-timeout on every collective and a
--timeout on every launch, so that a hang ends as an error exit) and measures:

1. mode "sequence": one layer's forward + backward of linrope.torch.distributed.linear_attention,
   causal, each rank holding an equal contiguous slice [B, H, n / P, d] of the sequence: B = 1,
   H = 8, d = d_v = 64, float32; FAVOR+ with m = 256 features and elu+1 (m = d = 64), placement
   numerator_only with a linrope.Rope of width m. out.backward(d_out) ends the call. Each
   repetition starts at a barrier; its time is the slowest rank's (barrier to end of backward,
   the maximum over the ranks); the median of --repetitions (at most 3 at n >= 32768) after one
   warm-up call. Also the forward alone (barrier to end of forward, slowest rank).
2. mode "single": linrope.torch.linear_attention on the whole sequence in one process (the P = 1
   path without the wrapper), the same inputs, timed the same way, in the P = 1 launches: the
   ratio sequence(P = 1) / single (same threads) is the wrapper's overhead (the keys-only pass
   for the state, the merge, the three collectives of a group of one).

Data parallelism's cost is measured where the project uses it, with the trainer's own step and
all-reduce: `cd experiments && python3 -m training.ddp_cost`.

Bytes are counted, not computed. In every worker torch.distributed.all_gather and all_reduce
(the module attributes linrope.torch.distributed calls as dist.all_gather, dist.all_reduce) are
wrapped with counters, per call and rank: for all_gather the bytes this rank contributes (sent)
and the bytes of the other ranks' pieces it receives; for all_reduce the tensor's bytes (each
rank's contribution and result; the bytes gloo moves on the wire for it depend on its
algorithm, ~2 (P - 1) / P times that for a ring). The counts are checked against the formula in
linrope.torch.distributed's docstring, per rank and per call (warm-up included), with
s = B H (m (d_v + 1) w + 8), the state's bytes (S and z in w-byte elements, the float64 log
scale):

  forward    3 collectives (all_gather): 20 int64 (160 bytes), the packed state (S, z), the
             float64 log scales: sent s + 160, received (P - 1) (s + 160)
  backward   1 collective (all_reduce) of the P gathered packed states' gradients, without the
             scales: P (s - 8 B H) bytes

Any disagreement makes the script exit 1 (after writing its CSV, where bytes_match says which
rows). At the smallest n the
distributed outputs are also checked against the whole-sequence call (max|diff| / max|out| <
1e-4 at float32), else exit 1.

Threads: P = 1 runs with 1 thread and with all the CPUs; P > 1 with max(1, CPUs // P) per
process (torch.set_num_threads, linrope.set_num_threads and OMP_NUM_THREADS), so 2 and 4
processes on 2 cores compare with P = 1 on 1 thread, like with like; 4 processes on 2 cores
oversubscribe them. The environment is launch.environment's (OMP_WAIT_POLICY=PASSIVE: a waiting
thread sleeps instead of spinning on a descheduled peer's time). linrope: PYTHONPATH, else
build/release/python.

Output: a CSV (--out, written atomically by experiments/analysis/common.py's write_csv) with one
row per (mode, map, P, threads, n) and a table on stdout; progress on stderr.

  PYTHONPATH=build/release/python /usr/bin/python3 bench/bench_distributed.py
  PYTHONPATH=build/release/python /usr/bin/python3 bench/bench_distributed.py --quick
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
from analysis.common import write_csv  # noqa: E402  (the project's one CSV writer)
BATCH, HEADS, HEAD_DIM, VALUE_DIM = 1, 8, 64, 64
FEATURE_COUNTS = {"favor+": 256, "elu+1": 64}  # kind -> m at d = 64
PLACEMENT = "numerator_only"
DESCRIPTION_BYTES = 20 * 8  # the call's description: 20 int64
AGREEMENT = 1e-4
GRACE = 10.0  # seconds the other ranks of a launch have to end after one failed
LONG_N, LONG_REPETITIONS = 32768, 3
COLUMNS = ["mode", "map", "P", "threads", "n", "n_per_rank", "batch", "heads", "d", "m", "d_v",
           "repetitions", "median_ms", "min_ms", "max_ms", "forward_median_ms",
           "ratio_to_single", "forward_collectives", "forward_sent_bytes",
           "forward_received_bytes", "backward_collectives", "backward_allreduce_bytes",
           "predicted_forward_sent", "predicted_forward_received", "predicted_backward_allreduce",
           "bytes_match", "counted_by", "load_before", "load_after"]


def log(*parts):
    print("bench_distributed:", *parts, file=sys.stderr, flush=True)


def int_list(text):
    return [int(x) for x in text.split(",") if x]


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int_list, default=[4096, 8192, 16384, 32768, 65536],
                        help="comma-separated total sequence lengths n (split evenly)")
    parser.add_argument("--processes", type=int_list, default=[1, 2, 4],
                        help="comma-separated process counts P")
    parser.add_argument("--repetitions", type=int, default=5,
                        help=f"timed calls per case, the median (at most {LONG_REPETITIONS} at "
                             f"n >= {LONG_N}), after one warm-up call")
    parser.add_argument("--maps", default="favor+,elu+1", help="comma-separated: favor+, elu+1")
    parser.add_argument("--out", default="bench_distributed.csv", help="the CSV to write")
    parser.add_argument("--quick", action="store_true",
                        help="n in 4096, 8192; P in 1, 2; 3 repetitions")
    parser.add_argument("--timeout", type=float, default=1200.0,
                        help="seconds a launch (all of one P's work) may take")
    parser.add_argument("--collective-timeout", type=float, default=180.0,
                        help="seconds a gloo collective may wait before it fails")
    parser.add_argument("--worker", nargs=5, metavar=("RANK", "WORLD", "PORT", "THREADS", "JOB"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes = [n for n in args.sizes if n <= 8192]
        args.processes = [p for p in args.processes if p <= 2]
        args.repetitions = min(args.repetitions, 3)
    args.maps = [m for m in args.maps.split(",") if m]
    for kind in args.maps:
        if kind not in FEATURE_COUNTS:
            parser.error(f"--maps: {kind!r} is not one of {', '.join(FEATURE_COUNTS)}")
    for p in args.processes:
        for n in args.sizes:
            if p < 1 or n % p:
                parser.error(f"n = {n} does not split evenly across P = {p} processes")
    if args.repetitions < 1:
        parser.error(f"--repetitions is {args.repetitions} but expected >= 1")
    return args


# ---------------------------------------------------------------------------------------------
# The formula (linrope.torch.distributed's docstring), computed here independently.

def predicted(world, m, width=4):
    """(forward sent, forward received, backward all_reduce) bytes per rank and call."""
    s = BATCH * HEADS * (m * (VALUE_DIM + 1) * width + 8)
    return s + DESCRIPTION_BYTES, (world - 1) * (s + DESCRIPTION_BYTES), \
        world * (s - 8 * BATCH * HEADS)


# ---------------------------------------------------------------------------------------------
# Worker: one rank.

def worker(rank, world, port, threads, job_path):
    import torch
    import torch.distributed as dist

    import linrope
    import linrope.torch as lt
    import linrope.torch.distributed as ltd

    with open(job_path) as f:
        job = json.load(f)
    torch.set_num_threads(threads)
    linrope.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world,
                            timeout=datetime.timedelta(seconds=job["collective_timeout"]))

    # The counters: every all_gather / all_reduce while `phase` is set.
    counter = {"phase": None}
    calls = []
    original_gather, original_reduce = dist.all_gather, dist.all_reduce

    def nbytes(t):
        return t.numel() * t.element_size()

    def counted_gather(tensor_list, tensor, group=None, async_op=False):
        if counter["phase"] is not None:
            me = dist.get_rank(group) if group is not None else rank
            calls.append(dict(phase=counter["phase"], op="all_gather", sent=nbytes(tensor),
                              received=sum(nbytes(t) for i, t in enumerate(tensor_list)
                                           if i != me)))
        return original_gather(tensor_list, tensor, group=group, async_op=async_op)

    def counted_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if counter["phase"] is not None:
            calls.append(dict(phase=counter["phase"], op="all_reduce", sent=nbytes(tensor),
                              received=nbytes(tensor)))
        return original_reduce(tensor, op=op, group=group, async_op=async_op)

    dist.all_gather, dist.all_reduce = counted_gather, counted_reduce

    def summary(phase_calls, phase):
        mine = [c for c in phase_calls if c["phase"] == phase]
        return dict(collectives=len(mine), ops=sorted({c["op"] for c in mine}),
                    sent=sum(c["sent"] for c in mine),
                    received=sum(c["received"] for c in mine))

    records = []

    def time_attention(mode, kind, fm, rope, q, k, v, d_out, n, repetitions):
        """Forward + backward, warm-up then `repetitions` calls; this rank's times and counts."""
        call = ltd.linear_attention if mode == "sequence" else lt.linear_attention
        forward, total, counts = [], [], []
        for i in range(1 + repetitions):
            for x in (q, k, v):
                x.grad = None
            dist.barrier()
            del calls[:]
            start = time.perf_counter()
            counter["phase"] = "forward"
            out = call(q, k, v, fm, causal=True, placement=PLACEMENT, rope=rope)
            middle = time.perf_counter()
            counter["phase"] = "backward"
            out.backward(d_out)
            end = time.perf_counter()
            counter["phase"] = None
            del out
            counts.append(dict(forward=summary(calls, "forward"),
                               backward=summary(calls, "backward")))
            if i:
                forward.append(middle - start)
                total.append(end - start)
        records.append(dict(mode=mode, map=kind, n=n, n_per_rank=q.shape[2], m=fm.output_dim,
                            forward=forward, total=total, counts=counts))

    agreement = []
    for kind in job["maps"]:
        m = FEATURE_COUNTS[kind]
        fm = linrope.FeatureMap(kind, HEAD_DIM, num_features=m if kind == "favor+" else 0,
                                seed=7)
        assert fm.output_dim == m, (kind, fm.output_dim)
        rope = linrope.Rope(m)
        for index, n in enumerate(job["sizes"]):
            repetitions = min(job["repetitions"], LONG_REPETITIONS) if n >= LONG_N \
                else job["repetitions"]
            g = torch.Generator().manual_seed(1000 + n)
            q, k = (0.5 * torch.randn(BATCH, HEADS, n, HEAD_DIM, generator=g) for _ in range(2))
            v, d_out = (torch.randn(BATCH, HEADS, n, VALUE_DIM, generator=g) for _ in range(2))
            local = n // world
            begin = rank * local
            part = [x[:, :, begin:begin + local].clone().requires_grad_() for x in (q, k, v)]
            if index == 0:  # the distributed outputs against the whole sequence's
                whole = lt.linear_attention(q, k, v, fm, causal=True, placement=PLACEMENT,
                                            rope=rope)[:, :, begin:begin + local]
                mine = ltd.linear_attention(*part, fm, causal=True, placement=PLACEMENT,
                                            rope=rope)
                error = float((mine - whole).abs().max() / whole.abs().max())
                agreement.append(dict(map=kind, n=n, relative_error=error))
                del whole, mine
            if job["single"]:
                whole = [x.clone().requires_grad_() for x in (q, k, v)]
                time_attention("single", kind, fm, rope, *whole, d_out, n, repetitions)
                del whole
            time_attention("sequence", kind, fm, rope, *part,
                           d_out[:, :, begin:begin + local].contiguous(), n, repetitions)
            if rank == 0:
                print(f"rank 0: {kind} n = {n} done", file=sys.stderr, flush=True)

    dist.barrier()
    result = dict(rank=rank, world=world, threads=threads, records=records,
                  agreement=agreement, torch_threads=torch.get_num_threads(),
                  linrope_threads=linrope.get_num_threads())
    with open(job["out"] % rank, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Parent: launches, collects, checks, writes.

def load():
    return os.getloadavg()[0]


def launch(args, world, threads, single, directory, pythonpath):
    """Runs `world` workers of `threads` threads; returns their results (a list by rank)."""
    from linrope.torch.launch import GroupTimeout, environment, free_port, run_group

    tag = f"P{world}_t{threads}"
    job = dict(maps=args.maps, sizes=args.sizes, repetitions=args.repetitions, single=single,
               collective_timeout=args.collective_timeout,
               out=os.path.join(directory, tag + "_rank%d.json"))
    job_path = os.path.join(directory, tag + ".json")
    with open(job_path, "w") as f:
        json.dump(job, f)
    port = free_port()
    commands = [[sys.executable, os.path.abspath(__file__), "--worker", rank, world, port,
                 threads, job_path] for rank in range(world)]
    try:
        exits = run_group(commands, timeout=args.timeout, grace=GRACE,
                          env=environment(threads, pythonpath=[pythonpath]))
    except GroupTimeout as e:
        raise SystemExit(f"bench_distributed: {tag}: {e}")
    failed = [(rank, e) for rank, e in enumerate(exits) if e.returncode != 0]
    if failed:
        for rank, e in failed:
            log(f"--- {tag} rank {rank} output (end) ---\n{e.output[-3000:]}")
        raise SystemExit(f"bench_distributed: {tag}: rank {failed[0][0]} exited with "
                         f"{failed[0][1].returncode}")
    results = []
    for rank in range(world):
        with open(job["out"] % rank) as f:
            results.append(json.load(f))
    return results


def milliseconds(seconds):
    return round(1e3 * seconds, 3)


def attention_rows(results, world, threads, before, after, problems):
    """One row per (mode, map, n): slowest rank per repetition, its median; the counts checked
    on every rank and call."""
    rows = []
    for i, record in enumerate(results[0]["records"]):
        ranks = [r["records"][i] for r in results]
        total = [max(t) for t in zip(*(r["total"] for r in ranks))]
        forward = [max(t) for t in zip(*(r["forward"] for r in ranks))]
        mode, kind, m = record["mode"], record["map"], record["m"]
        row = dict(mode=mode, map=kind, P=world, threads=threads, n=record["n"],
                   n_per_rank=record["n_per_rank"], batch=BATCH, heads=HEADS, d=HEAD_DIM, m=m,
                   d_v=VALUE_DIM, repetitions=len(total),
                   median_ms=milliseconds(statistics.median(total)),
                   min_ms=milliseconds(min(total)), max_ms=milliseconds(max(total)),
                   forward_median_ms=milliseconds(statistics.median(forward)),
                   load_before=f"{before:.2f}", load_after=f"{after:.2f}")
        counts = [c for r in ranks for c in r["counts"]]
        first = counts[0]
        row.update(forward_collectives=first["forward"]["collectives"],
                   forward_sent_bytes=first["forward"]["sent"],
                   forward_received_bytes=first["forward"]["received"],
                   backward_collectives=first["backward"]["collectives"],
                   backward_allreduce_bytes=first["backward"]["sent"],
                   counted_by="wrapped torch.distributed.all_gather/all_reduce")
        if mode == "single":
            match = all(c["forward"]["collectives"] == 0 and c["backward"]["collectives"] == 0
                        for c in counts)
            if not match:
                problems.append(f"single {kind} n = {record['n']}: the single-process call "
                                f"made collectives")
        else:
            sent, received, reduced = predicted(world, m)
            row.update(predicted_forward_sent=sent, predicted_forward_received=received,
                       predicted_backward_allreduce=reduced)
            expected = dict(forward=dict(collectives=3, ops=["all_gather"], sent=sent,
                                         received=received),
                            backward=dict(collectives=1, ops=["all_reduce"], sent=reduced,
                                          received=reduced))
            match = all(c == expected for c in counts)
            if not match:
                wrong = next(c for c in counts if c != expected)
                problems.append(f"sequence {kind} P = {world} n = {record['n']}: counted "
                                f"{wrong}, the formula gives {expected}")
        row["bytes_match"] = "yes" if match else "NO"
        rows.append(row)
    return rows


def print_tables(rows, args):
    def key(row):
        return row["mode"], row["map"], row["P"], row["threads"], row["n"]
    found = {key(r): r for r in rows}
    configs = []  # (label, mode, P, threads)
    launches = sorted({(r["mode"], r["P"], r["threads"]) for r in rows},
                      key=lambda c: (c[0] != "single", c[1], c[2]))
    for mode, world, threads in launches:
        configs.append((f"{'single' if mode == 'single' else f'P={world}'} {threads}t", mode,
                        world, threads))
    print("\nForward + backward, one layer (B = 1, H = 8, d = d_v = 64, float32, numerator_only), "
          "median ms of the slowest rank")
    header = f"{'map':7} {'n':>6} " + " ".join(f"{c[0]:>11}" for c in configs) + \
        "  seq P=1/single (1t)"
    print(header)
    for kind in args.maps:
        for n in args.sizes:
            cells = []
            for _, mode, world, threads in configs:
                row = found.get((mode, kind, world, threads, n))
                cells.append(f"{row['median_ms']:>11.1f}" if row else f"{'-':>11}")
            ratio = ""
            seq = found.get(("sequence", kind, 1, 1, n))
            single = found.get(("single", kind, 1, 1, n))
            if seq and single:
                ratio = f"{seq['median_ms'] / single['median_ms']:.2f}"
            print(f"{kind:7} {n:>6} " + " ".join(cells) + f"  {ratio:>19}")
    print("\nBytes per rank and call (sequence mode; the same at every n), counted / formula")
    print(f"{'map':7} {'P':>2} {'fwd colls':>9} {'fwd sent':>10} {'fwd recv':>10} "
          f"{'bwd colls':>9} {'bwd all_reduce':>14}  match")
    seen = set()
    for row in rows:
        if row["mode"] != "sequence" or (row["map"], row["P"]) in seen:
            continue
        seen.add((row["map"], row["P"]))
        same = all(r["bytes_match"] == "yes" for r in rows if r["mode"] == "sequence"
                   and r["map"] == row["map"] and r["P"] == row["P"])
        print(f"{row['map']:7} {row['P']:>2} {row['forward_collectives']:>9} "
              f"{row['forward_sent_bytes']:>10} {row['forward_received_bytes']:>10} "
              f"{row['backward_collectives']:>9} {row['backward_allreduce_bytes']:>14}  "
              f"{'yes' if same else 'NO'} (formula {row['predicted_forward_sent']}, "
              f"{row['predicted_forward_received']}, {row['predicted_backward_allreduce']})")


def main(argv):
    args = parse_args(argv)
    if args.worker:
        rank, world, port, threads = (int(x) for x in args.worker[:4])
        worker(rank, world, port, threads, args.worker[4])
        return 0
    sys.path.append(os.path.join(ROOT, "build", "release", "python"))  # after PYTHONPATH's
    try:
        import linrope
        import linrope.torch.distributed as ltd
        import torch
    except ImportError as error:
        sys.exit(f"bench_distributed.py: cannot import linrope.torch.distributed ({error}); "
                 f"build it, or set PYTHONPATH to the directory holding the linrope package")
    package = os.path.dirname(os.path.dirname(os.path.abspath(linrope.__file__)))
    pythonpath = os.pathsep.join([package] + [p for p in os.environ.get("PYTHONPATH", "")
                                              .split(os.pathsep) if p])
    for kind in args.maps:  # the formula here and the module's state_bytes agree
        m = FEATURE_COUNTS[kind]
        s = BATCH * HEADS * (m * (VALUE_DIM + 1) * 4 + 8)
        if ltd.state_bytes(BATCH, HEADS, m, VALUE_DIM, torch.float32) != s:
            sys.exit(f"bench_distributed.py: state_bytes disagrees with s = {s} for {kind}")
    cpus = os.cpu_count()
    launches = []  # (P, threads, single)
    for world in args.processes:
        if world == 1:
            launches += [(1, 1, True)] + ([(1, cpus, True)] if cpus > 1 else [])
        else:
            launches.append((world, max(1, cpus // world), False))
    log(f"linrope from {package}; torch {torch.__version__}; {cpus} CPUs; sizes {args.sizes}; "
        f"P {args.processes}; maps {args.maps}; {args.repetitions} repetitions")
    rows, problems, started = [], [], time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench_distributed.") as directory:
        for world, threads, single in launches:
            before = load()
            log(f"P = {world}, {threads} thread(s) per process{', and single' if single else ''}:"
                f" launching (load {before:.2f})")
            begun = time.monotonic()
            results = launch(args, world, threads, single, directory, pythonpath)
            after = load()
            for r in results:
                if (r["torch_threads"], r["linrope_threads"]) != (threads, threads):
                    problems.append(f"P = {world} rank {r['rank']} ran {r['torch_threads']} "
                                    f"torch / {r['linrope_threads']} linrope threads")
                for a in r["agreement"]:
                    if not a["relative_error"] < AGREEMENT:
                        problems.append(f"P = {world} rank {r['rank']} {a['map']} n = {a['n']}: "
                                        f"outputs differ from the whole sequence's by "
                                        f"{a['relative_error']:.2e} (relative)")
            rows += attention_rows(results, world, threads, before, after, problems)
            log(f"P = {world}, {threads} thread(s): done in {time.monotonic() - begun:.1f} s "
                f"(load {after:.2f})")
    for row in rows:  # the wrapper's overhead: sequence / single, same P = 1 and threads
        if row["mode"] == "sequence" and row["P"] == 1:
            single = [r for r in rows if r["mode"] == "single" and r["map"] == row["map"]
                      and r["n"] == row["n"] and r["threads"] == row["threads"]]
            if single:
                row["ratio_to_single"] = round(row["median_ms"] / single[0]["median_ms"], 3)
    write_csv(args.out, rows, COLUMNS)
    print_tables(rows, args)
    log(f"wrote {args.out} ({len(rows)} rows) in {time.monotonic() - started:.1f} s")
    if problems:
        for p in problems:
            log("FAILED:", p)
        return 1
    log("bytes counted = the formula on every rank and call; outputs agree")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
