"""What bench/compare_pytorch.py and bench/bench_torch_layer.py share: the environment PyTorch
runs best in, and attention written the way a PyTorch user would write it ([B, H, n, d] tensors,
features [B, H, n, m]).

Import order matters: call reexec_with_tunables() before importing this module's torch users'
torch, because glibc reads GLIBC_TUNABLES at start-up (compare_pytorch.py's docstring says why
they are set).
"""
import math
import os
import sys

TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"
EPS = 1e-6  # out = num / (den + eps), as linrope's default
CHUNK = 64  # the chunk of the chunked causal form


def reexec_with_tunables():
    """Re-executes this script with TUNABLES added to GLIBC_TUNABLES, unless they are there."""
    current = os.environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.mmap_max=0" in current and "glibc.malloc.trim_threshold" in current:
        return
    env = dict(os.environ, GLIBC_TUNABLES=current + ":" + TUNABLES if current else TUNABLES)
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable] + sys.argv, env)


def loaded_blas():
    """Which BLAS the process has mapped (after a matmul has run)."""
    import torch
    torch.ones(64, 64) @ torch.ones(64, 64)
    with open("/proc/self/maps") as maps:
        return sorted({line.split()[-1] for line in maps if "blas" in line.lower() and "/" in line})


def torch_softmax(q, k, v, causal):
    """(q / sqrt(d)) @ k^T, masked_fill with a triu mask when causal, softmax, @ v."""
    import torch
    n = q.shape[-2]
    s = (q * (1.0 / math.sqrt(q.shape[-1]))) @ k.transpose(-1, -2)
    if causal:
        s.masked_fill_(torch.ones(n, n, dtype=torch.bool).triu_(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def phi_favor(x, w):
    """FAVOR+ features exp(x' W^T - |x'|^2 / 2) / sqrt(m), x' = x d^-1/4."""
    import torch
    xp = x * x.shape[-1] ** -0.25
    return torch.exp(xp @ w.t() - (xp * xp).sum(-1, keepdim=True) / 2) / math.sqrt(w.shape[0])


def linear_causal_chunked(fq, fk, v, chunk=CHUNK):
    """Quadratic (tril-masked) inside chunks, plus the state of the earlier chunks (exclusive
    cumsum over chunks of phi(K_c)^T V_c), all batched PyTorch ops."""
    import torch
    b, h, n, m = fq.shape
    dv = v.shape[-1]
    pad = (-n) % chunk  # zero rows at the end: later than every real row, so invisible to them
    if pad:
        fq, fk, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (fq, fk, v))
    c = (n + pad) // chunk
    # reshape, not view: v may be a projection's transposed (strided) view.
    qc, kc = fq.reshape(b, h, c, chunk, m), fk.reshape(b, h, c, chunk, m)
    vc = v.reshape(b, h, c, chunk, dv)
    kv = kc.transpose(-1, -2) @ vc                                   # [B,H,c,m,d_v] per chunk
    state = torch.cat([torch.zeros_like(kv[:, :, :1]), kv[:, :, :-1].cumsum(2)], dim=2)
    zc = kc.sum(3)                                                   # [B,H,c,m]
    z = torch.cat([torch.zeros_like(zc[:, :, :1]), zc[:, :, :-1].cumsum(2)], dim=2)
    scores = (qc @ kc.transpose(-1, -2)).tril_()                     # [B,H,c,C,C]
    num = qc @ state + scores @ vc
    den = (qc * z.unsqueeze(3)).sum(-1) + scores.sum(-1)
    out = num / (den.unsqueeze(-1) + EPS)
    return out.reshape(b, h, c * chunk, dv)[:, :, :n]
