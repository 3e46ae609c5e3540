"""Multi-query associative recall (MQAR) as Zoology defines it (Arora et al. 2023, "Zoology:
measuring and improving recall in efficient language models", its `multiquery_ar` generator):

  * keys come from the first half of the vocabulary (not 0), values from the second half; each
    sequence draws `pairs` distinct keys and distinct values;
  * the sequence opens with the pairs, k1 v1 k2 v2 ...; the rest is filler in which each key
    appears again once, at an even offset 2g after the pairs, g drawn without replacement with
    probability proportional to g^(a-1) (a = 0.01: most queries come soon after the pairs);
  * the target at a query key's position is its value; every other position is IGNORE (scored
    on queries only); filler positions hold random tokens.

Written here from that description, in NumPy, drawing from (seed, step) alone."""
import numpy as np
import torch

IGNORE = -100
POWER_A = 0.01


def check(vocab_size, length, pairs):
    if length % 2 or pairs < 1 or 4 * pairs > length or vocab_size <= length:
        raise ValueError("MQAR needs an even length >= 4 x pairs and vocab_size > length; got "
                         "length %d, pairs %d, vocab_size %d" % (length, pairs, vocab_size))


def settings_name(settings):
    """'64x4' for ((64, 4),): the (length, pairs) settings of a run, '+' between several (trained
    in turn); '' for none (char_lm)."""
    return "+".join("%dx%d" % tuple(s) for s in settings)


def parse_settings(text):
    """settings_name's inverse: ((64, 4), (128, 8)) for '64x4+128x8', () for ''. ValueError for
    anything else."""
    if not text:
        return ()
    try:
        settings = tuple(tuple(int(n) for n in part.split("x")) for part in text.split("+"))
    except ValueError:
        settings = None
    if settings is None or any(len(s) != 2 for s in settings):
        raise ValueError("MQAR settings are LENGTHxPAIRS (e.g. 64x4), '+' between several; got "
                         "%r" % text)
    return settings


def batch(rng, size, length, pairs, vocab_size):
    """Inputs [size, length] and targets [size, length] (IGNORE except at the queries)."""
    check(vocab_size, length, pairs)
    half = vocab_size // 2
    context = 2 * pairs
    space = (length - context) // 2
    weights = POWER_A * np.arange(1, space + 1, dtype=np.float64) ** (POWER_A - 1)
    weights /= weights.sum()
    sequence = np.zeros((size, length + 1), dtype=np.int64)
    targets = np.full((size, length + 1), IGNORE, dtype=np.int64)
    rows = np.arange(size)[:, None]
    keys = np.stack([rng.choice(np.arange(1, half), pairs, replace=False) for _ in range(size)])
    values = np.stack([rng.choice(np.arange(half, vocab_size), pairs, replace=False)
                       for _ in range(size)])
    gaps = np.stack([rng.choice(space, pairs, replace=False, p=weights) for _ in range(size)])
    sequence[:, 0:context:2], sequence[:, 1:context:2] = keys, values
    sequence[rows, context + 2 * gaps] = keys
    # Labels as next-token targets, shifted by one below: the value is the target at the query
    # key's own position (the value itself never appears after the query).
    targets[rows, context + 2 * gaps + 1] = values
    inputs, targets = sequence[:, :-1], targets[:, 1:]
    filler = inputs == 0
    inputs[filler] = rng.integers(0, vocab_size, size=int(filler.sum()))
    return torch.from_numpy(inputs), torch.from_numpy(targets)


def training_batch(seed, step, size, settings, vocab_size):
    """The batch of one training step: `settings` (length, pairs) taken in turn, step by step."""
    length, pairs = settings[step % len(settings)]
    return batch(np.random.default_rng([seed, step, 0x6d71]), size, length, pairs, vocab_size)


def test_set(seed, size, length, pairs, vocab_size):
    """A held-out set for one (length, pairs): drawn from a stream training never uses."""
    return batch(np.random.default_rng([seed, length, pairs, 0x7465]), size, length, pairs,
                 vocab_size)
