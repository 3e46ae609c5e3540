"""The native path (linrope.torch.native: PyTorch ops on any device) against the C++ kernels,
forced onto CPU tensors with linrope.torch.backend("native"): linear attention for every map x
placement x causal x option (offsets, eps = 0, no denominator, decay, one per head, lengths,
state in and out, chunk boundaries), softmax attention, RoPE and the feature maps, in value,
denominator statistics, states and gradients; float64 to 1e-12 of each result's largest entry,
float32 within twice bounds.py's derived bounds (each side within one bound of the exact
result); gradcheck in float64; decoding = forward and a sequence cut anywhere; large inputs and a
long decayed sequence stay finite; the choice of path and its refusals; bfloat16's accuracy.

LINROPE_TEST_DEVICE=cuda (scripts/gpu_check.sh) runs the native side on that device; the C++
side stays on the CPU. Where the C++ module is not built (linrope._pure stands in), the expected
side is the native path on the CPU, which the same tests prove equal to the kernels wherever the
module is built, and the tests of the kernels' own behaviour are skipped."""
import math
import os

import pytest
import torch

import linrope
import linrope.torch as lt
import bounds
import reference as ref
from cases import CAUSAL_OR_NOT, PLACEMENTS, inputs, make_map, rope_for, true_sums
from linrope.torch.native import softmax as native_softmax
from linrope.torch.native.dispatch import core_built

KINDS = ["elu+1", "relu", "favor+", "favor-trig", "1+cos", "favor-hyp"]
DEVICE = torch.device(os.environ.get("LINROPE_TEST_DEVICE", "cpu"))
# Float64 results of the two paths differ by the rounding of sums taken in other orders: ~1e-15
# of their magnitude at these sizes; 1e-12 leaves room for the products' condition.
TOLERANCE64 = 1e-12
# The path the native one is compared with: the C++ kernels on CPU tensors, where built.
EXPECTED = "auto" if core_built() else "native"
NEEDS_CORE = pytest.mark.skipif(not core_built(), reason="the C++ module is not built here")


def _outputs(result):
    """The tensors of a result (out, a LinearState's S, z, log_scale) and its stats dict."""
    if isinstance(result, torch.Tensor):
        return [result], None
    tensors, stats = [], None
    for part in result:
        if isinstance(part, dict):
            stats = part
        else:
            tensors.extend([part] if isinstance(part, torch.Tensor) else list(part))
    return tensors, stats


def run(call, tensors, backend, device=torch.device("cpu"), seed=7):
    """call(*tensors) under `backend` with the tensors on `device` (leaves requiring grad):
    (its output tensors, its stats, the gradients of sum(G * outputs) with respect to the
    tensors, G a fixed random draw per output), all on the CPU."""
    leaves = [t.detach().to(device).requires_grad_() for t in tensors]
    with lt.backend(backend):
        result = call(*leaves)
    outs, stats = _outputs(result)
    g = torch.Generator().manual_seed(seed)
    weighted = [(o * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o)).sum()
                for o in outs if o.requires_grad]
    grads = torch.autograd.grad(sum(weighted), leaves, allow_unused=True)
    grads = [torch.zeros_like(x) if gx is None else gx for x, gx in zip(leaves, grads)]
    return [o.detach().cpu() for o in outs], stats, [gx.cpu() for gx in grads]


def assert_close64(got, want, what):
    """Within TOLERANCE64 of want's largest |entry| (infinities, -inf log scales, equal)."""
    assert got.shape == want.shape, what
    infinite = torch.isinf(want)
    assert torch.equal(torch.isinf(got), infinite) and torch.equal(got[infinite], want[infinite]), (
        what)
    got, want = got[~infinite], want[~infinite]
    if want.numel():
        scale = float(want.abs().max())
        error = float((got - want).abs().max())
        assert error <= TOLERANCE64 * scale, f"{what}: error {error:.3g} of {scale:.3g}"


def assert_same_stats(got, want, what):
    for name in ("count", "no_keys", "zero_divisor", "nonpositive", "below_threshold",
                 "threshold"):
        assert got[name] == want[name], (what, name, got, want)
    assert got["min"] == pytest.approx(want["min"], rel=TOLERANCE64, abs=0), (what, got, want)


def compare(call, tensors, what):
    """call on the native path (on DEVICE) equals call on the C++ kernels (EXPECTED), float64."""
    want, want_stats, want_grads = run(call, tensors, EXPECTED)
    got, got_stats, got_grads = run(call, tensors, "native", DEVICE)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_close64(a, b, f"{what}: output {i}")
    for name, a, b in zip(("dq", "dk", "dv", "dS0", "dz0"), got_grads, want_grads):
        assert_close64(a, b, f"{what}: {name}")
    if want_stats is not None:
        assert_same_stats(got_stats, want_stats, what)


# ---- Linear attention: every map x placement x causal x option, float64 ------------------------

# name: (keyword options, key count, causal only). chunk_size reaches the C++ chunked form only
# with method="chunked"; the native path's causal form always chunks by it.
OPTIONS = {
    "plain": (dict(), 9, False),
    "offsets": (dict(q_offset=5, k_offset=2, chunk_size=2), 12, False),
    "keys_after_queries": (dict(q_offset=0, k_offset=3, chunk_size=4), 9, False),
    "eps_0": (dict(eps=0.0), 9, False),
    "no_denominator": (dict(denominator=False), 9, False),
    "chunked": (dict(method="chunked", chunk_size=3), 9, True),
    "decay": (dict(decay=0.8, chunk_size=4), 9, True),
    "head_decays": (dict(decay=(0.5, 0.95), method="chunked", chunk_size=2), 9, True),
    "lengths": (dict(q_lengths=[9, 4], k_lengths=[9, 6], chunk_size=3), 9, False),
    "state": (dict(q_offset=3, k_offset=3, chunk_size=4), 9, True),
    "state_decay": (dict(q_offset=3, k_offset=3, decay=(0.7, 0.9), chunk_size=2), 9, True),
}


def map_rope_eps(kind, placement):
    """The sweep's map (width 4, 6 random features), its rope and the reference's arguments for
    it, and eps: 1 where the denominator is signed (full, favor-trig), as test_torch.py's sweep
    does."""
    fm = make_map(kind, 4, seed=2)
    rope, rope_ref = rope_for(placement, fm, 4)
    return fm, rope, rope_ref, 1.0 if kind == "favor-trig" or placement == "full" else 1e-6


def linear_call(kind, placement, causal, option):
    """(call, tensors) of one case: [2, 2, 9, 4] queries, map_rope_eps's map, rope and eps."""
    options, n_k, _ = OPTIONS[option]
    fm, rope, _, eps = map_rope_eps(kind, placement)
    kwargs = dict(dict(causal=causal, placement=placement, rope=rope, eps=eps,
                       return_stats=True), **options)
    tensors = inputs((2, 2, 9, 4), (2, 2, n_k, 4), (2, 2, n_k, 3), seed=1)
    if not option.startswith("state"):
        return (lambda q, k, v: lt.linear_attention(q, k, v, fm, **kwargs)), tensors
    m = fm.output_dim
    S0, z0 = inputs((2, 2, m, 3), (2, 2, m), seed=3)
    z0 = z0.detach().abs() + 0.5
    # One head of one sequence starts empty (log scale -inf: its S and z are not read).
    log_scale0 = torch.tensor([[0.4, -math.inf], [-1.0, 2.0]], dtype=torch.float64)

    def call(q, k, v, S0, z0):
        return lt.linear_attention(q, k, v, fm, initial_state=(S0, z0, log_scale0.to(q.device)),
                                   return_state=True, **kwargs)
    return call, tensors + [S0, z0]


def linear_cases():
    for option, (_, _, causal_only) in OPTIONS.items():
        for kind in KINDS:
            for placement in PLACEMENTS:
                if option == "no_denominator" and placement == "full":
                    continue  # refused: full is numerator_only without a denominator
                for causal in ((True,) if causal_only else (False, True)):
                    yield pytest.param(kind, placement, causal, option,
                                       id=f"{option}-{kind}-{placement}-{causal}")


@pytest.mark.parametrize("kind, placement, causal, option", linear_cases())
def test_linear_attention_equals_the_kernels_in_float64(kind, placement, causal, option):
    call, tensors = linear_call(kind, placement, causal, option)
    compare(call, tensors, f"{kind} {placement} causal={causal} {option}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("placement", PLACEMENTS)
@CAUSAL_OR_NOT
def test_linear_attention_float32_within_the_derived_bounds(kind, placement, causal):
    # Both paths in float32, each within bounds.py's bound of the exact result (out: linear_bound,
    # gradients: linear_gradient_bounds), so within twice it of each other.
    fm, rope, rope_ref, eps = map_rope_eps(kind, placement)
    exact = [x.detach() for x in inputs((2, 2, 9, 4), (2, 2, 9, 4), (2, 2, 9, 3), (2, 2, 9, 3),
                                        seed=4)]
    options = dict(causal=causal, placement=placement, rope=rope, eps=eps)
    g32 = exact[3].float()
    results = []
    for backend, device in ((EXPECTED, torch.device("cpu")), ("native", DEVICE)):
        leaves = [x.float().to(device).requires_grad_() for x in exact[:3]]
        with lt.backend(backend):
            out = lt.linear_attention(*leaves, fm, **options)
        grads = torch.autograd.grad((out * g32.to(device)).sum(), leaves)
        results.append([out.detach().cpu()] + [x.cpu() for x in grads])
    W = torch.from_numpy(fm.projection) if kind.startswith("favor") else None
    where = dict(causal=causal, placement=placement, rope=rope_ref, eps=eps)
    within = [bounds.linear_bound(*exact[:3], kind, W, torch.float32, **where),
              *bounds.linear_gradient_bounds(*exact, kind, W, torch.float32, **where)]
    for name, got, want, bound in zip(("out", "dq", "dk", "dv"), *results, within):
        bounds.assert_within(got, want, 2 * bound, f"{kind} {placement} {causal}: {name}")


@pytest.mark.parametrize("kind", ["elu+1", "favor+", "1+cos", "favor-trig"])
@pytest.mark.parametrize("placement", PLACEMENTS)
@CAUSAL_OR_NOT
def test_linear_attention_gradcheck(kind, placement, causal):
    fm, rope, _, eps = map_rope_eps(kind, placement)
    q, k, v = inputs((2, 1, 6, 4), (2, 1, 6, 4), (2, 1, 6, 3), seed=5)
    with lt.backend("native"):
        assert torch.autograd.gradcheck(
            lambda q, k, v: lt.linear_attention(q, k, v, fm, causal=causal, placement=placement,
                                                rope=rope, eps=eps, chunk_size=4),
            [x.detach().to(DEVICE).requires_grad_() for x in (q, k, v)])


@pytest.mark.parametrize("kind", ["elu+1", "favor+", "favor-hyp", "1+cos"])
@pytest.mark.parametrize("decay", [None, 0.8, (0.6, 0.95)], ids=["plain", "decay", "per-head"])
def test_state_in_state_out_and_lengths_gradcheck(kind, decay):
    # The inputs, the initial state (one head empty) and padding, against finite differences of
    # the outputs and the final state's sums exp(log_scale) (S, z); chunks of 2.
    fm = make_map(kind, 4, seed=2)
    rope, _ = rope_for("numerator_only", fm, 4)
    m = fm.output_dim
    tensors = inputs((2, 2, 5, 4), (2, 2, 5, 4), (2, 2, 5, 3), (2, 2, m, 3), seed=3)
    z0 = torch.rand(2, 2, m, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    tensors = [x.detach().to(DEVICE).requires_grad_() for x in tensors + [z0 + 0.5]]
    log_scale0 = torch.tensor([[0.4, 0.4], [-math.inf, 0.4]], dtype=torch.float64).to(DEVICE)

    def call(q, k, v, S0, z0):
        out, state = lt.linear_attention(q, k, v, fm, causal=True, rope=rope, q_offset=3,
                                         k_offset=3, decay=decay, chunk_size=2,
                                         q_lengths=[5, 3], k_lengths=[5, 4],
                                         initial_state=(S0, z0, log_scale0), return_state=True)
        return (out, *true_sums(state))
    with lt.backend("native"):
        assert torch.autograd.gradcheck(call, tensors)


# ---- Decoding, cuts, long and large inputs ------------------------------------------------------

@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("decay", [None, (0.6, 0.95)], ids=["plain", "per-head"])
def test_decoding_token_by_token_and_cuts_anywhere_equal_one_call(placement, decay):
    # The native path fed token by token, and in parts cut at 0, 1, 6, 12 and 13 (of 13), each
    # part from the state the parts before left: the native call on the whole (outputs, the final
    # state's sums, every gradient), which equals the kernels' (test above).
    fm = make_map("favor+", 4, seed=5)
    rope, _ = rope_for(placement, fm, 4)
    options = dict(causal=True, placement=placement, rope=rope, decay=decay,
                   eps=1.0 if placement == "full" else 1e-6)
    tensors = inputs((2, 2, 13, 4), (2, 2, 13, 4), (2, 2, 13, 3), seed=7)

    def whole(q, k, v):
        return lt.linear_attention(q, k, v, fm, return_state=True, **options)

    def in_parts(cuts):
        def call(q, k, v):
            outs, state, edges = [], None, (0, *cuts, 13)
            for begin, end in zip(edges[:-1], edges[1:]):
                piece = [x[:, :, begin:end] for x in (q, k, v)]
                out, state = lt.linear_attention(*piece, fm, q_offset=begin, k_offset=begin,
                                                 initial_state=state, return_state=True,
                                                 **options)
                outs.append(out)
            return torch.cat(outs, 2), state
        return call

    want, _, want_grads = run(whole, tensors, "native", DEVICE)
    for cuts in [tuple(range(1, 13)), (0, 1, 6, 12, 13)]:
        got, _, got_grads = run(in_parts(cuts), tensors, "native", DEVICE)
        for name, a, b in [("out", got[0], want[0])] + list(zip(
                ("exp(l) S", "exp(l) z"), true_sums(got[1:]), true_sums(want[1:]))) + list(
                zip(("dq", "dk", "dv"), got_grads, want_grads)):
            assert_close64(a, b, f"{placement} {decay} cuts {cuts}: {name}")


def test_large_inputs_and_a_long_decayed_sequence_stay_finite_and_equal_the_kernels():
    # FAVOR+ at |q|, |k| ~ 40 (exp(<q, k> / sqrt(d)) overflows float64 unstabilised) and n = 4096
    # at g = 0.5 (g^4095 underflows float64): finite, and equal to the kernels'.
    fm = make_map("favor+", 8, m=16, seed=1)
    rope, _ = rope_for("numerator_only", fm, 8)
    q, k, v = inputs((1, 2, 4096, 8), (1, 2, 4096, 8), (1, 2, 4096, 4), scale=10.0, seed=2)

    def call(q, k, v):
        return lt.linear_attention(q, k, v, fm, causal=True, rope=rope, decay=0.5,
                                   return_state=True)
    compare(call, [q, k, v], "large inputs, n = 4096, g = 0.5")
    out, _, grads = run(call, [q, k, v], "native", DEVICE)
    # Every entry finite: the output, the state (its log scale included: the keys are not all
    # decayed away, g^4095 is kept as a logarithm) and the gradients.
    assert all(torch.isfinite(t).all() for t in out + grads)


# ---- Softmax attention, RoPE, feature maps ------------------------------------------------------

SOFTMAX_OPTIONS = {
    "plain": (dict(), 9, 9),
    "offsets": (dict(q_offset=5, k_offset=2), 9, 12),
    "decoding": (dict(q_offset=9, k_offset=0), 3, 12),  # the last queries of a key cache
    "every_key_seen": (dict(q_offset=20, k_offset=0), 3, 12),
    "lengths": (dict(q_lengths=[9, 4], k_lengths=[6, 9]), 9, 9),
    "a_length_0": (dict(q_lengths=[9, 4], k_lengths=[0, 9]), 9, 9),
    "scale": (dict(scale=0.3), 9, 9),
    "no_keys": (dict(), 9, 0),
    "blocks": (dict(q_offset=3, k_offset=1), 300, 300),  # several QUERY_BLOCKs of the fallback
}


@pytest.mark.parametrize("option", list(SOFTMAX_OPTIONS))
@pytest.mark.parametrize("rope", [False, True], ids=["plain", "rope"])
@CAUSAL_OR_NOT
def test_softmax_attention_equals_the_kernels(option, rope, causal):
    options, n, n_k = SOFTMAX_OPTIONS[option]
    r = linrope.Rope(4, layout="half") if rope else None
    tensors = inputs((2, 2, n, 4), (2, 2, n_k, 4), (2, 2, n_k, 3), scale=1.0, seed=8)
    compare(lambda q, k, v: lt.softmax_attention(q, k, v, causal=causal, rope=r, **options),
            tensors, f"softmax {option} rope={rope} causal={causal}")
    two_d = [x[0, 0] for x in tensors]
    if "lengths" not in options and "k_lengths" not in options:
        compare(lambda q, k, v: lt.softmax_attention(q, k, v, causal=causal, rope=r, **options),
                two_d, f"softmax (n, d) {option}")


@CAUSAL_OR_NOT
def test_softmax_attention_gradcheck_and_float32_bounds(causal):
    q, k, v = [x.detach().to(DEVICE).requires_grad_()
               for x in inputs((2, 2, 6, 4), (2, 2, 5, 4), (2, 2, 5, 3), seed=9)]
    rope = linrope.Rope(4)
    with lt.backend("native"):
        assert torch.autograd.gradcheck(
            lambda q, k, v: lt.softmax_attention(q, k, v, causal=causal, rope=rope, q_offset=2,
                                                 k_lengths=[5, 3]), (q, k, v))
    exact = [x.detach() for x in inputs((2, 2, 12, 8), (2, 2, 12, 8), (2, 2, 12, 8),
                                        (2, 2, 12, 8), scale=1.0, seed=10)]
    leaves = [x.float().to(DEVICE).requires_grad_() for x in exact[:3]]
    rope = linrope.Rope(8)
    with lt.backend("native"):
        out = lt.softmax_attention(*leaves, causal=causal, rope=rope)
    grads = torch.autograd.grad((out * exact[3].float().to(DEVICE)).sum(), leaves)
    q, k, v = (x.clone().requires_grad_() for x in exact[:3])
    want = ref.softmax_attention(q, k, v, causal=causal, rope={})
    wanted = torch.autograd.grad(want, (q, k, v), exact[3])
    want = want.detach()
    bounds.assert_within(out.cpu(), want, bounds.softmax_bound(
        *exact[:3], torch.float32, causal=causal, rope={}), "out")
    within = bounds.softmax_gradient_bounds(*exact, torch.float32, causal=causal, rope={})
    for name, got, w, bound in zip(("dq", "dk", "dv"), grads, wanted, within):
        bounds.assert_within(got.cpu(), w, bound, name)


def explicit_sdpa(q, k, v, attn_mask=None, is_causal=False, scale=None):
    """scaled_dot_product_attention's documented contract written out (a boolean attn_mask keeps
    the True entries; is_causal keeps key j <= query i, top-left aligned), so that sdpa_route's
    choice of mask is tested where PyTorch has no SDPA (torch < 2.1): the explicit n x n_k form."""
    scores = (q @ k.transpose(-1, -2)) * scale
    if is_causal:
        rows, cols = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(rows, cols, dtype=torch.bool).triu(1), -math.inf)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, -math.inf)
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("option", ["plain", "decoding", "every_key_seen", "lengths",
                                    "a_length_0", "offsets"])
@CAUSAL_OR_NOT
def test_the_sdpa_route_takes_only_the_masks_it_can_express(option, causal):
    # sdpa_route with the explicit stand-in gives the kernels' result where it answers, and
    # declines (None) where the mask would need an n x n_k tensor or a row sees no key.
    options, n, n_k = SOFTMAX_OPTIONS[option]
    q, k, v = inputs((2, 2, n, 4), (2, 2, n_k, 4), (2, 2, n_k, 3), scale=1.0, seed=11)
    q_offset, k_offset = options.get("q_offset", 0), options.get("k_offset", 0)
    k_lengths = options.get("k_lengths")
    k_valid = (None if k_lengths is None else
               (torch.arange(n_k)[None, :] < torch.tensor(k_lengths)[:, None])[:, None, :, None])
    k_in, v_in = ((k, v) if k_valid is None else (k * k_valid, v * k_valid))
    got = native_softmax.sdpa_route(q, k_in, v_in, 0.5, causal, q_offset, k_offset, k_lengths,
                                    k_valid, kernel=explicit_sdpa)
    expressible = (k_lengths is None or min(k_lengths) > 0) and (
        not causal or q_offset >= k_offset + n_k - 1 or (q_offset == k_offset and not k_lengths))
    assert (got is not None) == expressible, option
    if got is not None:
        with lt.backend(EXPECTED):
            want = lt.softmax_attention(q, k, v, causal=causal, scale=0.5, q_offset=q_offset,
                                        k_offset=k_offset, k_lengths=k_lengths)
        assert_close64(got.detach(), want.detach(), option)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize("scaling, rotary_dim", [(s, r) for s in ("none", "linear", "ntk", "yarn")
                                                 for r in (8, 6, 2) if (s, r) != ("ntk", 2)])
def test_rope_equals_the_kernels_at_every_position(layout, scaling, rotary_dim):
    # NTK needs r > 2. Positions up to 90001: the C++ tables' float64 angles err by ~3e-18 p
    # (3e-13 there), the native path's exact products by ~1e-16 (rope.py).
    rope = linrope.Rope(8, rotary_dim=rotary_dim, layout=layout, scaling=scaling,
                        factor=1.0 if scaling == "none" else 2.5,
                        original_max_position=16 if scaling == "yarn" else 0)
    tensors = inputs((2, 3, 7, 8), seed=12)
    positions = [3, -4, 5, 90001, 0, 1, 7]
    for first in (0, -3, 65537):
        compare(lambda x: lt.rope_apply(x, rope, first_position=first), tensors,
                f"rope from {first}")
    compare(lambda x: lt.rope_apply(x, rope, positions=positions), [tensors[0][0, 0]],
            "rope at positions")
    (x,) = [t.detach().to(DEVICE).requires_grad_() for t in tensors]
    with lt.backend("native"):
        assert torch.autograd.gradcheck(lambda x: lt.rope_apply(x, rope, 3), (x,))


@pytest.mark.parametrize("kind", KINDS)
def test_feature_maps_equal_the_kernels(kind):
    fm = make_map(kind, 8, m=5, seed=3)
    tensors = inputs((2, 3, 7, 8), seed=13)
    compare(lambda x: lt.feature_map_apply(x, fm), tensors, kind)
    zero = torch.zeros(1, 8, dtype=torch.float64)  # 1+cos at x = 0: [0, ..., 0, 1]
    compare(lambda x: lt.feature_map_apply(x, fm), [zero], f"{kind} at 0")
    (x,) = [t.detach().to(DEVICE).requires_grad_() for t in tensors]
    with lt.backend("native"):
        assert torch.autograd.gradcheck(lambda x: lt.feature_map_apply(x, fm), (x,))


# ---- The choice of path, refusals ----------------------------------------------------------------

@NEEDS_CORE
def test_the_backend_is_chosen_by_name_and_restored():
    assert lt.backend.current() == "auto"
    with pytest.raises(ValueError, match="name is 'cuda' but expected one of auto, native"):
        lt.backend("cuda")
    with lt.backend("native"):
        assert lt.backend.current() == "native"
        with lt.backend("auto"):
            assert lt.backend.current() == "auto"
        assert lt.backend.current() == "native"
    assert lt.backend.current() == "auto"
    # "auto" keeps CPU tensors on the C++ kernels: they refuse bfloat16, which the native path
    # computes (in float32).
    q, k, v = (x.detach().bfloat16() for x in inputs((5, 4), (5, 4), (5, 3)))
    with pytest.raises(ValueError, match="q has dtype torch.bfloat16 but expected"):
        lt.softmax_attention(q, k, v)
    with lt.backend("native"):
        assert lt.softmax_attention(q, k, v).dtype == torch.bfloat16


def test_mixed_devices_and_dtypes_are_refused_naming_them():
    q, k, v = (x.detach() for x in inputs((5, 4), (5, 4), (5, 3)))
    fm = make_map("elu+1", 4)
    meta = k.to("meta")  # a second device without one: the check runs before any computation
    for backend in ("auto", "native"):
        with lt.backend(backend):
            with pytest.raises(ValueError, match="k is on meta but q is on cpu; expected every "
                                                 "tensor on one device"):
                lt.linear_attention(q, meta, v, fm, placement="none")
            with pytest.raises(ValueError, match="v is on meta but q is on cpu"):
                lt.softmax_attention(q, k, v.to("meta"))
    with lt.backend("native"):
        with pytest.raises(ValueError, match="k has dtype torch.float32 but q has dtype "
                                             "torch.float64"):
            lt.linear_attention(q, k.float(), v, fm, placement="none")
        with pytest.raises(ValueError, match="initial_state.S is on meta but q is on cpu"):
            lt.linear_attention(q, k, v, fm, placement="none", causal=True, initial_state=(
                torch.zeros(4, 3, device="meta"), torch.zeros(4), torch.zeros(())))
        with pytest.raises(TypeError, match="q is a ndarray"):
            lt.softmax_attention(q.numpy(), k, v)


@NEEDS_CORE
def test_bad_calls_are_refused_on_both_paths():
    # Each call raises ValueError on the C++ kernels and on the native path, both messages
    # holding the words given (the argument and the expected value).
    q, k, v = (x.detach() for x in inputs((1, 2, 5, 4), (1, 2, 5, 4), (1, 2, 5, 3)))
    fm = make_map("favor+", 4)
    rope = linrope.Rope(6)
    state = (torch.zeros(1, 2, 6, 4, dtype=torch.float64),
             torch.zeros(1, 2, 6, dtype=torch.float64), torch.zeros(1, 2, dtype=torch.float64))

    def linear(**options):
        return lambda: lt.linear_attention(q, k, v, fm, **dict(dict(rope=rope), **options))
    calls = [
        (linear(placement="numerator-only"), "expected one of none, before_map, numerator_only"),
        (linear(method="scanned"), "expected one of chunked, scan"),
        (linear(eps=-1.0), "but expected a finite eps >= 0"),
        (linear(chunk_size=0), "options.chunk_size is 0 but expected >= 1"),
        (linear(rope=None), "options.rope is null but placement numerator_only needs a rope"),
        (linear(rope=linrope.Rope(4)), "options.rope has dim 4 but placement numerator_only"),
        (lambda: lt.linear_attention(q, k, v, make_map("favor+", 6), rope=rope),
         "q has d = 4 but map.input_dim() is 6"),
        (linear(causal=True, decay=1.5), "options.decay is 1.5 but expected a decay in (0, 1]"),
        (linear(decay=0.5), "options.decay is 0.5 but options.causal is false"),
        (linear(causal=True, decay=(0.5,)), "decay has 1 values but q has H = 2 heads"),
        (linear(causal=True, decay="0.9"), "decay is a str but expected a float"),
        (linear(placement="full", denominator=False), "without a denominator full and"),
        (linear(return_state=True), "options.causal is false but a state in, state out call"),
        (linear(causal=True, initial_state=state), "initial_state.S has shape (1, 2, 6, 4) but "
                                                   "expected (1, 2, 6, 3)"),
        (linear(q_lengths=[6]), "lengths[0] is 6 but expected a length in [0, 5]"),
        (linear(k_lengths=[1, 2]), "k_lengths has 2 entries but"),
        (lambda: lt.linear_attention(q, k[..., :3], v, fm, rope=rope),
         "k is [1, 2, 5, 3] but q has d = 4"),
        (lambda: lt.linear_attention(q, k, v[:, :, :4], fm, rope=rope),
         "v is [1, 2, 4, 3] but k has n = 5"),
        (lambda: lt.softmax_attention(q[0], k, v), "q has 3 dimensions but expected 2 (n, d)"),
        (lambda: lt.softmax_attention(q, k, v, scale=-1.0), "but expected a finite scale > 0"),
        (lambda: lt.softmax_attention(q, k, v, rope=rope), "rope has dim = 6 but q has d = 4"),
        (lambda: lt.rope_apply(q, rope), "but the rope has dim = 6"),
        (lambda: lt.rope_apply(q, linrope.Rope(4), first_position=2 ** 60), "2^53"),
    ]
    for call, words in calls:
        for backend in ("auto", "native"):
            with lt.backend(backend), pytest.raises(ValueError) as raised:
                call()
            assert words in str(raised.value), (backend, words, str(raised.value))


# ---- bfloat16 -----------------------------------------------------------------------------------

def bfloat16_inputs(placement, kind):
    """A causal problem in bfloat16, n = 256, d = 16, m = 64: (q, k, v, feature map, options)."""
    fm = make_map(kind, 16, m=64, seed=4)
    rope, _ = rope_for(placement, fm, 16)
    q, k, v = (x.detach().bfloat16() for x in inputs((1, 4, 256, 16), (1, 4, 256, 16),
                                                     (1, 4, 256, 16), scale=1.0, seed=5))
    return q, k, v, fm, dict(causal=True, placement=placement, rope=rope)


def bfloat16_errors(placement, kind="favor+"):
    """The native path in bfloat16 (computed in float32) against the kernels in float64 on the
    same (bfloat16-rounded) inputs: the largest error over the largest |output|, and the share of
    rows whose error exceeds 10% of that row's largest |output|."""
    q, k, v, fm, options = bfloat16_inputs(placement, kind)
    with lt.backend(EXPECTED):
        want = lt.linear_attention(q.double(), k.double(), v.double(), fm, **options)
    with lt.backend("native"):
        got = lt.linear_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), fm, **options)
    assert got.dtype == torch.bfloat16
    error = (got.cpu().double() - want).abs()
    rows = error.amax(-1) > 0.1 * want.abs().amax(-1)
    return float(error.max() / want.abs().max()), float(rows.double().mean())


def test_bfloat16_keeps_eq_19_to_its_rounding():
    # eq. 19 (numerator_only): the output is bfloat16's rounding of the float32 result, within
    # 2^-8 of each entry (plus float32's own error): every row stays within 10%.
    error, bad_rows = bfloat16_errors("numerator_only")
    assert error <= 2 ** -7 and bad_rows == 0, (error, bad_rows)


@pytest.mark.parametrize("placement", ["numerator_only", "full"])
def test_bfloat16_is_float32_rounded_once(placement):
    # bfloat16 inputs are computed in float32 and the output rounded once: bit for bit the float32
    # call on the same values, rounded. (No error bound for full: a denominator that nearly
    # cancels magnifies the inputs' own bfloat16 rounding, a relative 2^-9, without bound.)
    q, k, v, fm, options = bfloat16_inputs(placement, "elu+1")
    with lt.backend("native"):
        got = lt.linear_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), fm, **options)
        want = lt.linear_attention(q.float().to(DEVICE), k.float().to(DEVICE),
                                   v.float().to(DEVICE), fm, **options)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want.bfloat16())
