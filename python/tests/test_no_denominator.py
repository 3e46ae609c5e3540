"""denominator=False (o = num, no normalisation) in Python: the NumPy function and the stream
against reference.py's explicit n x n form, gradcheck of linrope.torch.linear_attention in float64,
and MultiheadAttention's output RMSNorm per head."""
import numpy as np
import pytest
import torch

import linrope
import linrope.torch as lt
import reference as ref
from cases import CAUSAL_OR_NOT, linear_case

KEPT = ["none", "before_map", "numerator_only"]  # full equals numerator_only without a den


@pytest.mark.parametrize("kind", ["elu+1", "favor+", "relu"])
@pytest.mark.parametrize("placement", KEPT)
@CAUSAL_OR_NOT
def test_numerator_alone_matches_the_reference_and_gradcheck(kind, placement, causal):
    fm, rope, rope_ref, q, k, v = linear_case(kind, placement, 7, map_seed=3, seed=4)
    options = dict(causal=causal, placement=placement, q_offset=2, k_offset=2)
    out = lt.linear_attention(q, k, v, fm, rope=rope, denominator=False, **options)
    W = torch.from_numpy(fm.projection) if "favor" in kind else None
    want, _ = ref.linear_attention(q.detach(), k.detach(), v.detach(), kind, W, rope=rope_ref,
                                   denominator=False, **options)
    torch.testing.assert_close(out.detach(), want, rtol=1e-12, atol=1e-13)
    assert torch.autograd.gradcheck(
        lambda q, k, v: lt.linear_attention(q, k, v, fm, rope=rope, denominator=False,
                                            **options),
        (q, k, v))


def test_the_stream_and_refusals():
    fm = linrope.FeatureMap("favor+", 4, num_features=6, seed=1)
    rope = linrope.Rope(6)
    rng = np.random.default_rng(5)
    q, k, v = [0.5 * rng.standard_normal((9, w)) for w in (4, 4, 3)]
    whole = linrope.linear_attention(q, k, v, fm, causal=True, rope=rope, denominator=False)
    stream = linrope.LinearAttentionStream(fm, 3, dtype="float64", rope=rope, denominator=False)
    steps = np.concatenate([stream.step(q[i:i + 1], k[i:i + 1], v[i:i + 1]) for i in range(9)])
    np.testing.assert_allclose(steps, whole, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="full and numerator_only are one function"):
        linrope.linear_attention(q, k, v, fm, placement="full", rope=rope, denominator=False)
    with pytest.raises(ValueError, match="denominator=False needs attention='linear'"):
        lt.MultiheadAttention(8, 2, attention="softmax", denominator=False)


def test_the_layer_normalises_each_heads_output():
    # The layer without a denominator: out_proj of RMSNorm(o_h) * gain, o_h the heads' numerators.
    torch.manual_seed(0)
    layer = lt.MultiheadAttention(8, 2, attention="linear", feature_map="elu+1", causal=True,
                                  denominator=False).double()
    gain = torch.linspace(0.5, 2.0, 8, dtype=torch.float64)
    with torch.no_grad():
        layer.head_norm.copy_(gain)  # the gain of output_norm, a HeadRMSNorm
    assert torch.equal(layer.output_norm.weight, gain)
    x = torch.randn(2, 5, 8, dtype=torch.float64)

    def heads(projection):  # [B, n, 8] -> [B, 2 heads, n, 4]
        return projection(x).view(2, 5, 2, 4).transpose(1, 2).contiguous()

    q, k, v = heads(layer.q_proj), heads(layer.k_proj), heads(layer.v_proj)
    num = lt.linear_attention(q, k, v, layer.feature_map, causal=True, placement=layer.placement,
                              rope=layer.rope, denominator=False)
    normed = num / torch.sqrt(num.pow(2).mean(-1, keepdim=True) + layer.norm_eps)
    normed = normed * gain.view(2, 1, 4)
    want = layer.out_proj(normed.transpose(1, 2).reshape(2, 5, 8))
    torch.testing.assert_close(layer(x), want, rtol=1e-12, atol=1e-12)
    assert "denominator=False" in repr(layer)


def test_a_state_dict_with_the_gain_as_head_norm_loads():
    # Version 1 state dicts (linrope 0.1) hold the output norm's gain as the key head_norm.
    layer = lt.MultiheadAttention(8, 2, attention="linear", feature_map="elu+1", causal=True,
                                  denominator=False)
    saved = layer.state_dict()
    gain = torch.linspace(0.5, 2.0, 8)
    saved["head_norm"] = gain
    del saved["output_norm.weight"]
    saved._metadata[""]["version"] = 1
    loaded = lt.MultiheadAttention(8, 2, attention="linear", feature_map="elu+1", causal=True,
                                   denominator=False)
    loaded.load_state_dict(saved)
    assert torch.equal(loaded.head_norm, gain)
