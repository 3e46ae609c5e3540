"""What data parallelism costs per training step: the --full char_lm run (the default model,
batch 16 x 256 characters of Austen) timed in one process without torch.distributed, then under
torchrun (gloo, 127.0.0.1; linrope.torch.launch) with 1 and with 2 processes, one thread each; and
what each rank puts into the collectives per step, counted by the trainer's own
TrainingGroup.traffic: its gradients in the one all-reduce after its backward (4 bytes x
parameters: the prediction beside it; gloo's ring all-reduce sends about 2 (W - 1) / W times that
over the wire) and its pickled share of the per-step exchange. Writes DIR/ddp_cost.csv.

    cd experiments && /usr/bin/python3 -m training.ddp_cost [--out DIR] [--steps N]

This is the one measurement of data parallelism's cost: the trainer's own step, its own
all-reduce. On a 2-core machine two processes share the cores with each other (and with anything
else running): the times say what the synchronisation costs, not what a real cluster gains."""
import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

from linrope.torch import launch

from analysis.common import write_csv  # experiments/analysis

from . import parallel, plans
from .data import load_corpus
from .train import Run
from .variants import from_name

WARMUP = 3  # steps left out of the times: the first allocations and caches
TIMEOUT = 600  # seconds for one measurement's processes
EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLUMNS = ["processes", "distributed", "variant", "batch", "context", "threads", "parameters",
           "steps_timed", "seconds", "tokens_per_s", "allreduce_bytes",
           "predicted_allreduce_bytes", "exchange_bytes", "load_average_before"]


def _config(variant, steps):
    # No evaluation but the final one, which comes after the last timed step; no checkpoints.
    config = plans.Plan("full", ("char_lm",), (from_name(variant),), (0,)).stage("grid")[0]
    return dataclasses.replace(config, steps=steps, eval_every=10 ** 9, log_every=1,
                               extrapolation=(1,), final_eval_tokens=config.context,
                               checkpoint_every=10 ** 9)


def _measure(group, config, corpus):
    """Median seconds per step (after WARMUP, before the last) and, per step, the bytes this
    rank put into the gradients' all-reduce and into the exchange."""
    run = Run(config, corpus, group)
    stamps = []
    run.train(progress=lambda r: stamps.append(time.perf_counter()))
    steps = [b - a for a, b in zip(stamps, stamps[1:])][WARMUP - 1:-1]
    parameters = sum(p.numel() for p in run.model.parameters())
    return dict(seconds=statistics.median(steps), steps_timed=len(steps), parameters=parameters,
                allreduce_bytes=group.traffic["gradients"] / config.steps,
                predicted_allreduce_bytes=4 * parameters if group.distributed else 0,
                exchange_bytes=group.traffic["exchange"] / config.steps)


def _worker(variant, steps, row_path):
    """One rank under torchrun: measures, and rank 0 writes its row to row_path (JSON)."""
    group = parallel.from_environment()
    try:
        row = _measure(group, _config(variant, steps), load_corpus())
        if group.main:
            with open(row_path, "w") as f:
                json.dump(row, f)
    finally:
        group.close()


def _distributed(processes, variant, steps):
    """_worker on `processes` ranks under torchrun; rank 0's row."""
    with tempfile.TemporaryDirectory(prefix="ddp_cost.") as directory:
        row_path = os.path.join(directory, "row.json")
        command = launch.torchrun_command(
            ["-m", "training.ddp_cost", "--variant", variant, "--steps", str(steps),
             "--worker", row_path], processes, launch.free_port())
        [agent] = launch.run_group([command], timeout=TIMEOUT, cwd=EXPERIMENTS,
                                   env=launch.environment(pythonpath=[EXPERIMENTS]))
        if agent.returncode != 0:
            raise SystemExit("ddp_cost: the %d processes failed (exit %d):\n%s" % (
                processes, agent.returncode, agent.output[-3000:]))
        with open(row_path) as f:
            return json.load(f)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python3 -m training.ddp_cost",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/training", help="directory of ddp_cost.csv")
    p.add_argument("--steps", type=int, default=20, help="steps per measurement (default 20)")
    p.add_argument("--variant", default="favor-numerator_only")
    p.add_argument("--worker", metavar="ROW_JSON", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < WARMUP + 2:
        p.error("--steps is %d but expected >= %d" % (args.steps, WARMUP + 2))
    if args.worker:
        _worker(args.variant, args.steps, args.worker)
        return 0
    config = _config(args.variant, args.steps)
    rows = []
    for processes, distributed in ((1, False), (1, True), (2, True)):
        load = os.getloadavg()[0]
        if distributed:
            row = _distributed(processes, args.variant, args.steps)
        else:
            row = _measure(parallel.ONE_PROCESS, config, load_corpus())
        tokens = config.batch_size * config.context
        rows.append(dict(processes=processes, distributed=distributed,
                         variant=config.variant.name, batch=config.batch_size,
                         context=config.context, threads=config.threads,
                         tokens_per_s=tokens / row["seconds"], load_average_before=load, **row))
        sys.stderr.write("ddp_cost: %d process(es)%s: %.1f ms per step; per step and rank, %d "
                         "bytes all-reduced (4 x parameters: %d) and %d bytes of exchange\n" % (
                             processes, " under torchrun" if distributed else "",
                             1e3 * row["seconds"], row["allreduce_bytes"],
                             row["predicted_allreduce_bytes"], row["exchange_bytes"]))
    os.makedirs(args.out, exist_ok=True)
    write_csv(os.path.join(args.out, "ddp_cost.csv"), rows, COLUMNS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
