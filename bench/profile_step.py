#!/usr/bin/python3
"""The study's training step, timed and profiled (issue 39): experiments/training's own Run (its
Decoder, loss, backward, clipping and AdamW; train.Run.train) with its evaluation left out, for
each variant and shape asked for, and the evaluation timed on its own. The steps are taken as a
long run takes them: in one train() call per batch of steps (stop_after), of a schedule so long
that no step is its last (which logs and summarises), one step in 10 logged (log_every), each
timed at its end (train.RunHooks.stepped) from the end of the one before, or, the first of a
call, from the call.

A case is a variant at one shape: char_lm at a context (batch = --tokens / context: 16 x 256 and
4 x 1024, as the plans use), or MQAR at one (length, pairs) setting trained on its own (batch
--mqar-batch). The model is the plan's (plans.MODEL, plans.MQAR_MODEL) unless --d-model,
--layers, --heads say otherwise. Per case:
  * tokens/s of a training step: every case warmed up (--warm-up steps), then --rounds rounds,
    each running --steps steps of every case in turn (interleaved: a slower minute of the shared
    machine slows one round of each case), each step timed in wall and in CPU time
    (time.process_time: what this process ran, which other work on a shared machine does not add
    to at one thread); the median step and the range of the rounds' medians, and the tokens/s of
    the mean step (slow steps included: what a long run gets; with several cases, the first step
    after a switch of case carries some of the switch's cost, page faults say);
  * tokens/s of the evaluation (validation_bpc over --eval-tokens characters at the context; MQAR:
    mqar_accuracy over its test set) and the time to draw a batch (train.Run.batch);
  * with --profile, where a step's time goes (breakdown()): torch.profiler over --steps more
    steps, each event's self time put in one of CATEGORIES (category(): the model's forward, the
    attention layers, the data and the clipping marked by record_function ranges around them,
    AdamW by torch's own, each backward node placed with the forward operator that made it, by
    its sequence number). The profiler's times serve as weights only: Python and the framework
    are the CPU time of a step at batch 1 x 16 (fixed_cost_ms), the data the batch's own time,
    and the operators share the rest of the unprofiled CPU step.

--compare BEFORE AFTER (two PYTHONPATHs, each the linrope package and the experiments directory of
one checkout, joined by ':') runs this script on each in turn, --rounds times alternated; it
prints each side's median tokens/s over the rounds and the ratio after / before per round.

  cd /tmp && PYTHONPATH=<tree>/build/release/python:<tree>/experiments \\
      /usr/bin/python3 <tree>/bench/profile_step.py --contexts 256,1024 --profile
  ... profile_step.py --task mqar --settings 64:4,128:8,256:16
  /usr/bin/python3 bench/profile_step.py --compare <before path> <after path> --rounds 3
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = "softmax-rope,elu-numerator_only,favor-numerator_only"
MARK = "profile_step: "  # the record_function ranges this script puts around parts of a step
ATTENTION_MARK, DATA_MARK, CLIP_MARK = MARK + "attention", MARK + "data", MARK + "clipping"
FORWARD_MARK, LINEAR_MARK = MARK + "forward", MARK + "linrope.torch.Linear"
GEMMS = ("aten::linear", "aten::addmm", "aten::mm", "aten::bmm", "aten::matmul", LINEAR_MARK)
# linrope.torch.Linear's node is its autograd Function's: _LinearBackward.
GEMM_NODES = ("AddmmBackward0", "MmBackward0", "BmmBackward0", "_LinearBackward")
ENGINE = "autograd::engine::evaluate_function: "
CATEGORIES = ("linrope attention forward", "linrope attention backward",
              "projections, MLP and output (GEMMs, forward and backward)",
              "GELU (forward and backward)",
              "other forward ops (norms, residuals, embedding, loss)",
              "other backward ops", "gradient clipping", "optimiser", "data (drawing the batch)",
              "Python and framework (no operator)")
FORWARD_TO_BACKWARD = {"linrope attention forward": "linrope attention backward",
                       "other forward ops (norms, residuals, embedding, loss)":
                       "other backward ops"}


def forward_category(chain):
    """The category of an event outside the backward, `chain` its enclosing events' names,
    outermost first, then its own."""
    if any(name.startswith("Optimizer.") for name in chain):
        return "optimiser"
    if CLIP_MARK in chain:
        return "gradient clipping"
    if DATA_MARK in chain:
        return "data (drawing the batch)"
    if any(name in GEMMS for name in chain):
        return "projections, MLP and output (GEMMs, forward and backward)"
    if ATTENTION_MARK in chain:
        return "linrope attention forward"
    if "aten::gelu" in chain or "_GELU" in chain:  # nn.GELU's operator, linrope.torch.GELU's
        return "GELU (forward and backward)"
    return "other forward ops (norms, residuals, embedding, loss)"


def category(chain, node, forward_of):
    """The category of an event: `chain` as in forward_category; `node` the backward node it
    runs in (the event under the engine's evaluate_function), None outside the backward;
    forward_of: {sequence number: forward category} of the step's forward operators."""
    if chain[-1] == LINEAR_MARK:  # linrope.matmul is no operator: its time is the range's own
        return "projections, MLP and output (GEMMs, forward and backward)"
    if chain[-1].startswith(MARK):
        return "Python and framework (no operator)"  # a range's own time: the Python in it
    if node is None:
        return forward_category(chain)
    name = node.name[len(ENGINE):] if node.name.startswith(ENGINE) else node.name
    if name in GEMM_NODES:
        return "projections, MLP and output (GEMMs, forward and backward)"
    if name.startswith("GeluBackward") or name == "_GELUBackward":
        return "GELU (forward and backward)"
    made_by = forward_of.get(node.sequence_nr)
    return FORWARD_TO_BACKWARD.get(made_by, made_by or "other backward ops")


def ranges_around(run):
    """Puts record_function ranges around the model's forward, each attention layer's, each
    linrope.torch.Linear's, the data and the clipping (this script's own seams: instance
    attributes, a module's hooks, torch's function as train.py looks it up); returns what undoes
    them."""
    import torch
    from torch.autograd.profiler import record_function

    import linrope.torch as lt
    open_ranges, undo = [], []

    def entering(mark):
        def enter(*_):
            open_ranges.append(record_function(mark))
            open_ranges[-1].__enter__()
        return enter

    def leave(*_):
        open_ranges.pop().__exit__(None, None, None)

    marked_modules = [(block.attention, ATTENTION_MARK) for block in run.model.blocks]
    marked_modules += [(m, LINEAR_MARK) for m in run.model.modules() if isinstance(m, lt.Linear)]
    for module, mark in marked_modules:
        undo += [module.register_forward_pre_hook(entering(mark)).remove,
                 module.register_forward_hook(leave).remove]
    batch, clip = run.batch, torch.nn.utils.clip_grad_norm_

    def marked(function, name):
        def call(*args, **kwargs):
            with record_function(name):
                return function(*args, **kwargs)
        return call

    run.batch, run.forward = marked(batch, DATA_MARK), marked(run.forward, FORWARD_MARK)
    torch.nn.utils.clip_grad_norm_ = marked(clip, CLIP_MARK)
    undo += [lambda: delattr(run, "batch"), lambda: delattr(run, "forward"),
             lambda: setattr(torch.nn.utils, "clip_grad_norm_", clip)]
    return undo


def breakdown(run, count, step_cpu_ms, fixed_cpu_ms, batch_ms):
    """ms of the (unprofiled) CPU step in each of CATEGORIES, and their shares. The profiler adds
    its own cost to every event (a profiled step takes 2-3x the time), so its times serve as
    weights only: Python and the framework get fixed_cpu_ms (the CPU time of a step of the same
    model at a size where the operators do almost nothing: the per-step cost of the Python, the
    dispatch and the autograd engine), the data batch_ms (drawing a batch, timed on its own),
    the operators' categories the rest of the CPU step in proportion to their self times in
    torch.profiler over `count` steps."""
    from torch.profiler import ProfilerActivity, profile
    undo = ranges_around(run)
    try:
        started = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            steps(run, count)
        wall_ms = 1e3 * (time.perf_counter() - started)
    finally:
        for action in undo:
            action()
    placed = []  # (event, chain, node)
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        node = event if event.name.startswith(ENGINE) else None
        chain, parent, child = [event.name], event.cpu_parent, event
        while parent is not None:
            if parent.name.startswith(ENGINE) and node is None:
                node = child
            chain.insert(0, parent.name)
            parent, child = parent.cpu_parent, parent
        placed.append((event, chain, node))
    # An operator records the sequence number its backward node will have; operators without a
    # node (inside a custom Function, under no_grad) record the next one: the first operator of
    # the model's forward to record a number is the one whose node has it, or encloses it.
    forward_of = {}
    for event, chain, node in placed:
        if FORWARD_MARK in chain and node is None and event.sequence_nr >= 0:
            forward_of.setdefault(event.sequence_nr, forward_category(chain))
    weights = dict.fromkeys(CATEGORIES, 0.0)
    for event, chain, node in placed:
        weights[category(chain, node, forward_of)] += event.self_cpu_time_total
    python, data = "Python and framework (no operator)", "data (drawing the batch)"
    weights[python] = weights[data] = 0.0
    operators = max(0.0, step_cpu_ms - fixed_cpu_ms - batch_ms)
    ms = {k: operators * w / sum(weights.values()) for k, w in weights.items()}
    ms[python], ms[data] = fixed_cpu_ms, batch_ms
    return dict(ms_per_step=ms, shares={k: v / step_cpu_ms for k, v in ms.items()},
                profiled_wall_ms_per_step=wall_ms / count, fixed_cpu_ms=fixed_cpu_ms)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=("char_lm", "mqar"), default="char_lm")
    parser.add_argument("--variants", default=VARIANTS, help="comma-separated variant names")
    parser.add_argument("--contexts", default="256,1024", help="char_lm's")
    parser.add_argument("--tokens", type=int, default=4096, help="char_lm's tokens per step")
    parser.add_argument("--settings", default="64:4,128:8,256:16",
                        help="MQAR's length:pairs, each trained on its own")
    parser.add_argument("--mqar-batch", type=int, default=64)
    parser.add_argument("--d-model", type=int, help="default: the plan's model of the task")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per case and round")
    parser.add_argument("--warm-up", type=int, default=2, help="steps before the timed ones")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of every case (of each side with --compare)")
    parser.add_argument("--eval-tokens", type=int, default=32768, help="char_lm's")
    parser.add_argument("--eval-every", type=int, default=100,
                        help="steps per evaluation, to cost it per step")
    parser.add_argument("--profile", action="store_true", help="also the profile's breakdown")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                        help="two PYTHONPATHs, timed alternately")
    args = parser.parse_args(argv)
    args.variants = args.variants.split(",")
    args.contexts = [int(n) for n in args.contexts.split(",")]
    args.settings = [tuple(map(int, s.split(":"))) for s in args.settings.split(",")]
    return args


def say(*parts):
    print(*parts, flush=True)


def summary(values):
    ordered = sorted(values)
    return dict(median=statistics.median(ordered), mean=statistics.fmean(ordered),
                low=ordered[0], high=ordered[-1])


# ---------------------------------------------------------------------------------------------
# One checkout, in this process.

def model_of(args):
    """The model measured: the plan's for the task, with the command line's changes."""
    from training import plans
    model = dict(plans.MODEL if args.task == "char_lm" else plans.MQAR_MODEL)
    for key in ("d_model", "layers", "heads"):
        if getattr(args, key) is not None:
            model[key] = getattr(args, key)
    return model


def make_run(args, variant, shape, corpus):
    """A train.Run of the study's shape (char_lm: a context; MQAR: a (length, pairs)), its
    evaluation left out of train()."""
    from training.train import Config, Run
    from training.variants import from_name
    if args.task == "char_lm":
        fields = dict(batch_size=args.tokens // shape, context=shape, text_digest=corpus.digest)
    else:
        fields = dict(batch_size=args.mqar_batch, context=0, mqar_settings=(shape,))
    # A schedule far longer than anything stepped here: steps() trains in parts (stop_after), so
    # no step is the schedule's last (logged, its summary made), and 1 in log_every is logged,
    # as in a long run.
    config = Config(task=args.task, variant=from_name(variant), seed=0, steps=10 ** 9, lr=1e-3,
                    warmup=1, eval_every=10 ** 9, log_every=10, checkpoint_every=10 ** 9,
                    threads=args.threads, **model_of(args), **fields)
    run = Run(config, corpus)
    run.evaluate = lambda final=False: []
    return run


def steps(run, count):
    """Runs `count` more training steps in one train() call; each step's (wall, CPU) seconds,
    from the end of one to the end of the next (train.RunHooks.stepped), the first from the
    call."""
    from training.train import RunHooks
    marks = [(time.perf_counter(), time.process_time())]

    class Marks(RunHooks):
        def stepped(self, _):
            marks.append((time.perf_counter(), time.process_time()))

    hooks, run.hooks = run.hooks, Marks()
    try:
        run.train(stop_after=count)
    finally:
        run.hooks = hooks
    times = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(marks, marks[1:])]
    if run.records["diverged_step"] is not None:
        raise RuntimeError("the run diverged: %s" % run.records["diverged_reason"])
    return times


def timed(function):
    """(wall, CPU) seconds of function()."""
    wall, cpu = time.perf_counter(), time.process_time()
    function()
    return time.perf_counter() - wall, time.process_time() - cpu


def evaluation(args, run, shape, corpus):
    """(tokens, function) of the run's evaluation: validation_bpc at the context over
    --eval-tokens characters, or mqar_accuracy over the setting's test set."""
    from training.train import mqar_accuracy, validation_bpc
    if args.task == "char_lm":
        return args.eval_tokens, lambda: validation_bpc(run.model, corpus, shape,
                                                        args.eval_tokens)
    return (run.config.mqar_test_size * shape[0],
            lambda: mqar_accuracy(run.model, run.config, *shape))


def fixed_cost_ms(args, variant, corpus):
    """The median CPU ms of a step of the model at batch 1 and length 16 (MQAR: 16 tokens, 2
    pairs), where the operators' work is next to nothing: the per-step cost of Python, the
    dispatch and the autograd engine."""
    tiny = argparse.Namespace(**dict(vars(args), tokens=16, mqar_batch=1))
    run = make_run(tiny, variant, 16 if args.task == "char_lm" else (16, 2), corpus)
    steps(run, args.warm_up)
    return 1e3 * statistics.median(cpu for _, cpu in steps(run, 3 * args.steps))


def finish_case(args, run, shape, corpus, rounds):
    """A case's figures from its rounds of step times."""
    import torch
    times = [t for one in rounds for t in one]
    tokens = run.tokens_per_step()
    result = dict(task=args.task, variant=run.config.variant.name, shape=shape,
                  batch=run.config.batch_size, tokens_per_step=tokens,
                  step_wall_s=summary(t[0] for t in times),
                  step_cpu_s=summary(t[1] for t in times),
                  round_cpu_s=summary(statistics.median(t[1] for t in one) for one in rounds),
                  round_wall_s=summary(statistics.median(t[0] for t in one) for one in rounds))
    result["tokens_per_s_wall"] = tokens / result["step_wall_s"]["median"]
    result["tokens_per_s_cpu"] = tokens / result["step_cpu_s"]["median"]
    # What a run of many steps gets, the slow steps included (a burst of page faults, say)
    result["tokens_per_s_cpu_mean"] = tokens / result["step_cpu_s"]["mean"]
    result["batch_ms"] = 1e3 * timed(lambda: [run.batch(i) for i in range(20)])[0] / 20
    torch.set_num_threads(args.threads)
    eval_tokens, evaluate = evaluation(args, run, shape, corpus)
    evaluate()  # warm-up
    wall, cpu = timed(evaluate)
    result["eval_tokens_per_s_wall"], result["eval_tokens_per_s_cpu"] = (
        eval_tokens / wall, eval_tokens / cpu)
    result["eval_ms_per_step_cpu"] = 1e3 * cpu / args.eval_every
    if args.profile:
        result["profile"] = breakdown(run, args.steps, 1e3 * result["step_cpu_s"]["median"],
                                      fixed_cost_ms(args, run.config.variant.name, corpus),
                                      result["batch_ms"])
    return result


def print_case(r):
    wall, cpu, spread = r["step_wall_s"], r["step_cpu_s"], r["round_cpu_s"]
    say(f"{r['variant']:24s} {str(r['shape']):9s} x{r['batch']:<3d} step: wall "
        f"{1e3 * wall['median']:7.1f} ms, CPU {1e3 * cpu['median']:7.1f} ms (rounds' medians "
        f"{1e3 * spread['low']:.1f}-{1e3 * spread['high']:.1f}); tokens/s "
        f"{r['tokens_per_s_wall']:7.0f} wall, {r['tokens_per_s_cpu']:7.0f} CPU (mean step: "
        f"{r['tokens_per_s_cpu_mean']:7.0f}); eval "
        f"{r['eval_tokens_per_s_cpu']:7.0f} tokens/s CPU ({r['eval_ms_per_step_cpu']:.1f} ms per "
        f"step); batch {r['batch_ms']:.2f} ms")
    if "profile" in r:
        p = r["profile"]
        say(f"  profile ({p['profiled_wall_ms_per_step']:.1f} ms wall per profiled step; ms of "
            f"the {1e3 * cpu['median']:.1f} ms CPU step; {p['fixed_cpu_ms']:.1f} ms at batch 1 "
            f"x 16):")
        for name in CATEGORIES:
            say(f"    {name:60s} {p['ms_per_step'][name]:7.1f} ms {p['shares'][name]:6.1%}")


def measure(args):
    import linrope
    import torch
    from training.data import load_corpus
    torch.set_num_threads(args.threads)
    linrope.set_num_threads(args.threads)
    corpus = load_corpus() if args.task == "char_lm" else None
    model = model_of(args)
    say(f"# {args.task}: d_model {model['d_model']}, {model['layers']} layers, {model['heads']} "
        f"heads, {args.threads} thread(s), {args.rounds} rounds of {args.steps} steps per case; "
        f"load average {' '.join('%.2f' % x for x in os.getloadavg())}; linrope from "
        f"{os.path.dirname(linrope.__file__)}; OPENBLAS_CORETYPE "
        f"{os.environ.get('OPENBLAS_CORETYPE', 'unset')}")
    shapes = args.contexts if args.task == "char_lm" else args.settings
    cases = [(make_run(args, v, shape, corpus), shape) for shape in shapes for v in args.variants]
    for run, _ in cases:
        steps(run, args.warm_up)
    rounds = [[] for _ in cases]
    for _ in range(args.rounds):
        for (run, _), seen in zip(cases, rounds):
            seen.append(steps(run, args.steps))
    results = []
    for (run, shape), seen in zip(cases, rounds):
        results.append(finish_case(args, run, shape, corpus, seen))
        print_case(results[-1])
    say(f"# load average at the end {' '.join('%.2f' % x for x in os.getloadavg())}")
    return dict(model=model, load_average=os.getloadavg(), cases=results)


# ---------------------------------------------------------------------------------------------
# Two checkouts, alternated in subprocesses.

def own_arguments(argv):
    """argv without --compare, --rounds and --json (and their values)."""
    kept, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
        elif arg in ("--compare", "--rounds", "--json"):
            skip = 2 if arg == "--compare" else 1
        elif not arg.startswith(("--compare=", "--rounds=", "--json=")):
            kept.append(arg)
    return kept


def compare(args, argv):
    sides = dict(zip(("before", "after"), args.compare))
    seen = {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            for side, path in sides.items():
                out = os.path.join(scratch, f"{side}{round_}.json")
                say(f"\n## round {round_ + 1}, {side} ({path})")
                subprocess.run([sys.executable, os.path.abspath(__file__), *own_arguments(argv),
                                "--rounds", "1", "--json", out],
                               check=True, env=dict(os.environ, PYTHONPATH=path))
                with open(out) as f:
                    seen[side].append(json.load(f)["results"]["cases"])
    rows = []
    say("\n| variant | shape | before tokens/s (CPU) | after | after / before, per round | "
        "the same from the mean step |\n|---|---|---|---|---|---|")
    for i, case in enumerate(seen["before"][0]):
        tps = {side: [r[i]["tokens_per_s_cpu"] for r in seen[side]] for side in sides}
        ratios = [a / b for a, b in zip(tps["after"], tps["before"])]
        means = {side: [r[i]["tokens_per_s_cpu_mean"] for r in seen[side]] for side in sides}
        row = dict(variant=case["variant"], shape=case["shape"],
                   before=summary(tps["before"]), after=summary(tps["after"]),
                   ratio=summary(ratios),
                   mean_ratio=summary(a / b for a, b in zip(means["after"], means["before"])))
        rows.append(row)
        say(f"| {row['variant']} | {row['shape']} | {row['before']['median']:.0f} "
            f"({row['before']['low']:.0f}-{row['before']['high']:.0f}) | "
            f"{row['after']['median']:.0f} ({row['after']['low']:.0f}-{row['after']['high']:.0f})"
            f" | **{row['ratio']['median']:.2f}x** ({row['ratio']['low']:.2f}-"
            f"{row['ratio']['high']:.2f}) | {row['mean_ratio']['median']:.2f}x "
            f"({row['mean_ratio']['low']:.2f}-{row['mean_ratio']['high']:.2f}) |")
    return dict(rounds=seen, table=rows)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    results = compare(args, argv) if args.compare else measure(args)
    if args.json:  # written whole, then renamed: a reader never sees half a file
        with open(args.json + ".tmp", "w") as f:
            json.dump(dict(args=vars(args), results=results), f, indent=1)
        os.replace(args.json + ".tmp", args.json)


if __name__ == "__main__":
    main()
