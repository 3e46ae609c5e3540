"""python3 -m training [--quick | --full] --out DIR [options]: trains small decoders with each
attention variant (RoPE numerator-only against full normalisation, the other placements, without
a denominator, with a decay or a short convolution, softmax) on character-level English and on
associative recall, and writes the measurements to DIR.

The plan (plans.py) runs in stages, each chosen from the results of those before it; --stages
trains some of them and reads the others' finished runs from DIR, so the study can be run stage
by stage, and --plan prints every run and what it will cost before anything runs. Before each
stage a line estimates its time. After each stage DIR/runs.csv, curves.csv, layers.csv,
evaluations.csv hold every finished run and training.json their metadata, with the stages done
so far: each stage's results can be analysed on their own. DIR/runs/ keeps each finished run and
DIR/checkpoints/ the unfinished ones (--resume continues them). The analysis,
experiments/analysis/report.py, writes summary.json, the plots and the report section from them.
See __init__.py for the pieces.

Data parallel, on one machine or several (see experiments/README.md):

    /usr/bin/python3 -m torch.distributed.run --redirects 1 --tee 1 --nproc_per_node 2 \
        -m training [options]

(--redirects 1 --tee 1: without them torch 1.13's torchrun fails at start under Python 3.11.)

Every process takes its share of each global batch (a plan's batch must divide by the process
count) and after each backward the processes average their gradients in one all-reduce (gloo):
the numbers are the single process's, to float32 rounding. The runs are then trained one after
another, all processes together (no --jobs); rank 0 alone writes. Threads per process: --threads
(default 1).

Sequence parallel: the same command with --sequence-parallel. Every process then holds the whole
global batch, each sequence cut along its length into one contiguous slice per process (n/W
positions, rounded either way), and each attention layer's causal linear attention continues
across the processes from the earlier slices' states (linrope.torch.distributed): the numbers
are again the single process's, to float32 rounding. Linear attention variants only (softmax
needs every earlier key), and under torchrun only."""
import argparse
import json
import os
import platform
import subprocess
import sys
import time

from . import budget, decoding, parallel, plans, stages, step_time, sweep
from .model import sequence_parallel_problem
from .mqar import check as mqar_check, parse_settings
from .results import write_tables
from .train import Config
from .variants import CATALOGUE, from_name

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ints(text):
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError("expected integers separated by commas, got %r" % text)
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError("expected seeds >= 0, got %r" % text)
    return values


def _rates(text):
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError("expected numbers separated by commas, got %r" % text)
    if not all(0 < v < 1 for v in values):
        raise argparse.ArgumentTypeError("expected learning rates in (0, 1), got %r" % text)
    return values


def _names(allowed):
    def parse(text):
        names = tuple(text.split(","))
        unknown = [n for n in names if n not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError("unknown %s; expected some of %s" % (
                ", ".join(unknown), ", ".join(allowed)))
        return names
    return parse


def _variants(text):
    try:
        return tuple(from_name(name) for name in text.split(","))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))


def _mqar_settings(text):
    """'64x4,128x8': two runs' settings, each trained on its own; '64x4+128x8': one run's,
    trained in turn."""
    try:
        settings = tuple(parse_settings(part) for part in text.split(","))
        if not all(settings):
            raise ValueError("expected LENGTHxPAIRS settings separated by commas, e.g. "
                             "64x4,128x8; got %r" % text)
        for length, pairs in (pair for run in settings for pair in run):
            mqar_check(Config.mqar_vocab, length, pairs)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))
    return settings


def parse(argv, plan_seams=None):
    p = argparse.ArgumentParser(prog="python3 -m training", description=__doc__.split("\n\n")[0],
                                epilog="Under torchrun (python3 -m torch.distributed.run "
                                "--redirects 1 --tee 1 --nproc_per_node N -m training ...; the "
                                "two flags work around torch 1.13 on Python 3.11) each run is "
                                "trained by all N processes together, one run after another: "
                                "data parallel (N must divide the plans' batches) or, with "
                                "--sequence-parallel, each sequence cut along its length over "
                                "them (linear variants only); rank 0 alone writes. See "
                                "experiments/README.md for the commands on several machines and "
                                "what travels between the processes.")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick",
                      help="a few variants, few steps: the pipeline end to end (default)")
    mode.add_argument("--full", dest="mode", action="store_const", const="full",
                      help="the study: its variants, 3 seeds (char_lm) and 2 (mqar), the whole "
                      "budget (--plan lists it)")
    p.add_argument("--out", default="results/training", help="output directory")
    p.add_argument("--text", help="a UTF-8 file for char_lm instead of Jane Austen's novels")
    p.add_argument("--tasks", type=_names(plans.TASKS), default=plans.TASKS)
    p.add_argument("--variants", type=_variants,
                   help="variants by name, e.g. softmax-rope,favor-full-conv4 (--list-variants)")
    p.add_argument("--seeds", type=_ints)
    p.add_argument("--steps", type=int, help="optimiser steps per run (overrides the mode's)")
    p.add_argument("--lrs", type=_rates,
                   help="every task's learning-rate grid, e.g. 1e-3,3e-3 (overrides the mode's)")
    p.add_argument("--mqar-settings", type=_mqar_settings,
                   help="MQAR's (length, pairs) settings instead of the mode's, each trained on "
                   "its own, e.g. 64x4 or 64x4,128x8 ('+' joins settings one run trains in "
                   "turn: 64x4+128x8)")
    p.add_argument("--stages", type=_names(plans.STAGES), default=plans.STAGES,
                   help="which of the plan's stages to train (default all: %s); the others' "
                   "finished runs are read from --out" % ",".join(plans.STAGES))
    p.add_argument("--plan", action="store_true",
                   help="print every run of the plan, its budget and estimated time, and exit")
    p.add_argument("--redraw-interval", type=int, default=0,
                   help="FAVOR+: draw a new W every k training steps (0: never)")
    p.add_argument("--jobs", type=int,
                   help="runs trained at once, in separate processes (default: the core count; "
                   "not under torchrun)")
    p.add_argument("--threads", type=int, default=1,
                   help="threads per run, per process under torchrun (default 1)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="under torchrun: split each sequence along its length over the "
                   "processes (every process holds the whole batch; the attention layers "
                   "exchange states) instead of splitting the batch; linear variants only")
    p.add_argument("--resume", action="store_true",
                   help="keep finished runs and continue unfinished ones from their checkpoints")
    p.add_argument("--no-step-time", action="store_true", help="skip the one-layer step times")
    p.add_argument("--no-decode", action="store_true",
                   help="skip decoding the trained models (decode.csv, samples.json)")
    p.add_argument("--quiet", action="store_true", help="no per-run progress lines")
    p.add_argument("--list-variants", action="store_true",
                   help="the catalogue's variants and how to name others")
    args = p.parse_args(argv)
    args.mode = args.mode or "quick"
    for name in ("steps", "jobs", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error("--%s is %d but expected >= 1" % (name, value))
    if args.redraw_interval < 0:
        p.error("--redraw-interval is %d but expected >= 0" % args.redraw_interval)
    if args.sequence_parallel and not (args.list_variants or args.plan):
        _check_sequence_parallel(p, args, plan_seams)
    if parallel.under_torchrun():
        if args.jobs is not None:
            p.error("--jobs does not apply under torchrun: its processes train each run "
                    "together, one run after another")
        args.jobs = 1
    args.jobs = args.jobs or os.cpu_count() or 1
    return args


def _check_sequence_parallel(p, args, plan_seams):
    """Exits (status 2) with one line if --sequence-parallel cannot apply: every rank parses the
    same command line, so every rank stops here alike, before any joins the process group."""
    def refuse(message):
        p.exit(2, "%s: error: --sequence-parallel %s\n" % (p.prog, message))
    if not parallel.under_torchrun():
        refuse("splits each sequence over torchrun's processes: run it under python3 -m "
               "torch.distributed.run (see --help)")
    plan = _plan(args, plan_seams)
    for task in plan.tasks:
        model = plan.model_of(task)
        for variant in plan.all_variants((task,)):
            problem = sequence_parallel_problem(variant, model["d_model"], model["heads"])
            if problem:
                refuse("cannot train %s: %s; choose other variants with --variants" % (
                    variant.name, problem))


def _git(*command):
    try:
        return subprocess.run(["git", "-C", REPO, *command], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _cpu():
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def _inside_repo(arg):
    """A path in the repository as a path from its root (the command reads the same anywhere)."""
    if os.path.isabs(arg) and arg.startswith(REPO + os.sep):
        return os.path.relpath(arg, REPO)
    return arg


def source_state():
    """The commit and whether tracked files differed from it, read when the run starts."""
    return dict(git_commit=_git("rev-parse", "HEAD"),
                git_dirty=bool(_git("status", "--porcelain", "--untracked-files=no")))


def metadata(args, argv, plan, started, source, corpus_info, processes=1, parallel_mode=None):
    import torch
    import linrope
    launcher = "python3 -m torch.distributed.run (%d processes) " % processes if processes > 1 \
        else ""
    return dict(
        experiment="training", mode=args.mode,
        command=launcher + "python3 -m training " + " ".join(_inside_repo(a) for a in argv),
        **source,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        duration_s=time.time() - started, machine=dict(cpu=_cpu(), cores=os.cpu_count()),
        torch=torch.__version__, linrope=linrope.__version__,
        # The installed linrope's commit, -march=native or not, instruction sets, OpenMP, threads.
        linrope_build=linrope.build_info(),
        jobs=args.jobs, threads=args.threads, processes=processes,
        # Under torchrun, how the processes share each batch: "data" (its sequences) or
        # "sequence" (each sequence's positions); None in one process outside torchrun.
        parallel=parallel_mode,
        redraw_interval=args.redraw_interval,
        corpus=corpus_info, model=plan.model_of("char_lm"), mqar_model=plan.model_of("mqar"),
        # The plan's settings, each Variant in them by its name.
        plan=dict(json.loads(json.dumps(plan.settings, default=lambda v: v.name)),
                  stages=plan.stage_names(), lrs=plan.rates(), mqar_lrs=plan.rates("mqar"),
                  mqar_settings=plan.mqar_setting_list()),
        variants={v.name: v.describe() for v in plan.all_variants()})


def _make_out(out):
    """None if the output directory exists or could be made, else the one-line complaint."""
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        return "--out %s: %s" % (out, e.strerror or e)
    return None


def _load(args):
    """The corpus (None without char_lm) and its description for training.json."""
    if "char_lm" not in args.tasks:
        return None, None
    from .data import load_corpus
    corpus = load_corpus(args.text)  # extracted into the cache once, before the workers
    return corpus, dict(name=corpus.name, characters=len(corpus.train) + len(corpus.validation),
                        vocabulary=corpus.vocab_size, sha256_16=corpus.digest,
                        validation_characters=len(corpus.validation))


def plan_problem(configs, corpus, text, sequence_parallel, processes):
    """None if every run can be trained on the corpus (char_lm; read from the file `text`, None:
    Austen) by `processes` ranks, data or sequence parallel, else the one-line complaint (the same
    on every rank, which all stop on it: no rank is left waiting for another)."""
    for config in configs:
        if sequence_parallel:  # each sequence over the processes, at least a token each
            length = config.context if config.task == "char_lm" else \
                min(n for n, _ in config.mqar_settings)
            problem = parallel.split_problem(length, processes)
            if problem:
                return "%s (%s): use at most %d processes" % (problem, config.task, length)
        elif config.batch_size % processes:
            return ("the %s batch of %d sequences does not split over %d processes: use a process "
                    "count that divides it" % (config.task, config.batch_size, processes))
        if config.task == "char_lm":
            try:  # the final evaluation's longest window must fit in the validation split
                corpus.validation_windows(max(config.extrapolation) * config.context, 1)
                corpus.batch(0, 0, 1, config.context)
            except ValueError as e:
                return "%s: %s" % (text or "the text", e)
    return None


def main(argv=None, *, hooks=None, modes=None, model=None):
    """The command line. hooks (train.RunHooks), modes and model (plans.Plan's): the seams of the
    tests under torchrun (tests/torchrun_entry.py), which train tiny plans and inject faults into
    the runs inside each process; a run from the command line passes none."""
    argv = sys.argv[1:] if argv is None else argv
    plan_seams = dict(modes=modes, model=model)
    args = parse(argv, plan_seams)
    if args.list_variants:
        _list_variants()
        return 0
    if args.plan:
        sys.stdout.write(budget.plan_text(_plan(args, plan_seams), args.jobs,
                                          "python3 -m training " + " ".join(argv)))
        return 0
    try:
        group = parallel.from_environment(args.sequence_parallel)
    except (RuntimeError, ValueError) as e:
        sys.stderr.write("training: could not join torchrun's process group: %s\n" %
                         str(e).splitlines()[0])
        return 1
    try:
        return _train(args, argv, group, _plan(args, plan_seams), hooks)
    finally:
        group.close()


def _list_variants():
    print("The catalogue's variants:\n")
    for variant in CATALOGUE:
        print("  %-28s %s" % (variant.name, variant.describe()))
    others = [v for v in plans.Plan("full").all_variants() if v not in CATALOGUE]
    print("\nThe --full plan's others (with a decay, a short convolution or more features):\n")
    for variant in others:
        print("  %-28s %s" % (variant.name, variant.describe()))
    print("\nAny catalogue variant, followed by any of these in this order, is a variant too:\n"
          "  -m<f>x          FAVOR+ with f x head dim random features (default 2)\n"
          "  -redraw<k>      FAVOR+ with a new W every k training steps\n"
          "  -decay<gamma>   linear attention whose state decays by gamma in (0, 1) per step,\n"
          "  or -retnet      or by RetNet's gamma_h = 1 - 2^(-5-h) per head h\n"
          "  -conv<w>        a causal depthwise convolution of width w on q, k and v\n"
          "e.g. favor-numerator_only-m4x, elu-nodenom-retnet-conv4.")


def _plan(args, plan_seams=None):
    """The plan the command line asks for; plan_seams: main's modes and model."""
    return plans.Plan(args.mode, args.tasks, args.variants, args.seeds, args.steps,
                      args.redraw_interval, args.threads, args.lrs, args.stages,
                      mqar_settings=args.mqar_settings, **(plan_seams or {}))


def _train(args, argv, group, plan, hooks):
    started, source = time.time(), source_state()
    # Rank 0 alone writes; its verdict on --out reaches every rank, which all stop on a bad one.
    problem = group.broadcast(_make_out(args.out) if group.main else None)
    if problem is None:
        try:
            corpus, corpus_info = _load(args)
        except RuntimeError as e:
            problem = str(e)
    if problem is None:
        problem = plan_problem(stages.with_text(plan.preview(), corpus), corpus, args.text,
                               args.sequence_parallel, group.world_size)
    if problem is not None:
        sys.stderr.write("training: %s\n" % problem)
        return 1
    log = _stage_log(args.out, args.mode)

    def after_stage(progress):
        # Each stage's tables and metadata as soon as it is done: analysable on their own.
        write_tables(progress.results, args.out)
        _write_metadata(args, argv, plan, started, source, corpus_info, group, progress, log)

    # One set of worker processes for every stage (each start imports torch and loads the text).
    pool = None if group.distributed else sweep.new_pool(args.jobs)

    def train(configs):
        return sweep.run_all(configs, args.out, args.jobs, args.text, args.resume, args.quiet,
                             group, pool=pool, hooks=hooks)

    try:
        try:
            progress = stages.run(plan, args.out, corpus, train, args.jobs, group, after_stage,
                                  args.resume)
        finally:
            if pool is not None:
                pool.shutdown()
        if not group.main:
            return 0
        write_tables(progress.results, args.out)
        if not args.no_step_time:
            step_time.run(args.out, plan.settings["step_time"], plan.model_of("char_lm"),
                          args.resume, args.quiet)
        if not args.no_decode:
            decoding.run(args.out, progress.results, args.quiet,
                         words=corpus.words() if corpus else None)
    except sweep.RunsFailed as e:
        sys.stderr.write("training: %s\n" % e)
        return 1
    except OSError as e:
        sys.stderr.write("training: %s\n" % e)
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("training: interrupted; finished runs and checkpoints are kept: run the "
                         "same command with --resume to go on\n")
        return 130
    # Written last too: its presence tells the analysis that the CSVs are those of finished
    # stages (stages_done says which).
    _write_metadata(args, argv, plan, started, source, corpus_info, group, progress, log)
    return 0


def _stage_log(out, mode):
    """The stage log of an earlier training.json of the same mode in out (each stage: the
    command, commit and date that trained it), or {}."""
    path = os.path.join(out, "training.json")
    try:
        with open(path) as f:
            earlier = json.load(f)
    except (OSError, ValueError):
        return {}
    return earlier.get("stage_log", {}) if earlier.get("mode") == mode else {}


def _write_metadata(args, argv, plan, started, source, corpus_info, group, progress, log):
    meta = metadata(args, argv, plan, started, source, corpus_info, group.world_size, group.mode)
    for name in progress.trained:  # this command trained them, on this commit
        log[name] = dict(command=meta["command"], date=meta["date"],
                         git_commit=meta["git_commit"], git_dirty=meta["git_dirty"])
    meta.update(stages_done=progress.done, stage_log=log,
                run_seconds=sum(r.summary.get("wall_seconds") or r.summary.get("train_seconds")
                                or 0.0 for r in progress.results))
    sweep.write_json(os.path.join(args.out, "training.json"), meta)


if __name__ == "__main__":
    sys.exit(main())
