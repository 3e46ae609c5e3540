"""Rounding-error bounds for the tests that compare a lower-precision result (float32) with the
float64 reference, or two results of one precision computed in different orders. Derived as the
C++ tests derive theirs (tests/linear_gradient_cases.hpp): a result made of rounded sums and
products errs by at most gamma = k u times the sum of the magnitudes of the terms it is made of,
u the unit roundoff (2^-24 for float32), k the roundings along its longest chain. Each function
says its k and its magnitudes, computed from the float64 inputs with reference.py (which shares
nothing with linrope), and returns a bound per entry of the result.

Magnitudes of dot products use Cauchy-Schwarz, sum_c |a_c| |b_c| <= |a| |b|, and RoPE keeps norms,
so |<R a, R b>| terms sum to at most |a| |b| whatever the rotation."""
import torch

import reference as ref


def unit_roundoff(dtype):
    """u: half the distance from 1 to the next number of dtype (2^-24 for float32)."""
    return torch.finfo(dtype).eps / 2


def rope_bound(x, dtype):
    """R x in dtype against R x exact, x [..., n, d] (magnitude 1: no YaRN). Each output entry is
    a cos - b sin (or a sin + b cos) of its pair (a, b): x rounded to dtype (u |a|, u |b|), cos
    and sin rounded (u each; the angle is computed in double), two products and a sum (3 u), so
    at most 6 u (|a| + |b|) <= 12 u max |x| over the row."""
    return 12 * unit_roundoff(dtype) * x.abs().amax(-1, keepdim=True).expand_as(x)


def _exponent_magnitude(x, W):
    """The magnitude of the favor maps' exponent W x' - |x'|^2 / 2, x' = x d^-1/4, per feature:
    sum_c |W_jc| |x'_c| + |x'|^2 / 2, [..., f]."""
    scaled = x * x.shape[-1] ** -0.25
    return scaled.abs() @ W.abs().T + (scaled * scaled).sum(-1, keepdim=True) / 2


def feature_map_bound(x, kind, W, dtype):
    """phi(x) in dtype against phi(x) exact, per feature [..., m]. x rounded to dtype and the
    exponent's d-term dot product with a few more operations perturb an exponent (or a sin / cos
    argument) of magnitude A by at most (d + 5) u A; exp turns that into a relative error of the
    feature, sin and cos into an absolute error times their envelope exp(|x'|^2 / 2) / sqrt(f);
    exp itself and the scale 1 / sqrt(f) add 2 u. elu+1: x + 1, or exp(x) (A = |x|), within
    3 u (|x| + 1) |phi|. relu: x's rounding, u |x|. 1+cos: x / |x| and the constant, within
    (d + 4) u."""
    u, d = unit_roundoff(dtype), x.shape[-1]
    phi = ref.feature_map(x, kind, W)
    if kind == "relu":
        return u * x.abs()
    if kind == "elu+1":
        return 3 * u * (x.abs() + 1) * phi.abs()
    if kind == "1+cos":
        return torch.full_like(phi, (d + 4) * u)
    exponent = _exponent_magnitude(x, W)
    relative = (d + 5) * u * exponent + 2 * u
    if kind == "favor+":
        return relative * phi
    if kind == "favor-hyp":  # exp(u - h) and exp(-u - h): the same magnitude for both halves
        return torch.cat([relative, relative], -1) * phi
    if kind == "favor-trig":
        scaled = x * d ** -0.25
        envelope = torch.exp((scaled * scaled).sum(-1, keepdim=True) / 2) / W.shape[0] ** 0.5
        return torch.cat([relative, relative], -1) * envelope
    raise ValueError(kind)


def _feature_relative_error(x, kind, W, dtype):
    """The largest |phi(x) error| / |phi(x)| over the rows of x (norms over the features)."""
    phi = ref.feature_map(x, kind, W)
    bound = feature_map_bound(x, kind, W, dtype)
    return float((bound.norm(dim=-1) / phi.norm(dim=-1).clamp_min(1e-300)).max())


def _keys_seen(n, n_k, causal, q_offset, k_offset):
    """[n, n_k] float64: 1 where query i sees key j."""
    if not causal:
        return torch.ones(n, n_k, dtype=torch.float64)
    return ((k_offset + torch.arange(n_k))[None, :]
            <= (q_offset + torch.arange(n))[:, None]).to(torch.float64)


def softmax_weights(q, k, causal=False, scale=None, rope=None, q_offset=0, k_offset=0):
    """The reference's attention weights p [..., n, n_k]: its output for the values I."""
    eye = torch.eye(k.shape[-2], dtype=torch.float64).expand(*k.shape[:-1], k.shape[-2])
    return ref.softmax_attention(q, k, eye, causal=causal, scale=scale, rope=rope,
                                 q_offset=q_offset, k_offset=k_offset)


def _score_error(q, k, scale, u):
    """max over j of the error of s_ij = scale <R q_i, R k_j>, [..., n, 1]: q and k rounded, the
    rotation (4 u) and a d-term dot product, (d + 6) u scale |q_i| |k_j|."""
    d = q.shape[-1]
    scale = d ** -0.5 if scale is None else scale
    return ((d + 6) * u * scale * q.norm(dim=-1, keepdim=True)
            * k.norm(dim=-1).amax(-1, keepdim=True)[..., None, :])


def softmax_bound(q, k, v, dtype, scale=None, **options):
    """out_i = sum_j p_ij v_j in dtype against exact, per entry. A score error delta moves each
    p_ij by a relative 2 delta at most (the normalisation takes the rest); exp, the running sum
    and the division add (n_k + 4) u; v's rounding and the weighted sum (n_k + 1) u, all of
    sum_j p_ij |v_j|."""
    u, n_k = unit_roundoff(dtype), k.shape[-2]
    p = softmax_weights(q, k, scale=scale, **options)
    return (2 * _score_error(q, k, scale, u) + (2 * n_k + 5) * u) * (p @ v.abs())


def softmax_gradient_bounds(q, k, v, d_out, dtype, scale=None, **options):
    """dq, dk, dv of L = sum(d_out * out) in dtype against exact, per row (all entries of a row
    share it). dp_ij = <g_i, v_j> (|g_i| |v_j| in magnitude) and D_i = sum_j p_ij dp_ij;
    dq_i = scale sum_j p_ij (dp_ij - D_i) k_j, dk_j = scale sum_i p_ij (dp_ij - D_i) q_i,
    dv_j = sum_i p_ij g_i. Each term is off by the weights' relative error (softmax_bound's) plus
    the dot products and sums around it, (2 n_k + d + d_v + 8) u, of its magnitude."""
    u, n, n_k, d, d_v = (unit_roundoff(dtype), q.shape[-2], k.shape[-2], q.shape[-1],
                         v.shape[-1])
    scale_ = d ** -0.5 if scale is None else scale
    p = softmax_weights(q, k, scale=scale, **options)
    gamma = 2 * _score_error(q, k, scale, u) + (2 * n_k + n + d + d_v + 8) * u  # [..., n, 1]
    dp = d_out.norm(dim=-1, keepdim=True) * v.norm(dim=-1)[..., None, :]  # [..., n, n_k]
    D = (p * dp).sum(-1, keepdim=True)
    terms = gamma * p * (dp + D)
    dq = scale_ * terms @ k.norm(dim=-1, keepdim=True)
    dk = scale_ * terms.transpose(-1, -2) @ q.norm(dim=-1, keepdim=True)
    dv = (gamma * p).transpose(-1, -2) @ d_out.norm(dim=-1, keepdim=True)
    return dq.expand_as(q), dk.expand_as(k), dv.expand_as(v)


def linear_bound(q, k, v, kind, W, dtype, causal=False, placement="numerator_only", rope=None,
                 eps=1e-6, q_offset=0, k_offset=0):
    """o_i = num_i / (den_i + eps) in dtype against exact, per entry; num_i = sum_j w_ij v_j,
    den_i = sum_j w'_ij, w and w' products of the features phi_i = phi(q_i), psi_j = phi(k_j)
    (rotated or not: |w_ij|, |w'_ij| <= |phi_i| |psi_j|). A weight errs by the two features'
    relative errors (c each, feature_map_bound) plus its m-term dot product and the rotations
    ((m + 4) u); the sums over j add (n_k + 1) u: with gamma = 2 c + (m + n_k + 6) u,
    |num_i error| <= gamma N_i, N_i = sum_j |phi_i| |psi_j| |v_j|, and |den_i error| <= gamma
    D_i, D_i = sum_j |phi_i| |psi_j|, so |o_i error| <= gamma (N_i + |o_i| D_i) / |den_i + eps|
    + u |o_i| (the division)."""
    u, n, n_k = unit_roundoff(dtype), q.shape[-2], k.shape[-2]
    if placement == "before_map":
        q, k = ref.rotate(q, q_offset, **rope), ref.rotate(k, k_offset, **rope)
    phi, psi = ref.feature_map(q, kind, W), ref.feature_map(k, kind, W)
    c = max(_feature_relative_error(q, kind, W, dtype), _feature_relative_error(k, kind, W, dtype))
    gamma = 2 * c + (phi.shape[-1] + n_k + 6) * u
    seen = _keys_seen(n, n_k, causal, q_offset, k_offset)
    products = phi.norm(dim=-1)[..., :, None] * psi.norm(dim=-1)[..., None, :] * seen
    out, den = ref.linear_attention(q, k, v, kind, W, causal=causal,
                                    placement="none" if placement == "before_map" else placement,
                                    rope=rope, eps=eps, q_offset=q_offset, k_offset=k_offset)
    N = products @ v.abs()
    D = products.sum(-1, keepdim=True)
    return gamma * (N + out.abs() * D) / (den + eps).abs()[..., None] + u * out.abs()


def _jacobian_norms(x, kind, W):
    """|J_phi(x_i)| per row, [..., n, 1]: the Frobenius norm (>= the spectral norm) of the
    feature map's Jacobian, one reference backward per feature."""
    x = x.detach().requires_grad_()
    phi = ref.feature_map(x, kind, W)
    squares = torch.zeros(x.shape[:-1] + (1,), dtype=torch.float64)
    for c in range(phi.shape[-1]):
        (row_gradients,) = torch.autograd.grad(phi[..., c].sum(), x, retain_graph=True)
        squares += (row_gradients * row_gradients).sum(-1, keepdim=True)
    return squares.sqrt()


def linear_gradient_bounds(q, k, v, d_out, kind, W, dtype, causal=False,
                           placement="numerator_only", rope=None, eps=1e-6, q_offset=0,
                           k_offset=0):
    """dq, dk, dv of L = sum(d_out * out) in dtype against exact, per row. With a_i = |phi_i|,
    b_j = |psi_j|, J the feature map's Jacobian and den~_i = |den_i + eps|:
        dv_j = sum_i w_ij g_i / (den_i + eps)            magnitude  sum_i a_i b_j |g_i| / den~_i
        dq_i = J_i^T sum_j (dw_ij (g_i . v_j) - dw'_ij (g_i . o_i)) / (den_i + eps)
                                magnitude  |J_i| sum_j b_j |g_i| (|v_j| + |o_i|) / den~_i
        dk_j likewise           magnitude  |J_j| sum_i a_i |g_i| (|v_j| + |o_i|) / den~_i
    Each term carries the forward's relative error gamma (linear_bound) magnified by the division
    (1 + D_i / den~_i, the reciprocal's condition), the Jacobian's own (gamma again) and the dot
    products and sums of the backward ((n + d + d_v + 4) u)."""
    u, n, n_k, d, d_v = (unit_roundoff(dtype), q.shape[-2], k.shape[-2], q.shape[-1],
                         v.shape[-1])
    x_q, x_k = q, k
    if placement == "before_map":
        x_q, x_k = ref.rotate(q, q_offset, **rope), ref.rotate(k, k_offset, **rope)
    phi, psi = ref.feature_map(x_q, kind, W), ref.feature_map(x_k, kind, W)
    c = max(_feature_relative_error(x_q, kind, W, dtype),
            _feature_relative_error(x_k, kind, W, dtype))
    gamma = 2 * c + (phi.shape[-1] + n_k + 6) * u
    seen = _keys_seen(n, n_k, causal, q_offset, k_offset)
    out, den = ref.linear_attention(x_q, x_k, v, kind, W, causal=causal,
                                    placement="none" if placement == "before_map" else placement,
                                    rope=rope, eps=eps, q_offset=q_offset, k_offset=k_offset)
    a, b = phi.norm(dim=-1, keepdim=True), psi.norm(dim=-1, keepdim=True)
    divisor = (den + eps).abs()[..., None]
    condition = 1 + (a * (seen @ b)) / divisor  # [..., n, 1]
    g = d_out.norm(dim=-1, keepdim=True) / divisor  # |g_i| / den~_i
    o = out.norm(dim=-1, keepdim=True)
    v_norm = v.norm(dim=-1, keepdim=True)
    relative = (2 * gamma * condition.amax(-2, keepdim=True)
                + (n + d + d_v + 4) * u)  # [..., 1, 1]
    dv = relative * (seen.transpose(-1, -2) @ (a * g)) * b
    dq = relative * _jacobian_norms(x_q, kind, W) * g * (seen @ (b * v_norm) + (seen @ b) * o)
    dk = relative * _jacobian_norms(x_k, kind, W) * (
        seen.transpose(-1, -2) @ (a * g) * v_norm + seen.transpose(-1, -2) @ (a * g * o))
    return dq.expand_as(q), dk.expand_as(k), dv.expand_as(v)


def assert_within(actual, expected, bound, what=""):
    """|actual - expected| <= bound entry by entry (tensors or arrays); the message names the
    worst entry's error and bound."""
    actual, expected, bound = (torch.as_tensor(x).detach().to(torch.float64)
                               for x in (actual, expected, bound))
    error = (actual - expected).abs()
    worst = int((error - bound).flatten().argmax())
    assert bool((error <= bound).all()), (
        f"{what}: |error| {error.flatten()[worst]:.3g} > bound {bound.flatten()[worst]:.3g}")
