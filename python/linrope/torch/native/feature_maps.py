"""The feature maps in PyTorch on any device (docs/DESIGN.md, "Feature maps"), with the same W as
the C++ maps: a map is read through kind, input_dim, output_dim and projection (W [f x d],
float64), which linrope.FeatureMap and linrope.torch.native.FeatureMap both have.

    x [..., d] -> phi(x) [..., m]                                 (apply: unstabilised)
    x [..., d] -> phi~(x) [..., m], log_scale [...] (float64)     (stabilized)

With x' = x d^(-1/4), u = W x', h = |x'|^2 / 2, the stabilised form phi(x) = exp(log_scale)
phi~(x) is the C++ one (FeatureMap::apply_stabilized):

    favor+      log_scale = max_l u_l - h - ln(f)/2       phi~ = exp(u - max u)
    favor-hyp   log_scale = max_l |u_l| - h - ln(2f)/2    phi~ = [exp(u - max|u|), exp(-u - max|u|)]
    favor-trig  log_scale = h - ln(f)/2                   phi~ = [sin u, cos u]
    elu+1, relu, 1+cos: none (log_scale 0), phi~ = phi

The log scale is a constant of the computation (as in the C++ kernels, where the shifts drop out
of the gradient): autograd sees phi~ = phi(x) exp(-log_scale) with log_scale held fixed, so the
gradient through phi~ is exp(-log_scale) times phi's. That is written phi~ = exp(u - max u - (h -
h0)) with max u and h0 = h detached: its value is exp(u - max u) exactly (h - h0 is 0), its
gradient the one of exp(u - h) times the constant.
"""
import math

import torch

from linrope.torch.native import checks

__all__ = ["STABILISED", "apply", "feature_map_apply", "projection", "stabilized"]

# The maps whose features are exponentials and carry a log scale.
STABILISED = ("favor+", "favor-hyp", "favor-trig")
KINDS = ("elu+1", "relu", "favor+", "favor-trig", "1+cos", "favor-hyp")

# W per map configuration, device and dtype: a call copies it to the device once, not per call.
_projections = {}


def projection(feature_map, device, dtype):
    """W [f x d] of a favor map in `dtype` on `device` (the map's own W, cast from float64)."""
    key = (feature_map.__getstate__(), str(device), dtype)
    W = _projections.get(key)
    if W is None:
        W = torch.as_tensor(feature_map.projection, dtype=torch.float64)
        W = W.to(device=device, dtype=dtype)
        if len(_projections) > 64:  # bounded: a redraw every step makes a new map each time
            _projections.clear()
        _projections[key] = W
    return W


def _exponent(x, W):
    """u = W x' [..., f] and h = |x'|^2 / 2 [...], x' = x d^(-1/4)."""
    scaled = x * x.shape[-1] ** -0.25
    return scaled @ W.transpose(0, 1), (scaled * scaled).sum(-1) / 2


def _unit(x):
    """1+cos's features [x / |x|, 1] ([0, .., 0, 1] at x = 0, with gradient 0 there)."""
    norm = x.norm(dim=-1, keepdim=True)
    nonzero = norm > 0
    unit = x / torch.where(nonzero, norm, torch.ones_like(norm)) * nonzero
    return torch.cat([unit, torch.ones_like(norm)], -1)


def stabilized(x, feature_map, W):
    """(phi~(x), log_scale): log_scale float64 [...], or None for the maps without one."""
    kind = feature_map.kind
    if kind == "elu+1":
        return torch.nn.functional.elu(x) + 1, None
    if kind == "relu":
        return torch.relu(x), None
    if kind == "1+cos":
        return _unit(x), None
    u, h = _exponent(x, W)
    h_moves = (h - h.detach())[..., None]  # 0, carrying h's gradient
    f = W.shape[0]
    if kind == "favor+":
        top = u.detach().max(-1).values
        features = torch.exp(u - top[..., None] - h_moves)
        log_scale = top.double() - h.detach().double() - 0.5 * math.log(f)
    elif kind == "favor-hyp":
        top = u.detach().abs().max(-1).values
        features = torch.exp(torch.cat([u, -u], -1) - top[..., None] - h_moves)
        log_scale = top.double() - h.detach().double() - 0.5 * math.log(2 * f)
    else:  # favor-trig
        features = torch.cat([torch.sin(u), torch.cos(u)], -1) * torch.exp(h_moves)
        log_scale = h.detach().double() - 0.5 * math.log(f)
    return features, log_scale


def apply(x, feature_map, W):
    """phi(x) [..., m], unstabilised: exactly the definitions (favor maps may overflow)."""
    kind = feature_map.kind
    if kind not in STABILISED:
        return stabilized(x, feature_map, W)[0]
    u, h = _exponent(x, W)
    h = h[..., None]
    f = W.shape[0]
    if kind == "favor+":
        return torch.exp(u - h) / math.sqrt(f)
    if kind == "favor-hyp":
        return torch.exp(torch.cat([u, -u], -1) - h) / math.sqrt(2 * f)
    return torch.exp(h) / math.sqrt(f) * torch.cat([torch.sin(u), torch.cos(u)], -1)


def feature_map_apply(x, feature_map):
    """linrope.torch.feature_map_apply on the native path: phi(x) row by row, x [..., d]."""
    function = "FeatureMap.apply"
    checks.same_device_and_dtype(function, [("x", x)])
    if x.dim() < 1 or x.shape[-1] != feature_map.input_dim:
        raise ValueError(f"{function}: x has shape {tuple(x.shape)} but expected [..., d = "
                         f"{feature_map.input_dim}]")
    work = torch.float32 if x.dtype == torch.bfloat16 else x.dtype
    W = projection(feature_map, x.device, work) if feature_map.kind in STABILISED else None
    return apply(x.to(work), feature_map, W).to(x.dtype)
