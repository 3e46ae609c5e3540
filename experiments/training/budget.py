"""What a plan costs, before and while it runs: each run's steps and tokens, its time, the wall
time of a stage whose runs train `jobs` at a time, and the --plan printout.

A run's time is its steps times the seconds per step of the finished runs most like it (the same
task, length and variant, else the same attention: softmax or linear), their median, wall-clock
with the evaluations; before any such run has finished, the plan's throughput (tokens per second
of one run, per task, length and attention, beside its model in plans.MODES) for the steps, and a
third of it for the evaluations' tokens (a forward without the backward). An MQAR run is costed at
its cap: it stops sooner once it reaches the stop accuracy."""
import statistics

from .mqar import settings_name


def length_of(config):
    """The sequence length a run trains at: char_lm's context, MQAR's longest setting."""
    return config.context if config.task == "char_lm" else max(n for n, _ in config.mqar_settings)


def _kinds(task, length, variant):
    """What makes two runs' steps cost alike, most alike first."""
    return [(task, length, variant.name), (task, length, variant.attention)]


def _measured(results):
    """{kind: [seconds per step, ...]} of the finished runs."""
    table = {}
    for r in results:
        steps, seconds = r.summary.get("steps"), (r.summary.get("wall_seconds") or
                                                  r.summary.get("train_seconds"))
        if not steps or not seconds:
            continue
        length = r.context if r.task == "char_lm" else max(n for n, _ in r.mqar_settings)
        for kind in _kinds(r.task, length, r.variant):
            table.setdefault(kind, []).append(seconds / steps)
    return table


def _throughput(plan, task, length, attention):
    """The plan's tokens/s for one run at `length` (the nearest length it gives)."""
    table = plan.settings[task].get("throughput") or {}
    if not table:
        return None
    nearest = min(table, key=lambda n: abs(n - length))
    return table[nearest][attention]


def _evaluated_tokens(config):
    """Tokens the run's evaluations read: every eval_every steps and at the end."""
    evaluations = config.steps // config.eval_every + 1
    if config.task == "char_lm":
        return (evaluations * config.eval_tokens +
                (config.final_eval_tokens or 0) * (len(config.extrapolation) - 1))
    return evaluations * config.mqar_test_size * sum(n for n, _ in config.mqar_settings)


def run_seconds(config, plan, measured):
    """(estimated seconds of the run, "measured" or "plan"); (None, None) without either."""
    length = length_of(config)
    for kind in _kinds(config.task, length, config.variant):
        if kind in measured:
            return config.steps * statistics.median(measured[kind]), "measured"
    tokens_per_s = _throughput(plan, config.task, length, config.variant.attention)
    if not tokens_per_s:
        return None, None
    tokens = config.steps * config.batch_size * (
        config.context if config.task == "char_lm" else
        sum(n for n, _ in config.mqar_settings) / len(config.mqar_settings))
    return (tokens + _evaluated_tokens(config) / 3) / tokens_per_s, "plan"


def makespan(seconds, jobs):
    """The wall time of runs of these durations on `jobs` workers, each taking the next longest
    run when it is free."""
    workers = [0.0] * max(1, jobs)
    for s in sorted(seconds, reverse=True):
        workers[workers.index(min(workers))] += s
    return max(workers)


def duration(seconds):
    """'42 s', '12 min', '3.4 h'."""
    if seconds < 90:
        return "%.0f s" % seconds
    if seconds < 5400:
        return "%.0f min" % (seconds / 60)
    return "%.1f h" % (seconds / 3600)


def stage_estimate(name, configs, results, plan, jobs):
    """The line printed before a stage starts: its runs and their estimated wall time."""
    measured = _measured(results)
    times = [run_seconds(c, plan, measured) for c in configs]
    known = [s for s, _ in times if s is not None]
    if not known:
        return "stage %s: %d runs; no estimate (no run of their kind has finished, and the " \
            "plan gives no throughput)" % (name, len(configs))
    sources = {source for _, source in times if source}
    cap = " at most" if any(c.task == "mqar" and c.stop_accuracy for c in configs) else ""
    return "stage %s: %d runs,%s ~%s with %d at a time (%s)" % (
        name, len(configs), cap, duration(makespan(known, jobs)), jobs,
        "seconds per step of the finished runs like them" if sources == {"measured"} else
        "the plan's tokens/s" if sources == {"plan"} else
        "measured seconds per step where runs like them finished, else the plan's tokens/s")


def _describe_settings(plan):
    lines = []
    if "char_lm" in plan.tasks:
        s = plan.settings["char_lm"]
        model = plan.model_of("char_lm")
        long = s.get("long")
        lines.append(
            "char_lm: d_model %d, %d layers, %d heads; batch %d x %d%s; %s characters per run, "
            "the grid %s; grid rates %s; seeds %s." % (
                model["d_model"], model["layers"], model["heads"], s["batch_size"],
                s["context"], " (long context: %d x %d)" % (long["batch_size"], long["context"])
                if long else "", "{:,}".format(s["tokens"]),
                "{:,}".format(s["grid"]["tokens"]), ", ".join("%g" % r for r in plan.rates()),
                ", ".join(map(str, plan.seeds_of("char_lm")))))
    if "mqar" in plan.tasks:
        s = plan.settings["mqar"]
        model = plan.model_of("mqar")
        lines.append(
            "mqar: d_model %d, %d layers, %d heads; batch %d; settings %s, each on its own; up "
            "to %d steps%s; rates %s; seeds %s." % (
                model["d_model"], model["layers"], model["heads"], s["batch_size"],
                ", ".join(settings_name(x) for x in plan.mqar_setting_list()),
                plan.steps or s["steps"], ", stopping at accuracy %g" % s["run"]["stop_accuracy"]
                if s["run"].get("stop_accuracy") else "",
                ", ".join("%g" % r for r in plan.rates("mqar")),
                ", ".join(map(str, plan.seeds_of("mqar")))))
    return lines


def plan_text(plan, jobs, command):
    """The --plan printout: every run of every stage with its steps, tokens and estimated time,
    each stage's wall time with `jobs` runs at a time, and the total."""
    stages = plan.preview_stages()
    lines, total_runs, total_tokens, total_wall, total_seconds = [], 0, 0.0, 0.0, 0.0
    for name, configs in stages:
        times = [run_seconds(c, plan, {})[0] for c in configs]
        wall = makespan([t or 0.0 for t in times], jobs)
        tokens = [c.steps * c.batch_size * length_of(c) for c in configs]
        lines.append("")
        if name == "grid_edge":
            extensions = plan.settings["char_lm"]["grid"]["extensions"]
            grid = dict(stages)["grid"]
            per_run = max((run_seconds(c, plan, {})[0] or 0.0 for c in grid), default=0.0)
            most = extensions * len({c.variant for c in grid})
            lines.append("stage grid_edge: none if every variant's best rate is inside its grid; "
                         "at most %d runs (%d more rates for each of %d variants), ~%s" % (
                             most, extensions, most // max(1, extensions),
                             duration(makespan([per_run] * most, jobs))))
            continue
        if not configs:
            lines.append("stage %s: no runs" % name)
            continue
        lines.append("stage %s: %d runs, ~%s%s" % (
            name, len(configs), duration(wall),
            " at most (each at its cap)" if plan.settings[
                "mqar" if name.startswith("mqar") else "char_lm"]["run"].get("stop_accuracy")
            else ""))
        for c, t, n in zip(configs, times, tokens):
            lines.append("  %-58s %6d steps %8.2f M tokens  %s" % (
                c.key(), c.steps, n / 1e6, "~" + duration(t) if t is not None else "no estimate"))
        total_runs += len(configs)
        total_tokens += sum(tokens)
        total_wall += wall
        total_seconds += sum(t or 0.0 for t in times)
    head = ["The plan of `%s`: %d runs (grid_edge's aside), %.0f M tokens, ~%s of runs, ~%s "
            "with %d at a time." % (command, total_runs, total_tokens / 1e6,
                                    duration(total_seconds), duration(total_wall), jobs)]
    head += _describe_settings(plan)
    head.append("Runs chosen from earlier results are shown as if every grid found its middle "
                "rate best and the variants ranked in the plan's order. Times: the plan's "
                "tokens/s of one run (plans.MODES, beside the model), the evaluations included.")
    return "\n".join(head + lines) + "\n"
