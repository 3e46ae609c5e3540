"""State in, state out (linrope.torch.linear_attention's initial_state= and return_state=; the
NumPy functions' initial_state, return_state, d_final_state, return_state_gradient): gradcheck of
the state's gradients in float64 (with and without a decay), a sequence cut into parts equal to
one call in value and gradient, merge_states, and bad input."""
import numpy as np
import pytest
import torch

import linrope
import linrope.torch as lt
import bounds
from cases import PLACEMENTS, inputs, make_map, rope_for, true_sums

KINDS = ["elu+1", "favor+", "favor-hyp", "1+cos"]


def map_and_options(kind, placement, d=4, seed=2):
    fm = make_map(kind, d, seed=seed)
    rope, _ = rope_for(placement, fm, d)
    # eps = 1 for full: a signed denominator near 0 would make finite differences meaningless.
    eps = 1.0 if placement == "full" else 1e-6
    return fm, dict(causal=True, placement=placement, rope=rope, eps=eps)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("decay", [None, 0.8, (0.6, 0.95)], ids=["plain", "decay", "per-head"])
def test_state_in_state_out_gradcheck(kind, placement, decay):
    # Every input and the initial state (at log scale 0.4, one head's empty) against finite
    # differences of the outputs and the final state's sums; without a decay, with one for every
    # head, and with one per head through the chunked forward (chunks of 2).
    fm, options = map_and_options(kind, placement)
    options["decay"] = decay
    if isinstance(decay, tuple):
        options.update(method="chunked", chunk_size=2)
    m = fm.output_dim
    q, k, v, S0 = inputs((2, 2, 5, 4), (2, 2, 5, 4), (2, 2, 5, 3), (2, 2, m, 3), seed=3)
    z0 = (torch.rand(2, 2, m, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
          + 0.5).requires_grad_()
    log_scale0 = torch.tensor([[0.4, 0.4], [-torch.inf, 0.4]], dtype=torch.float64)

    def run(q, k, v, S0, z0):
        out, state = lt.linear_attention(q, k, v, fm, q_offset=3, k_offset=3, return_state=True,
                                         initial_state=(S0, z0, log_scale0), **options)
        return (out, *true_sums(state))

    assert torch.autograd.gradcheck(run, (q, k, v, S0, z0))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_a_sequence_cut_in_three_equals_one_call(kind, placement, dtype):
    # Cuts at 7 and 8 (a one-token part) of 19 tokens; outputs and every gradient through the
    # states between the parts. Both sides are the kernels' results in dtype, each within the
    # rounding bound of the exact result (bounds.py), so they differ by at most twice it.
    fm, options = map_and_options(kind, placement)
    exact = [x.detach() for x in inputs((2, 3, 19, 4), (2, 3, 19, 4), (2, 3, 19, 3),
                                        (2, 3, 19, 3), seed=5)]
    q, k, v, g = [x.to(dtype) for x in exact]
    whole = [x.clone().requires_grad_() for x in (q, k, v)]
    out = lt.linear_attention(*whole, fm, **options)
    (out * g).sum().backward()
    parts = [x.clone().requires_grad_() for x in (q, k, v)]
    outs, state = [], None
    for begin, end in [(0, 7), (7, 8), (8, 19)]:
        piece = [x[:, :, begin:end] for x in parts]
        o, state = lt.linear_attention(*piece, fm, q_offset=begin, k_offset=begin,
                                       initial_state=state, return_state=True, **options)
        outs.append(o)
    cut = torch.cat(outs, 2)
    (cut * g).sum().backward()
    W = torch.from_numpy(fm.projection) if "favor" in kind else None
    _, rope = rope_for(placement, fm, 4)
    where = dict(causal=True, placement=placement, rope=rope, eps=options["eps"])
    bounds.assert_within(cut, out, 2 * bounds.linear_bound(*exact[:3], kind, W, dtype, **where),
                         "out")
    gradient_bounds = bounds.linear_gradient_bounds(*exact, kind, W, dtype, **where)
    for name, a, b, bound in zip(("dq", "dk", "dv"), parts, whole, gradient_bounds):
        bounds.assert_within(a.grad, b.grad, 2 * bound, name)


def test_merge_states_sums_the_keys_of_each():
    # The states of two disjoint sets of keys (the second's keys larger, so a larger scale) and an
    # empty one, merged, equal the state of all the keys in one call; gradients flow into each.
    fm = linrope.FeatureMap("favor+", 4, num_features=6, seed=1)
    q, k, v = inputs((1, 2, 9, 4), (1, 2, 9, 4), (1, 2, 9, 3), seed=7)
    k = k.detach().clone()
    k[:, :, 5:] *= 3
    _, whole = lt.linear_attention(q, k, v, fm, causal=True, placement="none", return_state=True)
    _, first = lt.linear_attention(q[:, :, :5], k[:, :, :5], v[:, :, :5], fm, causal=True,
                                   placement="none", return_state=True)
    _, second = lt.linear_attention(q[:, :, 5:], k[:, :, 5:], v[:, :, 5:], fm, causal=True,
                                    placement="none", k_offset=5, q_offset=5, return_state=True)
    empty = lt.LinearState(torch.zeros_like(first.S), torch.zeros_like(first.z),
                           torch.full_like(first.log_scale, -torch.inf))
    merged = lt.merge_states([second, empty, first])
    assert torch.equal(merged.log_scale, whole.log_scale)
    assert torch.allclose(merged.S, whole.S, rtol=1e-12, atol=1e-14)
    assert torch.allclose(merged.z, whole.z, rtol=1e-12, atol=1e-14)
    all_empty = lt.merge_states([empty, empty])
    assert torch.isinf(all_empty.log_scale).all() and not all_empty.S.isnan().any()


def test_the_state_alone_has_a_gradient():
    # A loss of the final state only (the output unused): gradients reach k and v, none reach q.
    fm = linrope.FeatureMap("elu+1", 4)
    q, k, v = inputs((6, 4), (6, 4), (6, 3), seed=8)
    _, state = lt.linear_attention(q, k, v, fm, causal=True, placement="none", return_state=True)
    state.S.sum().backward()
    assert q.grad is None or q.grad.abs().max() == 0
    assert k.grad.abs().max() > 0 and v.grad.abs().max() > 0
    # S = sum_j phi(k_j) v_j^T: dS/dv_j summed over S's entries is sum_l phi(k_j)_l.
    phi = torch.nn.functional.elu(k.detach()) + 1
    assert torch.allclose(v.grad, phi.sum(1, keepdim=True).expand(-1, 3), rtol=1e-12)


def test_numpy_state_round_trip_and_refusals():
    rng = np.random.default_rng(0)
    fm = linrope.FeatureMap("elu+1", 4)
    q, k, v = [rng.standard_normal((2, 3, 6, w)) for w in (4, 4, 5)]
    out, state = linrope.linear_attention(q, k, v, fm, causal=True, placement="none",
                                          return_state=True)
    S, z, log_scale = state
    assert S.shape == (2, 3, 4, 5) and z.shape == (2, 3, 4) and log_scale.shape == (2, 3)
    assert log_scale.dtype == np.float64
    # elu+1 has no stabiliser: the scale is 0 and S is the plain sum.
    phi = np.where(k > 0, k + 1, np.exp(k))
    np.testing.assert_allclose(S, np.einsum("bhnm,bhnv->bhmv", phi, v), rtol=1e-12)
    with pytest.raises(ValueError, match="options.causal is false"):
        linrope.linear_attention(q, k, v, fm, placement="none", return_state=True)
    with pytest.raises(ValueError, match=r"initial_state.S has shape \(3, 4, 5\)"):
        linrope.linear_attention(q, k, v, fm, causal=True, placement="none",
                                 initial_state=(S[0], z, log_scale))
    with pytest.raises(ValueError, match="initial_state.z has dtype float32"):
        linrope.linear_attention(q, k, v, fm, causal=True, placement="none",
                                 initial_state=(S, z.astype(np.float32), log_scale))
    with pytest.raises(ValueError, match="expected 3"):
        linrope.linear_attention(q, k, v, fm, causal=True, placement="none",
                                 initial_state=(S, z))
    bad = log_scale.copy()
    bad[1, 2] = np.nan
    with pytest.raises(ValueError, match=r"initial_state.log_scale\[1, 2\] is nan"):
        linrope.linear_attention(q, k, v, fm, causal=True, placement="none",
                                 initial_state=(S, z, bad))
    with pytest.raises(ValueError, match=r"d_final_state.dz has shape"):
        linrope.linear_attention_backward(q, k, v, out, fm, causal=True, placement="none",
                                          d_final_state=(S, z[..., :2]))
