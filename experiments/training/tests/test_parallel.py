"""training.parallel: the batch shares, the statistics' combination, and the loss weighting
derived in train.Run._forward, checked in this process by computing each rank's share in turn."""
import pytest
import torch

from training import mqar, parallel
from training.parallel import Ranks
from training.train import Run


def test_torchrun_is_detected_by_all_four_variables():
    env = dict(WORLD_SIZE="2", RANK="1", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1")
    assert parallel.under_torchrun(env)
    for name in env:
        assert not parallel.under_torchrun({k: v for k, v in env.items() if k != name})


def test_shares_are_contiguous_and_make_up_the_batch():
    inputs, targets = torch.arange(24).reshape(6, 4), torch.arange(24).reshape(6, 4) + 100
    shares = [Ranks(r, 3).share(inputs, targets) for r in range(3)]
    assert [x.tolist() for x, _ in shares] == [inputs[0:2].tolist(), inputs[2:4].tolist(),
                                               inputs[4:6].tolist()]
    assert torch.equal(torch.cat([y for _, y in shares]), targets)
    assert all(torch.equal(a, b) for a, b in zip(Ranks().share(inputs, targets), (inputs, targets)))
    with pytest.raises(ValueError, match="a batch of 6 sequences does not split over 4"):
        Ranks(1, 4).share(inputs, targets)


def test_statistics_combine_to_the_whole_batch():
    a = dict(min=0.5, nonpositive=1, below_threshold=2, count=10, threshold=1e-3)
    b = dict(min=-0.25, nonpositive=3, below_threshold=0, count=10, threshold=1e-3)
    assert parallel.combine_stats([[a, None], [b, None]]) == [
        dict(min=-0.25, nonpositive=4, below_threshold=2, count=20), None]
    one = [[a]]
    assert parallel.combine_stats(one) is one[0]


def gradients_of(run, step):
    loss, reason = run._forward(step)
    assert reason is None
    run.model.zero_grad(set_to_none=True)
    loss.backward()
    return float(loss), [p.grad.clone() for p in run.model.parameters()]


def unscored_in_first_half(batch):
    """A batch whose first half scores a quarter of its positions (the rest IGNORE): the two
    ranks' shares then hold 1 : 4 of the scored tokens."""
    def masked(step):
        inputs, targets = batch(step)
        targets = targets.clone()
        half, length = len(targets) // 2, targets.shape[1]
        targets[:half, :3 * length // 4] = mqar.IGNORE
        return inputs, targets
    return masked


@pytest.mark.parametrize("task", ["char_lm", "mqar"])
@pytest.mark.parametrize("uneven", [False, True])
def test_rank_losses_average_to_the_batch_mean(task, uneven, tiny, corpus):
    """Each rank's weighted loss on its share, as train.Run._forward computes it: the mean over
    2 ranks of these losses and of their gradients (what DistributedDataParallel applies) is the
    single process's mean loss and gradient over the whole batch, to float32 rounding (relative
    1e-5: the same terms summed in another order, ~log2(count) ulps of 6e-8 each).

    Split by sequences, the tasks' shares hold equal numbers of scored tokens (every MQAR
    sequence scores exactly `pairs` queries), so the weight is exactly 1; with IGNORE spread
    unevenly (uneven=True, as a split along the length or padding would give) it is not, and
    the shares' plain means miss the batch mean by far more than rounding."""
    config = tiny(task=task, context=16 if task == "char_lm" else 0, batch_size=8)
    data = corpus if task == "char_lm" else None
    runs = [Run(config, data)] + [Run(config, data, Ranks(r, 2)) for r in range(2)]
    if uneven:
        for run in runs:
            run.batch = unscored_in_first_half(run.batch)
    step = 1
    whole_loss, whole_grads = gradients_of(runs[0], step)
    parts = [gradients_of(run, step) for run in runs[1:]]
    assert sum(loss for loss, _ in parts) / 2 == pytest.approx(whole_loss, rel=1e-5, abs=0)
    for i, whole in enumerate(whole_grads):
        mean = (parts[0][1][i] + parts[1][1][i]) / 2
        assert torch.allclose(mean, whole, rtol=1e-5, atol=1e-5 * float(whole.abs().max()))
    _, targets = runs[0].batch(step)
    counts = [int((y != mqar.IGNORE).sum()) for y in targets.chunk(2)]
    assert (counts[0] != counts[1]) == uneven, counts
    plain = [loss / (2 * count / sum(counts)) for (loss, _), count in zip(parts, counts)]
    if uneven:
        assert abs(sum(plain) / 2 - whole_loss) > 1e-3 * whole_loss
    else:
        assert plain == [loss for loss, _ in parts]  # weight 1.0
