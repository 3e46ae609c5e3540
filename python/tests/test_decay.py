"""The decay at the NumPy level (linrope.linear_attention, linear_attention_backward and
LinearAttentionStream with decay=): against the float64 reference with an explicit n x n decay
matrix (reference.decayed_linear_attention), every map and placement, with and without a
denominator, (n, d) and (B, H, n, d) with one decay per head; the backward against torch.autograd
on the reference; a sequence cut anywhere, through the states, equal to one call; the stream; and
the refused calls.

Tolerances: float64 throughout. The C++ tests derive the kernels' bound, gamma = 16 u (m + d + n_k +
16 + 2 z) plus the decay's 40 u |log g| P (tests/reference/linear_reference.hpp), relative to the
size of each row's terms: ~1e-13 at these sizes. Relative to |num| / |den + eps| a signed
denominator near 0 magnifies it; 1e-11 / min(1, min |den + eps|), as test_numpy.py uses, is a
hundred times above and far below any misplaced power of g (0.97^1 = 3% of a term)."""
import math
import re

import numpy as np
import pytest
import torch

import linrope
import reference as ref
from conftest import randn
from test_numpy import FAVOR, PLACEMENTS, close, make_map, rope_for, t

KINDS = ["elu+1", "favor+", "1+cos", "favor-trig"]
DECAYS = [1.0, 0.97, 0.5, 1e-3]


def forms():
    """(placement, denominator): full has no form of its own without a denominator."""
    return [(p, True) for p in PLACEMENTS] + [(p, False) for p in PLACEMENTS if p != "full"]


def problem(rng, kind, placement, lead, n=9, n_k=9, d=6, dv=4):
    fm = make_map(kind, d)
    q, k = randn(rng, *lead, n, d, scale=0.5), randn(rng, *lead, n_k, d, scale=0.5)
    v = randn(rng, *lead, n_k, dv)
    rope, rope_ref = rope_for(placement, fm, d)
    W = t(fm.projection) if kind in FAVOR else None
    return fm, q, k, v, rope, rope_ref, W


def tolerance(den, eps=1e-6):
    return 1e-11 / min(1.0, float(den.abs().min()) + eps)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("form", forms(), ids=lambda f: f[0] + ("" if f[1] else "-numerator"))
@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("batched", [False, True], ids=["n,d", "B,H,n,d"])
def test_forward_and_backward_match_the_decay_matrix(rng, kind, form, decay, batched):
    # Queries at 6.., keys at 2..: each query also sees keys before its own position. Batched:
    # one decay per head, the given one beside none and 1/2.
    placement, denominator = form
    lead = (2, 3) if batched else ()
    fm, q, k, v, rope, rope_ref, W = problem(rng, kind, placement, lead, n=7, n_k=11)
    decays = [decay, 1.0, 0.5] if batched else decay
    options = dict(causal=True, placement=placement, q_offset=6, k_offset=2,
                   denominator=denominator)
    for method in ("scan", "chunked"):
        out = linrope.linear_attention(q, k, v, fm, rope=rope, method=method, chunk_size=3,
                                       decay=decays, **options)
        qt, kt, vt = (t(a).requires_grad_() for a in (q, k, v))
        expected, den = ref.decayed_linear_attention(qt, kt, vt, kind, decays, W, placement,
                                                     rope_ref, 1e-6, 6, 2, denominator)
        tol = tolerance(den) if denominator else 1e-11
        close(out, expected, tol)
        g = randn(rng, *expected.shape)
        grads = linrope.linear_attention_backward(q, k, v, g, fm, rope=rope, method=method,
                                                  decay=decays, **options)
        for actual, wanted in zip(grads, torch.autograd.grad(expected, (qt, kt, vt), t(g))):
            close(actual, wanted, tol * 10)


def true_sums(state):
    """exp(log_scale) (S, z): what a continued call reads, whichever scale the kernel chose."""
    S, z, log_scale = state
    scale = np.exp(log_scale)
    return S * scale[..., None, None], z * scale[..., None]


@pytest.mark.parametrize("kind", ["elu+1", "favor+"])
@pytest.mark.parametrize("decay", [0.97, 0.5, 1e-3, (0.9, 1.0, 0.3)], ids=str)
def test_a_cut_anywhere_equals_one_call_states_and_gradients(rng, kind, decay):
    # 13 tokens cut at 0, 1, 6, 12 and 13: the outputs, the final state (its sums) and every
    # gradient, the first part's keys reaching the second part's queries only through the decayed
    # state between them (d_final_state of the first part = the second part's state gradient).
    fm, q, k, v, rope, _, _ = problem(rng, kind, "numerator_only", (2, 3), n=13, n_k=13)
    g = randn(rng, *v.shape)
    S_g, z_g = randn(rng, 2, 3, fm.output_dim, v.shape[-1]), randn(rng, 2, 3, fm.output_dim)
    options = dict(causal=True, placement="numerator_only", rope=rope, decay=decay)
    out, final = linrope.linear_attention(q, k, v, fm, q_offset=5, k_offset=5, return_state=True,
                                          **options)
    whole = linrope.linear_attention_backward(q, k, v, g, fm, q_offset=5, k_offset=5,
                                              d_final_state=(S_g, z_g), **options)
    for cut in (0, 1, 6, 12, 13):
        parts = [(x[..., :cut, :], x[..., cut:, :]) for x in (q, k, v, g)]
        first_out, between = linrope.linear_attention(*(p[0] for p in parts[:3]), fm, q_offset=5,
                                                      k_offset=5, return_state=True, **options)
        second_out, last = linrope.linear_attention(*(p[1] for p in parts[:3]), fm,
                                                    q_offset=5 + cut, k_offset=5 + cut,
                                                    initial_state=between, return_state=True,
                                                    **options)
        close(np.concatenate([first_out, second_out], -2), out, 1e-11)
        for a, b in zip(true_sums(last), true_sums(final)):
            close(a, b, 1e-11)
        # The sums at the final scale: d_final_state is the gradient at the state's own scale.
        scale = np.exp(last[2] - final[2])
        *second, d_between = linrope.linear_attention_backward(
            *(p[1] for p in parts), fm, q_offset=5 + cut, k_offset=5 + cut, initial_state=between,
            d_final_state=(S_g * scale[..., None, None], z_g * scale[..., None]),
            return_state_gradient=True, **options)
        first = linrope.linear_attention_backward(*(p[0] for p in parts), fm, q_offset=5,
                                                  k_offset=5, d_final_state=d_between, **options)
        for a, b, w in zip(first, second, whole):
            close(np.concatenate([a, b], -2), w, 1e-10)


@pytest.mark.parametrize("kind", ["elu+1", "favor+"])
@pytest.mark.parametrize("decay", [0.97, 0.5])
def test_the_stream_equals_one_call(rng, kind, decay):
    fm, q, k, v, rope, _, _ = problem(rng, kind, "numerator_only", (), n=11, n_k=11)
    out = linrope.linear_attention(q, k, v, fm, causal=True, rope=rope, q_offset=3, k_offset=3,
                                   decay=decay)
    stream = linrope.LinearAttentionStream(fm, v.shape[-1], dtype="float64", rope=rope, offset=3,
                                           decay=decay)
    steps = [stream.step(q[i:i + 2], k[i:i + 2], v[i:i + 2]) for i in range(0, 11, 2)]
    close(np.concatenate(steps), out, 1e-11)


def test_the_default_decay_comes_from_the_cpp_struct_and_means_none(rng):
    assert linrope.LinearOptions().decay == 1.0
    fm, q, k, v, rope, _, _ = problem(rng, "favor+", "numerator_only", (2, 3))
    plain = linrope.linear_attention(q, k, v, fm, causal=True, rope=rope)
    np.testing.assert_array_equal(
        linrope.linear_attention(q, k, v, fm, causal=True, rope=rope, decay=1.0), plain)
    np.testing.assert_array_equal(
        linrope.linear_attention(q, k, v, fm, causal=True, rope=rope, decay=[1.0, 1, 1.0]), plain)


def test_refused_decays_raise_value_error_naming_decay(rng):
    fm, q, k, v, _, _, _ = problem(rng, "elu+1", "none", ())
    q4, k4, v4 = (x[None, None].repeat(3, 1) for x in (q, k, v))
    causal = dict(causal=True, placement="none")
    cases = [
        ((q, k, v), dict(decay=0.0, **causal), "options.decay is 0 but expected a decay in (0, 1]"),
        ((q, k, v), dict(decay=1.5, **causal), "options.decay is 1.5"),
        ((q, k, v), dict(decay=math.nan, **causal), "options.decay is nan"),
        ((q, k, v), dict(decay=0.9, causal=False, placement="none"), "a decay is causal only"),
        ((q, k, v), dict(decay="0.9", **causal), "decay is a str but expected a float"),
        ((q, k, v), dict(decay=[0.9], **causal), "one decay per head needs (B, H, n, d)"),
        ((q4, k4, v4), dict(decay=[0.9, 0.8], **causal), "decay has 2 values but q has H = 3"),
        ((q4, k4, v4), dict(decay=[0.9, 1.5, 0.8], **causal), "options.head_decays[1] is 1.5"),
        ((q4, k4, v4), dict(decay=[0.9, "x", 0.8], **causal), "decay holds a str"),
    ]
    for arrays, kwargs, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            linrope.linear_attention(*arrays, fm, **kwargs)
        with pytest.raises(ValueError, match="decay"):
            linrope.linear_attention_backward(*arrays, arrays[2], fm, **kwargs)
    with pytest.raises(ValueError, match="LinearAttentionStream: options.decay is 2"):
        linrope.LinearAttentionStream(fm, 3, dtype="float64", decay=2.0)
