"""linrope.torch: linrope's kernels as differentiable PyTorch functions and layers (CPU tensors).

Functions (torch.autograd.Function over the C++ forward and backward; each saves only q, k, v
and its options, and its backward calls the C++ backward):
    softmax_attention(q, k, v, causal, scale, rope, q_offset, k_offset, q_lengths, k_lengths)
    linear_attention(q, k, v, feature_map, causal, placement, rope, eps, q_offset, k_offset,
                     return_stats, stats_threshold, method, chunk_size, q_lengths, k_lengths,
                     initial_state, return_state)
    merge_states(states): the state holding the keys of several (LinearState, below)
    rope_apply(x, rope, first_position, positions), feature_map_apply(x, feature_map)
q_lengths / k_lengths (B entries: a list, array or tensor) mark padding in (B, H, n, d) batches:
rows at or past them are not attended to, their outputs are 0 and their gradients 0.
Tensors are float32 or float64, shaped (n, d) or (B, H, n, d), as in ``linrope``; arguments and
names are those of the NumPy functions. Contiguous tensors reach the kernels without a copy
(torch and NumPy share the memory), outputs are new tensors.

Layers (torch.nn.Module):
    RotaryEmbedding  RoPE on (n, d) or (B, H, n, d) tensors, differentiable.
    MultiheadAttention  q/k/v/out projections and attention chosen by name: "softmax" (exact, RoPE
        on q and k) or "linear" (a feature map, a RoPE placement, eps, feature redraws).
"""
import functools
from typing import NamedTuple

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from linrope import _core

# The defaults of the options, read from the default-constructed C++ structs so that each lives in
# the C++ header alone (the NumPy functions take theirs from the same structs).
_SOFTMAX = _core.SoftmaxOptions()
_LINEAR = _core.LinearOptions()
_STATS = _core.DenominatorStats()
_ROPE = _core.RopeConfig()
_MAP = _core.FeatureMapConfig()

__all__ = [
    "softmax_attention", "linear_attention", "LinearState", "merge_states", "rope_apply",
    "feature_map_apply",
    "RotaryEmbedding", "MultiheadAttention",
]


def _array(t, function, name):
    """A NumPy view of the CPU tensor t (the same memory: the kernels read t in place)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{function}: {name} is a {type(t).__name__} but expected a torch.Tensor")
    if t.device.type != "cpu":
        raise ValueError(f"{function}: {name} is on {t.device} but linrope runs on the CPU")
    # bfloat16 has no NumPy dtype: say so here rather than let .numpy() raise a TypeError.
    if t.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{function}: {name} has dtype {t.dtype} but expected torch.float32 or "
                         f"torch.float64")
    return t.detach().numpy()


def _tensors(arrays):
    return tuple(torch.from_numpy(a) for a in arrays)


def _int_list(values):
    """Lengths or positions as the list of ints the module takes (None stays None); a
    non-integer value is refused rather than truncated."""
    if values is None:
        return None
    if isinstance(values, torch.Tensor):
        values = values.reshape(-1).tolist()
    result = [int(n) for n in values]
    if any(n != v for n, v in zip(result, values)):
        raise ValueError(f"lengths and positions must be integers, got {list(values)}")
    return result


class _SoftmaxAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, options):
        fn = "softmax_attention"
        ctx.options = options
        ctx.save_for_backward(q, k, v)
        out = _core.softmax_attention(_array(q, fn, "q"), _array(k, fn, "k"), _array(v, fn, "v"),
                                      **options)
        return torch.from_numpy(out)

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        fn = "softmax_attention_backward"
        q, k, v = ctx.saved_tensors
        grads = _core.softmax_attention_backward(
            _array(q, fn, "q"), _array(k, fn, "k"), _array(v, fn, "v"),
            _array(d_out, fn, "d_out"), **ctx.options)
        return (*_tensors(grads), None)


class LinearState(NamedTuple):
    """The state of causal linear attention after some tokens (include/linrope/attention.hpp,
    "State in, state out"): the sums over the keys so far of features times values, S [..., m,
    d_v], and of features, z [..., m] (q's dtype), both divided by exp(log_scale) [...]
    (float64; -inf: no key yet), "..." being q's leading dimensions. The scale is the stabiliser's
    (the largest key shift so far, 0 for maps without one), so S and z stay finite for large
    inputs. Gradients flow through S and z with log_scale held fixed: exact for every use that
    reads the state as exp(log_scale) (S, z), as a call continued from it does."""
    S: torch.Tensor
    z: torch.Tensor
    log_scale: torch.Tensor


def merge_states(states):
    """The state that holds the keys of every state in `states` (a non-empty sequence of
    LinearState of one shape): sum_p exp(log_scale_p - top) (S_p, z_p) at top = max log_scale.
    The sums commute, so order does not matter. Differentiable in each S and z."""
    states = [LinearState(*s) for s in states]
    if not states:
        raise ValueError("merge_states: expected at least one state")
    scales = torch.stack([s.log_scale for s in states])
    top = scales.max(0).values
    # exp(-inf - finite) = 0: empty states add nothing, and an all-empty result stays at -inf.
    weights = torch.exp(scales - torch.where(torch.isinf(top), torch.zeros_like(top), top))
    dtype = states[0].S.dtype
    S = sum(w.to(dtype)[..., None, None] * s.S for w, s in zip(weights, states))
    z = sum(w.to(dtype)[..., None] * s.z for w, s in zip(weights, states))
    return LinearState(S, z, top)


def _state_arrays(state, function, name):
    if state is None:
        return None
    S, z, log_scale = state
    return (_array(S, function, name + ".S"), _array(z, function, name + ".z"),
            _array(log_scale, function, name + ".log_scale"))


class _LinearAttention(torch.autograd.Function):
    """out (and, with return_state, the final state's S, z, log_scale) from q, k, v and an optional
    initial state (S0, z0, log_scale0); the backward takes the gradients of out and of the final
    S and z, and gives those of q, k, v, S0 and z0."""

    @staticmethod
    def forward(ctx, q, k, v, S0, z0, log_scale0, feature_map, options, stats, stats_threshold,
                return_state):
        fn = "linear_attention"
        ctx.feature_map, ctx.options = feature_map, options
        # The backward needs the W of this forward: a redraw in between would silently give the
        # gradient of another function, so the seed is checked (MultiheadAttention redraws by
        # making a new map instead, which leaves this one, held here, unchanged).
        ctx.seed = feature_map.seed
        ctx.set_materialize_grads(False)  # an unused output's gradient comes as None
        ctx.save_for_backward(q, k, v, S0, z0, log_scale0)
        initial = None if S0 is None else _state_arrays((S0, z0, log_scale0), fn, "initial_state")
        result = _core.linear_attention(
            _array(q, fn, "q"), _array(k, fn, "k"), _array(v, fn, "v"), feature_map,
            return_stats=stats is not None, stats_threshold=stats_threshold,
            initial_state=initial, return_state=return_state, **options)
        if stats is None and not return_state:
            return torch.from_numpy(result)
        out = result[0]
        if stats is not None:
            stats.update(result[1])
        if not return_state:
            return torch.from_numpy(out)
        S, z, log_scale = _tensors(result[-1])
        ctx.mark_non_differentiable(log_scale)
        return torch.from_numpy(out), S, z, log_scale

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out, d_S=None, d_z=None, _d_log_scale=None):
        fn = "linear_attention_backward"
        if ctx.feature_map.seed != ctx.seed:
            raise RuntimeError(
                f"{fn}: the feature map was redrawn (seed {ctx.seed} -> {ctx.feature_map.seed}) "
                f"between the forward and the backward; redraw after backward(), or use a new "
                f"FeatureMap")
        q, k, v, S0, z0, log_scale0 = ctx.saved_tensors
        if d_out is None:  # only the state was used
            d_out = q.new_zeros(q.shape[:-1] + v.shape[-1:])
        d_final = None
        if d_S is not None or d_z is not None:
            m = ctx.feature_map.output_dim
            d_S = d_S if d_S is not None else q.new_zeros(q.shape[:-2] + (m, v.shape[-1]))
            d_z = d_z if d_z is not None else q.new_zeros(q.shape[:-2] + (m,))
            d_final = (_array(d_S, fn, "d_final_state.dS"), _array(d_z, fn, "d_final_state.dz"))
        want_initial = S0 is not None and (ctx.needs_input_grad[3] or ctx.needs_input_grad[4])
        initial = None if S0 is None else _state_arrays((S0, z0, log_scale0), fn, "initial_state")
        grads = _core.linear_attention_backward(
            _array(q, fn, "q"), _array(k, fn, "k"), _array(v, fn, "v"),
            _array(d_out, fn, "d_out"), ctx.feature_map, initial_state=initial,
            d_final_state=d_final, return_state_gradient=want_initial, **ctx.options)
        d_S0, d_z0 = _tensors(grads[3]) if want_initial else (None, None)
        return (*_tensors(grads[:3]), d_S0, d_z0, None, None, None, None, None, None)


class _RopeApply(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rope, first_position, positions):
        ctx.rope, ctx.where = rope, dict(first_position=first_position, positions=positions)
        return torch.from_numpy(rope.apply(_array(x, "Rope.apply", "x"), **ctx.where))

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        dx = ctx.rope.apply_transpose(_array(d_out, "Rope.apply_transpose", "d_out"), **ctx.where)
        return torch.from_numpy(dx), None, None, None


class _FeatureMapApply(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, feature_map):
        ctx.feature_map, ctx.seed = feature_map, feature_map.seed
        ctx.save_for_backward(x)
        return torch.from_numpy(feature_map.apply(_array(x, "FeatureMap.apply", "x")))

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        fn = "FeatureMap.backward"
        if ctx.feature_map.seed != ctx.seed:
            raise RuntimeError(f"{fn}: the feature map was redrawn between forward and backward")
        (x,) = ctx.saved_tensors
        dx = ctx.feature_map.backward(_array(x, fn, "x"), _array(d_out, fn, "d_out"))
        return torch.from_numpy(dx), None


def softmax_attention(q, k, v, causal=_SOFTMAX.causal, scale=None, rope=None,
                      q_offset=_SOFTMAX.q_offset, k_offset=_SOFTMAX.k_offset, q_lengths=None,
                      k_lengths=None):
    """Exact softmax attention, differentiable in q, k and v; see linrope.softmax_attention."""
    options = dict(causal=causal, scale=scale, rope=rope, q_offset=q_offset, k_offset=k_offset,
                   q_lengths=_int_list(q_lengths), k_lengths=_int_list(k_lengths))
    return _SoftmaxAttention.apply(q, k, v, options)


def linear_attention(q, k, v, feature_map, causal=_LINEAR.causal, placement=_LINEAR.placement,
                     rope=None, eps=_LINEAR.eps, q_offset=_LINEAR.q_offset,
                     k_offset=_LINEAR.k_offset, return_stats=False,
                     stats_threshold=_STATS.threshold, method=_LINEAR.method,
                     chunk_size=_LINEAR.chunk_size, q_lengths=None, k_lengths=None,
                     initial_state=None, return_state=False, denominator=_LINEAR.denominator):
    """Linear attention, differentiable in q, k and v (W held fixed); see
    linrope.linear_attention. method ("scan" or "chunked", with chunk_size) picks the causal
    forward; both give the same gradients. denominator=False computes o = num (no
    normalisation; placement full is then numerator_only and is refused). With return_stats=True returns (out, stats), stats a
    dict of the denominator statistics (min, nonpositive, below_threshold, threshold, count,
    no_keys, zero_divisor; include/linrope/attention.hpp says what each counts).

    State in, state out (causal only): initial_state, a LinearState (or a tuple (S, z,
    log_scale)), is the state of the tokens before these, whose positions q_offset and k_offset
    then continue; return_state=True also returns the LinearState after every key of k, last in
    the tuple: (out, state) or (out, stats, state). Both are differentiable in S and z, so a
    sequence cut into parts and run part by part from each other's states gives the outputs and
    gradients of one call on the whole (to rounding)."""
    options = dict(causal=causal, placement=placement, rope=rope, eps=eps, q_offset=q_offset,
                   k_offset=k_offset, method=method, chunk_size=chunk_size,
                   q_lengths=_int_list(q_lengths), k_lengths=_int_list(k_lengths),
                   denominator=denominator)
    stats = {} if return_stats else None
    S0, z0, log_scale0 = (None, None, None) if initial_state is None else tuple(initial_state)
    result = _LinearAttention.apply(q, k, v, S0, z0, log_scale0, feature_map, options, stats,
                                    stats_threshold, bool(return_state))
    if not return_state:
        return (result, stats) if return_stats else result
    out, state = result[0], LinearState(*result[1:])
    return (out, stats, state) if return_stats else (out, state)


def rope_apply(x, rope, first_position=0, positions=None):
    """R x for a linrope.Rope, differentiable (the gradient is R^T): row i at first_position + i,
    or at positions[i] (a list, array or tensor of n integers)."""
    return _RopeApply.apply(x, rope, first_position, _int_list(positions))


def feature_map_apply(x, feature_map):
    """phi(x) row by row for a linrope.FeatureMap, differentiable in x (W held fixed)."""
    return _FeatureMapApply.apply(x, feature_map)


class RotaryEmbedding(nn.Module):
    """RoPE of width dim on (n, dim) or (B, H, n, dim) tensors: forward(x, first_position=0).
    Arguments as linrope.Rope (layout "interleaved" or "half"; scaling "none", "linear", "ntk",
    "yarn")."""

    def __init__(self, dim, rotary_dim=_ROPE.rotary_dim, base=_ROPE.base, layout=_ROPE.layout,
                 scaling=_ROPE.scaling, factor=_ROPE.factor,
                 original_max_position=_ROPE.original_max_position):
        super().__init__()
        self.rope = _core.Rope(dim, rotary_dim=rotary_dim, base=base, layout=layout,
                               scaling=scaling, factor=factor,
                               original_max_position=original_max_position)

    def forward(self, x, first_position=0, positions=None):
        return rope_apply(x, self.rope, first_position, positions)

    def extra_repr(self):
        r = self.rope
        return (f"dim={r.dim}, rotary_dim={r.rotary_dim}, base={r.base}, layout={r.layout!r}, "
                f"scaling={r.scaling!r}")


class MultiheadAttention(nn.Module):
    """Multi-head attention with q/k/v/out projections over linrope's kernels.

    forward(query, key=None, value=None, *, first_position=0, lengths=None, key_lengths=None):
    query [B, n, embed_dim], key and value [B, n_k, embed_dim] (default: self-attention) ->
    [B, n, embed_dim]. Tokens sit at positions first_position + i (for RoPE and the causal mask).
    lengths (B entries) pads the batch: entry b holds lengths[b] real tokens, the rest is neither
    attended to nor given gradients (its output is out_proj's bias); key_lengths the same for the
    keys (default: lengths in self-attention, none otherwise).

    attention="softmax": exact softmax attention, RoPE (width head_dim) on q and k when rope=True.
    attention="linear": linear attention with feature_map ("elu+1", "relu", "favor+",
        "favor-trig", "1+cos", "favor-hyp"; num_features for the favor maps, default
        4 * head_dim, the m = 256 at d = 64 that linrope's benchmarks use) and RoPE placement
        ("none", "before_map", "numerator_only", "full"; default "numerator_only" when rope=True,
        else "none"), eps as in the C++ API, method ("scan" or "chunked") and chunk_size for the
        causal forward. denominator=False drops the denominator (o = num) and normalises
        each head's output instead, an RMSNorm over its head_dim channels with a learned gain
        (norm_eps inside the root), as TransNormer, RetNet and GLA do; placement "full" is then
        refused (it equals "numerator_only"). redraw_interval=k > 0 draws a new W every k forward
        calls in training mode (Performer's feature redrawing); the current seed and the count of
        training forwards are the buffers feature_seed and training_forwards, so a state_dict
        restores W and the redraw schedule.
    track_stats=True keeps the last forward's denominator statistics in last_stats (linear only);
    stats_threshold is the |den| below which a denominator counts as tiny (below_threshold).

    Sequence parallelism: with sequence_parallel=True (an attribute, settable after construction),
    each rank of sequence_group (None: the whole torch.distributed world) holds a contiguous slice
    of every sequence, and causal linear attention runs through linrope.torch.distributed, which
    exchanges only states between the ranks; first_position is then the whole sequence's first
    position (each rank's own follows from the slices before it). Causal linear self-attention
    only, without lengths.
    """

    def __init__(self, embed_dim, num_heads, attention="softmax", *, causal=False, rope=True,
                 rope_base=_ROPE.base, rope_layout=_ROPE.layout, feature_map="favor+",
                 num_features=None, orthogonal=_MAP.orthogonal, placement=None, eps=_LINEAR.eps,
                 method=_LINEAR.method, chunk_size=_LINEAR.chunk_size,
                 denominator=_LINEAR.denominator, norm_eps=1e-5, redraw_interval=0,
                 seed=_MAP.seed, bias=True, track_stats=False, stats_threshold=_STATS.threshold,
                 device=None, dtype=None):
        super().__init__()
        if attention not in ("softmax", "linear"):
            raise ValueError(f"MultiheadAttention: attention is {attention!r} but expected one of "
                             f"softmax, linear")
        if num_heads < 1 or embed_dim % num_heads != 0:
            raise ValueError(f"MultiheadAttention: embed_dim {embed_dim} is not a multiple of "
                             f"num_heads {num_heads}")
        if redraw_interval < 0:
            raise ValueError(f"MultiheadAttention: redraw_interval is {redraw_interval} but "
                             f"expected >= 0 (0: never)")
        factory = dict(device=device, dtype=dtype)
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.attention, self.causal, self.eps = attention, causal, eps
        self.method, self.chunk_size = method, chunk_size
        self.denominator, self.norm_eps = denominator, norm_eps
        if not denominator:
            if attention != "linear":
                raise ValueError("MultiheadAttention: denominator=False needs attention='linear'")
            self.head_norm = nn.Parameter(torch.ones(embed_dim, **factory))
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.track_stats, self.stats_threshold, self.last_stats = track_stats, stats_threshold, None
        self.redraw_interval = redraw_interval
        self.sequence_parallel, self.sequence_group = False, None
        self.feature_map, self.rope = None, None
        if attention == "softmax":
            self.placement = None
            if rope:
                self.rope = _core.Rope(self.head_dim, base=rope_base, layout=rope_layout)
            return
        self.placement = placement if placement is not None else (
            _LINEAR.placement if rope else "none")
        self._map_args = dict(kind=feature_map, input_dim=self.head_dim,
                              num_features=num_features or 4 * self.head_dim,
                              orthogonal=orthogonal)
        self.register_buffer("feature_seed", torch.tensor(seed, dtype=torch.int64))
        self.register_buffer("training_forwards", torch.tensor(0, dtype=torch.int64))
        self.feature_map = _core.FeatureMap(seed=seed, **self._map_args)
        if self.placement != "none":
            # numerator_only and full rotate the features (width m), before_map the inputs (d).
            width = self.head_dim if self.placement == "before_map" else self.feature_map.output_dim
            # 1+cos has m = d + 1: the constant feature passes through (rotary width d).
            self.rope = _core.Rope(width, rotary_dim=width - width % 2, base=rope_base,
                                   layout=rope_layout)

    def redraw_features(self, seed=None):
        """A new W from seed (default: the current seed + 1). A new FeatureMap, not an in-place
        redraw, so that a forward awaiting its backward keeps the W it used."""
        if self.feature_map is None:
            raise ValueError("MultiheadAttention: redraw_features needs attention='linear'")
        self.feature_seed.fill_(int(self.feature_seed) + 1 if seed is None else seed)
        self.feature_map = _core.FeatureMap(seed=int(self.feature_seed), **self._map_args)

    def _heads(self, x, n):
        # [B, n, E] -> [B, H, n, head_dim], contiguous: the layout linrope reads in place.
        return x.view(x.shape[0], n, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, query, key=None, value=None, *, first_position=0, lengths=None,
                key_lengths=None, cache=None, return_cache=False):
        """[B, n, embed_dim] -> [B, n, embed_dim] (see the class). Decoding (causal
        self-attention, no lengths): with return_cache=True or a cache given, returns (out,
        cache), the cache after these tokens; cache= continues from one, these tokens then sitting
        at first_position = the number of tokens before them. The cache of linear attention is the
        LinearState of the tokens so far: O(m d_v) per head, whatever their number, so each new
        token costs the same. That of softmax attention is their keys and values before RoPE, a
        tuple (k, v) of [B, H, n_past, head_dim] that grows by a row per token."""
        decoding = cache is not None or return_cache
        if decoding:
            self._check_decoding(key, value, lengths, key_lengths)
        if key is None and key_lengths is None:
            key_lengths = lengths
        key = query if key is None else key
        value = key if value is None else value
        if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
            raise ValueError(f"MultiheadAttention: query, key and value are "
                             f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)} "
                             f"but expected [B, n, embed_dim = {self.embed_dim}]")
        batch, n, n_k = query.shape[0], query.shape[1], key.shape[1]
        q = self._heads(self.q_proj(query), n)
        k = self._heads(self.k_proj(key), n_k)
        v = self._heads(self.v_proj(value), n_k)
        where = dict(q_offset=first_position, k_offset=first_position, q_lengths=lengths,
                     k_lengths=key_lengths)
        if self.attention == "softmax":
            out, cache = self._softmax(q, k, v, where, cache, decoding)
        else:
            out, cache = self._linear(q, k, v, where, key is query, cache, decoding)
        out = self.out_proj(out.transpose(1, 2).reshape(batch, n, self.embed_dim))
        return (out, cache) if decoding else out

    def _softmax(self, q, k, v, where, cache, decoding):
        if self.sequence_parallel:
            raise ValueError("MultiheadAttention: sequence_parallel needs attention='linear' "
                             "(softmax attention needs every earlier key, not a state)")
        if decoding:
            if cache is not None:  # the earlier keys sit just before these tokens
                k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
            where = dict(q_offset=where["q_offset"], k_offset=where["q_offset"] - k.shape[2]
                         + q.shape[2])
        out = softmax_attention(q, k, v, causal=self.causal, rope=self.rope, **where)
        return out, ((k, v) if decoding else None)

    def _linear(self, q, k, v, where, self_attention, cache, decoding):
        if self.training and self.redraw_interval:
            done = int(self.training_forwards)
            if done and done % self.redraw_interval == 0:
                self.redraw_features()
            self.training_forwards.fill_(done + 1)
        if self.feature_map.seed != int(self.feature_seed):  # after load_state_dict
            self.feature_map = _core.FeatureMap(seed=int(self.feature_seed), **self._map_args)
        attend = linear_attention
        if self.sequence_parallel:
            self._check_sequence_parallel(self_attention, where["q_lengths"], where["k_lengths"])
            from linrope.torch import distributed  # imports torch.distributed only when used
            attend = functools.partial(distributed.linear_attention, group=self.sequence_group)
            where = dict(q_offset=where["q_offset"], k_offset=where["k_offset"])
        if decoding:
            where = dict(where, initial_state=cache, return_state=True)
        result = attend(q, k, v, self.feature_map, causal=self.causal, placement=self.placement,
                        rope=self.rope, eps=self.eps, method=self.method,
                        chunk_size=self.chunk_size, return_stats=self.track_stats,
                        stats_threshold=self.stats_threshold, denominator=self.denominator,
                        **where)
        if not isinstance(result, tuple):
            result = (result,)
        out = result[0]
        self.last_stats = result[1] if self.track_stats else None
        cache = result[-1] if decoding else None
        if not self.denominator:  # RMSNorm over each head's channels, then the gain
            rms = torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.norm_eps)
            out = out * rms * self.head_norm.view(self.num_heads, 1, self.head_dim)
        return out, cache

    def _check_decoding(self, key, value, lengths, key_lengths):
        if not self.causal or key is not None or value is not None:
            raise ValueError("MultiheadAttention: cache and return_cache need causal "
                             "self-attention (causal=True, key and value None)")
        if lengths is not None or key_lengths is not None:
            raise ValueError("MultiheadAttention: cache and return_cache take no lengths")
        if self.sequence_parallel:
            raise ValueError("MultiheadAttention: cache and return_cache are for one process; "
                             "set sequence_parallel False to decode")

    def _check_sequence_parallel(self, self_attention, lengths, key_lengths):
        if not self.causal:
            raise ValueError("MultiheadAttention: sequence_parallel needs causal=True")
        if not self_attention:
            raise ValueError("MultiheadAttention: sequence_parallel needs self-attention (key and "
                             "value None)")
        if lengths is not None or key_lengths is not None:
            raise ValueError("MultiheadAttention: sequence_parallel takes no lengths (a split "
                             "sequence has no padding)")

    def extra_repr(self):
        s = f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, attention={self.attention!r}"
        if self.feature_map is not None:
            s += (f", feature_map={self.feature_map.kind!r}, "
                  f"num_features={self.feature_map.num_features}, placement={self.placement!r}")
            if not self.denominator:
                s += ", denominator=False"
        return s + f", causal={self.causal}"
