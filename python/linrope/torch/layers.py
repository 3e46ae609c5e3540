"""linrope.torch.layers: torch.nn.Module layers over linrope.torch.functional (CPU tensors).

    RotaryEmbedding     RoPE on (n, d) or (B, H, n, d) tensors, differentiable.
    MultiheadAttention  q/k/v/out projections and attention chosen by name: "softmax" (exact, RoPE
                        on q and k) or "linear" (a feature map, a RoPE placement, eps, feature
                        redraws); an optional short convolution on q, k and v (ShortConvolution);
                        decoding through a cache (KeyValueCache, or the LinearState; with a short
                        convolution a ShortConvCache around either); sequence parallel over
                        linrope.torch.distributed.
    HeadRMSNorm         RMSNorm over each head's channels with a learned gain: the output
                        normalisation of linear attention without a denominator.
    RedrawSchedule      when Performer's feature redrawing draws a new W.
    Linear              nn.Linear whose products run on linrope.matmul (functional.linear): the
                        projections of MultiheadAttention, and a drop-in for a model's others.
    GELU, RMSNorm       nn.GELU on linrope.gelu, and RMSNorm over the last dimension on
                        linrope.rms_norm: the rest of a pre-norm block (functional.gelu,
                        functional.rms_norm).
"""
import functools
import numbers
from typing import NamedTuple

import torch
from torch import nn

import linrope
from linrope.torch import distributed
from linrope.torch.convolution import ShortConvolution
from linrope.torch.functional import (gelu, head_decays, linear, linear_attention, rms_norm,
                                      rms_norm_expression, rope_apply, softmax_attention)

__all__ = ["RotaryEmbedding", "MultiheadAttention", "KeyValueCache", "ShortConvCache",
           "HeadRMSNorm", "RedrawSchedule", "Linear", "GELU", "RMSNorm"]

# Defaults from the default-constructed C++ structs, so that each lives in the C++ header alone.
_LINEAR = linrope.LinearOptions()
_STATS = linrope.DenominatorStats()
_ROPE = linrope.RopeConfig()
_MAP = linrope.FeatureMapConfig()


class Linear(nn.Linear):
    """torch.nn.Linear (the same parameters, initialisation and state_dict) whose forward is
    linrope.torch.functional.linear: y = x W^T + b on linrope's own GEMM for CPU tensors in
    float32 and float64, F.linear elsewhere."""

    def forward(self, x):
        return linear(x, self.weight, self.bias)


class GELU(nn.GELU):
    """torch.nn.GELU (approximate "none" or "tanh") whose exact form runs on linrope.gelu
    (functional.gelu; "tanh" and its fall-backs are F.gelu)."""

    def forward(self, x):
        return gelu(x, self.approximate)


class RMSNorm(nn.Module):
    """RMSNorm (Zhang and Sennrich 2019) over the last dimension, dim wide: x / sqrt(mean(x^2) +
    eps) * weight, the gain `weight` [dim] initially 1 (functional.rms_norm: linrope.rms_norm on
    CPU tensors, the same expression in PyTorch elsewhere)."""

    def __init__(self, dim, eps=1e-6, *, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self):
        return f"{self.weight.shape[0]}, eps={self.eps}"


class RotaryEmbedding(nn.Module):
    """RoPE of width dim on (n, dim) or (B, H, n, dim) tensors: forward(x, first_position=0).
    Arguments as linrope.Rope (layout "interleaved" or "half"; scaling "none", "linear", "ntk",
    "yarn")."""

    def __init__(self, dim, rotary_dim=_ROPE.rotary_dim, base=_ROPE.base, layout=_ROPE.layout,
                 scaling=_ROPE.scaling, factor=_ROPE.factor,
                 original_max_position=_ROPE.original_max_position):
        super().__init__()
        self.rope = linrope.Rope(dim, rotary_dim=rotary_dim, base=base, layout=layout,
                                 scaling=scaling, factor=factor,
                                 original_max_position=original_max_position)

    def forward(self, x, first_position=0, positions=None):
        return rope_apply(x, self.rope, first_position, positions)

    def extra_repr(self):
        r = self.rope
        return (f"dim={r.dim}, rotary_dim={r.rotary_dim}, base={r.base}, layout={r.layout!r}, "
                f"scaling={r.scaling!r}")


class HeadRMSNorm(nn.Module):
    """RMSNorm over each head's channels, then a learned gain per channel (TransNormer's
    NormAttention, RetNet and GLA normalise the numerator of linear attention this way):
    [B, H, n, head_dim] -> the same, out = x / sqrt(mean over head_dim of x^2 + eps) * gain, the
    gain `weight` [H * head_dim] (head h's channels at h * head_dim ...), initially 1."""

    def __init__(self, num_heads, head_dim, eps=1e-5, *, device=None, dtype=None):
        super().__init__()
        self.num_heads, self.head_dim, self.eps = num_heads, head_dim, eps
        self.weight = nn.Parameter(torch.ones(num_heads * head_dim, device=device, dtype=dtype))

    def forward(self, x):
        return rms_norm_expression(x, self.weight.view(self.num_heads, 1, self.head_dim), self.eps)

    def extra_repr(self):
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}, eps={self.eps}"


class RedrawSchedule:
    """Performer's feature redrawing (Choromanski et al. 2021): a new W every `interval` training
    forwards, 0 for never. The count of training forwards is the caller's to keep
    (MultiheadAttention keeps it in a buffer, so that a state_dict restores the schedule)."""

    def __init__(self, interval):
        if interval < 0:
            raise ValueError(f"RedrawSchedule: interval is {interval} but expected >= 0 (0: "
                             f"never)")
        self.interval = interval

    def due(self, forwards_done):
        """True when the training forward after `forwards_done` earlier ones starts with a new
        W: after every `interval` of them, never before the first."""
        return bool(self.interval) and forwards_done > 0 and forwards_done % self.interval == 0


class KeyValueCache(NamedTuple):
    """The decoding cache of softmax attention: the keys and values of the tokens so far, before
    RoPE, each [B, H, n_past, head_dim]; it grows by a row per token."""
    k: torch.Tensor
    v: torch.Tensor


class ShortConvCache(NamedTuple):
    """The decoding cache of a layer with a short convolution of width k: the attention's own
    cache (a LinearState, or a KeyValueCache), and the last k - 1 projected inputs of q, k and v
    before their convolutions, each [B, k - 1, embed_dim] (zeros before the first token)."""
    attention: tuple
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


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
        each head's output instead (output_norm, a HeadRMSNorm with norm_eps); placement "full"
        is then refused (it equals "numerator_only"). redraw_interval=k > 0 draws a new W every
        k forward calls in training mode (RedrawSchedule); the current seed and the count of
        training forwards are the buffers feature_seed and training_forwards, so a state_dict
        restores W and the redraw schedule.
    short_conv=k > 0 puts a ShortConvolution of width k (a causal depthwise convolution over time,
        then SiLU) on each of the projected q, k and v, before RoPE and the attention, for both
        attentions (q_conv, k_conv, v_conv: their own weights, no bias); 0: none. Causal, it
        never reads right padding into a real token; sequence parallel, each rank reads the
        k - 1 rows before its slice from the ranks before (linrope.torch.distributed.halo).
    decay (causal linear attention only; None: none): RetNet's retention, the state multiplied by
        gamma_h at every step, so that key j weighs gamma_h^(i - j) at query i in head h: a float
        for every head, a sequence of num_heads floats, or "retnet" for RetNet's
        gamma_h = 1 - 2^(-5-h). A fixed setting (head_decays, no gradient), through decoding and
        sequence parallelism alike.
    track_stats=True keeps the last forward's denominator statistics in last_stats (linear only);
    stats_threshold is the |den| below which a denominator counts as tiny (below_threshold).
    save_features=True (linear only; an attribute) keeps each forward's features for its backward
    (linear_attention's save_features: the same gradients; worth it for FAVOR+ with a large m).

    Sequence parallelism: with sequence_parallel=True (an attribute, settable after construction),
    each rank of sequence_group (None: the whole torch.distributed world) holds a contiguous slice
    of every sequence, and causal linear attention runs through linrope.torch.distributed, which
    exchanges only states between the ranks; first_position is then the whole sequence's first
    position (each rank's own follows from the slices before it). sequence_parallel_problem() says
    whether a layer can (causal linear self-attention, without lengths), and setting
    sequence_parallel = True on one that cannot raises ValueError with the reason.
    """

    # PyTorch's state_dict versioning (nn.Module._version): version 1 state dicts (linrope 0.1)
    # hold the output norm's gain as `head_norm`, version 2 as `output_norm.weight`.
    _version = 2

    def __init__(self, embed_dim, num_heads, attention="softmax", *, causal=False, rope=True,
                 rope_base=_ROPE.base, rope_layout=_ROPE.layout, feature_map="favor+",
                 num_features=None, orthogonal=_MAP.orthogonal, placement=None, eps=_LINEAR.eps,
                 method=_LINEAR.method, chunk_size=_LINEAR.chunk_size,
                 denominator=_LINEAR.denominator, norm_eps=1e-5, redraw_interval=0,
                 seed=_MAP.seed, bias=True, short_conv=0, decay=None, track_stats=False,
                 stats_threshold=_STATS.threshold, save_features=False, device=None, dtype=None):
        super().__init__()
        if attention not in ("softmax", "linear"):
            raise ValueError(f"MultiheadAttention: attention is {attention!r} but expected one of "
                             f"softmax, linear")
        if isinstance(short_conv, bool) or not isinstance(short_conv, int) or short_conv < 0:
            raise ValueError(f"MultiheadAttention: short_conv is {short_conv!r} but expected an "
                             f"int >= 0 (the convolution's width; 0: none)")
        if num_heads < 1 or embed_dim % num_heads != 0:
            raise ValueError(f"MultiheadAttention: embed_dim {embed_dim} is not a multiple of "
                             f"num_heads {num_heads}")
        factory = dict(device=device, dtype=dtype)
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.attention, self.causal, self.eps = attention, causal, eps
        self.method, self.chunk_size = method, chunk_size
        self.denominator, self.norm_eps = denominator, norm_eps
        if not denominator:
            if attention != "linear":
                raise ValueError("MultiheadAttention: denominator=False needs attention='linear'")
            self.output_norm = HeadRMSNorm(num_heads, self.head_dim, norm_eps, **factory)
        self.q_proj = Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.v_proj = Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.out_proj = Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.short_conv = short_conv
        self.decay, self.head_decays = self._decay_setting(decay, attention, causal, num_heads)
        if short_conv:
            self.q_conv, self.k_conv, self.v_conv = (
                ShortConvolution(embed_dim, short_conv, **factory) for _ in range(3))
        self.track_stats, self.stats_threshold, self.last_stats = track_stats, stats_threshold, None
        self.save_features = bool(save_features)
        self.redraw_interval = redraw_interval
        self._sequence_parallel, self.sequence_group = False, None
        self.feature_map, self.rope = None, None
        if attention == "softmax":
            self.placement = None
            if rope:
                self.rope = linrope.Rope(self.head_dim, base=rope_base, layout=rope_layout)
            return
        self.placement = placement if placement is not None else (
            _LINEAR.placement if rope else "none")
        self._map_args = dict(kind=feature_map, input_dim=self.head_dim,
                              num_features=num_features or 4 * self.head_dim,
                              orthogonal=orthogonal)
        self.register_buffer("feature_seed", torch.tensor(seed, dtype=torch.int64))
        self.register_buffer("training_forwards", torch.tensor(0, dtype=torch.int64))
        self.feature_map = linrope.FeatureMap(seed=seed, **self._map_args)
        if self.placement != "none":
            # numerator_only and full rotate the features (width m), before_map the inputs (d).
            width = self.head_dim if self.placement == "before_map" else self.feature_map.output_dim
            # 1+cos has m = d + 1: the constant feature passes through (rotary width d).
            self.rope = linrope.Rope(width, rotary_dim=width - width % 2, base=rope_base,
                                     layout=rope_layout)

    @staticmethod
    def _decay_setting(decay, attention, causal, num_heads):
        """(the setting as given, one gamma per head as a tuple), both None without a decay."""
        if decay is None:
            return None, None
        if attention != "linear" or not causal:
            raise ValueError("MultiheadAttention: decay needs attention='linear' and causal=True: "
                             "it decays the state of causal linear attention, which softmax and "
                             "non-causal attention do not keep")
        if isinstance(decay, str):
            if decay != "retnet":
                raise ValueError(f"MultiheadAttention: decay is {decay!r} but expected a float, "
                                 f"a sequence of num_heads floats, or 'retnet'")
            return decay, tuple(1 - 2.0 ** (-5 - h) for h in range(num_heads))
        heads = tuple(head_decays(decay, num_heads, "MultiheadAttention"))
        return (decay if isinstance(decay, numbers.Real) else heads), heads

    @property
    def redraw_interval(self):
        return self.redraw_schedule.interval

    @redraw_interval.setter
    def redraw_interval(self, interval):
        self.redraw_schedule = RedrawSchedule(interval)

    @property
    def head_norm(self):
        """The gain of output_norm, [embed_dim] (denominator=False only)."""
        return self.output_norm.weight

    @property
    def sequence_parallel(self):
        return self._sequence_parallel

    @sequence_parallel.setter
    def sequence_parallel(self, on):
        problem = self.sequence_parallel_problem() if on else None
        if problem is not None:
            raise ValueError(f"MultiheadAttention: {problem}")
        self._sequence_parallel = bool(on)

    def sequence_parallel_problem(self, key=None, value=None, lengths=None, key_lengths=None):
        """None when this layer can run with sequence_parallel=True on forward(query, key, value,
        lengths=lengths, key_lengths=key_lengths) (by default: self-attention without lengths),
        else the reason, a sentence. The rule: causal linear self-attention, without lengths
        (softmax attention needs every earlier key, not a state; a split sequence has no
        padding). A program that splits sequences asks it of every layer before training."""
        if self.attention != "linear":
            return ("sequence_parallel needs attention='linear' (softmax attention needs every "
                    "earlier key, not a state)")
        if key is not None or value is not None:
            return "sequence_parallel needs self-attention (key and value None)"
        return distributed.sequence_parallel_problem(
            causal=self.causal, lengths_given=lengths is not None or key_lengths is not None)

    def redraw_features(self, seed=None):
        """A new W from seed (default: the current seed + 1). A new FeatureMap, not an in-place
        redraw, so that a forward awaiting its backward keeps the W it used."""
        if self.feature_map is None:
            raise ValueError("MultiheadAttention: redraw_features needs attention='linear'")
        self.feature_seed.fill_(int(self.feature_seed) + 1 if seed is None else seed)
        self.feature_map = linrope.FeatureMap(seed=int(self.feature_seed), **self._map_args)

    def _heads(self, x, n):
        # [B, n, E] -> [B, H, n, head_dim]. From a contiguous x (the projections' output), a view
        # that linrope's kernels read in place (HeadsLayout BNHD), giving their output and
        # gradients in that layout: no copy for the split, the merge before out_proj or their
        # gradients. Another x (a short convolution's output, say) is copied once here, as the
        # kernels would copy it in the forward and again in the backward.
        heads = x.view(x.shape[0], n, self.num_heads, self.head_dim).transpose(1, 2)
        return heads if x.is_contiguous() else heads.contiguous()

    def forward(self, query, key=None, value=None, *, first_position=0, lengths=None,
                key_lengths=None, cache=None, return_cache=False):
        """[B, n, embed_dim] -> [B, n, embed_dim] (see the class). Decoding (causal
        self-attention, no lengths): with return_cache=True or a cache given, returns (out,
        cache), the cache after these tokens; cache= continues from one, these tokens then sitting
        at first_position = the number of tokens before them. The cache of linear attention is the
        LinearState of the tokens so far: O(m d_v) per head, whatever their number, so each new
        token costs the same. That of softmax attention is a KeyValueCache of their keys and
        values, which grows by a row per token. With short_conv=k it is a ShortConvCache: that
        cache, and the last k - 1 projected q, k and v that the next tokens' convolutions read."""
        decoding = cache is not None or return_cache
        if decoding:
            self._check_decoding(key, value, lengths, key_lengths, cache)
        if self.sequence_parallel:
            problem = self.sequence_parallel_problem(key, value, lengths, key_lengths)
            if problem is not None:
                raise ValueError(f"MultiheadAttention: {problem}")
        if key is None and key_lengths is None:
            key_lengths = lengths
        key = query if key is None else key
        value = key if value is None else value
        if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
            raise ValueError(f"MultiheadAttention: query, key and value are "
                             f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)} "
                             f"but expected [B, n, embed_dim = {self.embed_dim}]")
        batch, n, n_k = query.shape[0], query.shape[1], key.shape[1]
        q, k, v = self.q_proj(query), self.k_proj(key), self.v_proj(value)
        if self.short_conv:
            q, k, v, pasts = self._short_convolutions(q, k, v, cache, decoding)
            cache = None if cache is None else cache.attention
        q, k, v = self._heads(q, n), self._heads(k, n_k), self._heads(v, n_k)
        where = dict(q_offset=first_position, k_offset=first_position, q_lengths=lengths,
                     k_lengths=key_lengths)
        if self.attention == "softmax":
            out, cache = self._softmax(q, k, v, where, cache, decoding)
        else:
            out, cache = self._linear(q, k, v, where, cache, decoding)
        out = self.out_proj(out.transpose(1, 2).reshape(batch, n, self.embed_dim))
        if self.short_conv and decoding:
            cache = ShortConvCache(cache, *pasts)
        return (out, cache) if decoding else out

    def _short_convolutions(self, q, k, v, cache, decoding):
        """The projected q, k and v [B, n, embed_dim] through their convolutions, and (decoding)
        the past each leaves for the next call. The k - 1 rows before these tokens come from the
        cache, from the ranks before this one (sequence parallel: a halo), or are zeros (the
        sequence starts here)."""
        convolutions = (self.q_conv, self.k_conv, self.v_conv)
        if cache is not None:
            pasts = (cache.q, cache.k, cache.v)
        elif self.sequence_parallel:
            before = distributed.halo(torch.cat([q, k, v], -1), self.short_conv - 1,
                                      group=self.sequence_group)
            pasts = before.split(self.embed_dim, -1)
        else:
            pasts = (None, None, None)
        inputs = list(zip(convolutions, (q, k, v), pasts))
        after = tuple(c.past_after(x, past) for c, x, past in inputs) if decoding else None
        return (*(c(x, past) for c, x, past in inputs), after)

    def _softmax(self, q, k, v, where, cache, decoding):
        if decoding:
            if cache is not None:  # the earlier keys sit just before these tokens
                k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
            where = dict(q_offset=where["q_offset"], k_offset=where["q_offset"] - k.shape[2]
                         + q.shape[2])
        out = softmax_attention(q, k, v, causal=self.causal, rope=self.rope, **where)
        return out, (KeyValueCache(k, v) if decoding else None)

    def _linear(self, q, k, v, where, cache, decoding):
        if self.training and self.redraw_interval:
            done = int(self.training_forwards)
            if self.redraw_schedule.due(done):
                self.redraw_features()
            self.training_forwards.fill_(done + 1)
        if self.feature_map.seed != int(self.feature_seed):  # after load_state_dict
            self.feature_map = linrope.FeatureMap(seed=int(self.feature_seed), **self._map_args)
        attend = linear_attention
        if self.sequence_parallel:
            attend = functools.partial(distributed.linear_attention, group=self.sequence_group)
            where = dict(q_offset=where["q_offset"], k_offset=where["k_offset"])
        if decoding:
            where = dict(where, initial_state=cache, return_state=True)
        elif not self.sequence_parallel:
            where = dict(where, save_features=self.save_features)
        result = attend(q, k, v, self.feature_map, causal=self.causal, placement=self.placement,
                        rope=self.rope, eps=self.eps, method=self.method,
                        chunk_size=self.chunk_size, return_stats=self.track_stats,
                        stats_threshold=self.stats_threshold, denominator=self.denominator,
                        decay=None if self.head_decays is None else list(self.head_decays),
                        **where)
        if not isinstance(result, tuple):
            result = (result,)
        out = result[0]
        self.last_stats = result[1] if self.track_stats else None
        cache = result[-1] if decoding else None
        if not self.denominator:
            out = self.output_norm(out)
        return out, cache

    def _check_decoding(self, key, value, lengths, key_lengths, cache):
        if cache is not None and isinstance(cache, ShortConvCache) != bool(self.short_conv):
            raise ValueError(f"MultiheadAttention: cache is a {type(cache).__name__} but this "
                             f"layer (short_conv={self.short_conv}) takes the "
                             f"{'ShortConvCache' if self.short_conv else 'cache'} its own forward "
                             f"returns")
        if not self.causal or key is not None or value is not None:
            raise ValueError("MultiheadAttention: cache and return_cache need causal "
                             "self-attention (causal=True, key and value None)")
        if lengths is not None or key_lengths is not None:
            raise ValueError("MultiheadAttention: cache and return_cache take no lengths")
        if self.sequence_parallel:
            raise ValueError("MultiheadAttention: cache and return_cache are for one process; "
                             "set sequence_parallel False to decode")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args):
        old_gain, gain = prefix + "head_norm", prefix + "output_norm.weight"
        if local_metadata.get("version", 1) < 2 and old_gain in state_dict:
            state_dict[gain] = state_dict.pop(old_gain)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)

    def extra_repr(self):
        s = f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, attention={self.attention!r}"
        if self.feature_map is not None:
            s += (f", feature_map={self.feature_map.kind!r}, "
                  f"num_features={self.feature_map.num_features}, placement={self.placement!r}")
            if not self.denominator:
                s += ", denominator=False"
        if self.decay is not None:
            s += f", decay={self.decay!r}"
        if self.short_conv:
            s += f", short_conv={self.short_conv}"
        return s + f", causal={self.causal}"
