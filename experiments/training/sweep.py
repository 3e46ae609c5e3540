"""Every run of a plan, `jobs` at a time in separate processes (one thread each by default), then
the tables. Each finished run is kept as runs/<key>.json (and a char_lm run's model as
models/<key>.pt, for training.generate); an unfinished one as checkpoints/<key>.pt. With resume=True a run whose file exists with the same configuration is not
run again and an unfinished one continues from its checkpoint; otherwise both are discarded.

Under torchrun (ranks distributed, see parallel.py) there is no process pool: the runs are
trained one after another, each by all the ranks together; rank 0 alone decides which runs are
left (it alone reads and writes the files), and a run that fails stops every rank."""
import concurrent.futures
import csv
import dataclasses
import io
import json
import math
import multiprocessing
import os
import sys
import time

from analysis.common import clean, write_atomic, write_json  # experiments/analysis

from .generate import save_model
from .parallel import SINGLE
from .train import Run

_corpora = {}


class RunsFailed(RuntimeError):
    """Some runs raised (the message names them); the others finished and were saved."""


def _normal(config):
    return json.loads(json.dumps(dataclasses.asdict(config)))


def _paths(out, config):
    return (os.path.join(out, "runs", config.key() + ".json"),
            os.path.join(out, "checkpoints", config.key() + ".pt"))


def _model_path(out, config):
    return os.path.join(out, "models", config.key() + ".pt")


def finished(out, config):
    """The saved result of this configuration's run, or None."""
    path, _ = _paths(out, config)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        result = json.load(f)
    return result if result["config"] == clean(_normal(config)) else None


def _run_one(config, out, text, quiet, ranks=SINGLE):
    """In a worker process, or in every rank together: trains one run (from its checkpoint if
    there is one) and saves it (rank 0)."""
    corpus = None
    if config.task == "char_lm":
        if text not in _corpora:
            from .data import load_corpus
            _corpora[text] = load_corpus(text)
        corpus = _corpora[text]
    result_path, checkpoint = _paths(out, config)
    run = Run(config, corpus, ranks)
    resumed = run.load(checkpoint)
    started = run.step

    def progress(r):
        if quiet or not ranks.main:
            return
        if r.step % max(1, config.steps // 4) and r.step != config.steps:
            return
        sys.stderr.write("  %s: step %d/%d, train loss %.3f\n" % (
            config.key(), r.step, config.steps, r.records["curves"][-1]["train_loss"]))

    summary = run.train(checkpoint=checkpoint, progress=progress)
    if not ranks.main:
        return summary
    if corpus is not None:  # char_lm: the model, for training.generate
        save_model(_model_path(out, config), _normal(config), run.model, corpus.chars)
    write_json(result_path, dict(config=_normal(config), summary=summary,
                                 records={k: v for k, v in run.records.items()
                                          if k not in ("den_totals", "window")},
                                 resumed_from_step=started if resumed else None))
    if os.path.exists(checkpoint):
        os.remove(checkpoint)
    return summary


def _todo(configs, out, resume):
    """The configs to run; without resume, their earlier results and checkpoints are removed."""
    for sub in ("runs", "checkpoints", "models"):
        os.makedirs(os.path.join(out, sub), exist_ok=True)
    todo = []
    for config in configs:
        result_path, checkpoint = _paths(out, config)
        if resume and finished(out, config):
            continue
        if not resume:
            for path in (result_path, checkpoint, _model_path(out, config)):
                if os.path.exists(path):
                    os.remove(path)
        todo.append(config)
    return todo


def _in_pool(todo, out, jobs, text, quiet):
    """(config, its summary or the exception it raised), as the worker processes finish them."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        futures = {pool.submit(_run_one, c, out, text, quiet): c for c in todo}
        for future in concurrent.futures.as_completed(futures):
            yield futures[future], future.exception() or future.result()


def _in_turn(todo, out, text, quiet, ranks):
    """(config, its summary), each run trained by every rank together, one after another. A run
    that raises stops them all: a rank cannot go on to the next run alone."""
    for config in todo:
        try:
            yield config, _run_one(config, out, text, quiet, ranks)
        except Exception as e:
            raise RunsFailed("%s failed: %s: %s; under torchrun every process stops: mend the "
                             "cause and run again with --resume" % (
                                 config.key(), type(e).__name__, _first_line(e))) from e


def _first_line(error):
    return str(error).splitlines()[0] if str(error) else ""


def run_all(configs, out, jobs, text=None, resume=False, quiet=False, ranks=SINGLE):
    """Runs what is not finished; returns the results of every config, in order (on rank 0;
    None on the other ranks)."""
    todo = _todo(configs, out, resume) if ranks.main else None
    todo = ranks.broadcast(todo)
    done = len(configs) - len(todo)
    if ranks.distributed:
        how = "one after another, each on %d processes (torchrun, %s parallel)" % (
            ranks.world_size, ranks.mode)
        runs = _in_turn(todo, out, text, quiet, ranks)
    else:
        how = "in %d processes" % jobs
        runs = _in_pool(todo, out, jobs, text, quiet)
    if ranks.main:
        sys.stderr.write("training: %d runs, %d already finished, %d to run %s\n" % (
            len(configs), done, len(todo), how))
    started, failed = time.time(), []
    for count, (config, summary) in enumerate(runs, 1):
        if isinstance(summary, Exception):  # one line, and the other runs go on
            failed.append(config.key())
            sys.stderr.write("training: %s failed: %s: %s\n" % (
                config.key(), type(summary).__name__, _first_line(summary)))
            continue
        elapsed = time.time() - started
        left = elapsed / count * (len(todo) - count)
        if ranks.main:
            sys.stderr.write("training: [%d/%d] %s %s in %.0f s; %.0f s elapsed, ~%.0f s left\n"
                             % (done + count, len(configs), config.key(), summary["status"],
                                summary["train_seconds"], elapsed, left))
    if failed:
        raise RunsFailed("%d run(s) failed (%s); the finished ones are kept: mend the cause and "
                         "run again with --resume" % (len(failed), ", ".join(failed)))
    return [finished(out, c) for c in configs] if ranks.main else None


def _csv(rows, columns):
    text = io.StringIO()
    writer = csv.DictWriter(text, columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if v is None or (isinstance(v, float) and math.isnan(v)) else v)
                         for k, v in row.items()})
    return text.getvalue()


# What tells one run from another in the tables: the cell (task, context, variant, FAVOR+'s
# features, redraws, learning rate) and the seed.
IDS = ("task", "context", "variant", "feature_factor", "redraw_interval", "lr", "seed")


def write_tables(results, out):
    """runs.csv (one row per run), curves.csv, layers.csv and evaluations.csv (per step)."""
    runs, curves, layers, evaluations = [], [], [], []
    for result in results:
        ids = {k: result["config"][k] for k in IDS}
        runs.append(dict(ids, **result["summary"]))
        curves += [dict(ids, **row) for row in result["records"]["curves"]]
        layers += [dict(ids, **row) for row in result["records"]["layers"]]
        evaluations += [dict(ids, **row) for row in result["records"]["evaluations"]]
    run_columns = list(dict.fromkeys(list(IDS) + ["status"] + [k for r in runs for k in r]))
    ids = list(IDS)
    tables = dict(
        runs=(runs, run_columns),
        curves=(curves, ids + ["step", "train_loss", "scheduled_lr", "grad_norm", "clipped_so_far"]),
        layers=(layers, ids + ["step", "layer", "den_min", "nonpositive_share", "tiny_share",
                               "grad_norm"]),
        evaluations=(evaluations, ids + ["step", "final", "length", "pairs", "metric", "value"]))
    for name, (rows, columns) in tables.items():
        write_atomic(os.path.join(out, name + ".csv"), _csv(rows, columns))
