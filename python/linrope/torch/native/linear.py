"""Linear attention in PyTorch on any device: the function of linrope.torch.linear_attention
(docs/DESIGN.md, "Linear attention", "Placements", "Stabiliser", "Denominators", "State in, state
out", "Decay"), every op a torch op on the inputs' device.

    q [B, H, n, d] (or (n, d)), k [.., n_k, d], v [.., n_k, d_v] -> out [.., n, d_v]

With the sides of "Placements" (a, b for queries, c, e for keys) and the stabiliser's log scales
(alpha_i, gamma_j: feature_maps.stabilized; with a decay g = exp(l) they take + l (p_i - o) and
- l (p_j - o), o = k_offset - 1, as the C++ FeatureBlock does):

    non-causal   S = sum_j exp(gamma_j - M) c~_j v_j^T,  z = sum_j exp(gamma_j - M) e~_j,
                 M = max_j gamma_j, then num~_i = a~_i S, den~_i = <b~_i, z>
    causal       chunks of chunk_size queries; the state (S, z at log scale M, the running
                 maximum of the keys' scales, rescaled when a larger key arrives) holds the keys
                 before the chunk, the chunk's own keys enter through masked products weighted
                 exp(gamma_j - M_i), M_i the running maximum over the keys query i sees (never a
                 later key's: a causal output depends on no later key, not even through the
                 stabiliser), then are absorbed into the state; every chunk's products at
                 once where queries and keys align (_causal_aligned), else chunk by chunk

and o_i = num~_i / D~_i, D~_i = den~_i + eps exp(-(alpha_i + M_i)) in float64 (no denominator:
exp(-(alpha_i + M_i))), a zero row where no key is seen or D~_i is 0 or not finite. With a decay
the masked products' weights are the chunked form's decay matrix g^(p_i - p_j) and the carried
state's g^L, both from the log scales: g^n is never formed, so long sequences stay finite.

Memory O(n) per head, never an n x n matrix: the features O(n m), per chunk a chunk_size^2 block
of products and the state O(m d_v).

The backward is autograd's through these ops. It keeps memory O(n) because what it saves is, per
chunk, the chunk's features, its chunk_size^2 products and the state it read (O(m d_v)): O(n (m
+ chunk_size) + (n / chunk_size) m d_v) per head, against the n^2 of one attention matrix (at n =
16384, chunk 64, m = 256, d_v = 64: 4.2 million values, not 268 million). The log scales are
constants of the computation (the C++ kernels' stabiliser shifts, which drop out of the
gradient), so it is the exact gradient of o = num / (den + eps) on the unstabilised scale.
"""
import math
import numbers
from typing import NamedTuple

import torch
import torch.nn.functional as F

from linrope.torch.native import checks, feature_maps
from linrope.torch.native.rope import positions_of, rotate
from linrope.torch.states import LinearState

__all__ = ["linear_attention"]

PLACEMENTS = ("none", "before_map", "numerator_only", "full")
METHODS = ("chunked", "scan")
INF = math.inf


class Sides(NamedTuple):
    """The four sides of "Placements" (b, e the same tensors as a, c unless the denominator is
    separate) and the rows' log scales, float64: alpha [B, H, n], gamma [B, H, n_k] (-inf for keys
    past the lengths)."""
    a: torch.Tensor
    b: torch.Tensor
    c: torch.Tensor
    e: torch.Tensor
    alpha: torch.Tensor
    gamma: torch.Tensor


class Scaled(NamedTuple):
    """Per query row: num~ [B, H, n, d_v], den~ [B, H, n] (None without a denominator), and the
    row's log scale alpha_i + M_i [B, H, n] (float64; -inf: nothing seen)."""
    num: torch.Tensor
    den: torch.Tensor
    log_scale: torch.Tensor


def _ratio(scale, top):
    """exp(scale - top) in float64, 0 where scale is -inf (top may then be -inf too)."""
    return torch.where(scale == -INF, torch.zeros_like(scale), torch.exp(scale - top))


def check_options(function, q, feature_map, causal, placement, rope, eps, method, chunk_size,
                  denominator, decay, stateful):
    """The C++ check_linear_setup's refusals, in its words; the per-head decays, float64 [H] on
    q's device as log g (None without a decay)."""
    d, heads = q.shape[-1], q.shape[1] if q.dim() == 4 else 1
    if d != feature_map.input_dim:
        raise ValueError(f"{function}: q has d = {d} but map.input_dim() is "
                         f"{feature_map.input_dim}")
    if feature_map.kind not in feature_maps.KINDS:
        raise ValueError(f"{function}: the feature map's kind is {feature_map.kind!r} but expected "
                         f"one of {', '.join(feature_maps.KINDS)}")
    if not (isinstance(eps, numbers.Real) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"{function}: options.eps is {eps} but expected a finite eps >= 0")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{function}: options.chunk_size is {chunk_size} but expected >= 1")
    if placement not in PLACEMENTS:
        raise ValueError(f"{function}: placement is {placement!r} but expected one of "
                         f"{', '.join(PLACEMENTS)}")
    if method not in METHODS:
        raise ValueError(f"{function}: method is {method!r} but expected one of "
                         f"{', '.join(METHODS)}")
    if stateful and not causal:
        raise ValueError(f"{function}: options.causal is false but a state in, state out call is "
                         f"causal")
    log_decay = _log_decays(function, decay, q, heads, causal)
    if not denominator and placement == "full":
        raise ValueError(f"{function}: options.placement is full with options.denominator false; "
                         f"without a denominator full and numerator_only are one function: use "
                         f"numerator_only")
    if placement != "none":
        width = d if placement == "before_map" else feature_map.output_dim
        what = "d" if placement == "before_map" else "m = map.output_dim()"
        if rope is None:
            raise ValueError(f"{function}: options.rope is null but placement {placement} needs "
                             f"a rope of width {what} = {width}")
        if rope.dim != width:
            raise ValueError(f"{function}: options.rope has dim {rope.dim} but placement "
                             f"{placement} needs width {what} = {width}")
    return log_decay


def _log_decays(function, decay, q, heads, causal):
    """log g per head [H] (float64, q's device), None for no decay (g = 1 everywhere)."""
    if decay is None:
        return None
    if isinstance(decay, torch.Tensor):
        decay = decay.tolist()
    per_head = isinstance(decay, (list, tuple))
    if per_head:
        if q.dim() != 4:
            raise ValueError(f"{function}: decay is a sequence of {len(decay)} values but q is "
                             f"{tuple(q.shape)}: one decay per head needs (B, H, n, d) tensors; "
                             f"expected a float")
        if len(decay) != heads:
            raise ValueError(f"{function}: decay has {len(decay)} values but q has H = {heads} "
                             f"heads: expected a float or one decay per head")
        values = list(decay)
    elif isinstance(decay, numbers.Real) and not isinstance(decay, bool):
        values = [decay] * heads
    else:
        raise ValueError(f"{function}: decay is a {type(decay).__name__} but expected a float or, "
                         f"for (B, H, n, d) tensors, a sequence of H floats")
    for h, g in enumerate(values):
        name = f"options.head_decays[{h}]" if per_head else "options.decay"
        if isinstance(g, bool) or not isinstance(g, numbers.Real):
            raise ValueError(f"{function}: decay holds a {type(g).__name__} but expected floats")
        if not 0 < g <= 1:
            raise ValueError(f"{function}: {name} is {g} but expected a decay in (0, 1] (1: none)")
        if g < 1 and not causal:
            raise ValueError(f"{function}: {name} is {g} but options.causal is false: a decay is "
                             f"causal only (RetNet's recurrence S_t = g S_{{t-1}} + ...); a "
                             f"non-causal sum would weight later keys by g^(negative distance), "
                             f"which grows without bound")
    if all(g == 1 for g in values):
        return None
    return torch.log(torch.tensor(values, dtype=torch.float64)).to(q.device)


def _check_state(function, state, q, m, d_v):
    """(S0, z0, log_scale0) of q's leading shape [...], m and d_v, on q's device; S0 and z0 of q's
    dtype, the log scale float64."""
    if not isinstance(state, (tuple, list)) or len(state) != 3:
        raise ValueError(f"{function}: initial_state is a {type(state).__name__} but expected a "
                         f"LinearState or a tuple (S, z, log_scale)")
    lead = tuple(q.shape[:-2])
    for name, t, shape, dtype in (("S", state[0], lead + (m, d_v), q.dtype),
                                  ("z", state[1], lead + (m,), q.dtype),
                                  ("log_scale", state[2], lead, torch.float64)):
        where = f"initial_state.{name}"
        checks.on_device_of(function, where, t, "q", q)
        if t.dtype != dtype:
            raise ValueError(f"{function}: {where} has dtype {t.dtype} but expected {dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{function}: {where} has shape {tuple(t.shape)} but expected "
                             f"{shape} (q's leading dimensions, m = feature_map.output_dim, v's "
                             f"d_v)")


def _sides(q, k, feature_map, placement, rope, denominator, q_offset, k_offset, log_decay,
           k_valid):
    """Sides of "Placements" from q [B, H, n, d] and k [B, H, n_k, d]: features stabilised, rotated
    as the placement says, log scales shifted by the decay."""
    function = "linear_attention"
    pos_q = positions_of(function, q.shape[2], q_offset, None, q.device)
    pos_k = positions_of(function, k.shape[2], k_offset, None, q.device)
    if placement == "before_map":
        q, k = rotate(q, rope, pos_q), rotate(k, rope, pos_k)
    W = (feature_maps.projection(feature_map, q.device, q.dtype)
         if feature_map.kind in feature_maps.STABILISED else None)
    phi, alpha = feature_maps.stabilized(q, feature_map, W)
    psi, gamma = feature_maps.stabilized(k, feature_map, W)
    zeros = q.new_zeros((), dtype=torch.float64)
    alpha = (zeros if alpha is None else alpha).expand(q.shape[:-1])
    gamma = (zeros if gamma is None else gamma).expand(k.shape[:-1])
    if log_decay is not None:
        origin = k_offset - 1
        alpha = alpha + log_decay[:, None] * (pos_q - origin)
        gamma = gamma - log_decay[:, None] * (pos_k - origin)
    if k_valid is not None:
        gamma = torch.where(k_valid[..., 0], gamma, torch.full_like(gamma, -INF))
    if placement in ("numerator_only", "full"):
        a, c = rotate(phi, rope, pos_q), rotate(psi, rope, pos_k)
    else:
        a, c = phi, psi
    separate = placement == "numerator_only" and denominator
    b, e = (phi, psi) if separate else (a, c)
    return Sides(a, b, c, e, alpha, gamma)


def _absorb(S, z, M, c, e, v, gamma, top):
    """The state (S, z at log scale M [B, H]) with keys c, e [B, H, j, m], v, scales gamma
    [B, H, j] added, at the new log scale top >= M, gamma."""
    keep = _ratio(M, top).to(S.dtype)
    w = _ratio(gamma, top[..., None]).to(S.dtype)[..., None]
    S = keep[..., None, None] * S + c.transpose(-1, -2) @ (w * v)
    z = keep[..., None] * z + (w * e).sum(-2)
    return S, z, top


def _noncausal(s, v, denominator):
    top = s.gamma.max(-1).values if s.gamma.shape[-1] else s.alpha.new_full(s.alpha.shape[:2], -INF)
    w = _ratio(s.gamma, top[..., None]).to(v.dtype)[..., None]
    num = s.a @ (s.c.transpose(-1, -2) @ (w * v))
    den = (s.b @ (w * s.e).sum(-2)[..., None])[..., 0] if denominator else None
    return Scaled(num, den, s.alpha + top[..., None])


def _causal_steps(n, n_k, chunk, shift, keep_all_keys):
    """The causal form's steps, in order: (queries, keys), `keys` a range of keys [j0, j1) and
    `queries` the chunk [i0, i1) inside which they enter, or None for keys absorbed apart (those
    before the first query's, those after the last query's when keep_all_keys). Query i sees keys
    j < i + shift; the key ranges tile [0, last key absorbed)."""
    def seen(i):  # how many keys query i sees (i = -1: before the first query)
        return min(max(i + shift, 0), n_k)

    steps, absorbed = [], 0

    def apart(end):
        steps.extend((None, (j0, min(end, j0 + chunk))) for j0 in range(absorbed, end, chunk))
    for i0 in range(0, n, chunk):
        i1 = min(n, i0 + chunk)
        apart(seen(i0 - 1))
        steps.append(((i0, i1), (seen(i0 - 1), seen(i1 - 1))))
        absorbed = seen(i1 - 1)
    if keep_all_keys:
        apart(n_k)
    return steps


def _causal(s, v, state, denominator, chunk, q_offset, k_offset, keep_all_keys):
    """The chunked causal form from `state` (S, z, M); returns (Scaled, the state after the keys
    every query saw, or after every key when keep_all_keys). The rows are split into the steps'
    pieces once (torch.split: one backward node for all of them; slicing per step would make the
    backward O(n^2 / chunk))."""
    n, n_k = s.a.shape[2], s.c.shape[2]
    device = s.a.device
    S, z, M = state
    shift = q_offset - k_offset + 1  # query i sees keys j < i + shift
    steps = _causal_steps(n, n_k, chunk, shift, keep_all_keys)
    sizes = [j1 - j0 for _, (j0, j1) in steps]
    sizes.append(n_k - sum(sizes))  # keys nothing absorbs (past every query, no state wanted)
    cs, vs, gammas = (torch.split(t, sizes, 2) for t in (s.c, v, s.gamma))
    es = cs if s.e is s.c else torch.split(s.e, sizes, 2)
    as_ = torch.split(s.a, chunk, 2)
    bs = as_ if s.b is s.a else torch.split(s.b, chunk, 2)
    nums, dens, tops = [], [], []
    for step, (queries, (begin, end)) in enumerate(steps):
        c, e, v_c, gamma = cs[step], es[step], vs[step], gammas[step]
        if queries is None:
            S, z, M = _absorb(S, z, M, c, e, v_c, gamma, torch.maximum(M, gamma.max(-1).values))
            continue
        i0, i1 = queries
        a, b = as_[i0 // chunk], bs[i0 // chunk]
        # Query i of the chunk sees the state and the chunk's keys [begin, begin + t_i).
        t = (torch.arange(i0, i1, device=device) + shift).clamp(0, n_k) - begin
        running = torch.cummax(torch.cat([M[..., None], gamma], -1), -1).values
        M_i = running[..., t]  # [B, H, chunk]: the largest scale query i has seen
        mask = torch.arange(end - begin, device=device)[None, :] < t[:, None]
        weights = torch.where(mask, _ratio(gamma[..., None, :], M_i[..., None]),
                              torch.zeros((), dtype=torch.float64, device=device)).to(v.dtype)
        from_state = _ratio(M[..., None], M_i).to(v.dtype)  # [B, H, chunk]
        scores = (a @ c.transpose(-1, -2)) * weights
        nums.append(from_state[..., None] * (a @ S) + scores @ v_c)
        if denominator:
            den_scores = scores if b is a else (b @ e.transpose(-1, -2)) * weights
            dens.append(from_state * (b @ z[..., None])[..., 0] + den_scores.sum(-1))
        tops.append(M_i)
        S, z, M = _absorb(S, z, M, c, e, v_c, gamma, running[..., -1])
    num = torch.cat(nums, 2) if nums else v.new_zeros(v.shape[:2] + (0, v.shape[-1]))
    den = (torch.cat(dens, 2) if dens else v.new_zeros(v.shape[:2] + (0,))) if denominator else None
    M_rows = torch.cat(tops, 2) if tops else s.alpha.new_zeros(s.alpha.shape[:2] + (0,))
    return Scaled(num, den, s.alpha + M_rows), (S, z, M)


def _causal_aligned(s, v, state, denominator, chunk):
    """The chunked causal form when query i sees keys j <= i (q_offset = k_offset, n = n_k), every
    chunk at once: the same products as _causal (which takes every other alignment), but batched
    over the chunks, so that only the state's recurrence is a loop, two ops a chunk. On a GPU the
    loop of _causal, tens of small ops a chunk, is what the time goes to.

    With the running maximum R of the scales (the state's first, then the keys'), query i reads
    at M_i = R[i + 1]; the state before chunk t sits at R[t L] and takes the chunk's keys at
    R[(t + 1) L], each weighted exp(gamma_j - R[(t + 1) L]). The rows are padded to whole chunks
    (zero features, keys at scale -inf: they add nothing) and the padding cut off after."""
    n = s.a.shape[2]
    length = min(chunk, n)
    count = -(-n // length)
    pad = count * length - n

    def blocks(t):  # [B, H, n, w] -> [B, H, count, length, w], zero rows appended
        return F.pad(t, (0, 0, 0, pad)).unflatten(2, (count, length))
    a, c, v_b = blocks(s.a), blocks(s.c), blocks(v)
    b = a if s.b is s.a else blocks(s.b)
    e = c if s.e is s.c else blocks(s.e)
    S, z, M = state
    gamma = F.pad(s.gamma, (0, pad), value=-INF)
    running = torch.cummax(torch.cat([M[..., None], gamma], -1), -1).values
    M_i = running[..., 1:].unflatten(2, (count, length))  # [B, H, count, length]
    starts = running[..., ::length]  # [B, H, count + 1]: the state's scale before each chunk
    gamma = gamma.unflatten(2, (count, length))
    w = _ratio(gamma, starts[..., 1:, None]).to(v.dtype)[..., None]
    S_chunks = (c.transpose(-1, -2) @ (w * v_b)).unbind(2)
    z_chunks = (w * e).sum(-2).unbind(2)
    keeps = _ratio(starts[..., :-1], starts[..., 1:]).to(v.dtype).unbind(2)
    S_before, z_before = [], []
    for keep, S_chunk, z_chunk in zip(keeps, S_chunks, z_chunks):
        S_before.append(S)
        z_before.append(z)
        S = torch.addcmul(S_chunk, keep[..., None, None], S)
        z = torch.addcmul(z_chunk, keep[..., None], z)
    from_state = _ratio(starts[..., :-1, None], M_i).to(v.dtype)  # [B, H, count, length]
    seen = torch.ones(length, length, dtype=torch.bool, device=v.device).tril()
    weights = torch.where(seen, _ratio(gamma[..., None, :], M_i[..., None]),
                          torch.zeros((), dtype=torch.float64, device=v.device)).to(v.dtype)
    scores = (a @ c.transpose(-1, -2)) * weights
    num = from_state[..., None] * (a @ torch.stack(S_before, 2)) + scores @ v_b
    den = None
    if denominator:
        den_scores = scores if b is a else (b @ e.transpose(-1, -2)) * weights
        den = from_state * (b @ torch.stack(z_before, 2)[..., None])[..., 0] + den_scores.sum(-1)
        den = den.flatten(2)[..., :n]
    scaled = Scaled(num.flatten(2, 3)[:, :, :n], den, s.alpha + M_i.flatten(2)[..., :n])
    return scaled, (S, z, starts[..., -1])


def _output(scaled, eps, denominator, dtype):
    """o = num~ / D~ (docs/DESIGN.md, "Denominators"), and the rows written as zeros: nothing
    seen, or D~ 0 or not finite."""
    log_scale = scaled.log_scale
    nothing = log_scale == -INF
    shift = torch.exp(-torch.where(nothing, torch.zeros_like(log_scale), log_scale))
    if not denominator:
        divisor = shift
    elif eps > 0:
        divisor = scaled.den.double() + eps * shift
    else:
        divisor = scaled.den.double()
    zero = nothing | (divisor == 0) | ~torch.isfinite(divisor)
    divisor = torch.where(zero, torch.ones_like(divisor), divisor)
    out = torch.where(zero[..., None], torch.zeros((), dtype=torch.float64, device=divisor.device),
                      scaled.num.double() / divisor[..., None])
    return out.to(dtype), nothing, zero


def _stats(scaled, nothing, zero, q_valid, denominator, threshold):
    """DenominatorStats over the rows within the lengths (include/linrope/attention.hpp)."""
    rows = torch.ones_like(nothing) if q_valid is None else q_valid[..., 0].expand_as(nothing)
    stats = dict(min=0.0, nonpositive=0, below_threshold=0, threshold=threshold,
                 count=int(rows.sum()), no_keys=int((rows & nothing).sum()), zero_divisor=0)
    attended = rows & ~nothing
    if not bool(attended.any()):
        return stats
    if not denominator:  # the kernels' tally: rows without a den leave its min at +inf
        stats["min"] = INF
        return stats
    den = scaled.den.detach().double()[attended]
    log_scale = scaled.log_scale[attended]
    true_den = torch.where(den == 0, torch.zeros_like(den), den * torch.exp(log_scale))
    log_threshold = math.log(threshold) if threshold > 0 else -INF
    below = torch.where(den == 0, torch.full_like(den, float(threshold > 0)),
                        (torch.log(den.abs()) + log_scale < log_threshold).double())
    stats.update(min=float(true_den.min()), nonpositive=int((den <= 0).sum()),
                 below_threshold=int(below.sum()), zero_divisor=int((zero & attended).sum()))
    return stats


def linear_attention(q, k, v, feature_map, *, causal, placement, rope, eps, q_offset, k_offset,
                     return_stats, stats_threshold, method, chunk_size, q_lengths, k_lengths,
                     initial_state, return_state, denominator, decay):
    """linrope.torch.linear_attention on the native path: the same arguments (lengths as lists of
    ints) and results; see the module's docstring for how it is computed."""
    function = "linear_attention"
    checks.attention_inputs(function, q, k, v)
    stateful = initial_state is not None or return_state
    log_decay = check_options(function, q, feature_map, causal, placement, rope, eps, method,
                              chunk_size, denominator, decay, stateful)
    m, d_v = feature_map.output_dim, v.shape[-1]
    if initial_state is not None:
        _check_state(function, initial_state, q, m, d_v)
    single = q.dim() == 2
    dtype = q.dtype
    work = torch.float32 if dtype == torch.bfloat16 else dtype
    if single:
        q, k, v = q[None, None], k[None, None], v[None, None]
    q, k, v = q.to(work), k.to(work), v.to(work)
    batch, heads, n, n_k = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    q_valid = checks.lengths_mask(function, "q_lengths", q_lengths, batch, n, q.device)
    k_valid = checks.lengths_mask(function, "k_lengths", k_lengths, batch, n_k, q.device)
    # Rows past the lengths are read by nothing (their values may be anything, NaN included).
    if q_valid is not None:
        q = torch.where(q_valid, q, torch.zeros((), dtype=work, device=q.device))
    if k_valid is not None:
        k = torch.where(k_valid, k, torch.zeros((), dtype=work, device=q.device))
        v = torch.where(k_valid, v, torch.zeros((), dtype=work, device=q.device))
    sides = _sides(q, k, feature_map, placement, rope, denominator, q_offset, k_offset, log_decay,
                   k_valid)
    if not causal:
        scaled, final = _noncausal(sides, v, denominator), None
    else:
        state = _start(initial_state, single, batch, heads, m, d_v, work, q.device)
        if q_offset == k_offset and n == n_k and n > 0:
            scaled, final = _causal_aligned(sides, v, state, denominator, chunk_size)
        else:
            scaled, final = _causal(sides, v, state, denominator, chunk_size, q_offset,
                                    k_offset, keep_all_keys=return_state)
    out, nothing, zero = _output(scaled, eps, denominator, work)
    if q_valid is not None:
        out = torch.where(q_valid, out, torch.zeros((), dtype=work, device=q.device))
    result = [out[0, 0] if single else out]
    result[0] = result[0].to(dtype)
    if return_stats:
        result.append(_stats(scaled, nothing, zero, q_valid, denominator, stats_threshold))
    if return_state:
        result.append(_final_state(final, log_decay, k_lengths, n_k, single, dtype))
    return result[0] if len(result) == 1 else tuple(result)


def _start(initial_state, single, batch, heads, m, d_v, work, device):
    """(S, z, M) to start a causal call from: the initial state (an empty one, log scale -inf,
    read as zeros whatever its S and z hold), or the empty state."""
    if initial_state is None:
        return (torch.zeros(batch, heads, m, d_v, dtype=work, device=device),
                torch.zeros(batch, heads, m, dtype=work, device=device),
                torch.full((batch, heads), -INF, dtype=torch.float64, device=device))
    S, z, log_scale = initial_state
    if single:
        S, z, log_scale = S[None, None], z[None, None], log_scale[None, None]
    present = log_scale > -INF
    zero = torch.zeros((), dtype=work, device=device)
    return (torch.where(present[..., None, None], S.to(work), zero),
            torch.where(present[..., None], z.to(work), zero), log_scale)


def _final_state(final, log_decay, k_lengths, n_k, single, dtype):
    """The LinearState after the keys: at the peak of the scales, moved with a decay to the last
    key's position (docs/DESIGN.md, "Decay": log_scale = peak + l n_k, n_k within the lengths)."""
    S, z, M = final
    if log_decay is not None:
        keys = (torch.tensor(k_lengths, dtype=torch.float64, device=M.device)
                if k_lengths is not None else torch.full(M.shape[:1], float(n_k),
                                                         dtype=torch.float64, device=M.device))
        M = M + log_decay[None, :] * keys[:, None]
    if single:
        S, z, M = S[0, 0], z[0, 0], M[0, 0]
    return LinearState(S.to(dtype), z.to(dtype), M)
