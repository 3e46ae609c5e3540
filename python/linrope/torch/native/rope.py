"""RoPE in PyTorch on any device: R x for a rope described by its frequencies (docs/DESIGN.md,
"RoPE").

    x [..., n, dim], positions [n] -> R x [..., n, dim]

Pair i of the rotary width r turns by p theta_i: (2i, 2i+1) in the interleaved layout
[c s c s 0 0], (i, i + r/2) in the half layout [c c s s 0 0]; dimensions at or past r pass
through. The angles p theta_i are computed in float64 as an exact product (_angles; a float32
angle at position 65536 is off by ~4e-3 rad), so cos and sin are within float64's rounding at
every position; times YaRN's magnitude mu they are cast to x's dtype. The rotation is element-wise
torch ops, so autograd gives its gradient, R^T (a turn by -p theta_i times mu). Nothing here calls
linrope's C++ module: a rope is read through rotary_dim, layout, magnitude and frequencies().
"""
import torch

from linrope.torch.native import checks

__all__ = ["frequencies", "positions_of", "rope_apply", "rotate"]

# |p| <= 2^53: the positions at which p itself is exact in a double (include/linrope/rope.hpp).
MAX_POSITION = 2 ** 53

# theta (float64) per rope configuration and device: a call reads it without a host copy.
_frequencies = {}


def _key(rope):
    return (rope.dim, rope.rotary_dim, rope.layout, rope.magnitude,
            tuple(float(t) for t in rope.frequencies()))


def frequencies(rope, device):
    """theta_i, i = 0 .. r/2 - 1, float64 on `device`."""
    key = (_key(rope), str(device))
    theta = _frequencies.get(key)
    if theta is None:
        theta = torch.tensor(key[0][4], dtype=torch.float64, device=device)
        if len(_frequencies) > 64:  # a program has a few ropes; this bounds one that makes many
            _frequencies.clear()
        _frequencies[key] = theta
    return theta


def positions_of(function, n, first_position, positions, device):
    """The positions of n rows as float64 on `device`: first_position + i, or positions[i] (a list
    of n ints). ValueError naming `function` beyond +-2^53."""
    if positions is None:
        last = first_position + max(n - 1, 0)
        if max(abs(first_position), abs(last)) > MAX_POSITION:
            raise ValueError(f"{function}: positions {first_position} .. {last} reach beyond "
                             f"+-2^53, where a position is no longer exact in a double")
        return torch.arange(n, dtype=torch.float64, device=device) + float(first_position)
    if len(positions) != n:
        raise ValueError(f"{function}: positions has {len(positions)} entries but x has n = {n} "
                         f"rows in each (n, d) slice")
    if positions and max(abs(p) for p in positions) > MAX_POSITION:
        raise ValueError(f"{function}: a position is beyond +-2^53, where a position is no longer "
                         f"exact in a double")
    return torch.tensor(positions, dtype=torch.float64, device=device)


def _split(a):
    """a = high + low with high holding the upper 26 bits of a's significand (Veltkamp): products
    of two highs, or of a high and a low, are exact in float64."""
    c = a * 134217729.0  # 2^27 + 1
    high = c - (c - a)
    return high, a - high


def _angles(positions, theta):
    """cos and sin of p theta_i [n, r/2], float64, exact to float64's rounding of the result at
    every position: p theta_i = angle + error exactly (Dekker's product, no fused multiply-add
    needed), then cos(angle + error) = cos(angle) - sin(angle) error (|error| < 2^-53 |angle|, so
    the next term is below float64's resolution). The rounded product alone would be off by up to
    2^-53 p theta_i radians: 4e-11 at position 10^6."""
    p, t = positions[:, None], theta[None, :]
    angle = p * t
    (p_high, p_low), (t_high, t_low) = _split(p), _split(t)
    error = ((p_high * t_high - angle) + p_high * t_low + p_low * t_high) + p_low * t_low
    cos, sin = torch.cos(angle), torch.sin(angle)
    return cos - sin * error, sin + cos * error


def rotate(x, rope, positions):
    """R_p x row by row: x [..., n, rope.dim], positions float64 [n] on x's device."""
    r = rope.rotary_dim
    cos, sin = _angles(positions, frequencies(rope, x.device))
    mu = float(rope.magnitude)
    cos, sin = (cos * mu).to(x.dtype), (sin * mu).to(x.dtype)
    if rope.layout == "interleaved":
        a, b = x[..., 0:r:2], x[..., 1:r:2]
        turned = torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)
    else:
        a, b = x[..., :r // 2], x[..., r // 2:r]
        turned = torch.cat([a * cos - b * sin, a * sin + b * cos], -1)
    return torch.cat([turned, x[..., r:]], -1) if r < x.shape[-1] else turned


def rope_apply(x, rope, first_position, positions):
    """linrope.torch.rope_apply on the native path: R x, x (n, dim) or (B, H, n, dim), row i of
    each (n, dim) slice at first_position + i or at positions[i] (a list of ints)."""
    function = "Rope.apply"
    checks.same_device_and_dtype(function, [("x", x)])
    if x.dim() not in (2, 4):
        raise ValueError(f"{function}: x has {x.dim()} dimensions but expected 2 (n, d) or 4 "
                         f"(B, H, n, d)")
    if x.shape[-1] != rope.dim:
        raise ValueError(f"{function}: x is {list(x.shape)} but the rope has dim = {rope.dim}")
    if positions is not None and first_position != 0:
        raise ValueError(f"{function}: first_position is {first_position} and positions are "
                         f"given: pass one")
    work = torch.float32 if x.dtype == torch.bfloat16 else x.dtype
    at = positions_of(function, x.shape[-2], first_position, positions, x.device)
    return rotate(x.to(work), rope, at).to(x.dtype)
