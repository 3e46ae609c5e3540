"""The computations bench/compare_pytorch.py times, checked: linrope's batched calls (forward and
backward) and the benchmarks' PyTorch competitor (bench/torch_side.py: forward, and autograd's
gradients) against the float64 reference (reference.py), in float32, the benchmarks' precision,
and in float64. Cases: softmax and linear attention (elu+1, FAVOR+ with linrope's W), causal or
not, placements none, numerator_only (RoFormer eq. 19) and full, our causal forms scan and chunked,
PyTorch's einsum, cumsum and chunked forms, and one long head that the causal kernels cut into one
segment per thread; then the benchmark's PyTorch layer (torch_side.torch_layer) against
linrope.torch.MultiheadAttention.

Tolerances: first-order rounding bounds in the precision run (u = 2^-24 float32, 2^-53 float64),
derived as the C++ tests derive theirs, computed entry by entry from the reference's magnitudes:
  softmax (tests/test_softmax_attention.cpp, test_softmax_backward.cpp): a score is off by
    e_s = scale |q| |k| (d + 10) u (the d-term product and the scaling; |.| the largest row
    norm); moving the scores by e_s moves each weight P_ij by 2 e_s relative, and the exp, the sum
    over n_k keys and the division add (2 n_k + 8) u: |out error| <= (P |v|) eps_o. The gradients
    go through P, dP_ij = <d_out_i, v_j> and <d_out_i, o_i>, each term bounded by
    E_ij = P_ij (|d_out_i|.|v_j| + |d_out_i|.(P |v|)_i), and sum n_k (dq) or n (dk, dv) such terms
    (softmax_bounds()). All times 4: first order, and the reference rounds too.
  linear (tests/test_linear_attention.cpp, linear_gradient_cases.hpp): num_i = sum_j A_ij v_j and
    den_i = sum_j B_ij add terms bounded by M_ij max|v_j| (M = |phi_i|.|psi_j|, or per rotary pair
    (|a| + |b|)(|c| + |e|) where the features are rotated); any summation order errs by (m + n_k) u
    times the sum of |terms|, FAVOR+'s exp carries its argument's error (z_size below), rotations
    and casts add a few u: gamma = 8 (u + u64) (m + d + n_k + 16 + 2 z_size), margin 8. Dividing,
    |o_i error| <= gamma (N_i + |o_i| (D_i + eps)) / (|den_i + eps| - gamma (D_i + eps)), N_i and
    D_i the sums of M over the admissible keys; the gradients within gamma G, G the sum over the
    pairs of the size of each term of dq, dk and dv (LinearReference.gradient_bounds()). A row with
    |den_i + eps| <= 2 gamma (D_i + eps) (placement full's rotated denominator near 0) is
    ill-conditioned in float32: its output is not compared and its d_out is 0 (at most 1 row in 50,
    checked).
  PyTorch's elu+1 is expm1(x) + 1, off by ~2u absolutely: relative to e^x at the inputs' most
    negative x (-4.5 here) that is ~180 u, inside elu+1's gamma (2800 u here).
The bounds are rigorous and loose: the errors measured use at most 1.2e-3 of them. In float32
they are 3e-4 - 6e-2 of the outputs' largest entry (0.3 for FAVOR+ full) and 2e-2 - 0.3 of the
gradients' for softmax and elu+1, but up to 4x for FAVOR+ (80x for full), whose Jacobian's |W|
terms cancel in the gradient and not in its bound, and whose gamma holds the exp's argument's
worst case (d + 2) |x'| |w|; float64's are at most 3e-7 of the largest entry. So the float32
checks catch the errors of order 1 (one key too many in PyTorch's chunks fails them, as does the
denominator's term of our non-causal dk dropped, for 3 of its 6 cases), the float64 checks also
small ones (that term scaled by 0.999 fails all 6 in float64; a lost eps in PyTorch's einsum
form, float64 only).

bench/torch_side.py is imported from this file's repository (../../bench); without the sources
beside the tests (an installed package alone) those checks are skipped, saying so.
"""
import importlib.util
import math
import pathlib

import pytest
import torch

import linrope
import linrope.torch as lt
import reference as ref

UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64],
                                 ids=["float32", "float64"])
EPS = 1e-6  # linrope's default, and torch_side's
# d as in the benchmarks; m = 128 (two orthogonal blocks) rather than their 256: the reference's
# explicit m x m rotation matrices then cost a quarter.
BATCH, HEADS, N, D, M = 2, 2, 200, 64, 128
CHUNK = 64  # the chunk of our chunked causal form, as compare_pytorch.py's
LONG_N, LONG_THREADS = 1100, 4  # a causal head of 1100 rows: 4 segments on 4 threads
TORCH_SIDE = pathlib.Path(__file__).resolve().parents[2] / "bench" / "torch_side.py"


def load_torch_side():
    """bench/torch_side.py of this file's repository, or None where it is absent."""
    if not TORCH_SIDE.is_file():
        return None
    spec = importlib.util.spec_from_file_location("torch_side", TORCH_SIDE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


torch_side = load_torch_side()
needs_sources = pytest.mark.skipif(
    torch_side is None, reason=f"{TORCH_SIDE} not found: the benchmarks' PyTorch side is checked "
                               f"from a source checkout only")
COMPETITOR_KEYS = list(torch_side.BY_KEY) if torch_side else ["(no bench/torch_side.py)"]


def feature_map(kind, d=D, m=M):
    """elu+1, or FAVOR+ as the benchmarks draw it: m orthogonal features, seed 11."""
    if kind == "favor+":
        return linrope.FeatureMap("favor+", d, num_features=m, orthogonal=True, seed=11)
    return linrope.FeatureMap("elu+1", d)


def projection(fm):
    """W [m x d] in float64 (the reference's); None for elu+1, which has none."""
    return torch.from_numpy(fm.projection) if fm.kind == "favor+" else None


def problem(n=N, heads=HEADS, d=D, seed=5):
    """q, k, v, d_out [BATCH, heads, n, d]: float32 Gaussians."""
    gen = torch.Generator().manual_seed(seed + n + heads)
    return [torch.randn(BATCH, heads, n, d, generator=gen) for _ in range(4)]


def causal_mask(n, causal):
    ones = torch.ones(n, n, dtype=torch.float64)
    return ones.tril() if causal else ones


def max_row_norm(x):
    return float(x.norm(dim=-1).max())


def leaves(tensors, dtype):
    return [x.detach().to(dtype).requires_grad_() for x in tensors]


# ---- Softmax -----------------------------------------------------------------------------------

def softmax_bounds(q, k, v, d_out, causal, dtype):
    """(out, dq, dk, dv) bounds on |computed - exact| for softmax attention computed in dtype
    (float64 q, k, v, d_out; the module's docstring says how)."""
    u = UNIT_ROUNDOFF[dtype]
    n, d, d_v = q.shape[-2], q.shape[-1], v.shape[-1]
    scale = 1 / math.sqrt(d)
    e_s = scale * max_row_norm(q) * max_row_norm(k) * (d + 10) * u
    scores = (scale * q @ k.transpose(-1, -2)).masked_fill(causal_mask(n, causal) == 0, -math.inf)
    p = torch.softmax(scores, dim=-1)
    pv = p @ v.abs()
    eps_p = 2 * e_s + (scale * max_row_norm(q) * max_row_norm(k) + n + 8) * u  # P_ij, relative
    eps_o = 2 * e_s + (2 * n + 8) * u  # out, relative to P |v|
    eps_s = 2 * eps_p + d_v * u + eps_o  # dS_ij = P_ij (dP_ij - <d_out_i, o_i>), relative to E
    e = p * (d_out.abs() @ v.abs().transpose(-1, -2) + (d_out.abs() * pv).sum(-1, keepdim=True))
    return (4 * eps_o * pv,
            4 * scale * (e @ k.abs()) * (eps_s + 2 * (n + d + 8) * u),
            4 * scale * (e.transpose(-1, -2) @ q.abs()) * (eps_s + 2 * (n + d + 8) * u),
            4 * (p.transpose(-1, -2) @ d_out.abs()) * (eps_p + (n + 8) * u))


def softmax_expected(causal, dtype):
    """The reference's output and gradients on problem(), their bounds in dtype, and d_out."""
    tensors = problem()
    exact = leaves(tensors, torch.float64)
    out = ref.softmax_attention(*exact[:3], causal=causal)
    want = [out.detach(), *torch.autograd.grad(out, exact[:3], exact[3])]
    return want, softmax_bounds(*(x.detach() for x in exact), causal, dtype), tensors[3]


# ---- Linear ------------------------------------------------------------------------------------

def pair_sums(x):
    """|a| + |b| for each interleaved rotary pair (a, b) of the last dimension: [.., m / 2]."""
    return x[..., 0::2].abs() + x[..., 1::2].abs()


def pair_magnitude(x):
    """|a| + |b| in both entries of each pair: bounds |(R x)_a| and |(R^T R' x)_a| entry by
    entry."""
    return pair_sums(x).repeat_interleave(2, dim=-1)


def exponent_size(kind, x, w):
    """z_size: elu+1's exp sees x itself; FAVOR+'s argument x' w - |x'|^2 / 2, x' = x d^-1/4,
    errs by <= (d + 2) u (|w| |x'| + |x'|^2 / 2) (tests/reference/linear_reference.hpp)."""
    if kind == "elu+1":
        return float(x.abs().max())
    d = x.shape[-1]
    xs = max_row_norm(x) * d ** -0.25
    return (d + 2) * (max_row_norm(w) * xs + xs * xs / 2)


class LinearReference:
    """One linear problem (float64 q, k, v [.., n, d] requiring grad): the reference's output,
    its magnitudes, and the bounds of a computation in another precision."""

    def __init__(self, q, k, v, kind, w, causal, placement):
        rotated = placement in ("numerator_only", "full")
        self.out, self.den = ref.linear_attention(
            q, k, v, kind, w, causal=causal, placement=placement, rope={} if rotated else None,
            eps=EPS)
        q, k, v = q.detach(), k.detach(), v.detach()
        phi, psi = ref.feature_map(q, kind, w), ref.feature_map(k, kind, w)
        n, d, m = q.shape[-2], q.shape[-1], phi.shape[-1]
        self.mask = causal_mask(n, causal)
        plain = (phi.abs() @ psi.abs().transpose(-1, -2)) * self.mask
        pairs = (pair_sums(phi) @ pair_sums(psi).transpose(-1, -2)) * self.mask
        self.M = pairs if rotated else plain  # bounds the terms of A_ij
        self.M_den = pairs if placement == "full" else plain  # and those of B_ij
        self.vmax = v.abs().amax(-1, keepdim=True)
        self.N = self.M @ self.vmax  # [.., n, 1]
        self.D = self.M_den.sum(-1, keepdim=True) + EPS
        self.terms = m + d + n + 16 + 2 * max(exponent_size(kind, q, w), exponent_size(kind, k, w))
        self.q, self.k, self.kind, self.w, self.phi, self.psi = q, k, kind, w, phi, psi
        self.rotated, self.full = rotated, placement == "full"

    def gamma(self, dtype):
        return 8 * (UNIT_ROUNDOFF[dtype] + UNIT_ROUNDOFF[torch.float64]) * self.terms

    def denominators(self):
        return (self.den.detach().unsqueeze(-1) + EPS).abs()

    def ill_conditioned(self, dtype):
        """[.., n, 1]: the rows whose |den + eps| <= 2 gamma (D + eps), where not even the sign of
        the denominator is determined in dtype and no bound holds."""
        return self.denominators() <= 2 * self.gamma(dtype) * self.D

    def forward_bound(self, dtype):
        """|o_i error| <= gamma (N_i + |o_i| (D_i + eps)) / (|den_i + eps| - gamma (D_i + eps)),
        infinite on the ill-conditioned rows."""
        gamma, o = self.gamma(dtype), self.out.detach().abs().amax(-1, keepdim=True)
        bound = gamma * (self.N + o * self.D) / (self.denominators() - gamma * self.D)
        return bound.masked_fill(self.ill_conditioned(dtype), math.inf)

    def jacobian_times(self, y, x, features):
        """y |J(x)|: y [.., m] times the magnitude of the map's Jacobian at x [.., d]."""
        if self.kind == "elu+1":
            return y * torch.exp(x.clamp(max=0))
        s = x.shape[-1] ** -0.25
        weighted = y * features
        return s * (weighted @ self.w.abs() + weighted.sum(-1, keepdim=True) * x.abs() * s)

    def gradient_bounds(self, dtype, d_out):
        """gamma G for dq, dk, dv of L = sum(d_out * out) (tests/linear_gradient_cases.cpp)."""
        fa = pair_magnitude(self.psi) if self.rotated else self.psi.abs()
        fb = fa if self.full else self.psi.abs()
        ga = pair_magnitude(self.phi) if self.rotated else self.phi.abs()
        gb = ga if self.full else self.phi.abs()
        den = self.denominators()
        cond = self.D / den
        o = self.out.detach().abs().amax(-1, keepdim=True)
        d_sum = d_out.abs().sum(-1, keepdim=True)
        amp = (2 + cond) / den  # on <g_i, v_j> and on dv's A_ij / D_i
        a_weight = d_sum * amp
        b_weight = d_sum * (self.N / den + (2 + 2 * cond) * o) / den  # on c_i
        mask_t = self.mask.transpose(-1, -2)
        dq = self.jacobian_times(a_weight * (self.mask @ (self.vmax * fa))
                                 + b_weight * (self.mask @ fb), self.q, self.phi)
        dk = self.jacobian_times(self.vmax * (mask_t @ (a_weight * ga)) + mask_t @ (b_weight * gb),
                                 self.k, self.psi)
        dv = self.M.transpose(-1, -2) @ (amp * d_out.abs())
        return [self.gamma(dtype) * g for g in (dq, dk, dv)]


_linear_cache = {}


def linear_reference(kind, placement, causal, n=N, heads=HEADS, d=D, m=M):
    """The reference on problem(n, heads, d), its gradients and the d_out they are for:
    problem()'s, 0 on the rows ill-conditioned in float32, so that the gradients do not depend on
    those rows' outputs. Computed once per case: the explicit rotation matrices are slow."""
    key = (kind, placement, causal, n, heads, d, m)
    if key not in _linear_cache:
        tensors = problem(n, heads, d)
        exact = leaves(tensors[:3], torch.float64)
        r = LinearReference(*exact, kind, projection(feature_map(kind, d, m)), causal, placement)
        ill = r.ill_conditioned(torch.float32)
        assert int(ill.sum()) <= ill.numel() // 50, (
            f"{key}: {int(ill.sum())} of {ill.numel()} rows ill-conditioned; choose other inputs")
        d_out = tensors[3].masked_fill(ill, 0)
        grads = torch.autograd.grad(r.out, exact, d_out.double())
        _linear_cache[key] = r, [r.out.detach(), *grads], d_out
    return _linear_cache[key]


def linear_expected(kind, placement, causal, dtype, **shape):
    """The reference's output and gradients, their bounds in dtype, and d_out."""
    r, want, d_out = linear_reference(kind, placement, causal, **shape)
    return want, [r.forward_bound(dtype), *r.gradient_bounds(dtype, d_out.double())], d_out


def assert_all_within(got, expected):
    """got (out, dq, dk, dv) within the bounds of expected (want, bounds, d_out), entry by entry."""
    want, bounds, _ = expected
    for name, g, w, bound in zip(("out", "dq", "dk", "dv"), got, want, bounds):
        error = (g.double() - w).abs()
        assert bool((error <= bound).all()), (
            f"{name}: |error| up to {float((error - bound).max()):.3g} above its bound "
            f"(largest |error| {float(error.max()):.3g}, largest |{name}| "
            f"{float(w.abs().max()):.3g})")


# ---- linrope's batched calls -------------------------------------------------------------------

def linrope_softmax(q, k, v, d_out, causal):
    """(out, dq, dk, dv) of linrope's batched softmax attention."""
    arrays = [x.numpy() for x in (q, k, v)]
    out = linrope.softmax_attention(*arrays, causal=causal)
    grads = linrope.softmax_attention_backward(*arrays, d_out.numpy(), causal=causal)
    return [torch.from_numpy(x) for x in (out, *grads)]


def linrope_linear(q, k, v, d_out, fm, causal, placement, method):
    """(out, dq, dk, dv) of linrope's batched linear attention; RoPE on the features (interleaved,
    base 10000, the reference's rope={}) unless placement is none."""
    options = dict(causal=causal, placement=placement, method=method, chunk_size=CHUNK,
                   rope=None if placement == "none" else linrope.Rope(fm.output_dim))
    arrays = [x.numpy() for x in (q, k, v)]
    out = linrope.linear_attention(*arrays, fm, **options)
    grads = linrope.linear_attention_backward(*arrays, d_out.numpy(), fm, **options)
    return [torch.from_numpy(x) for x in (out, *grads)]


@DTYPES
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_linrope_softmax_matches_the_reference(causal, dtype):
    expected = softmax_expected(causal, dtype)
    q, k, v, d_out = (x.to(dtype) for x in (*problem()[:3], expected[2]))
    assert_all_within(linrope_softmax(q, k, v, d_out, causal), expected)


LINEAR_CASES = [(kind, placement, causal, method)
                for kind in ("elu+1", "favor+")
                for placement in ("none", "numerator_only", "full")
                for causal, method in ((False, "scan"), (True, "scan"), (True, "chunked"))]


def check_linrope_linear(kind, placement, causal, method, dtype, n=N, heads=HEADS, d=D, m=M):
    expected = linear_expected(kind, placement, causal, dtype, n=n, heads=heads, d=d, m=m)
    q, k, v, d_out = (x.to(dtype) for x in (*problem(n, heads, d)[:3], expected[2]))
    fm = feature_map(kind, d, m)
    assert_all_within(linrope_linear(q, k, v, d_out, fm, causal, placement, method), expected)


@DTYPES
@pytest.mark.parametrize("kind,placement,causal,method", LINEAR_CASES)
def test_linrope_linear_matches_the_reference(kind, placement, causal, method, dtype):
    check_linrope_linear(kind, placement, causal, method, dtype)


def test_linrope_long_causal_head_in_segments_matches_the_reference():
    # The causal kernels cut a head into one segment per thread, each at least 256 rows long:
    # 1100 rows on 4 threads make 4 (src/linear/causal_plan.cpp). d = 16, m = 32 keep the
    # reference's 1100 explicit rotation matrices small.
    threads = linrope.get_num_threads()
    linrope.set_num_threads(LONG_THREADS)
    try:
        check_linrope_linear("favor+", "numerator_only", True, "scan", torch.float32, n=LONG_N,
                             heads=1, d=16, m=32)
    finally:
        linrope.set_num_threads(threads)


# ---- The benchmarks' PyTorch competitor --------------------------------------------------------

@needs_sources
@DTYPES
@pytest.mark.parametrize("key", COMPETITOR_KEYS)
def test_pytorch_competitor_computes_what_its_name_says(key, dtype):
    competitor = torch_side.BY_KEY[key]
    if competitor.attention == "softmax":
        expected, w = softmax_expected(competitor.causal, dtype), None
    else:
        expected = linear_expected(competitor.attention, "none", competitor.causal, dtype)
        w = projection(feature_map(competitor.attention))
    q, k, v = leaves(problem()[:3], dtype)
    out = competitor(q, k, v, None if w is None else w.to(dtype))
    got = [out.detach(), *torch.autograd.grad(out, (q, k, v), expected[2].to(dtype))]
    assert_all_within(got, expected)


@needs_sources
@pytest.mark.parametrize("attention", ["linear", "softmax"])
def test_pytorch_layer_is_the_linrope_layers_projections_around_its_attention(attention):
    # torch_side.torch_layer(mha, f) copies mha's projections and splits the heads itself; with f
    # the very call mha makes, both layers do the same operations on the same numbers (linrope's
    # kernels are deterministic: tests/test_determinism.cpp), so they agree bit for bit. The
    # attention the benchmark puts in f's place is checked against the reference above. The
    # twin's projections are torch.nn.Linear, mha's linrope.torch.Linear (linrope's GEMM, checked
    # in test_linear_maps.py): mha gets nn.Linear copies too, so that the products round alike.
    torch.manual_seed(0)
    options = dict(feature_map="favor+", num_features=M, placement="none") if (
        attention == "linear") else {}
    mha = lt.MultiheadAttention(128, 2, attention=attention, causal=True, rope=False, **options)
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        setattr(mha, name, torch_side.plain_linear(getattr(mha, name)))

    def same_call(q, k, v):
        if attention == "softmax":
            return lt.softmax_attention(q, k, v, causal=True)
        return lt.linear_attention(q, k, v, mha.feature_map, causal=True, placement="none",
                                   eps=mha.eps, method=mha.method, chunk_size=mha.chunk_size)

    layer = torch_side.torch_layer(mha, same_call)
    gen = torch.Generator().manual_seed(1)
    x, d_out = (torch.randn(1, 100, 128, generator=gen) for _ in range(2))
    seen = []
    for module in (mha, layer):
        xg = x.clone().requires_grad_()
        out = module(xg)
        out.backward(d_out)
        seen.append((out.detach(), xg.grad, module.q_proj.weight.grad, module.out_proj.weight.grad))
    for name, a, b in zip(("out", "dx", "d q_proj.weight", "d out_proj.weight"), *seen):
        assert torch.equal(a, b), f"{name} differs"
