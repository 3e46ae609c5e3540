"""The native path's argument checks: what the C++ module checks before its kernels run, in its
words (a ValueError naming the function, the argument, the expected and the actual value), for
tensors on any device. Values are not checked: a search for NaN or inf would wait for the device
at every call (docs/DESIGN.md, "Any device")."""
import torch

__all__ = ["DTYPES", "attention_inputs", "lengths_mask", "on_device_of", "same_device_and_dtype"]

# Computed in their own precision: float32, float64. bfloat16 inputs are computed in float32.
DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def on_device_of(function, name, t, first_name, first):
    """TypeError unless t (called name) is a tensor, ValueError unless it is on the device of
    first (a tensor called first_name)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{function}: {name} is a {type(t).__name__} but expected a torch.Tensor")
    if t.device != first.device:
        raise ValueError(f"{function}: {name} is on {t.device} but {first_name} is on "
                         f"{first.device}; expected every tensor on one device")


def same_device_and_dtype(function, named):
    """named: (name, tensor) pairs, the first the reference (q). TypeError for a non-tensor,
    ValueError for a tensor on another device or of another dtype, or a dtype outside DTYPES."""
    first_name, first = named[0]
    on_device_of(function, first_name, first, first_name, first)
    for name, t in named[1:]:
        on_device_of(function, name, t, first_name, first)
        if t.dtype != first.dtype:
            raise ValueError(f"{function}: {name} has dtype {t.dtype} but {first_name} has dtype "
                             f"{first.dtype}")
    if first.dtype not in DTYPES:
        raise ValueError(f"{function}: {first_name} has dtype {first.dtype} but expected "
                         f"torch.float32, torch.float64 or torch.bfloat16")


def attention_inputs(function, q, k, v):
    """q [B, H, n, d] or (n, d), k [.., n_k, d], v [.., n_k, d_v]: the checks of the C++ batched
    calls (include/linrope/batched.hpp)."""
    same_device_and_dtype(function, [("q", q), ("k", k), ("v", v)])
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() not in (2, 4):
            raise ValueError(f"{function}: {name} has {t.dim()} dimensions but expected 2 (n, d) "
                             f"or 4 (B, H, n, d)")
        if t.dim() != q.dim():
            raise ValueError(f"{function}: {name} has {t.dim()} dimensions but q has {q.dim()}")
    for name, t in (("k", k), ("v", v)):
        if t.shape[:-2] != q.shape[:-2]:
            raise ValueError(f"{function}: {name} is {list(t.shape)} but q has batch, heads = "
                             f"{list(q.shape[:-2])}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"{function}: k is {list(k.shape)} but q has d = {q.shape[-1]}")
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(f"{function}: v is {list(v.shape)} but k has n = {k.shape[-2]}")


def lengths_mask(function, name, lengths, batch, n, device):
    """[batch, 1, n, 1] bool, True at rows before lengths[b] (all True for lengths None), from a
    list of ints in [0, n] (linrope.torch.functional reads lists and tensors into one)."""
    if lengths is None:
        return None
    if len(lengths) != batch:
        raise ValueError(f"{function}: {name} has {len(lengths)} entries but expected batch = "
                         f"{batch}")
    for b, length in enumerate(lengths):
        if not 0 <= length <= n:
            raise ValueError(f"{function}: {name}[{b}] is {length} but expected a length in "
                             f"[0, {n}]")
    rows = torch.arange(n, device=device)
    limits = torch.tensor(lengths, device=device)
    return (rows[None, :] < limits[:, None])[:, None, :, None]
