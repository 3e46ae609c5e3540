"""python3 -m training [--quick | --full] --out DIR [options]: trains small decoders with each
attention variant (RoPE numerator-only against full normalisation, the other placements, softmax)
on character-level English and on associative recall, and writes the measurements to DIR.

DIR/runs.csv, curves.csv, layers.csv, evaluations.csv and step_time.csv hold the measurements and
training.json their metadata; DIR/runs/ keeps each finished run and DIR/checkpoints/ the
unfinished ones (--resume continues them). The analysis, experiments/analysis/report.py, writes
summary.json, the plots and the report section from them. See __init__.py for the pieces."""
import argparse
import dataclasses
import os
import platform
import subprocess
import sys
import time

from . import plans, step_time, sweep
from .model import VARIANTS, describe

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ints(text):
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError("expected integers separated by commas, got %r" % text)
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError("expected seeds >= 0, got %r" % text)
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


def parse(argv):
    p = argparse.ArgumentParser(prog="python3 -m training", description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick",
                      help="a few variants, few steps: the pipeline end to end (default)")
    mode.add_argument("--full", dest="mode", action="store_const", const="full",
                      help="every variant, 3 seeds (char_lm) and 2 (mqar), the whole budget")
    p.add_argument("--out", default="results/training", help="output directory")
    p.add_argument("--text", help="a UTF-8 file for char_lm instead of Jane Austen's novels")
    p.add_argument("--tasks", type=_names(plans.TASKS), default=plans.TASKS)
    p.add_argument("--variants", type=_names(tuple(VARIANTS)))
    p.add_argument("--seeds", type=_ints)
    p.add_argument("--steps", type=int, help="optimiser steps per run (overrides the mode's)")
    p.add_argument("--redraw-interval", type=int, default=0,
                   help="FAVOR+: draw a new W every k training steps (0: never)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="runs trained at once, in separate processes (default: the core count)")
    p.add_argument("--threads", type=int, default=1, help="threads per run (default 1)")
    p.add_argument("--resume", action="store_true",
                   help="keep finished runs and continue unfinished ones from their checkpoints")
    p.add_argument("--no-step-time", action="store_true", help="skip the one-layer step times")
    p.add_argument("--quiet", action="store_true", help="no per-run progress lines")
    p.add_argument("--list-variants", action="store_true")
    args = p.parse_args(argv)
    args.mode = args.mode or "quick"
    for name in ("steps", "jobs", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error("--%s is %d but expected >= 1" % (name, value))
    if args.redraw_interval < 0:
        p.error("--redraw-interval is %d but expected >= 0" % args.redraw_interval)
    return args


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


def metadata(args, argv, started, source, corpus_info):
    import torch
    import linrope
    return dict(
        experiment="training", mode=args.mode,
        command="python3 -m training " + " ".join(_inside_repo(a) for a in argv),
        **source,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        duration_s=time.time() - started, machine=dict(cpu=_cpu(), cores=os.cpu_count()),
        torch=torch.__version__, linrope=linrope.__version__,
        # The installed linrope's commit, -march=native or not, instruction sets, OpenMP, threads.
        linrope_build=linrope.build_info(),
        jobs=args.jobs, threads=args.threads, redraw_interval=args.redraw_interval,
        corpus=corpus_info, model=plans.MODEL,
        plan={k: v for k, v in plans.MODES[args.mode].items() if k != "variants"},
        variants={v: describe(v) for v in (args.variants or plans.MODES[args.mode]["variants"])})


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.list_variants:
        for name in VARIANTS:
            print("%-22s %s" % (name, describe(name)))
        return 0
    started, source = time.time(), source_state()
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        sys.stderr.write("training: --out %s: %s\n" % (args.out, e.strerror or e))
        return 1
    corpus_info = None
    if "char_lm" in args.tasks:
        from .data import load_corpus
        try:
            corpus = load_corpus(args.text)  # extracted into the cache once, before the workers
        except RuntimeError as e:
            sys.stderr.write("training: %s\n" % e)
            return 1
        corpus_info = dict(name=corpus.name, characters=len(corpus.train) + len(corpus.validation),
                           vocabulary=corpus.vocab_size, sha256_16=corpus.digest,
                           validation_characters=len(corpus.validation))
    configs = plans.configs(args.mode, args.tasks, args.variants, args.seeds, args.steps,
                            args.redraw_interval, args.threads)
    configs = [dataclasses.replace(c, text_digest=corpus.digest) if c.task == "char_lm" else c
               for c in configs]
    for config in configs:
        if config.task == "char_lm":
            try:  # the final evaluation's longest window must fit in the validation split
                corpus.validation_windows(max(config.extrapolation) * config.context, 1)
                corpus.batch(0, 0, 1, config.context)
            except ValueError as e:
                sys.stderr.write("training: %s: %s\n" % (args.text or "the text", e))
                return 1
    try:
        results = sweep.run_all(configs, args.out, args.jobs, args.text, args.resume, args.quiet)
        sweep.write_tables(results, args.out)
        if not args.no_step_time:
            step_time.run(args.out, args.mode, plans.MODEL, args.resume, args.quiet)
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
    # Written last: its presence tells the analysis that the CSVs are those of a finished sweep.
    sweep.write_json(os.path.join(args.out, "training.json"),
                     metadata(args, argv, started, source, corpus_info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
