"""What the torchrun tests (test_parallel.py, test_sequence_parallel.py) share: launching the
trainer on 2 processes through linrope.torch.launch (127.0.0.1, a free port, a timeout that kills
every process), reading what it printed and saved, and comparing a run's records with a single
process training the same global batch. A helper module, not a test module."""
import json
import os

import pytest

import linrope
from linrope.torch import launch
from training.data import load_corpus
from training.train import TIMING, Config, Run

TESTS = os.path.dirname(os.path.abspath(__file__))
ENTRY = os.path.join(TESTS, "torchrun_entry.py")
EXPERIMENTS = os.path.dirname(os.path.dirname(TESTS))
TIMEOUT = 120  # seconds for one torchrun; a run here takes ~10

# Float32 rounding: at step 1 the parameters are equal and only reductions are reordered (the
# loss's mean over 64 tokens per rank, then over the group, against 128 at once): a few ulps of
# float32 (ulp/value 6e-8 to 1.2e-7). Each update then carries the gradients' rounding into the
# parameters, and AdamW normalises every gradient element to ~lr, so the difference grows with
# the steps. Measured (softmax-rope, favor-numerator_only, elu-full, favor-full; both tasks;
# seeds 0, 1): at step 1 at most 9e-8 relative, over 12 steps at most 2e-7 (gradient norms
# 8e-7); over 200 steps 1e-6 typically and up to 2e-4 for favor-full, whose near-zero
# denominators amplify it -- so these tests stay short. 2e-5 over 12 steps is 100 times what was
# measured, and 50 times below what a wrong share or weighting changes (>= 1e-3: the weighting
# test of test_parallel.py).
RELATIVE = 2e-5


STEPS = 12


def tiny_plan(layers, heads, context, mqar_settings):
    """TRAINING_TEST_PLAN for runs of seconds through the real command line (--quick with these
    sizes: d_model 16, 12 steps with a warm-up of 2, checkpoints every 4, one seed, one rate, no
    later char_lm stage; MQAR's settings trained in turn in one run)."""
    run = dict(eval_every=4, log_every=1, checkpoint_every=4)
    tokens = STEPS * 4 * context
    return dict(model=dict(d_model=16, layers=layers, heads=heads),
                char_lm=dict(tokens=tokens, grid=dict(lrs=(1e-2,), tokens=tokens, extensions=0),
                             batch_size=4, context=context, warmup=2 / STEPS, seeds=(0,),
                             lr_check=None, extras=None, long=None,
                             run=dict(run, eval_tokens=64, final_eval_tokens=128,
                                      extrapolation=(1, 2))),
                mqar=dict(steps=STEPS, batch_size=4, lrs=(1e-2,), warmup=2 / STEPS, seeds=(0,),
                          settings=(mqar_settings,),
                          run=dict(run, mqar_vocab=64, mqar_test_size=16)))


def run_key(plan, task, variant, seed=0):
    """The name (train.Config.key) of a run of a tiny_plan."""
    where = ("n%d" % plan["char_lm"]["context"] if task == "char_lm" else
             "+".join("%dx%d" % s for s in plan["mqar"]["settings"][0]))
    return "%s-%s-%s-lr0.01-steps%d-s%d" % (task, where, variant, STEPS, seed)


def torchrun(args, cwd, processes=2, env=None):
    """Runs python3 -m torch.distributed.run with `processes` workers on 127.0.0.1 (args after
    torchrun's own, e.g. [ENTRY, ...] or ["-m", "training", ...]); returns (exit status, its
    output: stdout and stderr together). Past TIMEOUT every process is killed and the test
    fails instead of hanging."""
    command = launch.torchrun_command(args, processes, launch.free_port())
    # experiments/ for `training`; the linrope this test imports, for the workers too.
    environment = launch.environment(
        pythonpath=[EXPERIMENTS, os.path.dirname(os.path.dirname(linrope.__file__))],
        **(env or {}))
    try:
        [agent] = launch.run_group([command], timeout=TIMEOUT, env=environment, cwd=str(cwd))
    except launch.GroupTimeout as e:
        pytest.fail(str(e))
    return agent.returncode, agent.output


def train_in_torchrun(cwd, plan, argv, out, env=None, processes=2):
    """The trainer's command line (argv, with --out out) under torchrun through ENTRY, its plan
    made tiny by `plan` (TRAINING_TEST_PLAN) and its writes under out watched."""
    environment = dict(TRAINING_TEST_PLAN=json.dumps(plan), TRAINING_TEST_OUT=out, **(env or {}))
    return torchrun([ENTRY, *argv, "--out", out], cwd, processes, environment)


def first_sweep(tmp_path_factory, name, word_text, train):
    """One uninterrupted sweep through train(cwd, text, out) -> (status, output), on a text of
    words: dict(root, text, out, output, results = saved_runs(out))."""
    root = tmp_path_factory.mktemp(name)
    text = root / "words.txt"
    text.write_text(word_text(), encoding="utf-8")
    out = str(root / "out")
    status, output = train(root, str(text), out)
    assert status == 0, output[-3000:]
    return dict(root=root, text=str(text), out=out, output=output, results=saved_runs(out))


def lines(text, marker):
    """The words of each output line holding marker, from the marker on (torchrun prefixes
    each line with its rank)."""
    return [line[line.index(marker):].split() for line in text.splitlines() if marker in line]


def saved_runs(out):
    """{key: the run's runs/<key>.json} of an output directory."""
    runs = {}
    for name in sorted(os.listdir(os.path.join(out, "runs"))):
        with open(os.path.join(out, "runs", name)) as f:
            runs[name[:-len(".json")]] = json.load(f)
    return runs


def close(a, b, relative=RELATIVE):
    return abs(a - b) <= relative * max(abs(a), abs(b))


def reference(saved, text):
    """The saved run trained again by one process on the whole global batch."""
    config = Config.from_dict(saved["config"])
    run = Run(config, load_corpus(text) if config.task == "char_lm" else None)
    run.train()
    return run


def assert_records_match(key, saved, run):
    """A multi-process run's saved result against `run`, the single process's on the same
    global batch: the same steps, statuses and clip counts; losses, gradient norms, denominator
    minima and evaluations equal to float32 rounding (close); the denominator counts exactly
    (summed over the ranks; numerator_only's denominators are positive and far from the 1e-3
    threshold). Returns the worst relative loss difference."""
    records = saved["records"]
    assert saved["summary"]["status"] == "complete" and saved["summary"]["steps"] == 12
    assert len(records["curves"]) == len(run.records["curves"]) == 12
    worst = 0.0
    for got, want in zip(records["curves"], run.records["curves"]):
        assert got["step"] == want["step"] and got["scheduled_lr"] == want["scheduled_lr"]
        assert got["clipped_so_far"] == want["clipped_so_far"]
        assert close(got["train_loss"], want["train_loss"]), (key, got, want)
        assert close(got["grad_norm"], want["grad_norm"]), (key, got, want)
        worst = max(worst, abs(got["train_loss"] - want["train_loss"]) / want["train_loss"])
    assert len(records["layers"]) == len(run.records["layers"])
    for got, want in zip(records["layers"], run.records["layers"]):
        assert (got["step"], got["layer"]) == (want["step"], want["layer"])
        for name in ("den_min", "grad_norm"):
            assert close(got[name], want[name]), (key, name, got, want)
        for name in ("nonpositive_share", "tiny_share"):
            assert got[name] == want[name], (key, name, got, want)
    evaluations = [(e["step"], e["length"], e["pairs"]) for e in records["evaluations"]]
    assert evaluations == [(e["step"], e["length"], e["pairs"])
                           for e in run.records["evaluations"]]
    for got, want in zip(records["evaluations"], run.records["evaluations"]):
        if got["metric"] == "bpc":
            assert close(got["value"], want["value"])
        else:  # accuracy: a share of 16 x pairs queries, which rounding can tip by one
            assert abs(got["value"] - want["value"]) <= 1 / (16 * got["pairs"])
    return worst


def assert_same_records(got, want, skip=TIMING):
    """Two saved runs' records bitwise equal but for the wall-clock time."""
    assert {k: v for k, v in got["records"].items() if k not in skip} == \
        {k: v for k, v in want["records"].items() if k not in skip}
