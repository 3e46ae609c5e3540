"""Which path runs a linrope.torch call, chosen by the tensors' device and never silently:

    "auto"    (the default) CPU tensors run on the C++ kernels, tensors on any other device on
              the native path (PyTorch ops on that device);
    "native"  every call runs on the native path, CPU tensors included (how the tests prove the
              native path against the C++ kernels).

    with linrope.torch.backend("native"):
        out = linrope.torch.linear_attention(q, k, v, feature_map, causal=True)

Where linrope's C++ module is not built (linrope._pure stands in for it), "auto" refuses CPU
tensors with a ValueError that says so, rather than run them natively unasked.

The choice holds in the current thread (and asyncio task) inside the `with`, a contextvars
setting: a thread started inside it, or a process (each rank of a process group), makes its own.
A call's backward follows its forward's path, whatever the setting when backward() runs.
"""
import contextvars
import functools
import importlib.util

import torch

from linrope.torch.native import checks

__all__ = ["BACKENDS", "backend", "core_built", "runs_native"]

BACKENDS = ("auto", "native")
_chosen = contextvars.ContextVar("linrope_torch_backend", default="auto")


class backend:
    """with linrope.torch.backend(name): the calls inside run on the path `name` chooses,
    "auto" or "native" (the module's docstring); any other name is a ValueError. backend.current()
    is the name in force."""

    def __init__(self, name):
        if name not in BACKENDS:
            raise ValueError(f"linrope.torch.backend: name is {name!r} but expected one of "
                             f"{', '.join(BACKENDS)}")
        self.name, self._token = name, None

    def __enter__(self):
        self._token = _chosen.set(self.name)
        return self

    def __exit__(self, *exc_info):
        _chosen.reset(self._token)
        return False

    @staticmethod
    def current():
        return _chosen.get()


def runs_native(function, named):
    """True when the call whose tensors are `named` ((name, value) pairs, q first; values other
    than tensors are skipped) runs on the native path. ValueError naming both when two tensors
    sit on different devices, whichever the path; TypeError when the first is no tensor."""
    first_name, first = named[0]
    checks.on_device_of(function, first_name, first, first_name, first)
    for name, t in named[1:]:
        if isinstance(t, torch.Tensor):
            checks.on_device_of(function, name, t, first_name, first)
    if _chosen.get() == "native" or first.device.type != "cpu":
        return True
    if not core_built():
        raise ValueError(f"{function}: {first_name} is a CPU tensor, which runs on linrope's C++ "
                         f"module, and the module is not built here; build linrope (docs/"
                         f"INSTALL.md), or run the native path: with "
                         f"linrope.torch.backend('native')")
    return False


@functools.lru_cache(maxsize=None)
def core_built():
    """Whether linrope's C++ module (linrope._core) is built here."""
    return importlib.util.find_spec("linrope._core") is not None
