"""Every run of a plan, `jobs` at a time in separate processes (one thread each by default). Each
finished run is kept as runs/<key>.json (and a char_lm run's model as models/<key>.pt, for
training.generate); an unfinished one as checkpoints/<key>.pt. With resume=True a run whose file
exists with the same configuration is not run again and an unfinished one continues from its
checkpoint; otherwise both are discarded. The finished runs come back as results.Result (whose
write_tables writes the tables).

Under torchrun (the group distributed, see parallel.py) there is no process pool: the runs are
trained one after another, each by all the ranks together; rank 0 alone decides which runs are
left (it alone reads and writes the files), and a run that fails stops every rank."""
import concurrent.futures
import ctypes
import dataclasses
import json
import multiprocessing
import os
import signal
import sys
import time

from analysis.common import clean, write_json  # experiments/analysis

from .generate import save_model
from .parallel import ONE_PROCESS
from .results import from_saved
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
    """The saved result (results.Result) of this configuration's run, or None."""
    path, _ = _paths(out, config)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        saved = json.load(f)
    return from_saved(saved) if saved["config"] == clean(_normal(config)) else None


def _run_one(config, out, text, quiet, group=ONE_PROCESS, hooks=None):
    """In a worker process, or in every rank together: trains one run (from its checkpoint if
    there is one) and saves it (rank 0)."""
    corpus = None
    if config.task == "char_lm":
        if text not in _corpora:
            from .data import load_corpus
            _corpora[text] = load_corpus(text)
        corpus = _corpora[text]
    result_path, checkpoint = _paths(out, config)
    run = Run(config, corpus, group, hooks)
    resumed = run.load(checkpoint)
    started = run.step

    def progress(r):
        if quiet or not group.main:
            return
        if r.step % max(1, config.steps // 4) and r.step != config.steps:
            return
        sys.stderr.write("  %s: step %d/%d, train loss %.3f\n" % (
            config.key(), r.step, config.steps, r.records["curves"][-1]["train_loss"]))

    summary = run.train(checkpoint=checkpoint, progress=progress)
    if not group.main:
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


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent):
    """A pool worker's initializer: the worker is sent SIGTERM when `parent`, the process that
    started it, ends. Without it a killed command's workers went on training the runs already
    queued to them (up to jobs + 1), beside the next command that resumed the same runs (seen
    2026-11-28: their checkpoints coincide, as training is deterministic, but each step's time
    doubled). Linux only; elsewhere a no-op."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it ended before the signal was asked for
        os._exit(1)


def new_pool(jobs):
    """`jobs` spawned worker processes (started at the first run given them), which can train
    the runs of several run_all calls: each keeps its corpus loaded, and ends with this process."""
    return concurrent.futures.ProcessPoolExecutor(
        jobs, mp_context=multiprocessing.get_context("spawn"), initializer=die_with_parent,
        initargs=(os.getpid(),))


def _in_pool(todo, out, pool, text, quiet, hooks):
    """(config, its summary or the exception it raised), as the pool finishes them."""
    futures = {pool.submit(_run_one, c, out, text, quiet, ONE_PROCESS, hooks): c for c in todo}
    for future in concurrent.futures.as_completed(futures):
        yield futures[future], future.exception() or future.result()


def _in_turn(todo, out, text, quiet, group, hooks):
    """(config, its summary), each run trained by every rank together, one after another. A run
    that raises stops them all: a rank cannot go on to the next run alone."""
    for config in todo:
        try:
            yield config, _run_one(config, out, text, quiet, group, hooks)
        except Exception as e:
            raise RunsFailed("%s failed: %s: %s; under torchrun every process stops: mend the "
                             "cause and run again with --resume" % (
                                 config.key(), type(e).__name__, _first_line(e))) from e


def _first_line(error):
    return str(error).splitlines()[0] if str(error) else ""


def run_all(configs, out, jobs, text=None, resume=False, quiet=False, group=ONE_PROCESS,
            pool=None, hooks=None):
    """Runs what is not finished; returns the results.Result of every config, in order (on rank 0;
    None on the other ranks). pool: the concurrent.futures.Executor to train the runs in, left
    running for the caller (None: `jobs` spawned processes, shut down at the end; not under
    torchrun, where the ranks train each run together); hooks: a test's train.RunHooks, for every
    run."""
    todo = _todo(configs, out, resume) if group.main else None
    todo = group.broadcast(todo)
    done = len(configs) - len(todo)
    own = pool is None and not group.distributed
    if group.distributed:
        how = "one after another, each on %d processes (torchrun, %s parallel)" % (
            group.world_size, group.mode)
        runs = _in_turn(todo, out, text, quiet, group, hooks)
    else:
        how = "in %d processes" % jobs
        pool = pool or new_pool(jobs)
        runs = _in_pool(todo, out, pool, text, quiet, hooks)
    try:
        return _follow(runs, configs, todo, done, how, out, group)
    finally:
        if own:
            pool.shutdown()


def _follow(runs, configs, todo, done, how, out, group):
    """run_all's progress lines as the runs finish; the results, or RunsFailed."""
    if group.main:
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
        if group.main:
            sys.stderr.write("training: [%d/%d] %s %s in %.0f s; %.0f s elapsed, ~%.0f s left\n"
                             % (done + count, len(configs), config.key(), summary["status"],
                                summary["train_seconds"], elapsed, left))
    if failed:
        raise RunsFailed("%d run(s) failed (%s); the finished ones are kept: mend the cause and "
                         "run again with --resume" % (len(failed), ", ".join(failed)))
    return [finished(out, c) for c in configs] if group.main else None
