"""linrope.torch.states: the state of causal linear attention, and how states combine.

    LinearState(S, z, log_scale)  the state after some tokens (a NamedTuple of tensors)
    merge_states(states)          the state holding the keys of several

A call of linrope.torch.linear_attention with return_state=True returns a LinearState, and takes
one back as initial_state; a sequence split across processes (linrope.torch.distributed) merges the
states of the slices before each rank's.
"""
from typing import NamedTuple

import torch

__all__ = ["LinearState", "merge_states"]


class LinearState(NamedTuple):
    """The state of causal linear attention after some tokens (include/linrope/attention.hpp,
    "State in, state out"): the sums over the keys so far of features times values, S [..., m,
    d_v], and of features, z [..., m] (q's dtype), both divided by exp(log_scale) [...]
    (float64; -inf: no key yet), "..." being q's leading dimensions. The scale is the stabiliser's
    (the largest key shift so far, 0 for maps without one), so S and z stay finite for large
    inputs. Gradients flow through S and z with log_scale held fixed: exact for every use that
    reads the state as exp(log_scale) (S, z), as a call continued from it does."""
    S: torch.Tensor
    z: torch.Tensor
    log_scale: torch.Tensor


def merge_states(states):
    """The state that holds the keys of every state in `states` (a non-empty sequence of
    LinearState of one shape): sum_p exp(log_scale_p - top) (S_p, z_p) at top = max log_scale.
    The sums commute, so order does not matter. Differentiable in each S and z.

    A state whose log_scale is -inf (no key) has weight exactly 0 and adds nothing, yet its S and
    z still receive a gradient (of zeros): leaving a state out this way keeps it in the autograd
    graph, which linrope.torch.distributed needs so that every rank's backward reaches the
    exchange of every rank's state."""
    states = [LinearState(*s) for s in states]
    if not states:
        raise ValueError("merge_states: expected at least one state")
    scales = torch.stack([s.log_scale for s in states])
    top = scales.max(0).values
    # exp(-inf - finite) = 0: empty states add nothing, and an all-empty result stays at -inf.
    weights = torch.exp(scales - torch.where(torch.isinf(top), torch.zeros_like(top), top))
    dtype = states[0].S.dtype
    S = sum(w.to(dtype)[..., None, None] * s.S for w, s in zip(weights, states))
    z = sum(w.to(dtype)[..., None] * s.z for w, s in zip(weights, states))
    return LinearState(S, z, top)
