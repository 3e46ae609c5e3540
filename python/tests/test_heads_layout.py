"""The attentions read (B, H, n, d) views of contiguous (B, n, H, d) buffers in place (HeadsLayout
BNHD, include/linrope/batched.hpp) and give their outputs and gradients in the layout of the
input each matches. The kernels only gather such a view's rows and write theirs back, so the
claim is exact: the same bits as the calls on C-contiguous copies (which the other tests prove
against the references; tests/test_heads_layout.cpp proves the C++ side). A view in place shows
in its output: a copied input gives a C-contiguous output, a view read in place gives the
transposed layout back."""
import numpy as np
import pytest
import torch

import linrope
import linrope.torch as lt
from cases import CAUSAL_OR_NOT, inputs


def bnhd(rng, B, n, H, d, dtype):
    """A (B, H, n, d) view of a new C-contiguous (B, n, H, d) array of normal draws."""
    return rng.standard_normal((B, n, H, d)).astype(dtype).transpose(0, 2, 1, 3)


def is_bnhd(a):
    """True when `a` is the transposed view of a C-contiguous (B, n, H, d) buffer."""
    return not a.flags.c_contiguous and a.transpose(0, 2, 1, 3).flags.c_contiguous


def dense(*arrays):
    return tuple(np.ascontiguousarray(a) for a in arrays)


def assert_same_bits(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert np.ascontiguousarray(g).tobytes() == np.ascontiguousarray(w).tobytes()


def address(a):
    return a.__array_interface__["data"][0]


def test_which_arrays_are_read_in_place_and_as_which_layout():
    """What the kernels are handed (the module's _kernel_heads_view: the address they read, and
    the layout they are told): views of C-contiguous (B, n, H, d) buffers in place as BNHD, read-
    only ones and a batch sliced from a larger buffer too; C-contiguous arrays (H = 1 or n = 1
    included) in place as BHND; a misaligned view or an empty one copied to BHND."""
    view = linrope._core._kernel_heads_view
    rng = np.random.default_rng(1)
    q = bnhd(rng, 3, 5, 4, D, np.float32)
    assert view(q) == (address(q), "BNHD")
    read_only = q.copy(order="K")
    read_only.flags.writeable = False
    assert is_bnhd(read_only) and view(read_only) == (address(read_only), "BNHD")
    assert view(q[1:2]) == (address(q[1:2]), "BNHD")
    for dense in (bnhd(rng, 2, 5, 1, D, np.float64), bnhd(rng, 2, 1, 3, D, np.float64)):
        assert dense.flags.c_contiguous and view(dense) == (address(dense), "BHND")
    raw = np.zeros(2 * 5 * 3 * D * 4 + 1, np.uint8)
    misaligned = np.frombuffer(raw.data, np.float32, 2 * 5 * 3 * D, offset=1)
    misaligned = misaligned.reshape(2, 5, 3, D).transpose(0, 2, 1, 3)
    got_address, layout = view(misaligned)
    assert layout == "BHND" and got_address != address(misaligned)
    empty = np.zeros((2, 0, 3, D), np.float32).transpose(0, 2, 1, 3)
    assert view(empty)[1] == "BHND"


CALLS = {
    "softmax": (lambda q, k, v, **o: linrope.softmax_attention(q, k, v, **o),
                lambda q, k, v, g, **o: linrope.softmax_attention_backward(q, k, v, g, **o)),
    "favor+": (lambda q, k, v, **o: linrope.linear_attention(q, k, v, FAVOR, rope=ROPE, **o),
               lambda q, k, v, g, **o: linrope.linear_attention_backward(q, k, v, g, FAVOR,
                                                                         rope=ROPE, **o)),
    "elu+1 full": (lambda q, k, v, **o: linrope.linear_attention(q, k, v, ELU, rope=ELU_ROPE,
                                                                 placement="full", **o),
                   lambda q, k, v, g, **o: linrope.linear_attention_backward(
                       q, k, v, g, ELU, rope=ELU_ROPE, placement="full", **o)),
}
D = 6
FAVOR = linrope.FeatureMap("favor+", D, num_features=8, seed=3)
ELU = linrope.FeatureMap("elu+1", D)
ROPE, ELU_ROPE = linrope.Rope(8), linrope.Rope(D)  # after the maps: widths m


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("lengths", [None, [13, 0, 5]], ids=["full", "padded"])
@CAUSAL_OR_NOT
def test_views_are_read_in_place_and_give_the_same_bits(dtype, call, lengths, causal):
    rng = np.random.default_rng(7)
    B, H, n = 3, 2, 13
    q, k, v, d_out = (bnhd(rng, B, n, H, D, dtype), bnhd(rng, B, n, H, D, dtype),
                      bnhd(rng, B, n, H, 5, dtype), bnhd(rng, B, n, H, 5, dtype))
    forward, backward = CALLS[call]
    options = dict(causal=causal, q_lengths=lengths, k_lengths=lengths)
    out = forward(q, k, v, **options)
    assert is_bnhd(out)
    assert_same_bits([out], [forward(*dense(q, k, v), **options)])
    grads = backward(q, k, v, d_out, **options)
    assert all(is_bnhd(g) for g in grads)
    assert_same_bits(grads, backward(*dense(q, k, v, d_out), **options))
    if lengths:  # rows past the lengths: outputs 0 (a new output is zeroed), gradients 0
        for b, length in enumerate(lengths):
            for x in (out, *grads):
                assert not x[b, :, length:].any()


@pytest.mark.parametrize("call", list(CALLS))
def test_mixed_layouts_each_output_takes_its_inputs_layout(call):
    """Cross attention (n_k != n), q a view, k and v C-contiguous: out and dq come back as
    views, dk and dv C-contiguous; d_out C-contiguous is read whatever q's layout."""
    rng = np.random.default_rng(8)
    q = bnhd(rng, 2, 9, 3, D, np.float64)
    k, v = rng.standard_normal((2, 3, 4, D)), rng.standard_normal((2, 3, 4, 5))
    d_out = rng.standard_normal((2, 3, 9, 5))
    forward, backward = CALLS[call]
    out = forward(q, k, v)
    assert is_bnhd(out)
    assert_same_bits([out], [forward(*dense(q), k, v)])
    dq, dk, dv = backward(q, k, v, d_out)
    assert is_bnhd(dq) and dk.flags.c_contiguous and dv.flags.c_contiguous
    assert_same_bits((dq, dk, dv), backward(*dense(q), k, v, d_out))


def test_other_strides_are_copied_and_give_the_same_bits():
    """A view that is neither layout (every other head of a (B, n, 2H, d) buffer, a view
    whose last dimension is strided) is copied to a C-contiguous array, as before."""
    rng = np.random.default_rng(9)
    wide = rng.standard_normal((2, 7, 6, D)).transpose(0, 2, 1, 3)[:, ::2]
    strided_d = rng.standard_normal((2, 3, 7, 2 * D))[..., ::2]
    for q in (wide, strided_d):
        k, v = rng.standard_normal((2, 3, 7, D)), rng.standard_normal((2, 3, 7, 5))
        out = linrope.linear_attention(q, k, v, FAVOR, causal=True, placement="none")
        assert out.flags.c_contiguous
        assert_same_bits([out], [linrope.linear_attention(*dense(q), k, v, FAVOR, causal=True,
                                                          placement="none")])


# ---- linrope.torch ---------------------------------------------------------------------------

@pytest.mark.parametrize("attention", ["softmax", "linear"])
@CAUSAL_OR_NOT
def test_gradcheck_through_the_views(attention, causal):
    """gradcheck (float64) of the attentions on views of (B, n, H, d) leaves: the gradients go
    back through the transpose, in the leaves' own layout."""
    q, k, v = inputs((2, 5, 2, 4), (2, 5, 2, 4), (2, 5, 2, 3), seed=4)
    fm = linrope.FeatureMap("favor+", 4, num_features=6, seed=1)

    def call(q, k, v):
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        if attention == "softmax":
            return lt.softmax_attention(q, k, v, causal=causal, rope=linrope.Rope(4))
        return lt.linear_attention(q, k, v, fm, causal=causal, rope=linrope.Rope(6))

    assert call(q, k, v).transpose(1, 2).is_contiguous()  # the output in the views' layout
    assert torch.autograd.gradcheck(call, (q, k, v))


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_multihead_attention_makes_no_layout_copies(attention, monkeypatch):
    """MultiheadAttention hands the kernels views of its projections, gets back an output that
    its merge before out_proj views rather than copies, and d_out arrives in the same layout
    (so the backward copies nothing either: dq, dk, dv come back in their inputs' layout, as
    test_views_are_read_in_place_and_give_the_same_bits shows); its output and gradients are
    those of the same layer given C-contiguous heads, bit for bit."""
    torch.manual_seed(0)
    layer = lt.MultiheadAttention(16, 2, attention, causal=True, num_features=8)
    x = torch.randn(3, 11, 16, requires_grad=True)
    function = {"softmax": "softmax_attention", "linear": "linear_attention"}[attention]
    original = getattr(lt.layers, function)
    seen = []

    def bnhd_tensor(t):
        return t.transpose(1, 2).is_contiguous() and not t.is_contiguous()

    def recording(q, k, v, *args, **kwargs):
        result = original(q, k, v, *args, **kwargs)
        out = result[0] if isinstance(result, tuple) else result
        seen.append(("q, k, v", all(bnhd_tensor(t) for t in (q, k, v))))
        seen.append(("out", bnhd_tensor(out)))
        out.register_hook(lambda d_out: seen.append(("d_out", bnhd_tensor(d_out))))
        return result

    def contiguous(q, k, v, *args, **kwargs):
        return original(q.contiguous(), k.contiguous(), v.contiguous(), *args, **kwargs)

    g = torch.randn(3, 11, 16)
    monkeypatch.setattr(lt.layers, function, recording)
    views = layer(x)
    views_grads = torch.autograd.grad(views, [x, *layer.parameters()], g)
    assert seen == [("q, k, v", True), ("out", True), ("d_out", True)]
    monkeypatch.setattr(lt.layers, function, contiguous)
    copies = layer(x)
    copies_grads = torch.autograd.grad(copies, [x, *layer.parameters()], g)
    torch.testing.assert_close(views, copies, rtol=0, atol=0)
    for a, b in zip(views_grads, copies_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_multihead_attention_copies_heads_that_are_not_a_projections_view(monkeypatch):
    """With short_conv the heads come from a convolution's output, which is not contiguous: the
    layer copies them once (C-contiguous heads), rather than let the kernels copy them in the
    forward and again in the backward."""
    torch.manual_seed(0)
    layer = lt.MultiheadAttention(16, 2, "linear", causal=True, short_conv=3)
    original, seen = lt.layers.linear_attention, []

    def recording(q, k, v, *args, **kwargs):
        seen.append(all(t.is_contiguous() for t in (q, k, v)))
        return original(q, k, v, *args, **kwargs)

    monkeypatch.setattr(lt.layers, "linear_attention", recording)
    layer(torch.randn(2, 9, 16)).sum().backward()
    assert seen == [True]
