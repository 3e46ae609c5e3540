"""The PyTorch competitor that bench/compare_pytorch.py and bench/bench_torch_layer.py time:
attention written the way a PyTorch user would write it ([B, H, n, d] tensors, features
[B, H, n, m]), one Competitor record per computation, the layer around it, and the environment
PyTorch runs best in. python/tests/test_against_pytorch.py checks every entry of COMPETITORS
against the float64 reference (python/tests/reference.py), so that a benchmark times the function
its name says; the benchmarks themselves check nothing.

torch is imported inside the functions: a script re-executes itself with GLIBC_TUNABLES
(reexec_with_tunables) first, and an import of torch before that would be paid twice.
"""
import copy
import math
import os
import sys
from dataclasses import dataclass

TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"
EPS = 1e-6  # out = num / (den + eps), as linrope's default
CHUNK = 64  # the chunk of the chunked causal form


def reexec_with_tunables():
    """Re-executes this script with TUNABLES added to GLIBC_TUNABLES, unless they are there:
    without them glibc returns every large temporary to the kernel and PyTorch page-faults it
    afresh on the next call (compare_pytorch.py's docstring gives the figures)."""
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


# ---- Attention -------------------------------------------------------------------------------

def torch_softmax(q, k, v, causal):
    """(q / sqrt(d)) @ k^T, masked_fill with a triu mask when causal, softmax, @ v."""
    import torch
    n = q.shape[-2]
    s = (q * (1.0 / math.sqrt(q.shape[-1]))) @ k.transpose(-1, -2)
    if causal:
        s.masked_fill_(torch.ones(n, n, dtype=torch.bool).triu_(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def phi_elu(x):
    """elu+1 features: F.elu(x) + 1."""
    import torch
    return torch.nn.functional.elu(x) + 1


def phi_favor(x, w):
    """FAVOR+ features exp(x' W^T - |x'|^2 / 2) / sqrt(m), x' = x d^-1/4, W [m x d]."""
    import torch
    xp = x * x.shape[-1] ** -0.25
    return torch.exp(xp @ w.t() - (xp * xp).sum(-1, keepdim=True) / 2) / math.sqrt(w.shape[0])


def linear_noncausal(fq, fk, v):
    """einsum: S = phi(k)^T v, z = sum_j phi(k_j), out = phi(q) S / (phi(q) z + eps)."""
    import torch
    s = torch.einsum("bhnm,bhnd->bhmd", fk, v)
    num = torch.einsum("bhnm,bhmd->bhnd", fq, s)
    den = torch.einsum("bhnm,bhm->bhn", fq, fk.sum(-2))
    return num / (den.unsqueeze(-1) + EPS)


def linear_causal_cumsum(fq, fk, v):
    """The prefix-sum form: cumsum over n of phi(k_j) v_j^T, O(n m d_v) memory."""
    import torch
    s = torch.einsum("bhnm,bhnd->bhnmd", fk, v).cumsum_(2)  # [B,H,n,m,d_v]: every prefix
    num = torch.einsum("bhnm,bhnmd->bhnd", fq, s)
    den = (fq * fk.cumsum(2)).sum(-1)
    return num / (den.unsqueeze(-1) + EPS)


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


LINEAR_FORMS = {"einsum": linear_noncausal, "cumsum": linear_causal_cumsum,
                "chunked": linear_causal_chunked}
SHORT_NAMES = {"softmax": "softmax", "elu+1": "elu", "favor+": "favor"}


@dataclass(frozen=True)
class Competitor:
    """One PyTorch computation: softmax or linear attention (attention: "softmax", or the feature
    map, "elu+1" or "favor+", by linrope's and the reference's names), causal or not, in one form
    ("matmul" for softmax; "einsum" non-causal, "cumsum" or "chunked" causal for linear)."""
    attention: str
    causal: bool
    form: str

    @property
    def key(self):
        """The benchmark tables' name: softmax/causal, elu/noncausal, favor/chunked, ..."""
        how = self.form if self.form in ("cumsum", "chunked") else (
            "causal" if self.causal else "noncausal")
        return f"{SHORT_NAMES[self.attention]}/{how}"

    def __call__(self, q, k, v, w=None):
        """The attention of q, k, v; w: FAVOR+'s W [m x d] (unused otherwise)."""
        if self.attention == "softmax":
            return torch_softmax(q, k, v, self.causal)
        phi = phi_elu if self.attention == "elu+1" else (lambda x: phi_favor(x, w))
        return LINEAR_FORMS[self.form](phi(q), phi(k), v)


COMPETITORS = (
    Competitor("softmax", False, "matmul"), Competitor("softmax", True, "matmul"),
    *(Competitor(kind, causal, form) for kind in ("elu+1", "favor+")
      for causal, form in ((False, "einsum"), (True, "cumsum"), (True, "chunked"))))
BY_KEY = {c.key: c for c in COMPETITORS}


def plain_linear(projection):
    """A torch.nn.Linear holding a copy of `projection`'s parameters (a linrope.torch.Linear, whose
    products run on linrope's GEMM, or any nn.Linear)."""
    from torch import nn
    copied = nn.Linear(projection.in_features, projection.out_features,
                       bias=projection.bias is not None, device=projection.weight.device,
                       dtype=projection.weight.dtype)
    copied.load_state_dict(projection.state_dict())
    return copied


def torch_layer(reference, attention, own_projections=False):
    """The layer in plain PyTorch: `reference`'s four projections (a
    linrope.torch.MultiheadAttention) copied into torch.nn.Linear (linrope's own are
    linrope.torch.Linear, on linrope's GEMM; own_projections: copies of those instead) around
    attention(q, k, v) on [B, H, n, head_dim]."""
    from torch import nn

    def plain(projection):
        return copy.deepcopy(projection) if own_projections else plain_linear(projection)

    class TorchLayer(nn.Module):
        def __init__(self):
            super().__init__()
            for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
                setattr(self, name, plain(getattr(reference, name)))
            self.heads, self.head_dim = reference.num_heads, reference.head_dim

        def forward(self, x):
            b, n, e = x.shape
            q, k, v = (p(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
                       for p in (self.q_proj, self.k_proj, self.v_proj))
            return self.out_proj(attention(q, k, v).transpose(1, 2).reshape(b, n, e))

    return TorchLayer()
