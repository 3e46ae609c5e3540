"""linrope.torch.functional: linrope's kernels as differentiable PyTorch functions (CPU tensors).

    softmax_attention(q, k, v, causal, scale, rope, q_offset, k_offset, q_lengths, k_lengths)
    linear_attention(q, k, v, feature_map, causal, placement, rope, eps, q_offset, k_offset,
                     return_stats, stats_threshold, method, chunk_size, q_lengths, k_lengths,
                     initial_state, return_state, denominator, decay)
    rope_apply(x, rope, first_position, positions)
    feature_map_apply(x, feature_map)
    linear(x, weight, bias)                         F.linear on linrope's matmul (its own
                                                    fall-backs to F.linear: see its docstring)
    gelu(x, approximate)                            F.gelu on linrope.gelu (the same)
    rms_norm(x, weight, eps)                        RMSNorm on linrope.rms_norm (the same)

Each is a torch.autograd.Function over the C++ forward and backward: it saves only its inputs
and options (rms_norm also its 1 / rms per row), and its backward calls the C++ backward. A call
whose tensors are on another device than the CPU, or made under linrope.torch.backend("native"),
runs on linrope.torch.native instead (native.runs_native decides; docs/DESIGN.md, "Any device"),
but for linear, gelu and rms_norm, which are then PyTorch's own computation. q_lengths /
k_lengths (B entries: a list, array or tensor) mark padding in (B, H, n, d) batches: rows at or
past them are not attended to, their outputs are 0 and their gradients 0. Tensors are float32 or
float64, shaped (n, d) or (B, H, n, d), as in ``linrope`` (linear, gelu and rms_norm: any
shape); arguments and names are those of the NumPy functions. Contiguous tensors reach the
kernels without a copy (torch and NumPy share the memory), and so do the attentions' (B, H, n, d)
views of a contiguous (B, n, H, d) tensor, `x.view(B, n, H, d).transpose(1, 2)`, whose outputs
and gradients come back in the same layout; outputs are new tensors.
"""
import math
import numbers

import torch
from torch.autograd.function import once_differentiable

import linrope
from linrope.torch import native
from linrope.torch.states import LinearState

__all__ = ["softmax_attention", "linear_attention", "rope_apply", "feature_map_apply",
           "head_decays", "linear", "gelu", "rms_norm"]

# The defaults of the options, read from the default-constructed C++ structs so that each lives in
# the C++ header alone (the NumPy functions take theirs from the same structs).
_SOFTMAX = linrope.SoftmaxOptions()
_LINEAR = linrope.LinearOptions()
_STATS = linrope.DenominatorStats()


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
        out = linrope.softmax_attention(_array(q, fn, "q"), _array(k, fn, "k"),
                                        _array(v, fn, "v"), **options)
        return torch.from_numpy(out)

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        fn = "softmax_attention_backward"
        q, k, v = ctx.saved_tensors
        grads = linrope.softmax_attention_backward(
            _array(q, fn, "q"), _array(k, fn, "k"), _array(v, fn, "v"),
            _array(d_out, fn, "d_out"), **ctx.options)
        return (*_tensors(grads), None)


def _decay_argument(decay):
    """decay as the kernels take it: a float, or a list of one float per head (a tensor or other
    sequence becomes a list; whether the values suit the call is the kernels' to say)."""
    if isinstance(decay, torch.Tensor):
        decay = decay.tolist()
    if isinstance(decay, (list, tuple)):
        return list(decay)
    return decay


def head_decays(decay, heads, function="linear_attention"):
    """One decay per head, floats in (0, 1] (1.0 each for None), from a float or a sequence (or
    tensor) of `heads` of them; ValueError naming `function` otherwise."""
    if decay is None:
        return [1.0] * heads
    given = _decay_argument(decay)
    values = given if isinstance(given, list) else [given] * heads
    if len(values) != heads or not all(
            isinstance(g, numbers.Real) and not isinstance(g, bool) and 0 < g <= 1
            for g in values):
        raise ValueError(f"{function}: decay is {decay!r} but expected a float in (0, 1] or a "
                         f"sequence of H = {heads} of them, one per head")
    return [float(g) for g in values]


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
                return_state, save_features):
        fn = "linear_attention"
        ctx.feature_map, ctx.options = feature_map, options
        # The features the backward reads instead of mapping q and k again (linrope.LinearSaved),
        # held by the graph as the tensors are.
        ctx.linear_saved = None
        if save_features and any(ctx.needs_input_grad[:5]):
            ctx.linear_saved = linrope.LinearSaved()
        # The backward needs the W of this forward: a redraw in between would silently give the
        # gradient of another function, so the seed is checked (MultiheadAttention redraws by
        # making a new map instead, which leaves this one, held here, unchanged).
        ctx.seed = feature_map.seed
        ctx.set_materialize_grads(False)  # an unused output's gradient comes as None
        ctx.save_for_backward(q, k, v, S0, z0, log_scale0)
        initial = None if S0 is None else _state_arrays((S0, z0, log_scale0), fn, "initial_state")
        result = linrope.linear_attention(
            _array(q, fn, "q"), _array(k, fn, "k"), _array(v, fn, "v"), feature_map,
            return_stats=stats is not None, stats_threshold=stats_threshold,
            initial_state=initial, return_state=return_state, saved=ctx.linear_saved, **options)
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
        grads = linrope.linear_attention_backward(
            _array(q, fn, "q"), _array(k, fn, "k"), _array(v, fn, "v"),
            _array(d_out, fn, "d_out"), ctx.feature_map, initial_state=initial,
            d_final_state=d_final, return_state_gradient=want_initial, saved=ctx.linear_saved,
            **ctx.options)
        d_S0, d_z0 = _tensors(grads[3]) if want_initial else (None, None)
        return (*_tensors(grads[:3]), d_S0, d_z0, None, None, None, None, None, None, None)


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


def _kernels_take(tensors):
    """Whether linrope's C++ kernels can compute a layer's piece (linear, gelu, rms_norm) on these
    tensors; where they cannot, those functions are PyTorch's own (a drop-in's fall-back, not a
    refusal as for the attention functions): tensors on another device, backend("native"), CPU
    autocast (under which PyTorch's layers compute in bfloat16), dtypes other than float32 and
    float64, or no C++ module here."""
    return (native.dispatch.backend.current() != "native" and native.dispatch.core_built()
            and not torch.is_autocast_cpu_enabled()
            and all(t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64)
                    for t in tensors))


class _Linear(torch.autograd.Function):
    """y = x W^T + b by linrope.matmul, and its gradients dx = dy W, dW = dy^T x, db = sum dy."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        fn = "linear"
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
        y = torch.empty(rows.shape[0], weight.shape[0], dtype=x.dtype)
        linrope.matmul(_array(rows, fn, "input"), _array(weight, fn, "weight"),
                       transpose_b=True, out=y.numpy())
        if bias is not None:
            y.add_(bias)  # measured faster than y = b, then y += x W^T in the product
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @once_differentiable
    def backward(ctx, d_y):
        fn = "linear backward"
        x, weight = ctx.saved_tensors
        d_rows = d_y.reshape(math.prod(d_y.shape[:-1]), weight.shape[0]).contiguous()
        d_x = d_weight = d_bias = None
        if ctx.needs_input_grad[0]:
            d_x = torch.from_numpy(linrope.matmul(_array(d_rows, fn, "d_y"),
                                                  _array(weight, fn, "weight")))
            d_x = d_x.reshape(x.shape)
        if ctx.needs_input_grad[1]:
            rows = x.reshape(d_rows.shape[0], x.shape[-1])
            d_weight = torch.from_numpy(linrope.matmul(_array(d_rows, fn, "d_y"),
                                                       _array(rows, fn, "input"),
                                                       transpose_a=True))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            d_bias = d_rows.sum(0)
        return d_x, d_weight, d_bias


# Calls with fewer multiply-adds than this go to F.linear: linrope's call costs ~12 us more than
# F.linear's (the autograd Function and the binding), and the crossover measured here was about
# 2^20 (16 x 128 x 512, 64 x 128 x 128), which a decoding step's 1-row products are far below.
LINEAR_MIN_WORK = 1 << 20


def linear(x, weight, bias=None):
    """torch.nn.functional.linear, y = x W^T + b (x [..., in], W [out, in], b [out]), with the
    products on linrope.matmul: linrope's own GEMM, 1.4-1.8x PyTorch's products on a small
    model's shapes where its OpenBLAS runs AVX2 kernels on an AVX-512 CPU, about even with
    OpenBLAS's AVX-512 kernels (bench/RESULTS.md). Differentiable once (no double backward, no
    forward-mode AD). It is F.linear itself (a drop-in's fall-back, not a refusal as for the
    attention functions) where linrope's products would not run or not pay: tensors on another
    device, under backend("native") or CPU autocast, dtypes other than float32 and float64, no
    C++ module here, or fewer than LINEAR_MIN_WORK multiply-adds."""
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if not _kernels_take(tensors):
        return torch.nn.functional.linear(x, weight, bias)
    if any(t.dtype != x.dtype for t in tensors):
        names = ("input", "weight", "bias")[:len(tensors)]
        raise ValueError(f"linear: {', '.join(names)} have dtypes "
                         f"{', '.join(str(t.dtype) for t in tensors)}; expected one")
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: input has shape {tuple(x.shape)} and weight "
                         f"{tuple(weight.shape)}; expected input (..., in) and weight (out, in)")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"linear: bias has shape {tuple(bias.shape)} but weight has "
                         f"{weight.shape[0]} rows")
    if math.prod(x.shape[:-1]) * weight.numel() < LINEAR_MIN_WORK:
        return torch.nn.functional.linear(x, weight, bias)
    return _Linear.apply(x, weight, bias)


class _GELU(torch.autograd.Function):
    """GELU(x) = x Phi(x) by linrope.gelu, and dx = dy GELU'(x) by linrope.gelu_backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.from_numpy(linrope.gelu(_array(x, "gelu", "input")))

    @staticmethod
    @once_differentiable
    def backward(ctx, d_y):
        fn = "gelu backward"
        (x,) = ctx.saved_tensors
        return torch.from_numpy(linrope.gelu_backward(_array(x, fn, "input"),
                                                      _array(d_y, fn, "d_y")))


def gelu(x, approximate="none"):
    """torch.nn.functional.gelu, GELU(x) = x Phi(x), on linrope.gelu (include/linrope/
    activation.hpp: in float32 one vectorised pass forward and one backward, erf within 1.5e-7 of
    the exact one as PyTorch's vectorised CPU erf; in float64 std::erfc per element).
    approximate="tanh" and the fall-backs of _kernels_take: F.gelu itself. No size threshold
    (unlike linear), so that decoding computes the function training did: below 65536 elements
    a call costs 1-3 us more than F.gelu's (the Function's overhead; nothing against a decoding
    step), above it forward and backward are 1.2-1.5x faster (bench/RESULTS.md, "GELU and
    RMSNorm on linrope's kernels"). Differentiable once."""
    if approximate != "none" or not _kernels_take((x,)):
        return torch.nn.functional.gelu(x, approximate=approximate)
    return _GELU.apply(x)


def rms_norm_expression(x, weight, eps):
    """RMSNorm written in PyTorch operators (autograd differentiates it): rms_norm's fall-back,
    HeadRMSNorm's computation, and the PyTorch side of bench/step_pieces.py."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class _RMSNorm(torch.autograd.Function):
    """RMSNorm by linrope.rms_norm, which also returns 1 / rms per row, kept for the backward."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        fn = "rms_norm"
        y, inv_rms = linrope.rms_norm(_array(x, fn, "input"), _array(weight, fn, "weight"), eps)
        inv_rms = torch.from_numpy(inv_rms)
        ctx.save_for_backward(x, weight, inv_rms)
        return torch.from_numpy(y)

    @staticmethod
    @once_differentiable
    def backward(ctx, d_y):
        fn = "rms_norm backward"
        x, weight, inv_rms = ctx.saved_tensors
        d_x, d_weight = linrope.rms_norm_backward(
            _array(x, fn, "input"), _array(weight, fn, "weight"), _array(inv_rms, fn, "inv_rms"),
            _array(d_y, fn, "d_y"))
        return (torch.from_numpy(d_x) if ctx.needs_input_grad[0] else None,
                torch.from_numpy(d_weight) if ctx.needs_input_grad[1] else None, None)


def rms_norm(x, weight, eps=1e-6):
    """RMSNorm over the last dimension: x / sqrt(mean(x^2, -1) + eps) * weight (x [..., d],
    weight [d]), on linrope.rms_norm (include/linrope/normalization.hpp: one pass over each row
    forward and one backward, where PyTorch's expression makes six operators and their
    gradients). The fall-backs of _kernels_take compute that expression in PyTorch; as gelu, no
    size threshold (faster than the expression at every size measured, 128 elements up;
    bench/RESULTS.md). Differentiable once."""
    if not _kernels_take((x, weight)):
        return rms_norm_expression(x, weight, eps)
    if x.dtype != weight.dtype:
        raise ValueError(f"rms_norm: input has dtype {x.dtype} and weight {weight.dtype}; "
                         f"expected one")
    if x.dim() < 1 or tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"rms_norm: input has shape {tuple(x.shape)} and weight "
                         f"{tuple(weight.shape)}; expected input (..., d) and weight (d,)")
    return _RMSNorm.apply(x, weight, float(eps))


def softmax_attention(q, k, v, causal=_SOFTMAX.causal, scale=None, rope=None,
                      q_offset=_SOFTMAX.q_offset, k_offset=_SOFTMAX.k_offset, q_lengths=None,
                      k_lengths=None):
    """Exact softmax attention, differentiable in q, k and v; see linrope.softmax_attention."""
    if native.runs_native("softmax_attention", [("q", q), ("k", k), ("v", v)]):
        return native.softmax_attention(q, k, v, causal=causal, scale=scale, rope=rope,
                                        q_offset=q_offset, k_offset=k_offset,
                                        q_lengths=_int_list(q_lengths),
                                        k_lengths=_int_list(k_lengths))
    options = dict(causal=causal, scale=scale, rope=rope, q_offset=q_offset, k_offset=k_offset,
                   q_lengths=_int_list(q_lengths), k_lengths=_int_list(k_lengths))
    return _SoftmaxAttention.apply(q, k, v, options)


def linear_attention(q, k, v, feature_map, causal=_LINEAR.causal, placement=_LINEAR.placement,
                     rope=None, eps=_LINEAR.eps, q_offset=_LINEAR.q_offset,
                     k_offset=_LINEAR.k_offset, return_stats=False,
                     stats_threshold=_STATS.threshold, method=_LINEAR.method,
                     chunk_size=_LINEAR.chunk_size, q_lengths=None, k_lengths=None,
                     initial_state=None, return_state=False, denominator=_LINEAR.denominator,
                     decay=None, save_features=False):
    """Linear attention, differentiable in q, k and v (W held fixed); see
    linrope.linear_attention. method ("scan" or "chunked", with chunk_size) picks the causal
    forward; both give the same gradients. denominator=False computes o = num (no
    normalisation; placement full is then numerator_only and is refused). With
    return_stats=True returns (out, stats), stats a dict of the denominator statistics (min,
    nonpositive, below_threshold, threshold, count, no_keys, zero_divisor;
    include/linrope/attention.hpp says what each counts).

    State in, state out (causal only): initial_state, a LinearState (or a tuple (S, z,
    log_scale)), is the state of the tokens before these, whose positions q_offset and k_offset
    then continue; return_state=True also returns the LinearState after every key of k, last in
    the tuple: (out, state) or (out, stats, state). Both are differentiable in S and z, so a
    sequence cut into parts and run part by part from each other's states gives the outputs and
    gradients of one call on the whole (to rounding).

    decay (causal only; None: none) multiplies the state by g at every step, RetNet's retention:
    key j weighs g^(p_i - p_j) at query i, in the numerator and the denominator. A float g in
    (0, 1], or for (B, H, n, d) tensors a sequence (or tensor) of H of them, one per head; a
    fixed setting, with no gradient. A state is then the decayed sum at its last key's position
    (k_offset + n_k - 1), and initial_state is read as the state at k_offset - 1, so that a
    sequence cut anywhere still equals one call.

    save_features=True keeps the forward's features (linrope.LinearSaved, O((n + n_k) m) per
    head, until the graph is freed) for the backward, which then maps nothing again: the same
    gradients, bit for bit. It pays for causal FAVOR+ (the map is a GEMM and exps), not for the
    cheap maps nor non-causal calls (bench/RESULTS.md, "Saved features"). Ignored on other
    devices."""
    state = () if initial_state is None else tuple(initial_state)
    if native.runs_native("linear_attention", [("q", q), ("k", k), ("v", v)] + list(
            zip(("initial_state.S", "initial_state.z", "initial_state.log_scale"), state))):
        return native.linear_attention(
            q, k, v, feature_map, causal=causal, placement=placement, rope=rope, eps=eps,
            q_offset=q_offset, k_offset=k_offset, return_stats=return_stats,
            stats_threshold=stats_threshold, method=method, chunk_size=chunk_size,
            q_lengths=_int_list(q_lengths), k_lengths=_int_list(k_lengths),
            initial_state=initial_state, return_state=return_state, denominator=denominator,
            decay=decay)
    options = dict(causal=causal, placement=placement, rope=rope, eps=eps, q_offset=q_offset,
                   k_offset=k_offset, method=method, chunk_size=chunk_size,
                   q_lengths=_int_list(q_lengths), k_lengths=_int_list(k_lengths),
                   denominator=denominator)
    if decay is not None:
        options["decay"] = _decay_argument(decay)
    stats = {} if return_stats else None
    S0, z0, log_scale0 = (None, None, None) if initial_state is None else tuple(initial_state)
    result = _LinearAttention.apply(q, k, v, S0, z0, log_scale0, feature_map, options, stats,
                                    stats_threshold, bool(return_state),
                                    bool(save_features) and torch.is_grad_enabled())
    if not return_state:
        return (result, stats) if return_stats else result
    out, state = result[0], LinearState(*result[1:])
    return (out, stats, state) if return_stats else (out, state)


def rope_apply(x, rope, first_position=0, positions=None):
    """R x for a linrope.Rope, differentiable (the gradient is R^T): row i at first_position + i,
    or at positions[i] (a list, array or tensor of n integers)."""
    if native.runs_native("Rope.apply", [("x", x)]):
        return native.rope_apply(x, rope, first_position, _int_list(positions))
    return _RopeApply.apply(x, rope, first_position, _int_list(positions))


def feature_map_apply(x, feature_map):
    """phi(x) row by row for a linrope.FeatureMap, differentiable in x (W held fixed)."""
    if native.runs_native("FeatureMap.apply", [("x", x)]):
        return native.feature_map_apply(x, feature_map)
    return _FeatureMapApply.apply(x, feature_map)
