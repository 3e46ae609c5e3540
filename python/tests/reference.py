"""The pure-PyTorch float64 reference the Python package is checked against: explicit rotation
matrices and explicit n x n attention, written from docs/DESIGN.md's formulas ("RoPE", "Feature
maps", "Placements") and sharing nothing with linrope (the one input taken from linrope is a
favor map's W, its random parameter). Every function is differentiable by torch.autograd, which
gives the reference gradients."""
import math

import torch

D = torch.float64


def frequencies(rotary_dim, base=10000.0, scaling="none", factor=1.0, original_max_position=0,
                beta_fast=32.0, beta_slow=1.0):
    """theta_i after scaling, i = 0 .. r/2 - 1, and the magnitude on the rotated dimensions."""
    r = rotary_dim
    if scaling == "ntk":
        base = base * factor ** (r / (r - 2))
    theta = torch.tensor([base ** (-2.0 * i / r) for i in range(r // 2)], dtype=D)
    magnitude = 1.0
    if scaling == "linear":
        theta = theta / factor
    elif scaling == "yarn":
        turns = original_max_position * theta / (2 * math.pi)
        gamma = ((turns - beta_slow) / (beta_fast - beta_slow)).clamp(0, 1)
        theta = (1 - gamma) * theta / factor + gamma * theta
        magnitude = 0.1 * math.log(factor) + 1 if factor > 1 else 1.0
    return theta, magnitude


def rotation(p, dim, rotary_dim=0, layout="interleaved", **scaling):
    """The explicit dim x dim matrix R_p: pair i rotated by the angle p theta_i."""
    r = rotary_dim or dim
    theta, magnitude = frequencies(r, **scaling)
    R = torch.eye(dim, dtype=D)
    for i in range(r // 2):
        a, b = (2 * i, 2 * i + 1) if layout == "interleaved" else (i, i + r // 2)
        c, s = math.cos(p * theta[i].item()), math.sin(p * theta[i].item())
        c, s = c * magnitude, s * magnitude
        R[a, a], R[a, b], R[b, a], R[b, b] = c, -s, s, c
    return R


def rotate(x, first_position=0, positions=None, **rope):
    """Rows of x [..., n, dim] rotated by R_p at p = first_position + i, or at p = positions[i]."""
    n, dim = x.shape[-2], x.shape[-1]
    positions = range(first_position, first_position + n) if positions is None else positions
    R = torch.stack([rotation(p, dim, **rope) for p in positions])  # [n, d, d]
    return torch.einsum("nab,...nb->...na", R, x)


def feature_map(x, kind, W=None):
    """phi(x) row by row, unstabilised (docs/DESIGN.md, "Feature maps")."""
    d = x.shape[-1]
    xs = x * d ** -0.25
    if kind == "elu+1":
        return torch.nn.functional.elu(x) + 1
    if kind == "relu":
        return torch.relu(x)
    if kind == "1+cos":
        norm = x.norm(dim=-1, keepdim=True)
        unit = torch.where(norm > 0, x / torch.where(norm > 0, norm, torch.ones_like(norm)), x * 0)
        return torch.cat([unit, torch.ones_like(norm)], dim=-1)
    u = xs @ W.T
    h = (xs * xs).sum(-1, keepdim=True) / 2
    f = W.shape[0]
    if kind == "favor+":
        return torch.exp(u - h) / math.sqrt(f)
    if kind == "favor-trig":
        return torch.exp(h) / math.sqrt(f) * torch.cat([torch.sin(u), torch.cos(u)], dim=-1)
    if kind == "favor-hyp":
        return torch.exp(-h) / math.sqrt(2 * f) * torch.cat([torch.exp(u), torch.exp(-u)], dim=-1)
    raise ValueError(kind)


def _mask(n, n_k, causal, q_offset, k_offset):
    if not causal:
        return torch.ones(n, n_k, dtype=torch.bool)
    p_i = q_offset + torch.arange(n).unsqueeze(1)
    p_j = k_offset + torch.arange(n_k).unsqueeze(0)
    return p_j <= p_i


def softmax_attention(q, k, v, causal=False, scale=None, rope=None, q_offset=0, k_offset=0):
    """The explicit n x n softmax attention; rope: a dict of rotate()'s arguments, or None."""
    d = q.shape[-1]
    if rope is not None:
        q, k = rotate(q, q_offset, **rope), rotate(k, k_offset, **rope)
    scores = (scale if scale is not None else 1 / math.sqrt(d)) * q @ k.transpose(-1, -2)
    mask = _mask(q.shape[-2], k.shape[-2], causal, q_offset, k_offset)
    scores = scores.masked_fill(~mask, -math.inf)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no key: zeros
    return weights @ v


def linear_attention(q, k, v, kind, W=None, causal=False, placement="numerator_only", rope=None,
                     eps=1e-6, q_offset=0, k_offset=0, denominator=True):
    """The explicit n x n linear attention of docs/DESIGN.md's placement table ("Placements").
    Returns (out, den); denominator=False: out = num."""
    if placement == "before_map":
        q, k = rotate(q, q_offset, **rope), rotate(k, k_offset, **rope)
    phi, psi = feature_map(q, kind, W), feature_map(k, kind, W)
    plain = phi @ psi.transpose(-1, -2)
    if placement in ("numerator_only", "full"):
        rotated = rotate(phi, q_offset, **rope) @ rotate(psi, k_offset, **rope).transpose(-1, -2)
    else:
        rotated = plain
    mask = _mask(q.shape[-2], k.shape[-2], causal, q_offset, k_offset).to(D)
    num = (rotated * mask) @ v
    den = ((rotated if placement == "full" else plain) * mask).sum(-1, keepdim=True)
    return (num / (den + eps) if denominator else num), den.squeeze(-1)


def decay_matrix(n, n_k, decay, q_offset=0, k_offset=0):
    """The explicit [n, n_k] decay matrix of causal attention with a decay g (docs/DESIGN.md,
    "Decay"): g^(p_i - p_j) where key j stands at or before query i, 0 elsewhere."""
    distance = ((q_offset + torch.arange(n, dtype=D)).unsqueeze(1)
                - (k_offset + torch.arange(n_k, dtype=D)).unsqueeze(0))
    return torch.where(distance >= 0, decay ** distance.clamp(min=0), torch.zeros((), dtype=D))


def decayed_linear_attention(q, k, v, kind, decay, W=None, placement="numerator_only", rope=None,
                             eps=1e-6, q_offset=0, k_offset=0, denominator=True):
    """Causal linear attention with a decay: linear_attention's weights times decay_matrix. decay: a
    float, or for [B, H, n, d] inputs one per head. Row i is linear_attention's numerator for query
    i alone, v_j weighted by row i of the matrix (and its denominator the same with the values 1
    and the placement whose numerator is the denominator's weights), so every product is
    linear_attention's own. Returns (out, den), as linear_attention does."""
    if q.dim() == 4:
        decays = list(decay) if isinstance(decay, (list, tuple)) else [decay] * q.shape[1]
        heads = [decayed_linear_attention(q[:, h], k[:, h], v[:, h], kind, decays[h], W, placement,
                                          rope, eps, q_offset, k_offset, denominator)
                 for h in range(q.shape[1])]
        return torch.stack([o for o, _ in heads], 1), torch.stack([d for _, d in heads], 1)
    G = decay_matrix(q.shape[-2], k.shape[-2], decay, q_offset, k_offset)
    weights_of_den = "none" if placement == "numerator_only" else placement
    ones = torch.ones(*k.shape[:-1], 1, dtype=D)
    nums, dens = [], []
    for i in range(q.shape[-2]):
        row = dict(kind=kind, W=W, causal=True, rope=rope, q_offset=q_offset + i,
                   k_offset=k_offset, denominator=False)
        weight = G[i].unsqueeze(-1)
        nums.append(linear_attention(q[..., i:i + 1, :], k, v * weight, placement=placement,
                                     **row)[0])
        dens.append(linear_attention(q[..., i:i + 1, :], k, ones * weight,
                                     placement=weights_of_den, **row)[0])
    num, den = torch.cat(nums, -2), torch.cat(dens, -2)
    return (num / (den + eps) if denominator else num), den.squeeze(-1)


def short_convolution(x, weight, bias=None, past=None, activation="silu"):
    """The causal depthwise convolution of x [B, n, C] by weight [C, 1, k], term by term:
    y[b, t, c] = silu(sum_s weight[c, 0, s] x[b, t - (k - 1) + s, c] + bias[c]), the rows before x
    from past [B, k - 1, C] (zeros when None)."""
    k = weight.shape[-1]
    if past is None:
        past = torch.zeros(x.shape[0], k - 1, x.shape[2], dtype=x.dtype)
    rows = torch.cat([past, x], 1)
    y = torch.stack([sum(weight[:, 0, s] * rows[:, t + s] for s in range(k))
                     for t in range(x.shape[1])], 1)
    if bias is not None:
        y = y + bias
    return y * torch.sigmoid(y) if activation == "silu" else y
