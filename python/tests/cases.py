"""Case builders shared by the pytest files (a helper module: pytest collects no test here)."""
import numpy as np
import torch

import linrope

PLACEMENTS = ["none", "before_map", "numerator_only", "full"]


def randn(rng, *shape, dtype=np.float64, scale=1.0):
    """A NumPy array of normal draws from the generator rng, times scale."""
    return (scale * rng.standard_normal(shape)).astype(dtype)


def inputs(*shapes, dtype=torch.float64, scale=0.5, seed=0):
    """Tensors of normal draws times scale, one per shape, requiring grad; seeded."""
    g = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(*s, generator=g, dtype=dtype)).requires_grad_() for s in shapes]


def rope_for(placement, fm, d):
    """The linrope.Rope a placement needs with map fm on inputs of width d (None for none), and
    the reference's arguments for it: width d before the map, the features' m after it, rotary
    width even (1+cos has m = d + 1: its constant feature passes through)."""
    if placement == "none":
        return None, None
    width = d if placement == "before_map" else fm.output_dim
    rotary = width - width % 2
    return linrope.Rope(width, rotary_dim=rotary), dict(rotary_dim=rotary)
