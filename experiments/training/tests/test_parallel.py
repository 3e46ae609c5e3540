"""training.parallel and data parallel training under torchrun.

The first tests run in this process: the batch shares, the statistics' combination, and the loss
weighting of train.Run.step_loss, checked by computing each rank's share in turn. The others
launch `python3 -m torch.distributed.run --nproc_per_node 2` on 127.0.0.1 (gloo) through
linrope.torch.launch (torchrun_support), and compare with a single process."""
import hashlib
import json
import os

import pytest
import torch
import torch.nn.functional as F

from training import mqar, parallel
from training.data import load_corpus
from training.model import combine_stats
from training.parallel import TrainingGroup
from training.train import Config, Run

from torchrun_support import (assert_records_match, assert_same_records, first_sweep, lines,
                              reference, saved_runs, tiny_plan, torchrun, train_in_torchrun)
from torchrun_support import run_key as plan_run_key


# ---- in this process ----------------------------------------------------------------------

def test_torchrun_is_detected_by_all_four_variables():
    env = dict(WORLD_SIZE="2", RANK="1", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1")
    assert parallel.under_torchrun(env)
    for name in env:
        assert not parallel.under_torchrun({k: v for k, v in env.items() if k != name})


def test_shares_are_contiguous_and_make_up_the_batch():
    inputs, targets = torch.arange(24).reshape(6, 4), torch.arange(24).reshape(6, 4) + 100
    shares = [TrainingGroup(r, 3).share(inputs, targets) for r in range(3)]
    assert [x.tolist() for x, _ in shares] == [inputs[0:2].tolist(), inputs[2:4].tolist(),
                                               inputs[4:6].tolist()]
    assert torch.equal(torch.cat([y for _, y in shares]), targets)
    alone = TrainingGroup().share(inputs, targets)
    assert torch.equal(alone[0], inputs) and torch.equal(alone[1], targets)
    with pytest.raises(ValueError, match="a batch of 6 sequences does not split over 4"):
        TrainingGroup(1, 4).share(inputs, targets)


def test_statistics_combine_to_the_whole_batch():
    """Per layer the smallest minimum and the summed counts; softmax layers (None) stay None;
    one rank's come back with the counts alone (the layer's extra keys dropped)."""
    a = dict(min=0.5, nonpositive=1, below_threshold=2, count=10, threshold=1e-3)
    b = dict(min=-0.25, nonpositive=3, below_threshold=0, count=10, threshold=1e-3)
    assert combine_stats([[a, None], [b, None]]) == [
        dict(min=-0.25, nonpositive=4, below_threshold=2, count=20), None]
    assert combine_stats([[a]]) == [dict(min=0.5, nonpositive=1, below_threshold=2, count=10)]


def gradients_of(run, step):
    loss, reason = run.step_loss(step)
    assert reason is None
    run.model.zero_grad(set_to_none=True)
    loss.backward()
    return float(loss), [p.grad.clone() for p in run.model.parameters()]


class UnevenlyScored(Run):
    """A run whose batches' first half scores a quarter of its positions (the rest IGNORE): the
    two ranks' shares then hold 1 : 4 of the scored tokens."""

    def batch(self, step):
        inputs, targets = super().batch(step)
        targets = targets.clone()
        half, length = len(targets) // 2, targets.shape[1]
        targets[:half, :3 * length // 4] = mqar.IGNORE
        return inputs, targets


@pytest.mark.parametrize("task", ["char_lm", "mqar"])
@pytest.mark.parametrize("uneven", [False, True])
def test_rank_losses_average_to_the_batch_mean(task, uneven, tiny, corpus):
    """Each rank's weighted loss on its share, as train.Run.step_loss computes it: the mean over
    2 ranks of these losses and of their gradients (what TrainingGroup.backward's all-reduce
    applies) is the single process's mean loss and gradient over the whole batch, to float32
    rounding (relative 1e-5: the same terms summed in another order, ~log2(count) ulps of 6e-8
    each).

    Split by sequences, the tasks' shares hold equal numbers of scored tokens (every MQAR
    sequence scores exactly `pairs` queries), so the weight is exactly 1; with IGNORE spread
    unevenly (uneven=True, as a split along the length or padding would give) it is not, and
    the shares' plain means miss the batch mean by far more than rounding."""
    config = tiny(task=task, context=16 if task == "char_lm" else 0, batch_size=8)
    data = corpus if task == "char_lm" else None
    kind = UnevenlyScored if uneven else Run
    runs = [kind(config, data)] + [kind(config, data, TrainingGroup(r, 2)) for r in range(2)]
    step = 1
    whole_loss, whole_grads = gradients_of(runs[0], step)
    parts = [gradients_of(run, step) for run in runs[1:]]
    assert sum(loss for loss, _ in parts) / 2 == pytest.approx(whole_loss, rel=1e-5, abs=0)
    for i, whole in enumerate(whole_grads):
        mean = (parts[0][1][i] + parts[1][1][i]) / 2
        assert torch.allclose(mean, whole, rtol=1e-5, atol=1e-5 * float(whole.abs().max()))
    # Each rank's loss is its share's plain mean (F.cross_entropy over the share's logits, the
    # IGNOREd positions left out) times the weight 2 scored_r / scored, 1 for equal shares.
    inputs, targets = runs[0].batch(step)
    counts = [int((y != mqar.IGNORE).sum()) for y in targets.chunk(2)]
    assert (counts[0] != counts[1]) == uneven, counts
    plain = []
    with torch.no_grad():
        for x, y in zip(inputs.chunk(2), targets.chunk(2)):
            logits = runs[0].model(x)
            plain.append(float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                               y.reshape(-1), ignore_index=mqar.IGNORE)))
    for (loss, _), mean, count in zip(parts, plain, counts):
        assert loss == pytest.approx(mean * 2 * count / sum(counts), rel=1e-5, abs=0)
    if uneven:
        assert abs(sum(plain) / 2 - whole_loss) > 1e-3 * whole_loss


def test_jobs_is_refused_under_torchrun(monkeypatch, capsys):
    """--jobs means worker processes, which torchrun's ranks do not use: a usage error (exit 2,
    one line) on every rank alike, before any rank joins the process group."""
    from training.__main__ import parse
    for name, value in dict(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0",
                            MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(name, value)
    assert parse([]).jobs == 1
    with pytest.raises(SystemExit) as exit_:
        parse(["--jobs", "2"])
    assert exit_.value.code == 2
    assert "--jobs does not apply under torchrun" in capsys.readouterr().err


# ---- under torchrun -----------------------------------------------------------------------

# Tiny runs through the real command line: one layer, one head; FAVOR+ redrawn every 2 steps.
PLAN = tiny_plan(layers=1, heads=1, context=16, mqar_settings=((16, 2), (32, 6)))
VARIANT = "favor-numerator_only"


def run_key(task, seed=0):
    """The run's name (train.Config.key) under PLAN and --redraw-interval 2."""
    return plan_run_key(PLAN, task, VARIANT + "-redraw2", seed)


def train(cwd, text, out, *extra, env=None):
    argv = ["--text", text, "--variants", VARIANT, "--redraw-interval", "2", "--no-step-time",
            *extra]
    return train_in_torchrun(cwd, PLAN, argv, out, env)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, word_text):
    """One uninterrupted sweep (char_lm and mqar) on 2 processes."""
    return first_sweep(tmp_path_factory, "data", word_text, train)


def test_two_processes_give_the_single_process_curve(two_ranks):
    """Both tasks: the same steps, statuses and clip counts as one process training the same
    global batch; losses, gradient norms, learning rates, denominator statistics and rank 0's
    evaluations equal to float32 rounding (torchrun_support.RELATIVE). The worst relative loss
    difference is printed (pytest -s) for the record."""
    assert sorted(two_ranks["results"]) == [run_key("char_lm"), run_key("mqar")]
    for key, saved in two_ranks["results"].items():
        worst = assert_records_match(key, saved, reference(saved, two_ranks["text"]))
        print("%s: largest relative loss difference, 2 processes against 1: %.2e" % (key, worst))


def test_each_rank_computes_its_share_of_every_batch(two_ranks):
    """Rank r's training forwards saw, step after step, exactly rows r B/2 to (r + 1) B/2 of the
    single process's batch (the tokens' digests as the ranks printed them)."""
    for key, saved in two_ranks["results"].items():
        config = Config.from_dict(saved["config"])
        run = Run(config, load_corpus(two_ranks["text"]) if config.task == "char_lm" else None)
        seen = {s[1]: s[3] for s in lines(two_ranks["output"], "INPUTS") if s[2] == "key=" + key}
        for rank in (0, 1):
            digest = hashlib.sha256()
            for step in range(config.steps):
                inputs, _ = run.batch(step)
                assert len(inputs) == 4
                digest.update(inputs[2 * rank:2 * rank + 2].numpy().tobytes())
            assert seen["rank=%d" % rank] == digest.hexdigest(), (key, rank)


def test_ranks_hold_the_same_model(two_ranks):
    """After each run both ranks hold bitwise the same parameters and buffers (FAVOR+'s
    feature_seed, hence W, included), redraws every 2 steps notwithstanding."""
    states = lines(two_ranks["output"], "STATE")
    assert sorted(s[1] for s in states) == ["rank=0", "rank=0", "rank=1", "rank=1"]
    for key in two_ranks["results"]:
        digests = {s[1]: s[3] for s in states if s[2] == "key=" + key}
        assert len(digests) == 2 and digests["rank=0"] == digests["rank=1"], digests


def test_only_rank_0_writes(two_ranks):
    """Rank 0 wrote the outputs (several writes under --out, seen by the audit hook); rank 1
    none (any would have been refused, failing the run); no temporary or checkpoint is left."""
    writes = {w[1]: int(w[2].split("=")[1]) for w in lines(two_ranks["output"], "WRITES")}
    assert writes["rank=1"] == 0 and writes["rank=0"] > 10, writes
    out = two_ranks["out"]
    assert sorted(os.listdir(out)) == ["checkpoints", "curves.csv", "decode.csv",
                                       "evaluations.csv", "layers.csv", "models", "runs",
                                       "runs.csv", "samples.json", "training.json"]
    assert os.listdir(os.path.join(out, "checkpoints")) == []
    # The char_lm runs' models (training.generate), from rank 0 like the rest.
    assert sorted(os.listdir(os.path.join(out, "models"))) == [run_key("char_lm") + ".pt"]
    with open(os.path.join(out, "training.json")) as f:
        meta = json.load(f)
    assert meta["processes"] == 2 and meta["jobs"] == 1
    assert meta["command"].startswith("python3 -m torch.distributed.run (2 processes) ")
    assert "one after another, each on 2 processes" in two_ranks["output"]


def test_resume_under_two_processes(two_ranks, tmp_path):
    """Interrupted at step 6 on both ranks (the checkpoint holds step 4), then the same command
    with --resume on 2 processes: each run continues from step 4 and ends with bitwise the
    records and parameters of the uninterrupted 2-process run (its reductions are the same)."""
    out = str(tmp_path / "out")
    status, output = train(tmp_path, two_ranks["text"], out, env=dict(TRAINING_TEST_INTERRUPT="6"))
    assert status != 0
    assert output.count("training: interrupted; finished runs and checkpoints are kept") == 2
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == [run_key("char_lm") + ".pt"]
    status, output = train(tmp_path, two_ranks["text"], out, "--resume")
    assert status == 0, output[-3000:]
    resumed = saved_runs(out)
    for key, whole in two_ranks["results"].items():
        assert resumed[key]["resumed_from_step"] == (4 if key == run_key("char_lm") else None)
        assert_same_records(resumed[key], whole)
    assert sorted(lines(output, "STATE")) == sorted(lines(two_ranks["output"], "STATE"))


def test_a_backward_refused_on_one_rank_ends_the_run_on_both(two_ranks, tmp_path):
    """A kernel refusing a non-finite gradient on one rank only, mid-backward: that rank sends
    NaN in the gradients' all-reduce, so the other ends its step with NaN gradients and both end
    the run at that step, as diverged -- rank 0's reason is the refusal when it refused,
    "gradient norm nan" when rank 1 did. Nobody waits for ever, and the next runs train in
    step: equal to the uninterrupted 2-process run's."""
    out = str(tmp_path / "out")
    # char_lm seed 0 then 1, then the MQAR runs; one layer: one attention forward per step.
    # Rank 0 refuses at step 3 of the first run (forward 3), rank 1 at step 5 of the second (3 +
    # 5 = 8); the MQAR runs follow untouched.
    status, output = train(tmp_path, two_ranks["text"], out, "--seeds", "0,1",
                           env=dict(TRAINING_TEST_REFUSE="0:3,1:8"))
    assert status == 0, output[-3000:]
    assert sorted(r[1:] for r in lines(output, "REFUSED")) == [["rank=0", "forward=3"],
                                                               ["rank=1", "forward=8"]]
    results = saved_runs(out)
    first, second = (results[run_key("char_lm", seed)]["summary"] for seed in (0, 1))
    assert (first["status"], first["diverged_step"], first["steps"]) == ("diverged", 3, 2)
    assert first["diverged_reason"] == ("non-finite values in a kernel's input: linear_attention "
                                        "backward: non-finite values in grad_out (a test's)")
    assert (second["status"], second["diverged_step"], second["steps"]) == ("diverged", 5, 4)
    assert second["diverged_reason"] == "gradient norm nan"
    mqar_key = run_key("mqar")
    assert results[mqar_key]["summary"]["status"] == "complete"
    assert_same_records(results[mqar_key], two_ranks["results"][mqar_key])


def test_a_batch_that_does_not_split_is_refused_on_every_rank(tmp_path, word_text):
    """`-m training` itself on 3 processes: the --quick plan's batch of 16 does not split in 3,
    so every rank says so in one line and exits 1 (torchrun then fails) -- no rank is left
    waiting for the others."""
    text = tmp_path / "words.txt"
    text.write_text(word_text(), encoding="utf-8")
    status, output = torchrun(["-m", "training", "--text", str(text), "--tasks", "char_lm",
                               "--out", str(tmp_path / "out"), "--no-step-time"], tmp_path,
                              processes=3)
    assert status != 0
    line = ("training: the char_lm batch of 16 sequences does not split over 3 processes: use a "
            "process count that divides it")
    assert output.count(line + "\n") == 3, output[-3000:]
    assert not os.path.exists(tmp_path / "out" / "runs")
