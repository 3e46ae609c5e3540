"""Case builders shared by the pytest files (a helper module: pytest collects no test here)."""
import numpy as np
import pytest
import torch

import linrope

PLACEMENTS = ["none", "before_map", "numerator_only", "full"]
# The maps with a random projection W (FeatureMap.projection).
FAVOR = {"favor+", "favor-trig", "favor-hyp"}
# A test parametrized over causal and non-causal attention.
CAUSAL_OR_NOT = pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])


def randn(rng, *shape, dtype=np.float64, scale=1.0):
    """A NumPy array of normal draws from the generator rng, times scale."""
    return (scale * rng.standard_normal(shape)).astype(dtype)


def t(a):
    """A NumPy array as a float64 tensor (for the reference)."""
    return torch.from_numpy(np.ascontiguousarray(a)).to(torch.float64)


def close(actual, expected, tol=1e-9):
    """Equal to within tol relative to the largest |expected| (at least 1)."""
    expected = expected.detach().numpy() if isinstance(expected, torch.Tensor) else expected
    scale = max(1.0, float(np.max(np.abs(expected)))) if expected.size else 1.0
    np.testing.assert_allclose(actual, expected, rtol=0, atol=tol * scale)


def inputs(*shapes, dtype=torch.float64, scale=0.5, seed=0):
    """Tensors of normal draws times scale, one per shape, requiring grad; seeded."""
    g = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(*s, generator=g, dtype=dtype)).requires_grad_() for s in shapes]


def make_map(kind, d, m=6, seed=0):
    """A linrope.FeatureMap of kind on inputs of width d: m random features for the favor maps
    (the others have none to choose)."""
    return linrope.FeatureMap(kind, d, num_features=m if kind.startswith("favor") else 0,
                              seed=seed)


def rope_for(placement, fm, d):
    """The linrope.Rope a placement needs with map fm on inputs of width d (None for none), and
    the reference's arguments for it: width d before the map, the features' m after it, rotary
    width even (1+cos has m = d + 1: its constant feature passes through)."""
    if placement == "none":
        return None, None
    width = d if placement == "before_map" else fm.output_dim
    rotary = width - width % 2
    return linrope.Rope(width, rotary_dim=rotary), dict(rotary_dim=rotary)


def true_sums(state):
    """A state's sums exp(log_scale) (S, z) (a LinearState or a tuple of tensors): what a
    continued call reads, whatever scale the kernel chose (so finite differences and other calls
    see the same function)."""
    S, z, log_scale = state
    scale = torch.exp(log_scale)
    return S * scale[..., None, None], z * scale[..., None]


def linear_case(kind, placement, n, map_seed, seed=0, d=4, d_v=3):
    """A small linear-attention case: the map (make_map), the rope its placement needs and the
    reference's arguments for it (rope_for), and q, k, v [2, 1, n, d | d_v] requiring grad."""
    fm = make_map(kind, d, seed=map_seed)
    rope, rope_ref = rope_for(placement, fm, d)
    return (fm, rope, rope_ref, *inputs((2, 1, n, d), (2, 1, n, d), (2, 1, n, d_v), seed=seed))
