"""training.sweep (every run in worker processes, resumable), the tables (training.results) and
the command line (training.__main__).

One real sweep (spawned worker process, jobs=1) is shared by the first tests; the resume logic
is tested with an in-process pool passed to run_all, which counts what it is given to run."""
import concurrent.futures
import csv
import dataclasses
import importlib
import json
import math
import os
import signal
import subprocess
import sys
import time
import types

import pytest

from analysis.common import clean
from training import mqar, plans, sweep
from training.data import load_corpus
from training.results import IDS, RECORDS, Result, read_tables, write_tables
from training.train import TIMING, Run
from training.variants import CATALOGUE, Variant, from_name


class Stop(Exception):
    pass


def checkpoint_after(config, corpus, path, steps):
    """Trains `config` in this process until `steps` steps, keeping its checkpoints at path."""
    def progress(run):
        if run.step >= steps:
            raise Stop
    with pytest.raises(Stop):
        Run(config, corpus).train(checkpoint=path, progress=progress)


def as_json(value):
    """What a record looks like after the round trip through runs/<key>.json: tuples become
    lists and non-finite floats null (JSON has no NaN)."""
    return json.loads(json.dumps(clean(value)))


def comparable(records):
    """A run's records as a Result holds them: its curves, layers and evaluations."""
    return {k: v for k, v in as_json(records).items() if k in RECORDS}


def saved(out, config):
    with open(os.path.join(out, "runs", config.key() + ".json")) as f:
        return json.load(f)


def read_csv(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], rows[1:]


# ---- one real sweep -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def swept(tmp_path_factory, tiny, word_text):
    """Four tiny runs through run_all(jobs=1, resume=True) in a spawned worker: a plain char_lm
    run, an MQAR run, a run that diverges (lr 1e20) and one that continues from a checkpoint
    left at step 4 (an interrupted earlier sweep)."""
    root = tmp_path_factory.mktemp("sweep")
    text = root / "words.txt"
    text.write_text(word_text(), encoding="utf-8")
    corpus = load_corpus(str(text))
    out = str(root / "out")
    configs = [tiny(variant="softmax-rope", steps=6),
               tiny(task="mqar", context=0, variant="favor-numerator_only", steps=4,
                    eval_every=2),
               tiny(variant="favor-full", seed=1, lr=1e20),
               tiny(variant="elu-numerator_only", seed=2, steps=8)]
    os.makedirs(os.path.join(out, "checkpoints"))
    checkpoint_after(configs[3], corpus, os.path.join(out, "checkpoints",
                                                      configs[3].key() + ".pt"), 5)
    results = sweep.run_all(configs, out, 1, text=str(text), resume=True, quiet=True)
    return types.SimpleNamespace(out=out, configs=configs, results=results, corpus=corpus,
                                 text=str(text))


def test_run_all_returns_every_result_in_config_order(swept):
    """One result per config, in the order given (not completion order), each saved as
    runs/<key>.json holding that config, its summary and records; no checkpoint is left once the
    runs are done."""
    assert len(swept.results) == len(swept.configs)
    for config, result in zip(swept.configs, swept.results):
        assert (result.key, result.task, result.context, result.variant, result.lr,
                result.seed) == (config.key(), config.task, config.context, config.variant,
                                 config.lr, config.seed)
        on_disk = saved(swept.out, config)
        assert on_disk["config"] == as_json(dataclasses.asdict(config))
        assert (on_disk["summary"], comparable(on_disk["records"])) == (result.summary,
                                                                        result.records)
        assert "den_totals" not in on_disk["records"]
    assert os.listdir(os.path.join(swept.out, "checkpoints")) == []
    assert sorted(os.listdir(os.path.join(swept.out, "runs"))) == sorted(
        c.key() + ".json" for c in swept.configs)


def test_worker_results_equal_in_process_runs(swept):
    """A run trained in a worker process gives bitwise the numbers of the same run trained
    here (only the wall-clock time differs)."""
    for index in (0, 1):
        config = swept.configs[index]
        run = Run(config, swept.corpus if config.task == "char_lm" else None)
        summary = run.train()
        result = swept.results[index]
        assert result.summary["status"] == "complete"
        assert result.resumed_from_step is None
        assert result.records == comparable(run.records)
        assert {k: v for k, v in result.summary.items() if k not in TIMING} == \
            {k: v for k, v in as_json(summary).items() if k not in TIMING}


POOL_OWNER = """
import os, signal, sys, time
from training import sweep
pool = sweep.new_pool(1)
print(pool.submit(os.getpid).result(), flush=True)  # the worker's pid
pool.submit(time.sleep, 120)  # busy, and more queued behind it, as a sweep's runs are
pool.submit(time.sleep, 120)
time.sleep(0.5)
os.kill(os.getpid(), signal.SIGKILL)  # killed as a user kills a sweep: no shutdown
"""


def test_a_killed_sweeps_workers_end_with_it():
    """A pool worker outlives nothing: when the process that started it is killed (SIGKILL, no
    clean-up), the worker ends within seconds instead of training the runs queued to it."""
    experiments = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    owner = subprocess.run([sys.executable, "-c", POOL_OWNER], cwd=experiments,
                           capture_output=True, text=True, timeout=120)
    assert owner.returncode == -signal.SIGKILL, owner.stderr
    worker = int(owner.stdout.split()[0])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _alive(worker):
        time.sleep(0.1)
    assert not _alive(worker)


def _alive(pid):
    """Whether pid runs (a zombie, ended but not yet reaped by init, counts as ended)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_diverging_run_does_not_stop_the_sweep(swept):
    """The lr = 1e20 run ends as diverged (at the step an in-process run diverges at), its
    record saved with JSON nulls for NaN; the runs after it in the list still complete."""
    result = swept.results[2]
    reference = Run(swept.configs[2], swept.corpus).train()
    assert result.summary["status"] == "diverged" and not result.complete
    assert result.summary["diverged_step"] == reference["diverged_step"] is not None
    assert result.records["layers"][-1]["grad_norm"] is None  # NaN in the run
    assert [r.summary["status"] for r in swept.results] == ["complete", "complete",
                                                            "diverged", "complete"]


def test_sweep_continues_an_unfinished_run_from_its_checkpoint(swept):
    """The run with a checkpoint at step 4 continued from it (resumed_from_step 4) and ended
    with the numbers of an uninterrupted run."""
    config, result = swept.configs[3], swept.results[3]
    run = Run(config, swept.corpus)
    run.train()
    assert result.resumed_from_step == 4
    assert result.summary["steps"] == 8
    assert result.records == comparable(run.records)


def test_write_tables(swept):
    """runs.csv (one row per run: ids and status first, then every summary column),
    curves.csv, layers.csv and evaluations.csv (one row per record of every run, with the run's
    ids), NaN and None written as empty cells, "\n" line endings."""
    write_tables(swept.results, swept.out)
    header, rows = read_csv(os.path.join(swept.out, "runs.csv"))
    ids = list(IDS)
    assert ids == ["task", "context", "mqar_settings", "variant", "lr", "budget", "seed"]
    assert header[:len(ids) + 1] == ids + ["status"]
    assert set(header) == set(ids).union(*(r.summary for r in swept.results))
    column = {name: header.index(name) for name in ids + ["status"]}
    assert [tuple(r[column[k]] for k in ("task", "variant", "seed", "status")) for r in rows] == [
        ("char_lm", "softmax-rope", "0", "complete"), ("mqar", "favor-numerator_only", "0",
                                                       "complete"),
        ("char_lm", "favor-full", "1", "diverged"), ("char_lm", "elu-numerator_only", "2",
                                                     "complete")]
    assert [float(r[column["lr"]]) for r in rows] == [c.lr for c in swept.configs]
    assert [int(r[column["context"]]) for r in rows] == [c.context for c in swept.configs]
    assert [r[column["mqar_settings"]] for r in rows] == ["", "16x2+32x4", "", ""]
    assert [int(r[column["budget"]]) for r in rows] == [c.steps for c in swept.configs]
    den_min = header.index("layer0_den_min")
    assert rows[0][den_min] == "" and float(rows[3][den_min]) > 0  # softmax: none

    for name, columns in RECORDS.items():
        with open(os.path.join(swept.out, name + ".csv"), "rb") as f:
            assert b"\r" not in f.read()
        header, rows = read_csv(os.path.join(swept.out, name + ".csv"))
        assert header == ids + list(columns)
        counts = [len(r.records[name]) for r in swept.results]
        assert len(rows) == sum(counts)
        # Rows grouped run by run, in config order, each carrying its run's ids.
        keys = [(c.task, str(c.context),
                 mqar.settings_name(c.mqar_settings) if c.task == "mqar" else "",
                 c.variant.name, str(c.lr), str(c.steps), str(c.seed)) for c in swept.configs]
        assert [tuple(r[:len(ids)]) for r in rows] == [k for k, n in zip(keys, counts)
                                                       for _ in range(n)]
    k = swept.results[2].summary["diverged_step"]
    # Records per run: curves one per step done; layers one per step and layer (the diverged
    # run's also for its last step); evaluations as scheduled (none before the diverged end).
    assert [len(r.records["curves"]) for r in swept.results] == [6, 4, k - 1, 8]
    assert [len(r.records["layers"]) for r in swept.results] == [6, 4, k, 8]
    assert [len(r.records["evaluations"]) for r in swept.results] == [3, 4, 0, 3]
    _, layers = read_csv(os.path.join(swept.out, "layers.csv"))
    assert layers[10 + k - 1][-1] == ""  # the diverged step's NaN gradient norm


def test_tables_read_back_into_the_results(swept, tmp_path):
    """read_tables gives back the Results write_tables wrote: the same runs in the same order,
    the same records (numbers as numbers, NaN and None as None) and summaries, but for
    resumed_from_step, which the tables do not keep, and the summary columns of the other runs,
    which a run's row holds empty (None): softmax's layer0_den_min beside FAVOR+'s."""
    out = str(tmp_path)
    write_tables(swept.results, out)
    back = read_tables(out)
    assert [r.key for r in back] == [r.key for r in swept.results]
    for got, want in zip(back, swept.results):
        assert (got.task, got.context, got.variant, got.lr, got.seed, got.records) == (
            want.task, want.context, want.variant, want.lr, want.seed, want.records)
        assert got.summary == dict({k: None for k in back[0].summary}, **want.summary)
    assert back[0].summary["layer0_den_min"] is None and "layer0_den_min" not in \
        swept.results[0].summary
    assert read_tables(str(tmp_path / "nothing")) == []


def test_tables_with_the_features_and_redraws_in_columns_read_as_such(tmp_path):
    """The committed study's tables give FAVOR+'s feature count and the redraw interval in
    columns of their own beside the variant's name: they read as the variant with them."""
    ids = "task,context,variant,feature_factor,redraw_interval,lr,seed"
    (tmp_path / "runs.csv").write_text(
        ids + ",status\nmqar,0,favor-full,4,0,0.001,0,complete\n"
        "char_lm,256,favor-full,2,100,0.01,1,diverged\n")
    (tmp_path / "curves.csv").write_text(
        ids + ",step,train_loss\nmqar,0,favor-full,4,0,0.001,0,10,2.5\n")
    results = read_tables(str(tmp_path))
    assert [r.variant.name for r in results] == ["favor-full-m4x", "favor-full-redraw100"]
    assert results[0].records["curves"] == [dict(step=10, train_loss=2.5)]
    assert results[1].summary == dict(status="diverged") and not results[1].complete


# ---- resume logic, counted with an in-process pool ------------------------------------------

class InProcessPool(concurrent.futures.Executor):
    """A pool for run_all that runs each submitted call here, at once, and records the keys of
    the configs it was given in `submitted`."""

    def __init__(self, submitted):
        self.submitted = submitted

    def submit(self, fn, *args):
        self.submitted.append(args[0].key())
        future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args))
        except Exception as e:
            future.set_exception(e)
        return future


@pytest.fixture
def in_process():
    """run_all with an InProcessPool: in_process(configs, out, **options) -> results; what it
    was given to run is in in_process.submitted."""
    def run_all(configs, out, **options):
        return sweep.run_all(configs, out, 1, pool=InProcessPool(run_all.submitted), **options)
    run_all.submitted = []
    return run_all


@pytest.fixture
def text_file(tmp_path, word_text):
    path = tmp_path / "words.txt"
    path.write_text(word_text(), encoding="utf-8")
    return str(path)


def edit_result(out, config, change):
    path = os.path.join(out, "runs", config.key() + ".json")
    with open(path) as f:
        result = json.load(f)
    change(result)
    with open(path, "w") as f:
        json.dump(result, f)


def test_resume_keeps_finished_runs_and_reruns_the_others(in_process, tiny, text_file, tmp_path):
    """resume=True skips a run whose runs/<key>.json holds the same configuration (its file is
    returned as it is: the marker written into its summary survives) and reruns one whose file
    holds another configuration; resume=False reruns everything, discarding results and
    checkpoints (a corrupt checkpoint left behind is not even read)."""
    out = str(tmp_path / "out")
    a, b = tiny(steps=4), tiny(variant="favor-numerator_only", steps=4)
    first = in_process([a, b], out, text=text_file)
    assert in_process.submitted == [a.key(), b.key()]

    edit_result(out, a, lambda r: r["summary"].update(marker="kept"))
    edit_result(out, b, lambda r: r["summary"].update(marker="kept") or
                r["config"].update(lr=0.5))
    in_process.submitted.clear()
    again = in_process([a, b], out, text=text_file, resume=True)
    assert in_process.submitted == [b.key()]
    assert again[0].summary["marker"] == "kept"
    assert "marker" not in again[1].summary
    assert again[1].records == first[1].records

    with open(os.path.join(out, "checkpoints", a.key() + ".pt"), "wb") as f:
        f.write(b"not a checkpoint")
    in_process.submitted.clear()
    fresh = in_process([a], out, text=text_file, resume=False)
    assert in_process.submitted == [a.key()]
    assert "marker" not in fresh[0].summary and fresh[0].resumed_from_step is None
    assert fresh[0].records == first[0].records
    assert os.listdir(os.path.join(out, "checkpoints")) == []


def test_checkpoints_are_used_only_with_resume_and_the_same_config(in_process, tiny, text_file,
                                                                   tmp_path):
    """A checkpoint at step 4 is continued with resume=True, discarded with resume=False, and
    ignored (the run starts over) when another configuration wrote it; the numbers are the
    same every time."""
    out = str(tmp_path / "out")
    config = tiny(steps=8)
    corpus = load_corpus(text_file)
    checkpoint = os.path.join(out, "checkpoints", config.key() + ".pt")
    os.makedirs(os.path.dirname(checkpoint))
    outcomes = []
    for writer, resume in ((config, False), (config, True), (tiny(steps=8, lr=2e-2), True)):
        checkpoint_after(writer, corpus, checkpoint, 5)
        result = in_process([config], out, text=text_file, resume=resume)[0]
        outcomes.append(result.resumed_from_step)
        assert result.summary["steps"] == 8
        assert not os.path.exists(checkpoint)
        if len(outcomes) == 1:
            reference = result.records
        assert result.records == reference
        os.remove(os.path.join(out, "runs", config.key() + ".json"))
    assert outcomes == [None, 4, None]


def test_a_config_with_an_infinite_value_is_found_again(in_process, tiny, text_file, tmp_path):
    config = tiny(steps=2, clip=math.inf)
    result = in_process([config], str(tmp_path), text=text_file)[0]
    assert result is not None and result.summary["clip_share"] == 0.0


# ---- the plans ------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", sorted(plans.MODES))
def test_plans_make_valid_distinct_configs(mode):
    """Every run a plan may make has its own key (its file names), a variant whose name reads
    back as itself, a warm-up shorter than the run, valid MQAR settings (one per run), and
    checkpoints at multiples of log_every (a checkpoint between two curve rows would lose the
    losses in between on resume; see test_train). Every stage but grid_edge has runs in the
    preview, the grid has every rate for every variant at the grid's budget, and MQAR runs stop
    at their stop accuracy."""
    plan = plans.Plan(mode)
    stages = dict(plan.preview_stages())
    configs = plan.preview()
    assert len({c.key() for c in configs}) == len(configs) > 0
    assert {c.task for c in configs} == set(plans.TASKS)
    assert plan.stage_names() == list(plans.STAGES)
    assert all(runs for name, runs in stages.items() if name != "grid_edge")
    for c in configs:
        assert from_name(c.variant.name) == c.variant
        assert 0 < c.warmup < c.steps
        assert c.checkpoint_every % c.log_every == 0
        if c.task == "mqar":
            assert len(c.mqar_settings) == 1 and c.stop_accuracy == 0.99
            for length, pairs in c.mqar_settings:
                mqar.check(c.mqar_vocab, length, pairs)
        else:
            assert c.context > 0 and c.stop_accuracy is None
    assert {c.variant for c in configs} <= set(plan.all_variants())
    for task in plans.TASKS:
        rates = plan.rates(task)
        assert len(rates) >= 2 and list(rates) == sorted(rates)
    char_lm = plans.MODES[mode]["char_lm"]
    grid = plan.stage("grid")
    assert sorted((c.variant.name, c.lr) for c in grid) == sorted(
        (v.name, lr) for v in char_lm["variants"] for lr in plan.rates())
    for configs, tokens in ((grid, char_lm["grid"]["tokens"]),
                            (stages["seeds"], char_lm["tokens"])):
        assert {c.steps for c in configs} == {round(tokens / (c.batch_size * c.context))
                                              for c in configs}


def fake_results(configs, value, steps=lambda c: c.steps):
    """Finished runs of configs (results.Result), each ending at value(config) (None:
    diverged): char_lm's final bpc, MQAR's final accuracy after steps(config) steps."""
    out = []
    for c in configs:
        v = value(c)
        if c.task == "char_lm":
            evaluations = [dict(final=False, length=c.context, pairs=None, value=v and v - 1.0),
                           dict(final=True, length=2 * c.context, pairs=None, value=v and v - 2.0),
                           dict(final=True, length=c.context, pairs=None, value=v)]
        else:
            ((length, pairs),) = c.mqar_settings
            evaluations = [dict(final=True, length=length, pairs=pairs, value=v)]
        out.append(Result(c.task, c.context, c.variant, c.lr, c.seed,
                          summary=dict(status="diverged" if v is None else "complete",
                                       steps=steps(c)),
                          records=dict(curves=[], layers=[],
                                       evaluations=[] if v is None else evaluations),
                          mqar_settings=c.mqar_settings, budget=c.steps))
    return out


def names(configs):
    return list(dict.fromkeys(c.variant.name for c in configs))


def test_stages_follow_the_results_before_them():
    """Each stage chosen from the results before it: the grid (seed 0, the grid's budget) picks
    each variant's rate (the lowest final bpc; a diverged run never best; ties to the smaller
    rate); grid_edge goes one rate beyond a grid's edge while the best stays there (at most
    `extensions`); seeds trains every variant at its rate at the full budget; lr_check softmax
    + RoPE and the grid's best linear variant at the rates beside their best; extras the best
    linear variant of the seeds stage with the short convolution and RetNet's decay at its rate;
    long softmax + RoPE, each map's best variant and the best linear one with extras or not."""
    plan = plans.Plan("full", tasks=("char_lm",))
    grid = plan.stage("grid")
    assert {c.seed for c in grid} == {0} and {c.steps for c in grid} == {610}
    best = {"softmax-rope": 3e-3, "elu-before_map": 1e-1, "favor-before_map": 1e-3}
    level = {"softmax-rope": 1.9, "favor-before_map": 2.0, "elu-before_map": 2.2}

    def bpc(c):
        name = c.variant.name
        if name == "favor-full" and c.lr == 1e-2:
            return None  # diverged: never the best, though it "ends" nowhere
        if name == "elu-full":
            return 3.0  # a tie at every rate: the smaller wins
        return level.get(name, 2.9) + 0.3 * abs(math.log10(c.lr / best.get(name, 3e-3)))

    results = fake_results(grid, bpc)
    assert plans.chosen_lr(results, "char_lm", 256, from_name("favor-full")) == 3e-3
    assert plans.chosen_lr(results, "char_lm", 256, from_name("elu-full")) == 1e-3
    edges = []
    while True:  # grid_edge's rounds, as stages.run takes them
        more = [c for c in plan.stage("grid_edge", results + edges)
                if c.key() not in {r.key for r in edges}]
        if not more:
            break
        edges += fake_results(more, bpc)
    # elu-full's tie keeps its best at the smallest rate: two rates below it.
    assert sorted((r.variant.name, r.lr) for r in edges) == [
        ("elu-before_map", 3e-2), ("elu-before_map", 1e-1), ("elu-full", 1e-4),
        ("elu-full", 3e-4), ("favor-before_map", 3e-4)]
    results += edges
    rate = {v.name: plans.chosen_lr(results, "char_lm", 256, v)
            for v in plans.CHAR_LM_VARIANTS}
    assert rate["elu-before_map"] == 1e-1 and rate["favor-before_map"] == 1e-3

    seeds = plan.stage("seeds", results)
    assert sorted((c.variant.name, c.seed) for c in seeds) == sorted(
        (v.name, s) for v in plans.CHAR_LM_VARIANTS for s in (0, 1, 2))
    assert all(c.lr == rate[c.variant.name] and c.steps == 2441 for c in seeds)
    cell = {"favor-nodenom": 1.5, "elu-numerator_only": 1.7, "softmax-rope": 1.2}
    results += fake_results(seeds, lambda c: cell.get(c.variant.name, 2.5) + 0.01 * c.seed)

    check = plan.stage("lr_check", results)
    assert sorted((c.variant.name, c.lr, c.seed, c.steps) for c in check) == [
        ("favor-before_map", 3e-4, 0, 2441), ("favor-before_map", 3e-3, 0, 2441),
        ("softmax-rope", 1e-3, 0, 2441), ("softmax-rope", 1e-2, 0, 2441)]
    # The check's other rates, however good, do not move the cells off the chosen rate.
    results += fake_results(check, lambda c: 0.5)
    assert {r.lr for r in plans.cell_runs(results, "char_lm", 256,
                                          from_name("favor-before_map"))} == {1e-3}

    extras = plan.stage("extras", results)
    assert sorted((c.variant.name, c.seed) for c in extras) == sorted(
        (name, s) for name in ("favor-nodenom-conv4", "favor-nodenom-retnet") for s in (0, 1, 2))
    assert {c.lr for c in extras} == {rate["favor-nodenom"]}
    results += fake_results(extras, lambda c: 1.4 if c.variant.decay else 1.6)

    long = plan.stage("long", results)
    assert names(long) == ["softmax-rope", "elu-numerator_only", "favor-nodenom",
                           "favor-nodenom-retnet"]
    assert {(c.context, c.batch_size, c.steps) for c in long} == {(1024, 4, 2441)}
    assert all(c.lr == rate[c.variant.base.name] for c in long)
    keys = [c.key() for c in grid + seeds + check + extras + long] + [r.key for r in edges]
    assert len(set(keys)) == len(keys)


def test_mqar_stages_train_each_setting_alone_and_pick_by_accuracy_then_steps():
    """mqar_grid: every variant, setting and rate, seed 0, one setting a run, each stopping at
    0.99; mqar_seeds: the other seed at the rate of the highest final accuracy, the fewer steps
    among equal accuracies (a run stops once it reaches the stop accuracy), per setting (three
    here, whatever the full plan's)."""
    plan = plans.Plan("full", tasks=("mqar",), mqar_settings=((64, 4), (128, 8), (256, 16)))
    assert plan.stage_names() == ["mqar_grid", "mqar_seeds"]
    grid = plan.stage("mqar_grid")
    assert len(grid) == len(plans.MQAR_VARIANTS) * 3 * 3
    assert {c.mqar_settings for c in grid} == {((64, 4),), ((128, 8),), ((256, 16),)}
    assert {(c.seed, c.steps, c.batch_size, c.stop_accuracy) for c in grid} == {
        (0, 5000, 64, 0.99)}

    def accuracy(c):
        if c.mqar_settings == ((256, 16),):
            return {3e-4: 0.5, 1e-3: 0.7, 3e-3: None}[c.lr]
        return 1.0 if c.lr >= 1e-3 else 0.9

    results = fake_results(grid, accuracy, steps=lambda c: 800 if c.lr == 1e-3 else 400)
    seeds = plan.stage("mqar_seeds", results)
    assert {c.seed for c in seeds} == {1}
    assert len(seeds) == len(grid) // 3
    rates = {(c.variant.name, c.mqar_settings): c.lr for c in seeds}
    assert rates[("softmax-rope", ((64, 4),))] == 3e-3
    assert rates[("elu-numerator_only-conv4", ((256, 16),))] == 1e-3


def test_plan_overrides():
    """--tasks, --variants, --seeds, --steps (the warm-up then a tenth of it), --redraw-interval
    (FAVOR+'s W redrawn), --threads, --lrs and --mqar-settings reach every config; the variants
    are those named, in their order, in every stage; --stages selects the stages trained, the
    plan keeping every stage of its tasks."""
    plan = plans.Plan("full", ("mqar",), tuple(map(from_name, (
        "favor-full", "softmax-rope"))), (4, 5), 30, 7, 2, (1e-2, 2e-2),
        mqar_settings=((32, 2),))
    assert plan.stage_names() == ["mqar_grid", "mqar_seeds"]
    configs = plan.stage("mqar_grid")
    assert [(c.variant.name, c.lr, c.seed, c.mqar_settings) for c in configs] == [
        ("favor-full-redraw7", 1e-2, 4, ((32, 2),)), ("favor-full-redraw7", 2e-2, 4, ((32, 2),)),
        ("softmax-rope", 1e-2, 4, ((32, 2),)), ("softmax-rope", 2e-2, 4, ((32, 2),))]
    for c in configs:
        assert (c.steps, c.warmup, c.threads, c.context) == (30, 3, 2, 0)
    grid = plans.Plan("full", variants=(from_name("cos-full"),), lrs=(1e-2, 2e-2)).stage("grid")
    assert [(c.variant.name, c.lr, c.seed) for c in grid] == [("cos-full", 1e-2, 0),
                                                              ("cos-full", 2e-2, 0)]
    chosen = plans.Plan("full", stages=("long", "grid"))
    assert chosen.stage_names() == list(plans.STAGES)
    assert [s for s in plans.STAGES if chosen.selected(s)] == ["grid", "long"]


# ---- the command line -----------------------------------------------------------------------

@pytest.fixture
def cli():
    """training.__main__, the command line."""
    return importlib.import_module("training.__main__")


@pytest.mark.parametrize("argv,message", [
    (["--variants", "softmax-alibi"], "unknown variant 'softmax-alibi'"),
    (["--variants", "softmax-rope,favor-everything"], "unknown variant 'favor-everything'"),
    (["--variants", "elu-full-m4x"], "feature_factor is 4 but expected"),
    (["--tasks", "translation"], "unknown translation"),
    (["--steps", "0"], "--steps is 0"),
    (["--jobs", "0"], "--jobs is 0"),
    (["--threads", "-1"], "--threads is -1"),
    (["--seeds", "a"], "expected integers"),
    (["--seeds", "0,x"], "expected integers"),
    (["--seeds", "1,-1"], "expected seeds >= 0"),
    (["--redraw-interval", "-2"], "--redraw-interval is -2"),
    (["--quick", "--full"], "not allowed with"),
])
def test_parse_rejects_bad_arguments(cli, capsys, argv, message):
    """Bad names, non-positive counts and non-integer seeds are usage errors: exit status 2
    with a message saying what is wrong (argparse's convention), not a traceback later."""
    with pytest.raises(SystemExit) as exit_:
        cli.parse(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_parse_defaults_and_lists(cli):
    """--quick is the default mode; lists are parsed into tuples."""
    args = cli.parse([])
    assert args.mode == "quick" and args.tasks == ("char_lm", "mqar")
    assert args.variants is None and args.seeds is None and args.steps is None
    args = cli.parse(["--full", "--variants", "softmax-rope,cos-full", "--seeds", "3,1",
                      "--steps", "7", "--tasks", "mqar"])
    assert (args.mode, args.variants, args.seeds, args.steps, args.tasks) == (
        "full", (Variant("softmax"), Variant("linear", "1+cos", "full")), (3, 1), 7, ("mqar",))


def test_list_variants_prints_the_catalogue_and_the_name_parts(cli, capsys):
    """--list-variants prints one line per catalogue variant (14: 2 softmax, 4 placements x elu+1
    and FAVOR+, 2 for 1+cos, elu+1 and FAVOR+ without a denominator) with its description, then
    the parts that make other variants' names, and exits 0 without running anything."""
    assert cli.main(["--list-variants"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(CATALOGUE) == 14
    listed = lines[2:2 + len(CATALOGUE)]
    assert [line.split()[0] for line in listed] == [v.name for v in CATALOGUE]
    assert [line.split(None, 1)[1] for line in listed] == [v.describe() for v in CATALOGUE]
    assert listed[0].split(None, 1)[1] == "softmax, RoPE"
    assert "  favor-nodenom                favor+, no denominator (RoPE on the features, RMSNorm " \
        "per head)" in listed
    for part in ("-m<f>x", "-redraw<k>", "-decay<gamma>", "-retnet", "-conv<w>"):
        assert any(part in line for line in lines[2 + len(CATALOGUE):]), part


def test_missing_text_file_exits_1_naming_it(cli, capsys, tmp_path):
    missing = str(tmp_path / "missing.txt")
    assert cli.main(["--text", missing, "--tasks", "char_lm", "--out", str(tmp_path / "out"),
                     "--jobs", "1"]) == 1
    assert missing in capsys.readouterr().err


def test_main_end_to_end_on_a_small_text(cli, tmp_path, word_text):
    """python3 -m training --text FILE --tasks char_lm --variants softmax-rope --stages grid
    --lrs 3e-3 --steps 4 --no-step-time --jobs 1: exit status 0, the run saved and complete, the
    tables and training.json describing the corpus, and nothing derived from them (the
    analysis, experiments/analysis/report.py, writes that). Then the same command with --resume
    runs nothing again (the run's file is untouched)."""
    text = tmp_path / "words.txt"
    text.write_text(word_text(words=3000), encoding="utf-8")  # validation >= 4 x 128 + 1
    out = tmp_path / "out"
    argv = ["--text", str(text), "--tasks", "char_lm", "--variants", "softmax-rope",
            "--stages", "grid", "--lrs", "3e-3", "--steps", "4", "--no-step-time", "--jobs", "1",
            "--quiet", "--out", str(out)]
    assert cli.main(argv) == 0
    run_file = out / "runs" / "char_lm-n64-softmax-rope-lr0.003-steps4-s0.json"
    result = json.loads(run_file.read_text())
    assert result["summary"]["status"] == "complete" and result["summary"]["steps"] == 4
    for name in ("runs.csv", "curves.csv", "layers.csv", "evaluations.csv", "training.json"):
        assert (out / name).exists(), name
    for name in ("step_time.csv", "summary.json", "report_section.md"):
        assert not (out / name).exists(), name
    assert not [name for name in os.listdir(out) if name.endswith(".png")]
    _, runs = read_csv(str(out / "runs.csv"))
    assert len(runs) == 1
    meta = json.loads((out / "training.json").read_text())
    corpus = load_corpus(str(text))
    assert meta["corpus"]["name"] == "words.txt"
    assert meta["corpus"]["characters"] == len(text.read_text(encoding="utf-8"))
    assert meta["corpus"]["vocabulary"] == corpus.vocab_size
    assert meta["corpus"]["sha256_16"] == corpus.digest
    assert meta["variants"] == {"softmax-rope": "softmax, RoPE"}

    before = (run_file.stat().st_mtime_ns, run_file.read_bytes())
    assert cli.main(argv + ["--resume"]) == 0
    assert (run_file.stat().st_mtime_ns, run_file.read_bytes()) == before


def test_main_refuses_an_out_path_under_a_file_in_one_line(cli, tmp_path, capsys):
    """--out below an ordinary file: exit status 1 and one readable line, no traceback."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert cli.main(["--tasks", "mqar", "--out", str(blocker / "out"), "--no-step-time"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("training: --out ") and "Not a directory" in err[0]
