"""The short convolution: ShortConvolution against reference.py's term-by-term convolution (values,
a sequence fed in blocks, gradcheck), and MultiheadAttention(short_conv=k) against a plain PyTorch
layer built from the references, gradcheck in float64 of its input and the convolutions' weights,
padded batches, decoding through the cache (token by token and in blocks) for every attention
kind, and bad input. Sequence parallelism is in test_distributed.py."""
import pytest
import torch
from torch.nn.utils.stateless import functional_call

import linrope.torch as lt
import reference as ref
from cases import inputs

EPS64 = torch.finfo(torch.float64).eps
CONVOLUTIONS = ("q_conv", "k_conv", "v_conv")


def convolution_bound(x, weight, past=None):
    """|computed - exact| for ShortConvolution in float64, per output: the k products and their
    sum are within k eps sum_s |w_s x_{t-s}| (a sum of k terms), SiLU (slope < 1.1) and its own
    rounding add a few eps |y|; twice that, plus the same for the reference's own rounding."""
    k = weight.shape[-1]
    magnitude = ref.short_convolution(x.abs(), weight.abs(), past=None if past is None
                                      else past.abs(), activation=None)
    return 4 * (k + 4) * EPS64 * (magnitude + 1)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 2, 5, 7])
def test_short_convolution_matches_the_reference_and_continues_from_its_past(k, n):
    torch.manual_seed(k * 10 + n)
    conv = lt.ShortConvolution(6, k, bias=True).double()
    x, past = inputs((2, n, 6), (2, k - 1, 6), scale=2.0, seed=n)
    for given in (None, past):
        want = ref.short_convolution(x, conv.weight, conv.bias, past=given)
        got = conv(x, given)
        assert ((got - want).abs() <= convolution_bound(x, conv.weight, given)).all()
    # Fed in blocks, each from the past the one before left: the call on the whole.
    whole = conv(x)
    parts, before = [], None
    for lo, hi in ((0, n // 2), (n // 2, n // 2 + 1), (n // 2 + 1, n)):
        parts.append(conv(x[:, lo:hi], before))
        before = conv.past_after(x[:, lo:hi], before)
    # conv1d's summation order depends on the input's length: to rounding, not bit for bit.
    assert ((torch.cat(parts, 1) - whole).abs() <= convolution_bound(x, conv.weight)).all()
    assert torch.equal(before, torch.cat([torch.zeros(2, k - 1, 6, dtype=torch.float64),
                                          x.detach()], 1)[:, n:])
    weight, bias = (p.detach().clone().requires_grad_() for p in (conv.weight, conv.bias))
    assert torch.autograd.gradcheck(
        lambda x, weight, bias, past: functional_call(conv, dict(weight=weight, bias=bias),
                                                      (x, past)), (x, weight, bias, past))


def test_short_convolution_initialisation_and_refusals():
    torch.manual_seed(0)
    conv = lt.ShortConvolution(64, 4)
    assert conv.bias is None and conv.weight.shape == (64, 1, 4)
    # Conv1d's initialisation: uniform in +-1/sqrt(k), here 0.5; 256 draws fill the interval.
    assert conv.weight.abs().max() <= 0.5 and conv.weight.abs().max() > 0.45
    # The sample std is within 5 of its own standard deviations (2.8 %) of 0.5 / sqrt(3).
    assert conv.weight.std().item() == pytest.approx(0.5 / 3 ** 0.5, rel=0.15)
    assert "kernel_size=4, bias=False, activation='silu'" in repr(conv)
    plain = lt.ShortConvolution(3, 2, activation=None).double()
    (x,) = inputs((1, 4, 3))
    torch.testing.assert_close(plain(x), ref.short_convolution(x, plain.weight, activation=None))
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="kernel_size is .* but expected an int >= 1"):
            lt.ShortConvolution(4, bad)
    with pytest.raises(ValueError, match="activation is 'gelu' but expected 'silu' or None"):
        lt.ShortConvolution(4, 2, activation="gelu")
    with pytest.raises(ValueError, match=r"x is \(2, 5\) but expected \[B, n, channels = 64\]"):
        conv(torch.randn(2, 5))
    with pytest.raises(ValueError, match=r"past is \(1, 2, 64\) but expected \[B = 1, "
                                         r"kernel_size - 1 = 3, channels = 64\]"):
        conv(torch.randn(1, 5, 64), torch.randn(1, 2, 64))


def make_layer(attention, width, seed=0, **options):
    torch.manual_seed(seed)
    if attention == "linear":
        options = dict(dict(feature_map="favor+", num_features=8), **options)
    return lt.MultiheadAttention(8, 2, attention, causal=True, short_conv=width,
                                 **options).double()


def plain_layer(layer, x):
    """The layer in plain PyTorch from reference.py: projections, reference.short_convolution on
    each, then the explicit n x n attention (RoPE of width head_dim or on the features)."""
    batch, n, _ = x.shape

    def heads(name):
        projected = getattr(layer, name + "_proj")(x)
        conv = getattr(layer, name + "_conv")
        return ref.short_convolution(projected, conv.weight).view(batch, n, 2, 4).transpose(1, 2)
    q, k, v = heads("q"), heads("k"), heads("v")
    if layer.attention == "softmax":
        out = ref.softmax_attention(q, k, v, causal=True, rope={})
    else:
        out, _ = ref.linear_attention(q, k, v, "favor+",
                                      torch.from_numpy(layer.feature_map.projection), causal=True,
                                      placement=layer.placement,
                                      rope=dict(rotary_dim=layer.rope.rotary_dim))
    return layer.out_proj(out.transpose(1, 2).reshape(batch, n, 8))


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_the_layer_is_the_convolution_then_rope_and_attention(attention):
    layer = make_layer(attention, 3)
    (x,) = inputs((2, 7, 8), scale=1.0)
    # float64 throughout: the kernels' and the references' sums agree to ~1e-14 at these sizes.
    torch.testing.assert_close(layer(x), plain_layer(layer, x), rtol=0, atol=1e-10)
    g = torch.randn(2, 7, 8, dtype=torch.float64)
    params = list(layer.parameters())
    assert any(p is layer.k_conv.weight for p in params)
    for a, b in zip(torch.autograd.grad(layer(x), params, g),
                    torch.autograd.grad(plain_layer(layer, x), params, g)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)


@pytest.mark.parametrize("width", [1, 2, 4])
@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_the_layer_gradcheck_in_its_input_and_the_convolutions(attention, width):
    layer = make_layer(attention, width, seed=width)
    (x,) = inputs((2, 5, 8))  # n = 5, odd
    weights = [getattr(layer, c).weight.detach().clone().requires_grad_() for c in CONVOLUTIONS]
    names = [c + ".weight" for c in CONVOLUTIONS]

    def run(x, *weights):
        return functional_call(layer, dict(zip(names, weights)), (x,))
    assert torch.autograd.gradcheck(run, (x, *weights))


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_padding_never_reaches_a_real_token(attention):
    # Right padding: changing the padded rows changes no real token's output, no input gradient
    # of a real token, no parameter gradient (bit for bit: the causal convolution never reads a
    # later row, and the attention gives the padded rows zero gradient).
    layer = make_layer(attention, 4, method="chunked", chunk_size=2) if attention == "linear" \
        else make_layer(attention, 4)
    lengths = [7, 2, 4]
    g = torch.randn(3, 7, 8, dtype=torch.float64)
    results = []
    for seed in (1, 2):
        x = torch.randn(3, 7, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        spoil = torch.randn(3, 7, 8, dtype=torch.float64,
                            generator=torch.Generator().manual_seed(seed))
        for b, n in enumerate(lengths):
            x[b, n:] = 100 * spoil[b, n:]
        x.requires_grad_()
        out = layer(x, lengths=lengths)
        grads = torch.autograd.grad(out, [x, *layer.parameters()], g)
        results.append((out.detach(), grads))
    (out_a, grads_a), (out_b, grads_b) = results
    for b, n in enumerate(lengths):
        assert torch.equal(out_a[b, :n], out_b[b, :n])
        assert torch.equal(grads_a[0][b, :n], grads_b[0][b, :n])
        assert not grads_a[0][b, n:].any() and not grads_b[0][b, n:].any()
    for a, b in zip(grads_a[1:], grads_b[1:]):
        assert torch.equal(a, b)


DECODING = [
    dict(attention="softmax"), dict(attention="softmax", rope=False),
    dict(attention="linear", feature_map="favor+", num_features=8, placement="numerator_only"),
    dict(attention="linear", feature_map="elu+1", placement="full"),
    dict(attention="linear", feature_map="1+cos", placement="before_map"),
    dict(attention="linear", feature_map="relu", rope=False),
    dict(attention="linear", feature_map="elu+1", denominator=False),
]


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("options", DECODING, ids=str)
def test_decoding_token_by_token_and_in_blocks_equals_the_parallel_forward(options, width):
    # A prompt (of 1 token: shorter than the convolution's past, then of 5), then the rest one
    # token at a time, and again in blocks of 3, 1 and 2: the cache carries the last k - 1
    # projected q, k, v besides the attention's own cache, so every way gives the parallel
    # forward's outputs (float64: the same sums in another order, hence not bit for bit).
    torch.manual_seed(3)
    layer = lt.MultiheadAttention(16, 2, causal=True, short_conv=width, **options).double().eval()
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    whole = layer(x)
    for cuts in ([1] + list(range(2, 13)), [5] + list(range(6, 13)), [1, 4, 5, 7, 10, 12]):
        outs, cache, start = [], None, 0
        for stop in cuts:
            out, cache = layer(x[:, start:stop], first_position=start, cache=cache,
                               return_cache=True)
            outs.append(out)
            start = stop
        torch.testing.assert_close(torch.cat(outs, 1), whole, rtol=1e-10, atol=1e-12)
        assert isinstance(cache, lt.ShortConvCache)
        for name, projection in zip("qkv", (layer.q_proj, layer.k_proj, layer.v_proj)):
            torch.testing.assert_close(getattr(cache, name), projection(x[:, 12 - (width - 1):]))
        inner = lt.LinearState if options["attention"] == "linear" else lt.KeyValueCache
        assert isinstance(cache.attention, inner)


def test_bad_short_conv_and_cache():
    for bad in (-1, 2.5, True, "3", None):
        with pytest.raises(ValueError, match="short_conv is .* but expected an int >= 0"):
            lt.MultiheadAttention(8, 2, "linear", causal=True, short_conv=bad)
    plain = lt.MultiheadAttention(8, 2, "linear", causal=True, feature_map="elu+1")
    convolved = lt.MultiheadAttention(8, 2, "linear", causal=True, feature_map="elu+1",
                                      short_conv=3)
    x = torch.randn(1, 4, 8)
    _, state = plain(x, return_cache=True)
    _, both = convolved(x, return_cache=True)
    with pytest.raises(ValueError, match="cache is a LinearState but this layer "
                                         r"\(short_conv=3\) takes the ShortConvCache"):
        convolved(x, first_position=4, cache=state)
    with pytest.raises(ValueError, match="cache is a ShortConvCache but this layer "
                                         r"\(short_conv=0\) takes the cache"):
        plain(x, first_position=4, cache=both)
    assert "short_conv=3" in repr(convolved) and "short_conv" not in repr(plain)
    assert {"q_conv.weight", "k_conv.weight", "v_conv.weight"} <= set(convolved.state_dict())
