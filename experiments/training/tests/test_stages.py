"""training.stages (a plan run stage by stage, --stages reading the others' finished runs) and
training.budget (what a plan costs, the --plan printout), with a stand-in for the training that
saves each run's file as the sweep does, its final bpc or accuracy a function of the run."""
import math
import os
import types

from analysis.common import write_json
from training import budget, plans, stages, sweep
from training.parallel import ONE_PROCESS

TEXT = types.SimpleNamespace(digest="0123456789abcdef")  # what the char_lm configs are bound to


def value(config):
    """A run's made-up outcome: char_lm's final bpc lowest at lr 1e-2, MQAR's accuracy."""
    if config.task == "char_lm":
        return 2.0 + abs(math.log10(config.lr / 1e-2)) + 0.01 * config.seed
    return min(1.0, 0.5 + 100 * config.lr)


def fake_training(out):
    """train(configs) for stages.run: writes runs/<key>.json as sweep.run_all does, each run
    finished after its steps at value(config), 0.01 s a step; records what it was given."""
    def train(configs):
        train.given.append([c.key() for c in configs])
        os.makedirs(os.path.join(out, "runs"), exist_ok=True)
        for c in configs:
            if c.task == "char_lm":
                evaluations = [dict(step=c.steps, final=True, length=c.context, pairs=None,
                                    metric="bpc", value=value(c))]
            else:
                evaluations = [dict(step=c.steps, final=True, length=n, pairs=p,
                                    metric="accuracy", value=value(c))
                               for n, p in c.mqar_settings]
            write_json(os.path.join(out, "runs", c.key() + ".json"), dict(
                config=sweep._normal(c), summary=dict(status="complete", steps=c.steps,
                                                      wall_seconds=0.01 * c.steps),
                records=dict(curves=[], layers=[], evaluations=evaluations),
                resumed_from_step=None))
        return [sweep.finished(out, c) for c in configs]
    train.given = []
    return train


def run(plan, out, resume=False):
    train = fake_training(out)
    after = []
    progress = stages.run(plan, out, TEXT, train, 2, ONE_PROCESS,
                          lambda p: after.append(list(p.done)), resume)
    return progress, train.given, after


def test_every_stage_trains_in_order_and_is_done(tmp_path):
    out = str(tmp_path)
    plan = plans.Plan("quick")
    progress, given, after = run(plan, out)
    assert progress.done == plan.stage_names() == progress.trained
    assert len(after) == len(plan.stage_names())  # the tables after every stage
    keys = [r.key for r in progress.results]
    assert len(keys) == len(set(keys)) == sum(map(len, given))
    # grid_edge's round: the grid's best rate (1e-2) is its largest, so each variant tries 3e-2.
    edge = [k for k in given[1]]
    assert all("-lr0.03-" in k for k in edge) and len(edge) == 4


def test_resuming_a_finished_stage_does_not_count_as_training_it(tmp_path):
    """--resume over a stage whose runs are all finished (to write the tables and samples again)
    leaves the stage log's entry, the command and commit that trained it, as it was: the stage is
    not in progress.trained. Without --resume the runs are trained again, and it is."""
    out = str(tmp_path)
    run(plans.Plan("quick"), out)
    resumed, _, _ = run(plans.Plan("quick", stages=("long",)), out, resume=True)
    assert resumed.trained == [] and "long" in resumed.done
    again, _, _ = run(plans.Plan("quick", stages=("long",)), out, resume=False)
    assert again.trained == ["long"]


def test_stages_not_selected_are_read_from_the_output_directory(tmp_path):
    """A second command training `long` alone reads every other stage's finished runs and
    trains long's runs only; on an empty directory nothing before a missing stage is done."""
    out = str(tmp_path)
    first, _, _ = run(plans.Plan("quick"), out)
    again, given, _ = run(plans.Plan("quick", stages=("long",)), out)
    assert again.trained == ["long"] and len(given) == 1
    assert given[0] == [r.key for r in first.results if r.context == 128]
    assert again.done == first.done
    assert sorted(r.key for r in again.results) == sorted(r.key for r in first.results)
    empty, given, _ = run(plans.Plan("quick", stages=("seeds",)), str(tmp_path / "empty"))
    assert empty.done == [] and given == [] and empty.results == []


def test_estimates_come_from_measured_seconds_per_step_else_the_plan():
    plan = plans.Plan("full")
    config = plan.stage("grid")[0]
    seconds, source = budget.run_seconds(config, plan, {})
    tokens = config.steps * config.batch_size * config.context
    throughput = plans.THROUGHPUT[256]["softmax"]
    assert source == "plan" and tokens / throughput < seconds < 1.5 * tokens / throughput
    [result] = fake_results_of([config])
    assert budget.run_seconds(config, plan, budget._measured([result])) == (
        config.steps * 0.01, "measured")
    assert budget.run_seconds(config, plans.Plan("quick"), {}) == (None, None)
    line = budget.stage_estimate("grid", [config], [result], plan, 2)
    assert line.startswith("stage grid: 1 runs, ~") and "finished runs" in line


def fake_results_of(configs):
    return [sweep.from_saved(dict(
        config=sweep._normal(c), summary=dict(status="complete", steps=c.steps,
                                              wall_seconds=0.01 * c.steps),
        records=dict(curves=[], layers=[], evaluations=[]))) for c in configs]


def test_makespan_and_durations():
    assert budget.makespan([4, 3, 2, 1], 2) == 5
    assert budget.makespan([1, 2], 1) == 3
    assert budget.makespan([], 2) == 0
    assert [budget.duration(s) for s in (42, 720, 3.4 * 3600)] == ["42 s", "12 min", "3.4 h"]


def test_plan_printout_lists_every_run_of_every_stage():
    plan = plans.Plan("full")
    text = budget.plan_text(plan, 2, "python3 -m training --full --plan")
    for name, configs in plan.preview_stages():
        assert ("stage %s:" % name) in text
        for c in configs:
            assert c.key() in text
    runs = len(plan.preview())
    assert text.startswith("The plan of `python3 -m training --full --plan`: %d runs" % runs)
    assert "d_model %d, %d layers" % (plans.MODEL["d_model"], plans.MODEL["layers"]) in text
