"""training.train: one run -- learning, the schedule, divergence, clipping, the denominator
statistics, and resuming from a checkpoint bit for bit."""
import math
import os

import pytest
import torch
import torch.nn.functional as F

import linrope
from training import mqar
from training.train import TIMING, Run, RunHooks, learning_rate, loss_of


class Stop(Exception):
    """Raised from a progress callback to interrupt a run, as a kill between steps would."""


def stop_at(step):
    def progress(run):
        if run.step >= step:
            raise Stop
    return progress


def trained_until(config, corpus, steps, checkpoint=None):
    """A Run of `config` interrupted after `steps` optimiser steps (log_every must be 1 so the
    progress callback sees every step)."""
    assert config.log_every == 1
    run = Run(config, corpus)
    with pytest.raises(Stop):
        run.train(checkpoint=checkpoint, progress=stop_at(steps))
    assert run.step == steps
    return run


def same_tensors(a, b):
    """Bitwise equality of two state dicts (nested in the optimiser's case)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_tensors(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def same_records(a, b):
    """Records equal except the wall-clock time. NaN (a diverged step's gradient norm) equals
    NaN here."""
    strip = {k: v for k, v in a.items() if k not in TIMING}
    other = {k: v for k, v in b.items() if k not in TIMING}
    return repr(strip) == repr(other)


# ---- learning -------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["softmax-rope", "favor-numerator_only",
                                     "elu-numerator_only", "favor-full"])
def test_a_few_steps_lower_the_loss(variant, tiny, corpus):
    """30 steps on random words: the training loss falls from ~ln(14) = 2.64 to ~1.5 (ratio
    0.52-0.57 over seeds 0-3 and these variants; asserted < 0.7), and the validation bpc falls
    between the evaluations at steps 10 and 30 (by ~0.8 bit; asserted 15%). The gradients
    reach every part of the model through linrope's backward."""
    config = tiny(variant=variant, steps=30, batch_size=8, context=32, warmup=3, eval_every=10)
    run = Run(config, corpus)
    summary = run.train()
    curves = run.records["curves"]
    assert summary["status"] == "complete" and summary["steps"] == 30
    assert len(curves) == 30
    first, last = curves[0]["train_loss"], curves[-1]["train_loss"]
    assert abs(first - math.log(corpus.vocab_size)) < 0.2  # a fresh model is near uniform
    assert last < 0.7 * first, (first, last)
    assert summary["final_train_loss"] == last
    bpc = [e["value"] for e in run.records["evaluations"] if e["length"] == 32]
    assert len(bpc) == 3
    assert bpc[-1] < 0.85 * bpc[0], bpc


def test_runs_are_deterministic(tiny, corpus):
    """Two runs of one configuration give bitwise the same records and parameters (batches from
    (seed, step), initialisation and FAVOR+ W from the seed); another seed gives others."""
    config = tiny(variant="favor-numerator_only")
    a, b = Run(config, corpus), Run(config, corpus)
    assert same_tensors(a.model.state_dict(), b.model.state_dict())
    a.train()
    b.train()
    assert same_records(a.records, b.records)
    assert same_tensors(a.model.state_dict(), b.model.state_dict())
    c = Run(tiny(variant="favor-numerator_only", seed=1), corpus)
    assert not torch.equal(c.model.embedding.weight, Run(config, corpus).model.embedding.weight)


def test_char_lm_evaluations(tiny, corpus):
    """bpc at the training context every eval_every steps, and at the end also at each
    extrapolation multiple, flagged final; bits per character are positive and below
    log2(vocabulary) + 1 for a barely trained model."""
    run = Run(tiny(), corpus)  # 12 steps, eval_every 4, extrapolation (1, 2), context 16
    run.train()
    rows = [(e["step"], e["final"], e["length"], e["metric"]) for e in run.records["evaluations"]]
    assert rows == [(4, False, 16, "bpc"), (8, False, 16, "bpc"), (12, True, 16, "bpc"),
                    (12, True, 32, "bpc")]
    for e in run.records["evaluations"]:
        assert 0 < e["value"] < math.log2(corpus.vocab_size) + 1
        assert e["pairs"] is None


def test_mqar_run_evaluates_each_setting(tiny):
    """An MQAR run trains the settings in turn and reports the accuracy of each (length, pairs)
    on its held-out set, a share in [0, 1]; tokens are counted at the settings' mean length."""
    config = tiny(task="mqar", context=0, variant="favor-numerator_only", steps=4, eval_every=2)
    run = Run(config)
    summary = run.train()
    assert summary["status"] == "complete"
    rows = [(e["step"], e["final"], e["length"], e["pairs"], e["metric"])
            for e in run.records["evaluations"]]
    assert rows == [(2, False, 16, 2, "accuracy"), (2, False, 32, 4, "accuracy"),
                    (4, True, 16, 2, "accuracy"), (4, True, 32, 4, "accuracy")]
    assert all(0.0 <= e["value"] <= 1.0 for e in run.records["evaluations"])
    expected_tokens = 4 * config.batch_size * (16 + 32) / 2
    assert summary["tokens_per_s"] == pytest.approx(expected_tokens / summary["train_seconds"])


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_mqar_loss_from_the_scored_positions_logits_is_the_whole_sequences(reduction, tiny):
    """loss_of computes the logits of MQAR's scored positions only; its loss and gradients are
    those of the logits at every position with the others ignored (F.cross_entropy's
    ignore_index), to rounding. In float64, so that rounding is far below any real difference
    (a wrong position changes the loss by O(1)): the same terms summed in another order, each
    loss and gradient entry a sum over at most K = the batch's tokens x the model's width, which
    reordering changes by at most 2 K 2^-53 of its terms' magnitudes; those taken as <= 8 x the
    largest entry (the cancellation allowed)."""
    config = tiny(task="mqar", context=0, variant="elu-numerator_only", steps=1)
    run = Run(config)
    run.model.double()
    inputs, targets = run.batch(0)
    assert 0 < int((targets != mqar.IGNORE).sum()) < targets.numel()

    def loss_and_gradients(loss):
        run.model.zero_grad()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in run.model.parameters()]

    fast, fast_grads = loss_and_gradients(loss_of(run.forward, inputs, targets, reduction))
    logits = run.model(inputs)
    assert logits.dtype == torch.float64
    whole, whole_grads = loss_and_gradients(F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=mqar.IGNORE,
        reduction=reduction))
    tolerance = 2 * inputs.numel() * config.d_model * 2.0 ** -53 * 8
    assert abs(float(fast - whole)) <= tolerance * abs(float(whole))
    for a, b in zip(fast_grads, whole_grads):
        assert float((a - b).abs().max()) <= tolerance * float(b.abs().max())


def test_mqar_run_stops_at_the_first_evaluation_reaching_the_stop_accuracy(tiny):
    """stop_accuracy 0 (every accuracy reaches it): the run ends at its first evaluation, whose
    rows become its final ones, target_step there; unreachable (above 1) it runs to its cap.
    Either way the summary gives the final accuracy (the worst setting's) and the state size."""
    config = tiny(task="mqar", context=0, variant="elu-numerator_only", steps=8, eval_every=2,
                  stop_accuracy=0.0)
    run = Run(config)
    summary = run.train()
    assert (summary["steps"], summary["target_step"], summary["status"]) == (2, 2, "complete")
    assert [(e["step"], e["final"]) for e in run.records["evaluations"]] == [(2, True), (2, True)]
    assert summary["final_accuracy"] == min(e["value"] for e in run.records["evaluations"])
    assert summary["steps_to_0.9"] is None or summary["steps_to_0.9"] == 2
    never = Run(tiny(task="mqar", context=0, variant="elu-numerator_only", steps=8,
                     eval_every=2, stop_accuracy=1.5)).train()
    assert (never["steps"], never["target_step"]) == (8, None)
    assert summary["state_floats"] == never["state_floats"] > 0


def test_steps_to_an_accuracy_are_the_first_evaluated_steps_every_setting_reaches_it(tiny):
    """steps_to_0.9 and steps_to_0.99: the first evaluated step at which every setting's
    accuracy reached the threshold (None: never); final_accuracy the worst setting's final."""
    run = Run(tiny(task="mqar", context=0, variant="elu-numerator_only"))
    rows = [(2, False, 16, 0.95), (2, False, 32, 0.5), (4, False, 16, 0.92),
            (4, False, 32, 0.91), (6, True, 16, 1.0), (6, True, 32, 0.98)]
    run.records["evaluations"] = [dict(step=step, final=final, length=n, value=value)
                                  for step, final, n, value in rows]
    assert run._recall() == {"final_accuracy": 0.98, "target_step": None, "steps_to_0.9": 4,
                             "steps_to_0.99": None}


# ---- learning rate --------------------------------------------------------------------------

def test_learning_rate_warms_up_linearly_then_decays_to_a_tenth(tiny):
    """lr(step) = lr (step + 1) / warmup during warm-up, the peak lr at the end of it, then a
    cosine that decreases monotonically to 0.1 lr at step == steps."""
    config = tiny(steps=100, warmup=10, lr=3e-3)
    lr = [learning_rate(config, s) for s in range(101)]
    for s in range(10):
        assert lr[s] == pytest.approx(3e-3 * (s + 1) / 10, rel=1e-12)
    assert lr[9] == pytest.approx(3e-3, rel=1e-12)   # the last warm-up step reaches the peak
    assert lr[10] == pytest.approx(3e-3, rel=1e-12)  # and the decay starts from it
    assert all(a > b for a, b in zip(lr[10:], lr[11:]))
    assert lr[55] == pytest.approx(3e-3 * 0.55, rel=1e-12)  # the cosine's midpoint
    assert lr[100] == pytest.approx(3e-4, rel=1e-12)
    assert learning_rate(config, 150) == pytest.approx(3e-4, rel=1e-12)  # and stays there
    assert min(lr) > 0


def test_training_uses_the_schedule(tiny, corpus):
    """The optimiser's lr at each step is learning_rate(config, step), as logged."""
    config = tiny(steps=6, warmup=3)
    run = Run(config, corpus)
    run.train()
    assert [row["scheduled_lr"] for row in run.records["curves"]] == [
        learning_rate(config, s) for s in range(6)]
    assert run.optimiser.param_groups[0]["lr"] == learning_rate(config, 5)


# ---- divergence -----------------------------------------------------------------------------

class Poisoned(Run):
    """A run whose training forward number `at_call` (0-based: the training step, as
    evaluations do not go through Run.forward) gives logits poisoned by how(model, logits)."""

    def __init__(self, config, corpus, at_call, how):
        super().__init__(config, corpus)
        self.at_call, self.how, self.calls = at_call, how, 0

    def forward(self, tokens, at=None):
        logits = super().forward(tokens, at)
        self.calls += 1
        return self.how(self.model, logits) if self.calls == self.at_call + 1 else logits


def nan_loss(model, logits):
    return logits * float("nan")


def nan_gradient(model, logits):
    # sqrt's derivative at 0 is infinite, times 0 is NaN: the loss stays finite, the gradient
    # of the final norm's weight becomes NaN (and nothing non-finite reaches linrope's backward).
    w = model.final_norm.weight
    return logits + torch.sqrt(w.sum() * 0.0) * 0.0


@pytest.mark.parametrize("how,reason", [(nan_loss, "loss nan"),
                                        (nan_gradient, "gradient norm nan")])
@pytest.mark.parametrize("variant", ["softmax-rope", "elu-full"])
def test_divergence_ends_the_run_at_the_first_non_finite_step(tiny, corpus, how, reason,
                                                              variant):
    """A NaN loss (or a finite loss with a NaN gradient) at step 7 (steps count from 1: the k-th
    update) ends the run there: status "diverged", diverged_step 7 and the reason, no exception;
    the 6 steps before are kept (curves, the evaluation at step 4, layer rows up to the diverged
    step's, with NaN gradient norms) and the poisoned step is never applied -- the parameters
    and the optimiser state are bitwise those of an uninterrupted run after 6 steps."""
    config = tiny(variant=variant)
    reference = trained_until(config, corpus, 6)
    run = Poisoned(config, corpus, 6, how)
    summary = run.train()
    assert run.calls == 7  # stopped at once
    assert summary["status"] == "diverged"
    assert summary["diverged_step"] == 7 and summary["steps"] == 6
    assert summary["diverged_reason"] == reason
    assert [row["step"] for row in run.records["curves"]] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(row["train_loss"]) for row in run.records["curves"])
    assert [e["step"] for e in run.records["evaluations"]] == [4]
    layers = run.records["layers"]
    assert [row["step"] for row in layers] == [1, 2, 3, 4, 5, 6, 7]
    assert math.isfinite(layers[-2]["grad_norm"])
    # Measured before clipping, from the gradients the failed step computed: none when the loss
    # itself was NaN (no backward ran); the attention's own, finite, when only the final norm's
    # weight got a NaN gradient.
    assert (math.isnan if how is nan_loss else math.isfinite)(layers[-1]["grad_norm"])
    assert same_tensors(run.model.state_dict(), reference.model.state_dict())
    assert same_tensors(run.optimiser.state_dict()["state"],
                        reference.optimiser.state_dict()["state"])
    assert summary["clip_share"] == reference.summary()["clip_share"]
    # Training a diverged run again does nothing.
    assert run.train()["steps"] == 6 and run.calls == 7


def test_huge_learning_rate_diverges_without_an_exception(tiny, corpus):
    """lr = 1e20 drives the loss to NaN within a few steps (at step 3 for every variant, task
    and seed tried); the run reports it, keeping the finite steps before."""
    for variant in ("softmax-rope", "favor-numerator_only"):
        run = Run(tiny(variant=variant, lr=1e20), corpus)
        summary = run.train()
        assert summary["status"] == "diverged"
        k = summary["diverged_step"]
        assert 1 <= k <= 12 and summary["diverged_reason"].startswith(("loss", "gradient norm"))
        assert len(run.records["curves"]) == k - 1 == summary["steps"]
        assert all(math.isfinite(row["train_loss"]) for row in run.records["curves"])


def test_realistic_divergence_is_recorded_not_raised(tiny, corpus):
    """lr = 1e3 overflows the activations within a few steps: here the loss is still finite when
    its gradient turns NaN, which linrope's backward refuses (linrope.NonFiniteError). That is
    recorded as the divergence, at its step, never raised. Which check fires first, and at which
    step, depends on the CPU's rounding (the kernels' instruction sets), so either recorded form
    is accepted: the refusal's reason, or a non-finite loss or gradient norm."""
    run = Run(tiny(lr=1e3), corpus)
    summary = run.train()
    assert summary["status"] == "diverged"
    assert summary["diverged_step"] == run.step + 1  # the failing step was not applied
    reason = summary["diverged_reason"]
    assert (reason.startswith("non-finite values in a kernel's input: ")
            or reason in ("loss nan", "loss inf", "gradient norm nan", "gradient norm inf")), reason


class Refusing(Run):
    """A run whose training forward of step `at` raises `error`, as a kernel refusing its input
    does."""

    def __init__(self, config, corpus, at, error):
        super().__init__(config, corpus)
        self.at, self.error = at, error

    def forward(self, tokens, at=None):
        if self.step == self.at:
            raise self.error
        return super().forward(tokens, at)


def test_a_kernel_refusing_non_finite_input_is_a_divergence_by_its_type(tiny, corpus):
    """linrope.NonFiniteError (a ValueError) ends the run as diverged at that step, its first
    line the reason; any other ValueError is a failure, raised, even when its text speaks of
    non-finite values: the error's type decides, not its message."""
    refusal = linrope.NonFiniteError("linear_attention: q holds non-finite values\nmore")
    run = Refusing(tiny(), corpus, 3, refusal)
    summary = run.train()
    assert (summary["status"], summary["diverged_step"], summary["steps"]) == ("diverged", 4, 3)
    assert summary["diverged_reason"] == ("non-finite values in a kernel's input: "
                                          "linear_attention: q holds non-finite values")
    with pytest.raises(ValueError, match="non-finite values"):
        Refusing(tiny(), corpus, 3, ValueError("non-finite values, but no kernel's")).train()


# ---- clipping -------------------------------------------------------------------------------

def test_clip_share_counts_the_clipped_steps(tiny, corpus):
    """clip = 1e-6 clips every step (share 1, counted step by step); clip = 1e9 none (share 0);
    clip = 1.5 some (2 of 12 steps here): exactly the steps whose logged gradient norm (before
    clipping) exceeds the threshold."""
    run = Run(tiny(clip=1e-6, steps=5), corpus)
    summary = run.train()
    assert summary["clip_share"] == 1.0
    assert [row["clipped_so_far"] for row in run.records["curves"]] == [1, 2, 3, 4, 5]
    assert all(row["grad_norm"] > 1e-6 for row in run.records["curves"])
    assert Run(tiny(clip=1e9, steps=5), corpus).train()["clip_share"] == 0.0

    run = Run(tiny(clip=1.5), corpus)
    summary = run.train()
    above = [row["grad_norm"] > 1.5 for row in run.records["curves"]]
    assert 0 < sum(above) < len(above)  # a mixture, or the check below proves little
    assert summary["clip_share"] == sum(above) / 12
    running = [sum(above[:i + 1]) for i in range(12)]
    assert [row["clipped_so_far"] for row in run.records["curves"]] == running


# ---- denominator statistics -----------------------------------------------------------------

def test_softmax_has_no_denominator_statistics(tiny, corpus):
    """Softmax rows carry the attention's gradient norm but no denominator statistics, and the
    summary has no layer<i>_den_* columns."""
    run = Run(tiny(layers=2, steps=4), corpus)
    summary = run.train()
    rows = run.records["layers"]
    assert [(r["step"], r["layer"]) for r in rows] == [(s, i) for s in range(1, 5) for i in (0, 1)]
    for row in rows:
        assert row["den_min"] is None and row["nonpositive_share"] is None
        assert row["tiny_share"] is None
        assert math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0
    assert not any(k.startswith("layer") for k in summary)
    assert all(s is None for s in run.model.denominator_stats())


@pytest.mark.parametrize("variant", ["favor-numerator_only", "elu-numerator_only", "favor-full",
                                     "cos-full", "elu-none"])
def test_linear_denominator_statistics_per_layer(variant, tiny, corpus):
    """Linear variants record, per logged step and layer, the smallest denominator and the
    shares of non-positive and tiny ones (in [0, 1]); the summary's layer<i>_den_min is the
    smallest over all steps (here every step is logged, so the rows' minimum) and its shares are
    the pooled counts (equal batches: the mean of the rows' shares)."""
    run = Run(tiny(variant=variant, layers=2, steps=6), corpus)
    summary = run.train()
    rows = run.records["layers"]
    assert [(r["step"], r["layer"]) for r in rows] == [(s, i) for s in range(1, 7) for i in (0, 1)]
    for layer in (0, 1):
        layer_rows = [r for r in rows if r["layer"] == layer]
        for r in layer_rows:
            assert math.isfinite(r["den_min"])
            assert 0.0 <= r["nonpositive_share"] <= 1.0 and 0.0 <= r["tiny_share"] <= 1.0
            assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
        assert summary["layer%d_den_min" % layer] == min(r["den_min"] for r in layer_rows)
        for share in ("nonpositive_share", "tiny_share"):
            assert summary["layer%d_%s" % (layer, share)] == pytest.approx(
                sum(r[share] for r in layer_rows) / len(layer_rows), abs=1e-12)
    assert "layer2_den_min" not in summary


@pytest.mark.parametrize("variant", ["favor-numerator_only", "elu-numerator_only"])
def test_numerator_only_denominators_stay_positive(variant, tiny, corpus):
    """RoFormer's eq. 19 leaves the denominator unrotated: with positive features (FAVOR+,
    elu+1) it is a sum of positive terms, so no step of any layer sees one <= 0 -- even in
    training hard enough (lr 3e-2, context 64) that the 'full' placement's do (next test)."""
    run = Run(tiny(variant=variant, steps=20, batch_size=8, context=64, lr=3e-2, layers=2,
                   heads=2, eval_every=100, extrapolation=(1,)), corpus)
    summary = run.train()
    assert summary["status"] == "complete"
    assert len(run.records["layers"]) == 40
    for row in run.records["layers"]:
        assert row["nonpositive_share"] == 0.0 and row["den_min"] > 0
    assert summary["layer0_nonpositive_share"] == summary["layer1_nonpositive_share"] == 0.0


@pytest.mark.parametrize("variant", ["favor-full", "elu-full"])
def test_full_placement_denominators_can_be_nonpositive(variant, tiny, corpus):
    """With RoPE on the denominator too ('full'), rotated positive features can cancel: in the
    same training as above at lr 0.1 some denominators are <= 0 (measured with the untied output
    layer: in every layer of seeds 0-7 but one, for both; at lr 3e-2, as before the output layer
    was untied, in none of elu-full's and one of favor-full's), and a layer's share is > 0 exactly
    when its smallest denominator is <= 0."""
    seen = 0
    for seed in range(4):
        summary = Run(tiny(variant=variant, seed=seed, steps=20, batch_size=8, context=64,
                           lr=1e-1, layers=2, heads=2, eval_every=100, extrapolation=(1,)),
                      corpus).train()
        for layer in (0, 1):
            share = summary["layer%d_nonpositive_share" % layer]
            assert (share > 0) == (summary["layer%d_den_min" % layer] <= 0)
            seen += share > 0
    assert seen > 0


# ---- checkpoints and resume -----------------------------------------------------------------

@pytest.mark.parametrize("variant", ["softmax-rope", "favor-numerator_only",
                                     "favor-full-redraw3"])
def test_resumed_run_equals_an_uninterrupted_one(variant, tiny, corpus, tmp_path):
    """Interrupted after step 6 (last checkpoint at step 4), then continued by a new Run from the
    checkpoint: curves, layer rows, evaluations, clip count, denominator totals, the parameters
    (FAVOR+'s current W included, with redraws every 3 steps) and the optimiser state are
    bitwise those of a run never interrupted."""
    config = tiny(variant=variant)
    whole = Run(config, corpus)
    whole_summary = whole.train()

    path = str(tmp_path / "run.pt")
    trained_until(config, corpus, 6, checkpoint=path)
    assert os.listdir(tmp_path) == ["run.pt"]  # written atomically: no temporary left
    resumed = Run(config, corpus)
    assert resumed.load(path) is True
    assert resumed.step == 4
    summary = resumed.train(checkpoint=path)

    assert same_records(resumed.records, whole.records)
    assert same_tensors(resumed.model.state_dict(), whole.model.state_dict())
    assert same_tensors(resumed.optimiser.state_dict(), whole.optimiser.state_dict())
    assert {k: v for k, v in summary.items() if k not in TIMING} == \
        {k: v for k, v in whole_summary.items() if k not in TIMING}
    if config.variant.redraw_interval:
        seeds = [int(b.attention.feature_seed) for b in resumed.model.blocks]
        assert seeds == [int(b.attention.feature_seed) for b in whole.model.blocks]
        assert seeds[0] != 0  # W was redrawn (layer 0's first seed is 1000 x 0 + 0)


def test_a_run_trained_in_parts_equals_one_trained_whole(tiny, corpus):
    """train(stop_after=k) returns after k steps of the schedule (config.steps, not k, sets the
    learning rates and which step is the last, logged whatever log_every says); calls of 5, 0
    and the rest give bitwise the run of one call. RunHooks.stepped sees every step once, in
    order, after its records; a call cut short returns None and leaves finished unseen, the last
    returns the summary once finished has seen the run."""
    config = tiny(steps=13, log_every=3)
    whole = Run(config, corpus)
    whole_summary = whole.train()

    class Seen(RunHooks):
        def __init__(self):
            self.steps, self.rows, self.finished_at = [], [], []

        def stepped(self, run):
            self.steps.append(run.step)
            self.rows.append(len(run.records["curves"]))

        def finished(self, run):
            self.finished_at.append(run.step)

    seen = Seen()
    parts = Run(config, corpus, hooks=seen)
    for count, expected_step in ((5, 5), (0, 5)):
        assert parts.train(stop_after=count) is None
        assert parts.step == expected_step and seen.finished_at == []
    summary = parts.train(stop_after=10 ** 6)
    assert parts.step == config.steps and seen.finished_at == [config.steps]
    assert {k: v for k, v in summary.items() if k not in TIMING} == \
        {k: v for k, v in whole_summary.items() if k not in TIMING}
    assert seen.steps == list(range(1, config.steps + 1))
    # Rows at steps 3, 6, 9, 12, and at 13, the schedule's last.
    assert seen.rows == [step // 3 + (step == config.steps) for step in seen.steps]
    assert same_records(parts.records, whole.records)
    assert same_tensors(parts.model.state_dict(), whole.model.state_dict())
    assert same_tensors(parts.optimiser.state_dict(), whole.optimiser.state_dict())


def test_checkpoint_at_the_end_resumes_to_nothing(tiny, corpus, tmp_path):
    """A run whose last checkpoint is its last step continues to nothing and keeps its numbers."""
    config = tiny(steps=8)
    path = str(tmp_path / "run.pt")
    done = Run(config, corpus)
    done.train(checkpoint=path)
    again = Run(config, corpus)
    assert again.load(path) and again.step == 8
    again.train()
    assert same_records(again.records, done.records)


def test_load_refuses_a_checkpoint_of_another_configuration(tiny, corpus, tmp_path):
    """A checkpoint is used only by the configuration that wrote it; otherwise load() returns
    False and leaves the run untouched (step 0, its own initial parameters)."""
    path = str(tmp_path / "run.pt")
    trained_until(tiny(), corpus, 5, checkpoint=path)  # checkpoint at step 4
    for other in (tiny(lr=2e-2), tiny(seed=1), tiny(steps=13), tiny(variant="softmax-nopos")):
        run = Run(other, corpus)
        fresh = Run(other, corpus)
        assert run.load(path) is False
        assert run.step == 0 and run.records["curves"] == []
        assert same_tensors(run.model.state_dict(), fresh.model.state_dict())
    assert Run(tiny(), corpus).load(path) is True


def test_resume_with_checkpoints_between_log_rows(tiny, corpus, tmp_path):
    """log_every 3, checkpoint_every 2: interrupted after step 6, resumed from step 4; the row at
    step 6 should average the losses of steps 4-6 as in the uninterrupted run."""
    config = tiny(log_every=3, checkpoint_every=2)
    whole = Run(config, corpus)
    whole.train()
    path = str(tmp_path / "run.pt")
    run = Run(config, corpus)
    with pytest.raises(Stop):
        run.train(checkpoint=path, progress=stop_at(6))
    resumed = Run(config, corpus)
    assert resumed.load(path) and resumed.step == 4
    resumed.train()
    assert same_tensors(resumed.model.state_dict(), whole.model.state_dict())  # holds
    # The loss window since the last curve row is checkpointed: step 6's row averages 4-6.
    assert resumed.records["curves"] == whole.records["curves"]


def test_a_run_refuses_a_text_other_than_its_configured_one(tiny, corpus):
    """The corpus digest is part of the configuration (so --resume never mixes texts): a Run
    given another text raises, naming both digests."""
    with pytest.raises(ValueError, match="not the one this run was configured for"):
        Run(tiny(text_digest="0" * 16), corpus)
    assert Run(tiny(text_digest=corpus.digest), corpus).step == 0
