"""training.caches: the floats a model's decoding caches hold for one sequence, counted against
the shapes each kind of layer keeps (a reference written from the model's sizes, not from the
caches)."""
import pytest
import torch

from training.caches import cache_bytes, state_floats
from training.model import Decoder
from training.variants import from_name

D_MODEL, HEADS, LAYERS, VOCAB = 16, 2, 2, 11
HEAD = D_MODEL // HEADS


def model(name):
    torch.manual_seed(0)
    return Decoder(VOCAB, from_name(name), D_MODEL, LAYERS, HEADS, seed=0)


def linear_floats(features):
    """Per layer and head S (features x head dim) and z (features), and the stabiliser's scale
    (one per head) -- the LinearState -- times the heads and layers."""
    return LAYERS * HEADS * (features * HEAD + features + 1)


@pytest.mark.parametrize("name, per_sequence", [
    ("elu-numerator_only", lambda n: linear_floats(HEAD)),
    ("favor-full", lambda n: linear_floats(2 * HEAD)),
    ("softmax-rope", lambda n: LAYERS * 2 * n * D_MODEL),  # every key and value
    # The convolution's cache adds the last k - 1 projected q, k and v of each layer.
    ("elu-numerator_only-conv4", lambda n: linear_floats(HEAD) + LAYERS * 3 * 3 * D_MODEL),
])
def test_state_floats_count_what_each_layer_keeps(name, per_sequence):
    m = model(name)
    for length in (5, 12):
        assert state_floats(m, length) == per_sequence(length)
    assert m.training  # the mode it was in


def test_cache_bytes_are_the_tensors_bytes():
    caches = [(torch.zeros(2, 3), torch.zeros(4, dtype=torch.float64)), (torch.zeros(1),)]
    assert cache_bytes(caches) == 4 * 6 + 8 * 4 + 4
