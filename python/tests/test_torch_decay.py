"""The decay at the PyTorch level: linrope.torch.linear_attention(decay=) against reference.py's
explicit decay matrix in value and gradient, gradcheck in float64 (with the state in and out:
test_state.py), a sequence cut anywhere, bad input; MultiheadAttention(decay=): "retnet",
refusals, decoding equals the parallel forward, and a long sequence stays finite. Sequence
parallelism with a decay is in test_distributed.py."""
import math

import pytest
import torch

import linrope
import linrope.torch as lt
import reference as ref
from cases import PLACEMENTS, inputs, make_map, rope_for, true_sums

DECAYS = [0.8, (0.6, 0.95)]  # one for every head, one per head (H = 2)
DECAY_IDS = ["one", "per-head"]


def options_for(placement, fm, d=4):
    rope, rope_ref = rope_for(placement, fm, d)
    # eps = 1 for full: a signed denominator near 0 would make finite differences meaningless.
    eps = 1.0 if placement == "full" else 1e-6
    return dict(causal=True, placement=placement, rope=rope, eps=eps), rope_ref


@pytest.mark.parametrize("kind", ["elu+1", "favor+"])
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("decay", DECAYS, ids=DECAY_IDS)
def test_decay_matches_the_reference_in_value_and_gradient(kind, placement, decay):
    fm = make_map(kind, 4, seed=2)
    options, rope_ref = options_for(placement, fm)
    q, k, v = inputs((2, 2, 9, 4), (2, 2, 9, 4), (2, 2, 9, 3), seed=1)
    out = lt.linear_attention(q, k, v, fm, q_offset=3, k_offset=3, decay=decay, **options)
    W = torch.from_numpy(fm.projection) if kind == "favor+" else None
    want, _ = ref.decayed_linear_attention(
        q, k, v, kind, list(decay) if isinstance(decay, tuple) else decay, W=W,
        placement=placement, rope=rope_ref, eps=options["eps"], q_offset=3, k_offset=3)
    # float64: the kernels and the reference agree to ~1e-14 at these sizes (test_torch.py).
    torch.testing.assert_close(out, want, rtol=0, atol=1e-10)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g),
                    torch.autograd.grad(want, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)
    # A decay of 1 is no decay, bit for bit.
    assert torch.equal(lt.linear_attention(q, k, v, fm, decay=1.0, **options),
                       lt.linear_attention(q, k, v, fm, **options))


def test_decay_without_a_denominator_gradcheck():
    fm = make_map("elu+1", 4)
    q, k, v = inputs((2, 2, 7, 4), (2, 2, 7, 4), (2, 2, 7, 3), seed=6)
    assert torch.autograd.gradcheck(
        lambda q, k, v: lt.linear_attention(q, k, v, fm, causal=True, denominator=False,
                                            rope=linrope.Rope(4), decay=torch.tensor([0.5, 0.9])),
        (q, k, v))


@pytest.mark.parametrize("decay", DECAYS, ids=DECAY_IDS)
@pytest.mark.parametrize("cuts", [(0,), (1,), (6,), (12,), (13,), (5, 6)], ids=str)
def test_a_sequence_cut_anywhere_with_a_decay_equals_one_call(decay, cuts):
    # The parts after each cut continue from the state the parts before left (q_offset = k_offset
    # = the tokens before): outputs, the final state's sums and every gradient equal one call,
    # in float64 to ~1e-14 (the same sums, grouped otherwise); 1e-11 of the largest entry.
    fm = make_map("favor+", 4, seed=5)
    options, _ = options_for("numerator_only", fm)
    exact = inputs((2, 2, 13, 4), (2, 2, 13, 4), (2, 2, 13, 3), (2, 2, 13, 3), seed=7)
    g = exact[3].detach()
    whole = [x.detach().clone().requires_grad_() for x in exact[:3]]
    out, final = lt.linear_attention(*whole, fm, decay=decay, return_state=True, **options)
    (out * g).sum().backward()
    parts = [x.detach().clone().requires_grad_() for x in exact[:3]]
    outs, state, bounds = [], None, (0, *cuts, 13)
    for begin, end in zip(bounds[:-1], bounds[1:]):
        piece = [x[:, :, begin:end] for x in parts]
        o, state = lt.linear_attention(*piece, fm, q_offset=begin, k_offset=begin,
                                       initial_state=state, return_state=True, decay=decay,
                                       **options)
        outs.append(o)
    (torch.cat(outs, 2) * g).sum().backward()

    def close(a, b):
        return (a - b).abs().max().item() <= 1e-11 * max(1.0, b.abs().max().item())
    assert close(torch.cat(outs, 2).detach(), out.detach())
    for a, b in zip(true_sums(state), true_sums(final)):
        assert close(a.detach(), b.detach())
    for a, b in zip(parts, whole):
        assert close(a.grad, b.grad)


def test_bad_decays_are_refused_naming_decay():
    fm = make_map("elu+1", 4)
    q, k, v = inputs((1, 2, 5, 4), (1, 2, 5, 4), (1, 2, 5, 3))
    for decay in (0.0, 1.5, -0.5, float("nan"), (0.9,), (0.9, 0.8, 0.7), "0.9"):
        with pytest.raises(ValueError, match="decay"):
            lt.linear_attention(q, k, v, fm, causal=True, decay=decay)
    with pytest.raises(ValueError, match="decay"):
        lt.linear_attention(q, k, v, fm, causal=False, decay=0.9)


def retnet(heads):
    """RetNet's decays: gamma_h = 1 - 2^(-5-h)."""
    return [1 - 2.0 ** -(5 + h) for h in range(heads)]


def test_the_layer_decays_each_head_as_given():
    torch.manual_seed(0)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    settings = (("retnet", retnet(4)), (0.7, [0.7] * 4),
                ((0.5, 0.6, 0.7, 0.8), [0.5, 0.6, 0.7, 0.8]))
    for decay, heads in settings:
        layer = lt.MultiheadAttention(16, 4, "linear", feature_map="elu+1", causal=True,
                                      decay=decay, seed=3).double()
        assert layer.head_decays == tuple(heads)
        assert f"decay={decay!r}" in repr(layer)
        # A fixed setting: no parameter, no buffer, nothing in the state_dict.
        plain = lt.MultiheadAttention(16, 4, "linear", feature_map="elu+1", causal=True, seed=3)
        assert set(layer.state_dict()) == set(plain.state_dict())
        assert len(list(layer.parameters())) == len(list(plain.parameters()))

        def split(t):
            return t.view(2, 9, 4, 4).transpose(1, 2)
        q, k, v = split(layer.q_proj(x)), split(layer.k_proj(x)), split(layer.v_proj(x))
        out = lt.linear_attention(q.contiguous(), k.contiguous(), v.contiguous(),
                                  layer.feature_map, causal=True, placement=layer.placement,
                                  rope=layer.rope, decay=heads)
        want = layer.out_proj(out.transpose(1, 2).reshape(2, 9, 16))
        torch.testing.assert_close(layer(x), want, rtol=0, atol=0)


def test_the_layer_refuses_a_decay_it_cannot_apply():
    for options in (dict(attention="softmax", causal=True), dict(attention="linear")):
        with pytest.raises(ValueError, match="decay needs attention='linear' and causal=True"):
            lt.MultiheadAttention(8, 2, decay=0.9, **options)
    for decay in ("xpos", 0.0, 1.01, (0.9,), True):
        with pytest.raises(ValueError, match="MultiheadAttention: decay is"):
            lt.MultiheadAttention(8, 2, "linear", causal=True, decay=decay)


@pytest.mark.parametrize("options", [
    dict(feature_map="favor+", num_features=8, decay="retnet"),
    dict(feature_map="elu+1", placement="full", decay=0.7),
    dict(feature_map="elu+1", denominator=False, decay=(0.5, 0.9), short_conv=3),
], ids=str)
def test_decoding_with_a_decay_equals_the_parallel_forward(options):
    # A prompt of 4 tokens, then one token at a time, then a block of 3: the state carried in
    # the cache is the decayed sum at the last token, so each step continues it.
    torch.manual_seed(3)
    layer = lt.MultiheadAttention(16, 2, "linear", causal=True, **options).double().eval()
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    whole = layer(x)
    outs, cache, start = [], None, 0
    for stop in (4, 5, 6, 7, 8, 9, 12):
        out, cache = layer(x[:, start:stop], first_position=start, cache=cache,
                           return_cache=True)
        outs.append(out)
        start = stop
    torch.testing.assert_close(torch.cat(outs, 1), whole, rtol=1e-10, atol=1e-12)


def test_a_long_sequence_with_a_strong_decay_stays_finite():
    # n = 8192 at g = 0.5, in float64: g^8191 = 2^-8191 underflows even float64 (its least is
    # 2^-1074), and the stabiliser's log scale must carry it. The outputs and gradients are
    # finite, and the last tokens equal the layer run on the last 128 tokens alone (positions
    # continued): what the earlier ones add weighs at most 0.5^112 ~ 2e-34 of it.
    torch.manual_seed(1)
    layer = lt.MultiheadAttention(16, 2, "linear", causal=True, decay=0.5).double()
    x = torch.randn(1, 8192, 16, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters())
    tail = layer(x[:, -128:].detach(), first_position=8192 - 128)
    # Both sides round differently only, and the largest difference is the decay's: its log
    # weights at position p ~ 8191 are |ln g| p ~ 5,700 in size, rounded to |ln g| p u (u =
    # 2^-53), a relative 6.3e-13 in each weight exp(.); numerator and denominator each a sum of
    # such weights, the output within a few: 8 |ln g| n u = 5e-12 of the largest entry (measured
    # 2.9e-13). The rest (sums of 16 and 8 terms, the state's rounding decaying at g: <= 2u) is
    # under 100 u = 1.1e-14; the dropped tokens' 2e-34 far below.
    scale = out[:, -16:].abs().max().item()
    bound = (8 * math.log(2) * 8192 + 100) * 2.0 ** -53
    assert (tail[:, -16:] - out[:, -16:]).abs().max().item() <= bound * scale
