"""linrope: linear attention with Rotary Position Embedding, on NumPy arrays.

Arrays are float32 or float64, shaped (n, d) or (B, H, n, d); C-contiguous inputs are read in
place, every output is a new array, the GIL is released inside every kernel, and bad input raises
ValueError with the C++ library's message. The differentiable PyTorch layer is ``linrope.torch``
(imported on its own, so that ``import linrope`` does not load PyTorch).

Threads: linrope runs its kernels on ``get_num_threads()`` threads, the machine's cores (or
OMP_NUM_THREADS) by default, whatever ``torch.set_num_threads`` says; ``import torch`` lowers the
OpenMP thread count the two libraries share, which is why the count is linrope's own.
"""
from linrope._core import (  # noqa: F401
    DenominatorStats,
    FeatureMap,
    FeatureMapConfig,
    LinearAttentionStream,
    LinearOptions,
    Rope,
    RopeConfig,
    SoftmaxOptions,
    get_num_threads,
    linear_attention,
    linear_attention_backward,
    openmp,
    set_num_threads,
    softmax_attention,
    softmax_attention_backward,
)

__all__ = [
    "FeatureMap", "LinearAttentionStream", "Rope", "get_num_threads", "linear_attention", "linear_attention_backward",
    "openmp", "set_num_threads", "softmax_attention", "softmax_attention_backward",
    # The C++ options structs; default-constructed, they hold every function's defaults.
    "DenominatorStats", "FeatureMapConfig", "LinearOptions", "RopeConfig", "SoftmaxOptions",
]
