"""training.mqar: the multi-query associative recall generator, checked sequence by sequence
against the task's definition re-derived here (Zoology's multiquery_ar), not against the code."""
import numpy as np
import pytest
import torch

from training import mqar

IGNORE = -100  # the label every unscored position carries (PyTorch's cross-entropy default)

SETTINGS = [(16, 2, 64), (32, 4, 64), (64, 4, 128), (64, 16, 97), (128, 8, 512), (12, 3, 13)]


def check_sequence(inputs, targets, length, pairs, vocab):
    """Asserts the MQAR rules for one sequence (1-D int arrays):
      * the prefix is k1 v1 k2 v2 ...: keys in [1, vocab // 2), values in [vocab // 2, vocab),
        keys distinct, values distinct;
      * exactly `pairs` positions are scored (target != IGNORE), all in the filler after the
        prefix, at even offsets from its end;
      * at a scored position the input is a key of the prefix and the target is that key's
        value from the prefix; every key is queried exactly once;
      * every token is in [0, vocab)."""
    half = vocab // 2
    context = 2 * pairs
    assert inputs.shape == targets.shape == (length,)
    assert ((0 <= inputs) & (inputs < vocab)).all()
    keys, values = inputs[0:context:2], inputs[1:context:2]
    assert ((1 <= keys) & (keys < half)).all(), keys
    assert ((half <= values) & (values < vocab)).all(), values
    assert len(set(keys.tolist())) == pairs and len(set(values.tolist())) == pairs
    value_of = dict(zip(keys.tolist(), values.tolist()))

    scored = np.flatnonzero(targets != IGNORE)
    assert len(scored) == pairs
    assert (scored >= context).all() and ((scored - context) % 2 == 0).all()
    queried = []
    for t in scored:
        key = int(inputs[t])
        assert key in value_of, "position %d queries %d, not a key of the prefix" % (t, key)
        assert targets[t] == value_of[key]
        queried.append(key)
    assert sorted(queried) == sorted(value_of)  # each key exactly once
    # Unscored positions are all IGNORE (nothing else leaks into the loss).
    unscored = np.ones(length, dtype=bool)
    unscored[scored] = False
    assert (targets[unscored] == IGNORE).all()


@pytest.mark.parametrize("length,pairs,vocab", SETTINGS)
@pytest.mark.parametrize("seed", [0, 1, 7])
def test_batch_follows_the_mqar_definition(length, pairs, vocab, seed):
    """Every sequence of batches drawn for several shapes and seeds obeys the rules above."""
    assert mqar.IGNORE == IGNORE
    x, y = mqar.batch(np.random.default_rng(seed), 8, length, pairs, vocab)
    assert x.shape == y.shape == (8, length)
    assert x.dtype == y.dtype == torch.int64
    for inputs, targets in zip(x.numpy(), y.numpy()):
        check_sequence(inputs, targets, length, pairs, vocab)


def test_sequences_differ_within_a_batch():
    """Each row draws its own keys, values and query places."""
    x, y = mqar.batch(np.random.default_rng(0), 16, 64, 8, 128)
    assert len({tuple(row) for row in x[:, :16].tolist()}) == 16
    assert len({tuple(np.flatnonzero(row != IGNORE)) for row in y.numpy()}) > 1


def test_queries_come_soon_after_the_pairs():
    """Query gaps g are drawn with probability proportional to g^(a - 1), a = 0.01: heavily
    skewed to small g. Over 256 sequences of length 256 with 4 pairs (124 possible gaps), far
    more than half of the queries fall in the first quarter of the filler (uniform: a quarter)."""
    length, pairs = 256, 4
    _, y = mqar.batch(np.random.default_rng(3), 256, length, pairs, 512)
    gaps = (np.nonzero(y.numpy() != IGNORE)[1] - 2 * pairs) // 2
    space = (length - 2 * pairs) // 2
    assert gaps.min() >= 0 and gaps.max() < space
    assert np.mean(gaps < space // 4) > 0.6


@pytest.mark.parametrize("vocab,length,pairs", [
    (64, 15, 2),     # odd length
    (64, 16, 5),     # 4 x pairs > length
    (64, 16, 0),     # no pairs
    (16, 16, 2),     # vocab == length
    (10, 16, 2),     # vocab < length
])
def test_check_rejects_impossible_settings(vocab, length, pairs):
    """Odd lengths, too many pairs for the length, no pairs, and a vocabulary not larger than
    the length are refused with ValueError, both by check() and by batch()."""
    with pytest.raises(ValueError, match="MQAR needs"):
        mqar.check(vocab, length, pairs)
    with pytest.raises(ValueError, match="MQAR needs"):
        mqar.batch(np.random.default_rng(0), 2, length, pairs, vocab)


def test_check_accepts_the_boundary_cases():
    """length == 4 x pairs and vocab == length + 1 are allowed (and make valid batches)."""
    mqar.check(17, 16, 4)
    x, y = mqar.batch(np.random.default_rng(0), 4, 16, 4, 17)
    for inputs, targets in zip(x.numpy(), y.numpy()):
        check_sequence(inputs, targets, 16, 4, 17)


def test_training_batch_cycles_through_the_settings_and_is_deterministic():
    """Step s trains settings[s % len(settings)]; the batch depends on (seed, step) only."""
    settings = ((16, 2), (32, 4), (64, 8))
    for step in range(7):
        length, pairs = settings[step % 3]
        x, y = mqar.training_batch(5, step, 4, settings, 128)
        assert x.shape == (4, length)
        for inputs, targets in zip(x.numpy(), y.numpy()):
            check_sequence(inputs, targets, length, pairs, 128)
        again = mqar.training_batch(5, step, 4, settings, 128)
        assert torch.equal(x, again[0]) and torch.equal(y, again[1])
    # Same setting at steps 0 and 3, different batches; another seed, another batch.
    assert not torch.equal(mqar.training_batch(5, 0, 4, settings, 128)[0],
                           mqar.training_batch(5, 3, 4, settings, 128)[0])
    assert not torch.equal(mqar.training_batch(5, 0, 4, settings, 128)[0],
                           mqar.training_batch(6, 0, 4, settings, 128)[0])


def test_test_set_is_deterministic_and_not_a_training_batch():
    """The held-out set is reproducible and drawn from its own stream: none of the first 50
    training batches of that setting (same seed) shares a sequence with it."""
    length, pairs, vocab = 32, 4, 64
    x, y = mqar.test_set(0, 16, length, pairs, vocab)
    x2, y2 = mqar.test_set(0, 16, length, pairs, vocab)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    for inputs, targets in zip(x.numpy(), y.numpy()):
        check_sequence(inputs, targets, length, pairs, vocab)
    held_out = {tuple(row) for row in x.tolist()}
    for step in range(50):
        train_x, _ = mqar.training_batch(0, step, 16, ((length, pairs),), vocab)
        assert held_out.isdisjoint(tuple(row) for row in train_x.tolist())
    assert not torch.equal(mqar.test_set(1, 16, length, pairs, vocab)[0], x)
