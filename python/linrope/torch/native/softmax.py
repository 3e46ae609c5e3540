"""Softmax attention in PyTorch on any device: the function of linrope.torch.softmax_attention
(docs/DESIGN.md, "Softmax attention").

    q [B, H, n, d] (or (n, d)), k [.., n_k, d], v [.., n_k, d_v] -> out [.., n, d_v]
    o_i = sum_{j seen} softmax_j(scale <R_i q_i, R_j k_j>) v_j, a zero row where nothing is seen

RoPE is applied to q and k first (rope.rotate). Then, where PyTorch has
torch.nn.functional.scaled_dot_product_attention with its scale argument (torch >= 2.1) and the
mask is one it takes without an n x n_k tensor (every key seen, with or without key lengths as a
[B, 1, 1, n_k] mask; causal with q_offset == k_offset, its is_causal), SDPA runs it, forward and
backward (FlashAttention or the memory-efficient kernel on CUDA, O(n) memory). Otherwise (torch
< 2.1, offsets that shift the causal diagonal, causal with key lengths, a key length of 0) a
blocked softmax here: blocks of QUERY_BLOCK queries against every key, so memory is O(QUERY_BLOCK
n_k), never n x n_k, in a custom autograd.Function whose backward recomputes each block's weights
from the forward's per-row log-sum-exp (FlashAttention-2's way), since autograd through the
blocks would keep every block's weights: n x n_k in all.
"""
import math

import torch
from torch.autograd.function import once_differentiable

from linrope.torch.native import checks
from linrope.torch.native.rope import positions_of, rotate

__all__ = ["softmax_attention"]

QUERY_BLOCK = 128


def _torch_version():
    return tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


# SDPA with scale= (torch 2.1): None where PyTorch lacks it.
SDPA = (torch.nn.functional.scaled_dot_product_attention if _torch_version() >= (2, 1)
        else None)


def _seen(i0, i1, n_k, causal, shift, k_valid, device):
    """[B | 1, 1, i1 - i0, n_k] bool: query i sees key j (j < i + shift when causal; j within the
    key lengths)."""
    keys = torch.arange(n_k, device=device)
    if causal:
        queries = torch.arange(i0, i1, device=device)
        seen = (keys[None, :] < queries[:, None] + shift)[None, None]
    else:
        seen = torch.ones(1, 1, i1 - i0, n_k, dtype=torch.bool, device=device)
    if k_valid is not None:
        seen = seen & k_valid[:, :, None, :, 0]
    return seen


def _block_weights(q, k, scale, seen, lse=None):
    """A block's softmax weights p [.., i1 - i0, n_k] (0 where unseen) and, in the forward, each
    row's log-sum-exp (+inf for a row that sees nothing, so that exp(s - lse) is 0)."""
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~seen, -math.inf)
    if lse is not None:
        return torch.exp(scores - lse[..., None]), None
    top = (scores.max(-1, keepdim=True).values if scores.shape[-1]
           else scores.new_full(scores.shape[:-1] + (1,), -math.inf))
    nothing = top == -math.inf
    top = torch.where(nothing, torch.zeros_like(top), top)
    p = torch.exp(scores - top)
    total = p.sum(-1, keepdim=True)
    lse = torch.where(nothing, torch.full_like(top, math.inf), top + torch.log(total))
    return p / torch.where(nothing, torch.ones_like(total), total), lse[..., 0]


class _BlockedSoftmax(torch.autograd.Function):
    """out = softmax(scale q k^T, masked) v by blocks of queries; saves q, k, v, out and the rows'
    log-sum-exp, and the backward recomputes each block's weights:
        dv = sum_i p_ij g_i,  ds_ij = p_ij (<g_i, v_j> - <g_i, o_i>),  dq = scale ds k,
        dk = scale ds^T q."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, shift, k_valid):
        n, n_k = q.shape[2], k.shape[2]
        out = q.new_empty(q.shape[:-1] + v.shape[-1:])
        lse = q.new_empty(q.shape[:-1])
        for i0 in range(0, n, QUERY_BLOCK):
            i1 = min(n, i0 + QUERY_BLOCK)
            seen = _seen(i0, i1, n_k, causal, shift, k_valid, q.device)
            p, lse[..., i0:i1] = _block_weights(q[..., i0:i1, :], k, scale, seen)
            out[..., i0:i1, :] = p @ v
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.causal, ctx.shift, ctx.k_valid = scale, causal, shift, k_valid
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        n, n_k = q.shape[2], k.shape[2]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for i0 in range(0, n, QUERY_BLOCK):
            i1 = min(n, i0 + QUERY_BLOCK)
            seen = _seen(i0, i1, n_k, ctx.causal, ctx.shift, ctx.k_valid, q.device)
            p, _ = _block_weights(q[..., i0:i1, :], k, ctx.scale, seen, lse[..., i0:i1])
            g = d_out[..., i0:i1, :]
            dv += p.transpose(-1, -2) @ g
            ds = p * (g @ v.transpose(-1, -2) - (g * out[..., i0:i1, :]).sum(-1, keepdim=True))
            dq[..., i0:i1, :] = ctx.scale * (ds @ k)
            dk += ctx.scale * (ds.transpose(-1, -2) @ q[..., i0:i1, :])
        return dq, dk, dv, None, None, None, None


def sdpa_route(q, k, v, scale, causal, q_offset, k_offset, k_lengths, k_valid, kernel=SDPA):
    """out through kernel (scaled_dot_product_attention's contract), or None where the mask is
    not one it takes without an n x n_k tensor (or there is no kernel)."""
    n_k = k.shape[2]
    if kernel is None or n_k == 0 or (k_lengths is not None and min(k_lengths) == 0):
        return None
    if not causal or q_offset >= k_offset + n_k - 1:  # every query sees every key
        mask = None if k_valid is None else k_valid.transpose(-1, -2)  # [B, 1, 1, n_k]
        return kernel(q, k, v, attn_mask=mask, scale=scale)
    if q_offset == k_offset and k_valid is None:  # query i sees keys j <= i
        return kernel(q, k, v, is_causal=True, scale=scale)
    return None


def softmax_attention(q, k, v, *, causal, scale, rope, q_offset, k_offset, q_lengths, k_lengths):
    """linrope.torch.softmax_attention on the native path: the same arguments (lengths as lists
    of ints) and results; see the module's docstring for how it is computed."""
    function = "softmax_attention"
    checks.attention_inputs(function, q, k, v)
    d = q.shape[-1]
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)
                                  and scale > 0):
        raise ValueError(f"{function}: scale is {scale} but expected a finite scale > 0 (None "
                         f"means 1/sqrt(d))")
    if rope is not None and rope.dim != d:
        raise ValueError(f"{function}: options.rope has dim = {rope.dim} but q has d = {d}")
    single = q.dim() == 2
    if single:
        q, k, v = q[None, None], k[None, None], v[None, None]
    batch, n, n_k = q.shape[0], q.shape[2], k.shape[2]
    q_valid = checks.lengths_mask(function, "q_lengths", q_lengths, batch, n, q.device)
    k_valid = checks.lengths_mask(function, "k_lengths", k_lengths, batch, n_k, q.device)
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    if q_valid is not None:
        q = torch.where(q_valid, q, zero)
    if k_valid is not None:
        k, v = torch.where(k_valid, k, zero), torch.where(k_valid, v, zero)
    if rope is not None:
        q = rotate(q, rope, positions_of(function, n, q_offset, None, q.device))
        k = rotate(k, rope, positions_of(function, n_k, k_offset, None, q.device))
    scale = float(scale) if scale is not None else (1 / math.sqrt(d) if d > 0 else 1.0)
    out = sdpa_route(q, k, v, scale, causal, q_offset, k_offset, k_lengths, k_valid)
    if out is None:
        work = torch.float32 if q.dtype == torch.bfloat16 else q.dtype
        out = _BlockedSoftmax.apply(q.to(work), k.to(work), v.to(work), scale, causal,
                                    q_offset - k_offset + 1, k_valid).to(q.dtype)
    if q_valid is not None:
        out = torch.where(q_valid, out, zero)
    return out[0, 0] if single else out
