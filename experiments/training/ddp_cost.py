"""What data parallelism costs per training step: the --full char_lm run (the default model,
batch 16 x 256 characters of Austen) timed in one process without torch.distributed, then under
DistributedDataParallel on gloo (127.0.0.1) with 1 and with 2 processes, one thread each; and
what each rank puts into the collectives per step: the gradient buckets it all-reduces (their
bytes, counted in DDP's hook; gloo's ring all-reduce sends about 2 (W - 1) / W times that over
the wire) and its pickled share of the trainer's per-step exchange. Writes DIR/ddp_cost.csv.

    cd experiments && /usr/bin/python3 -m training.ddp_cost [--out DIR] [--steps N]

On a 2-core machine two processes share the cores with each other (and with anything else
running): the times say what the synchronisation costs, not what a real cluster gains."""
import argparse
import dataclasses
import os
import pickle
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing

from analysis.common import write_atomic  # experiments/analysis

from . import parallel, plans
from .data import load_corpus
from .sweep import _csv
from .train import Run

WARMUP = 3  # steps left out of the times: first allocations, DDP's bucket rebuild at step 2
TIMEOUT = 600  # seconds for one measurement's processes


def _config(variant, steps):
    # No evaluation but the final one, which comes after the last timed step; no checkpoints.
    config = plans.Plan("full", ("char_lm",), (variant,), (0,)).stage("grid")[0]
    return dataclasses.replace(config, steps=steps, eval_every=10 ** 9, log_every=1,
                               extrapolation=(1,), final_eval_tokens=config.context,
                               checkpoint_every=10 ** 9)


def _measure(ranks, config, corpus):
    """Median seconds per step (after WARMUP, before the last) and, per step, the bytes of the
    gradient buckets this rank all-reduced, their count, and its pickled share of the exchange."""
    sent = dict(allreduce_bytes=0, buckets=0, exchange_bytes=0)
    real_hook, real_gather = parallel._all_reduce, ranks.gather

    def hook(state, bucket):
        sent["allreduce_bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
        sent["buckets"] += 1
        return real_hook(state, bucket)

    def gather(value):
        sent["exchange_bytes"] += len(pickle.dumps(value)) if ranks.distributed else 0
        return real_gather(value)

    parallel._all_reduce, ranks.gather = hook, gather
    try:
        run = Run(config, corpus, ranks)
        stamps = []
        run.train(progress=lambda r: stamps.append(time.perf_counter()))
    finally:
        parallel._all_reduce = real_hook
        del ranks.gather  # the method again
    steps = [b - a for a, b in zip(stamps, stamps[1:])][WARMUP - 1:-1]
    return dict(seconds=statistics.median(steps), steps_timed=len(steps),
                **{k: v / config.steps for k, v in sent.items()},
                parameters=sum(p.numel() for p in run.model.parameters()))


def _worker(rank, world_size, port, config, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    ranks = parallel.Ranks(rank, world_size, distributed=True)
    try:
        row = _measure(ranks, config, load_corpus())
        if ranks.main:
            results.put(row)
    finally:
        ranks.close()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _distributed(world_size, config):
    """Runs _worker in world_size spawned processes; kills them all after TIMEOUT."""
    context = torch.multiprocessing.get_context("spawn")
    results = context.SimpleQueue()
    processes = torch.multiprocessing.start_processes(
        _worker, args=(world_size, _free_port(), config, results), nprocs=world_size,
        join=False, start_method="spawn")
    deadline = time.time() + TIMEOUT
    try:
        while not processes.join(timeout=5):
            if time.time() > deadline:
                raise RuntimeError("the %d processes did not finish in %d s" %
                                   (world_size, TIMEOUT))
    finally:
        for process in processes.processes:
            if process.is_alive():
                process.kill()
    return results.get()


def main(argv=None):
    p = argparse.ArgumentParser(prog="python3 -m training.ddp_cost",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/training", help="directory of ddp_cost.csv")
    p.add_argument("--steps", type=int, default=20, help="steps per measurement (default 20)")
    p.add_argument("--variant", default="favor-numerator_only")
    args = p.parse_args(argv)
    if args.steps < WARMUP + 2:
        p.error("--steps is %d but expected >= %d" % (args.steps, WARMUP + 2))
    config = _config(args.variant, args.steps)
    rows = []
    for processes, distributed in ((1, False), (1, True), (2, True)):
        load = os.getloadavg()[0]
        if distributed:
            row = _distributed(processes, config)
        else:
            row = _measure(parallel.SINGLE, config, load_corpus())
        tokens = config.batch_size * config.context
        rows.append(dict(processes=processes, ddp=distributed, variant=config.variant,
                         batch=config.batch_size, context=config.context, threads=config.threads,
                         tokens_per_s=tokens / row["seconds"], load_average_before=load, **row))
        sys.stderr.write("ddp_cost: %d process(es)%s: %.1f ms per step; per step and rank, %d "
                         "bytes all-reduced in %g bucket(s) and %d bytes of exchange\n" % (
                             processes, ", DDP" if distributed else "", 1e3 * row["seconds"],
                             row["allreduce_bytes"], row["buckets"], row["exchange_bytes"]))
    os.makedirs(args.out, exist_ok=True)
    write_atomic(os.path.join(args.out, "ddp_cost.csv"), _csv(rows, [
        "processes", "ddp", "variant", "batch", "context", "threads", "parameters",
        "steps_timed", "seconds", "tokens_per_s", "allreduce_bytes", "buckets", "exchange_bytes",
        "load_average_before"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
