"""Sequence parallel training (--sequence-parallel): each sequence split along its length.

The first tests run in this process: the slices, the loss weighting of train.Run.step_loss with
slices scoring unevenly many tokens (none, for MQAR's first slice), the Decoder's switch, and the
refusals. The others launch `python3 -m torch.distributed.run --nproc_per_node 2` on 127.0.0.1
(gloo) through linrope.torch.launch (torchrun_support), each bounded by its timeout that kills
every process, and compare with a single process training the same global batch."""
import hashlib
import json
import os
import shutil

import pytest
import torch

from linrope.torch import MultiheadAttention
from training import mqar, parallel
from training.__main__ import parse, plan_problem
from training.data import load_corpus
from training.model import Decoder
from training.parallel import TrainingGroup
from training.train import Config, Run
from training.variants import from_name

from torchrun_support import (assert_records_match, assert_same_records, close, first_sweep,
                              lines, reference, saved_runs, tiny_plan, torchrun,
                              train_in_torchrun)
from torchrun_support import run_key as plan_run_key

TORCHRUN_ENVIRONMENT = dict(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")


# ---- in this process ----------------------------------------------------------------------

def test_slices_are_contiguous_cuts_of_every_sequence():
    """Every rank keeps every sequence (the batch is not divided) and the positions floor(r n/W)
    to floor((r + 1) n/W): together exactly the batch, one position more for the later ranks when
    W does not divide n. A sequence shorter than W is refused (a slice would be empty)."""
    inputs = torch.arange(21).reshape(3, 7)
    targets = inputs + 100
    for world, widths in ((2, [3, 4]), (3, [2, 2, 3]), (7, [1] * 7)):
        shares = [TrainingGroup(r, world, sequence=True).share(inputs, targets)
                  for r in range(world)]
        assert [x.shape for x, _ in shares] == [(3, w) for w in widths]
        assert torch.equal(torch.cat([x for x, _ in shares], 1), inputs)
        assert torch.equal(torch.cat([y for _, y in shares], 1), targets)
    assert TrainingGroup(1, 2, sequence=True).share(inputs, targets)[0].tolist() == \
        [[3, 4, 5, 6], [10, 11, 12, 13], [17, 18, 19, 20]]
    with pytest.raises(ValueError, match="a sequence of 7 positions does not split over 8"):
        TrainingGroup(0, 8, sequence=True).share(inputs, targets)
    # A batch of 3 sequences over 2 ranks: refused data parallel, whole sequence parallel.
    with pytest.raises(ValueError, match="a batch of 3 sequences does not split over 2"):
        TrainingGroup(0, 2).share(inputs, targets)


class StandingInForTheRanks(Run):
    """A rank's run whose logits are its model's on the whole sequences, cut to the rank's slice:
    rank's logits as the sequence parallel layers give them, differentiable along every path
    (through the earlier slices too, as the layers' backward all-reduce carries it)."""
    step = None  # the step whose batch forward() computes

    def forward(self, tokens, at=None):
        whole, _ = self.batch(self.step)
        n, world = whole.shape[1], self.group.world_size
        columns = slice(self.group.rank * n // world, (self.group.rank + 1) * n // world)
        assert torch.equal(tokens, whole[:, columns])
        with self.model.alone():  # TrainingGroup.prepare switched it on; one process does all
            logits = self.model(whole)[:, columns]
        return logits if at is None else logits[at]


@pytest.mark.parametrize("task", ["char_lm", "mqar"])
def test_slice_losses_average_to_the_batch_mean(task, tiny, corpus):
    """Each rank's loss on its slice as train.Run.step_loss weighs it: their mean over the group,
    and that of their gradients (what TrainingGroup.backward applies, d(sum_r l_r)/dtheta / W: the
    derivation in step_loss), is the single process's mean loss and gradient over the whole
    batch, to float32 rounding (relative 1e-5, as in test_parallel). The slices score unevenly:
    char_lm, 17 positions cut 8 + 9 (weights 16/17 and 18/17); MQAR with 4 pairs in 16 tokens,
    the first slice holds only the pairs and scores nothing (its mean would be 0/0: its loss is
    its sum, a zero through the model) while the second scores every query (weight 2)."""
    config = tiny(task=task, variant="favor-numerator_only", layers=2, heads=2, batch_size=3,
                  context=17 if task == "char_lm" else 0, mqar_settings=((16, 4),))
    data = corpus if task == "char_lm" else None
    whole = Run(config, data)
    step = 1
    whole_loss, whole_grads = gradients_of(whole, step)
    parts = []
    for rank in range(2):
        run = StandingInForTheRanks(config, data, TrainingGroup(rank, 2, sequence=True))
        run.step = step
        parts.append(gradients_of(run, step))
    assert sum(loss for loss, _ in parts) / 2 == pytest.approx(whole_loss, rel=1e-5, abs=0)
    for i, grad in enumerate(whole_grads):
        mean = (parts[0][1][i] + parts[1][1][i]) / 2
        assert torch.allclose(mean, grad, rtol=1e-5, atol=1e-5 * float(grad.abs().max()))
    _, targets = whole.batch(step)
    half = targets.shape[1] // 2
    counts = [int((y != mqar.IGNORE).sum()) for y in (targets[:, :half], targets[:, half:])]
    assert counts == ([24, 27] if task == "char_lm" else [0, 12]), counts
    if task == "mqar":
        assert parts[0][0] == 0.0  # and computed through the model: gradients_of checks it


def gradients_of(run, step):
    loss, reason = run.step_loss(step)
    # requires_grad: a loss computed through the model, whose backward every rank must run.
    assert reason is None and torch.isfinite(loss) and loss.requires_grad
    run.model.zero_grad(set_to_none=True)
    loss.backward()
    return float(loss), [p.grad.clone() for p in run.model.parameters()]


def softmax_reason():
    """What linrope's layer says when asked to run softmax attention sequence parallel."""
    return MultiheadAttention(16, 2, attention="softmax", causal=True).sequence_parallel_problem()


def test_the_decoder_switches_sequence_parallelism_and_evaluates_alone():
    """Decoder.sequence_parallel turns every attention layer's on, over the group; alone() turns
    them off inside (rank 0 evaluating by itself) and back on after, even when the inside raises.
    The state dict is the same either way (an attribute, not state: checkpoints do not depend on
    the mode). Softmax layers are refused with the layer's own reason."""
    model = Decoder(64, from_name("elu-full"), 16, 2, 2, seed=0)
    keys = list(model.state_dict())
    group = object()  # any group: nothing is exchanged here
    model.sequence_parallel(group)
    layers = [b.attention for b in model.blocks]
    assert all(a.sequence_parallel and a.sequence_group is group for a in layers)
    with pytest.raises(RuntimeError, match="inside"):
        with model.alone():
            assert not any(a.sequence_parallel or a.sequence_group for a in layers)
            model(torch.zeros(1, 5, dtype=torch.int64))  # no process group needed
            raise RuntimeError("inside")
    assert all(a.sequence_parallel and a.sequence_group is group for a in layers)
    assert list(model.state_dict()) == keys
    assert softmax_reason()
    with pytest.raises(ValueError) as refused:
        Decoder(64, from_name("softmax-rope"), 16, 1, 1, seed=0).sequence_parallel()
    assert str(refused.value) == "sequence parallelism: " + softmax_reason()


def test_sequence_parallel_is_refused_outside_torchrun(monkeypatch, capsys):
    """One line, exit 2: there is nothing to split the sequences over."""
    for name in TORCHRUN_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exit_:
        parse(["--sequence-parallel", "--variants", "elu-full"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        "python3 -m training: error: --sequence-parallel splits each sequence over torchrun's "
        "processes: run it under python3 -m torch.distributed.run (see --help)\n")
    with pytest.raises(ValueError, match="sequence parallelism needs torchrun"):
        parallel.from_environment(sequence=True)


@pytest.mark.parametrize("variants, named", [
    (["--variants", "elu-full,softmax-nopos"], "softmax-nopos"),
    ([], "softmax-rope"),  # --quick's variants include it
    (["--full"], "softmax-rope")])
def test_softmax_variants_are_refused(monkeypatch, capsys, variants, named):
    """Under torchrun (its variables set here), softmax variants, named or in the mode's list,
    are refused in one line (exit 2), the first of them with the layer's reason, as every rank
    parses the same command line."""
    for name, value in TORCHRUN_ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    assert parse(["--sequence-parallel", "--variants", "elu-full,favor-full"]).sequence_parallel
    with pytest.raises(SystemExit) as exit_:
        parse(["--sequence-parallel", *variants])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        "python3 -m training: error: --sequence-parallel cannot train %s: %s; choose other "
        "variants with --variants\n" % (named, softmax_reason()))


def test_sequences_shorter_than_the_process_count_are_refused(tiny, corpus):
    """plan_problem's line (on every rank alike): a sequence must give every process a position,
    the batch need not divide."""
    char_lm = tiny(variant="elu-full", context=4, batch_size=3)
    assert plan_problem([char_lm], corpus, None, True, 4) is None
    assert plan_problem([char_lm], corpus, None, True, 5) == (
        "a sequence of 4 positions does not split over 5 processes (char_lm): use at most 4 "
        "processes")
    recall = tiny(task="mqar", variant="elu-full", mqar_settings=((32, 2), (16, 2)))
    assert plan_problem([recall], None, None, True, 17) == (
        "a sequence of 16 positions does not split over 17 processes (mqar): use at most 16 "
        "processes")


# ---- under torchrun -----------------------------------------------------------------------

# Two layers (so that the second layer's input on rank 1 already depends on rank 0's slice) of
# two heads; char_lm's 17 positions cut 8 + 9; MQAR's (16, 4) leaves rank 0 only the pairs (no
# scored token: its gradient comes through its states alone), (32, 6) gives both ranks queries.
PLAN = tiny_plan(layers=2, heads=2, context=17, mqar_settings=((16, 4), (32, 6)))
# --redraw-interval 2 redraws FAVOR+'s W; elu+1 has none to redraw.
VARIANTS = ("favor-numerator_only", "elu-full")
RUN_VARIANTS = ("favor-numerator_only-redraw2", "elu-full")


def run_key(task, variant, seed=0):
    """The run's name (train.Config.key) under PLAN and --redraw-interval 2."""
    return plan_run_key(PLAN, task, variant, seed)


KEYS = sorted(run_key(task, variant) for task in ("char_lm", "mqar") for variant in RUN_VARIANTS)


def train(cwd, text, out, *extra, env=None, sequence=True):
    argv = ["--text", text, "--variants", ",".join(VARIANTS), "--redraw-interval", "2",
            "--no-step-time", *(["--sequence-parallel"] if sequence else []), *extra]
    return train_in_torchrun(cwd, PLAN, argv, out, env)


@pytest.fixture(scope="module")
def sequence_ranks(tmp_path_factory, word_text):
    """One uninterrupted sweep (char_lm and mqar, both variants) on 2 processes, sequence
    parallel."""
    return first_sweep(tmp_path_factory, "sequence", word_text, train)


def test_two_processes_give_the_single_process_curve(sequence_ranks):
    """Each run: the same steps, statuses and clip counts as one process training the same
    global batch; losses, gradient norms, denominator minima and rank 0's evaluations equal to
    float32 rounding (torchrun_support.RELATIVE, 2e-5), the denominator counts exactly (summed
    over the slices). The rounding differs from data parallel's only in where the sums are split:
    the loss's mean (over each slice, then the ranks) and each layer's causal sums (rank 1's from
    the gathered state of rank 0's keys plus its own, against one running sum). Measured here
    over the 12 steps: the loss within 3.4e-7 relative, the gradient norms 5e-7,
    the denominator minima 7e-7 -- 2e-5 is 40 times that. Attention that did not span the ranks
    (each slice from an empty state) departs from the curve by 4e-3 to 1e-2 within these 12 steps
    (measured on these runs), 200 times the tolerance; unweighted slice means give MQAR's empty
    first slice's 0/0. The worst relative loss difference per run is printed (pytest -s)."""
    assert sorted(sequence_ranks["results"]) == KEYS
    for key, saved in sequence_ranks["results"].items():
        run = reference(saved, sequence_ranks["text"])
        assert len(run.records["layers"]) == 2 * 12  # 2 layers
        worst = assert_records_match(key, saved, run)
        print("%s: largest relative loss difference, 2 processes (sequence parallel) against 1: "
              "%.2e" % (key, worst))


def test_each_rank_computes_its_slice_of_every_sequence(sequence_ranks):
    """Rank r's training forwards saw, step after step, all 4 sequences of the batch, positions
    r n/2 to (r + 1) n/2 (char_lm: 0-7 and 8-16 of 17), and both ranks end with bitwise the same
    parameters and buffers."""
    states = lines(sequence_ranks["output"], "STATE")
    for key, saved in sequence_ranks["results"].items():
        config = Config.from_dict(saved["config"])
        run = Run(config, load_corpus(sequence_ranks["text"]) if config.task == "char_lm"
                  else None)
        seen = {s[1]: s[3] for s in lines(sequence_ranks["output"], "INPUTS")
                if s[2] == "key=" + key}
        for rank in (0, 1):
            digest = hashlib.sha256()
            for step in range(config.steps):
                inputs, _ = run.batch(step)
                n = inputs.shape[1]
                assert len(inputs) == 4
                digest.update(inputs[:, rank * n // 2:(rank + 1) * n // 2].numpy().tobytes())
            assert seen["rank=%d" % rank] == digest.hexdigest(), (key, rank)
        digests = {s[1]: s[3] for s in states if s[2] == "key=" + key}
        assert len(digests) == 2 and digests["rank=0"] == digests["rank=1"], digests


def test_only_rank_0_writes_and_records_the_mode(sequence_ranks):
    """Rank 0 wrote the outputs, rank 1 nothing (any write would have been refused, failing the
    run); training.json records the processes and the mode; no checkpoint is left."""
    writes = {w[1]: int(w[2].split("=")[1]) for w in lines(sequence_ranks["output"], "WRITES")}
    assert writes["rank=1"] == 0 and writes["rank=0"] > 10, writes
    out = sequence_ranks["out"]
    assert os.listdir(os.path.join(out, "checkpoints")) == []
    with open(os.path.join(out, "training.json")) as f:
        meta = json.load(f)
    assert (meta["processes"], meta["parallel"], meta["jobs"]) == (2, "sequence", 1)
    assert meta["command"].startswith("python3 -m torch.distributed.run (2 processes) ")
    assert "--sequence-parallel" in meta["command"]
    assert "each on 2 processes (torchrun, sequence parallel)" in sequence_ranks["output"]


def test_resume_in_either_mode(sequence_ranks, tmp_path):
    """Interrupted at step 6 (the checkpoint holds step 4), then --resume: sequence parallel
    again, each run ends with bitwise the records and parameters of the uninterrupted sequence
    parallel sweep (the same reductions); data parallel instead (the checkpoint is the same in
    every mode), the first run continues from step 4 and ends on the same curve to rounding."""
    interrupted = str(tmp_path / "interrupted")
    status, output = train(tmp_path, sequence_ranks["text"], interrupted,
                           env=dict(TRAINING_TEST_INTERRUPT="6"))
    assert status != 0
    assert output.count("training: interrupted; finished runs and checkpoints are kept") == 2
    first = run_key("char_lm", RUN_VARIANTS[0])
    assert os.listdir(os.path.join(interrupted, "checkpoints")) == [first + ".pt"]
    data = str(tmp_path / "data")
    shutil.copytree(interrupted, data)

    status, output = train(tmp_path, sequence_ranks["text"], interrupted, "--resume")
    assert status == 0, output[-3000:]
    resumed = saved_runs(interrupted)
    for key, whole in sequence_ranks["results"].items():
        assert resumed[key]["resumed_from_step"] == (4 if key == first else None)
        assert_same_records(resumed[key], whole)
    assert sorted(lines(output, "STATE")) == sorted(lines(sequence_ranks["output"], "STATE"))

    status, output = train(tmp_path, sequence_ranks["text"], data, "--resume", sequence=False)
    assert status == 0, output[-3000:]
    assert "each on 2 processes (torchrun, data parallel)" in output
    resumed = saved_runs(data)[first]
    assert resumed["resumed_from_step"] == 4
    whole = sequence_ranks["results"][first]["records"]["curves"]
    assert len(resumed["records"]["curves"]) == len(whole) == 12
    for got, want in zip(resumed["records"]["curves"], whole):
        assert close(got["train_loss"], want["train_loss"]), (got, want)


def test_a_backward_refused_on_one_rank_ends_the_run_on_both(sequence_ranks, tmp_path):
    """A kernel refusing a non-finite gradient on one rank only, mid-backward, while the other
    rank blocks in an attention layer's state all-reduce: the refusing rank joins the
    all-reduces it skipped (with NaN: linrope.torch.distributed.record_exchanges), then sends NaN
    in the gradients' all-reduce, so that both end the run as diverged at that step, and the
    next run trains in step. The two layers' forwards are counted over the process, two per
    step: rank 0 refuses at step 3 of the first run (forward 5: layer 0, after layer 1's
    all-reduce), rank 1 at step 5 of the second (3 x 2 + 4 x 2 + 2 = 16: layer 1, before
    either). The NaN reaching the other rank through the all-reduce makes its kernels refuse
    too: it then joins the rest the same way."""
    out = str(tmp_path / "out")
    status, output = train(tmp_path, sequence_ranks["text"], out, "--variants", VARIANTS[0],
                           "--tasks", "char_lm", "--seeds", "0,1",
                           env=dict(TRAINING_TEST_REFUSE="0:5,1:16"))
    assert status == 0, output[-3000:]
    assert sorted(r[1:] for r in lines(output, "REFUSED")) == [["rank=0", "forward=5"],
                                                               ["rank=1", "forward=16"]]
    results = saved_runs(out)
    first, second = (results[run_key("char_lm", RUN_VARIANTS[0], seed)]["summary"]
                     for seed in (0, 1))
    assert (first["status"], first["diverged_step"], first["steps"]) == ("diverged", 3, 2)
    assert first["diverged_reason"] == ("non-finite values in a kernel's input: linear_attention "
                                        "backward: non-finite values in grad_out (a test's)")
    assert (second["status"], second["diverged_step"], second["steps"]) == ("diverged", 5, 4)
    assert second["diverged_reason"].startswith("non-finite values in a kernel's input")


def test_softmax_is_refused_on_every_rank(tmp_path, word_text):
    """`-m training --sequence-parallel` on 2 processes with the --quick variants (softmax-rope
    among them): the ranks print the one line and exit 2 before joining the process group, and
    torchrun ends (within the timeout) with a failure. torchrun stops the other workers as soon
    as one exits with an error, so on a loaded machine the second rank may be stopped before it
    prints: one line or two."""
    text = tmp_path / "words.txt"
    text.write_text(word_text(), encoding="utf-8")
    status, output = torchrun(["-m", "training", "--sequence-parallel", "--text", str(text),
                               "--out", str(tmp_path / "out")], tmp_path)
    assert status != 0
    line = ("python3 -m training: error: --sequence-parallel cannot train softmax-rope: %s; "
            "choose other variants with --variants\n" % softmax_reason())
    assert output.count(line) in (1, 2), output[-3000:]
    assert not os.path.exists(tmp_path / "out")
