"""linrope: linear attention with Rotary Position Embedding, on NumPy arrays.

Arrays are float32 or float64, shaped (n, d) or (B, H, n, d) (``matmul``'s are matrices, and it
may write into ``out``; ``gelu`` takes any shape, ``rms_norm`` any with a last dimension d >= 1);
C-contiguous inputs are read in place (the attentions' also (B, H, n, d) views of C-contiguous
(B, n, H, d) arrays, their outputs then in that layout), every other output is a new array, the
GIL is released inside every kernel, and bad input raises ValueError with the C++ library's
message: NonFiniteError (a ValueError) when the input data holds NaN or inf. The differentiable
PyTorch layer is ``linrope.torch`` (imported on its own, so that ``import linrope`` does not load
PyTorch).

Threads: linrope runs its kernels on ``get_num_threads()`` threads, the machine's cores (or
OMP_NUM_THREADS) by default, whatever ``torch.set_num_threads`` says; ``import torch`` lowers the
OpenMP thread count the two libraries share, which is why the count is linrope's own.

What was built: ``__version__``, ``build_info()`` (the commit, the options, the instruction sets),
and ``python3 -m linrope``, which prints them for a bug report.
"""
import importlib.util

from linrope import _isa

# Not built here (no Eigen, say): stand-ins for linrope.torch's native path, and no NumPy
# functions (docs/DESIGN.md, "Any device").
if importlib.util.find_spec("linrope._build_info") is None:
    _build_info = None
    from linrope._pure import (DenominatorStats, FeatureMap, FeatureMapConfig,  # noqa: F401
                               LinearOptions, NonFiniteError, Rope, RopeConfig, SoftmaxOptions,
                               version)
    __version__ = version()
else:
    from linrope import _build_info
    __version__ = _build_info.version
    # Before the module is loaded: a build for instruction sets this CPU lacks stops here with one
    # line instead of an illegal instruction.
    _isa.check(_build_info.isa, _build_info.native)
    from linrope._core import (  # noqa: F401
        DenominatorStats,
        FeatureMap,
        FeatureMapConfig,
        LinearAttentionStream,
        LinearOptions,
        LinearSaved,
        NonFiniteError,
        Rope,
        RopeConfig,
        SoftmaxOptions,
        gelu,
        gelu_backward,
        get_num_threads,
        linear_attention,
        linear_attention_backward,
        matmul,
        openmp,
        release_cached_memory,
        rms_norm,
        rms_norm_backward,
        set_num_threads,
        softmax_attention,
        softmax_attention_backward,
    )


def build_info():
    """How this linrope was built and runs: a dict of the version, the commit (``git_dirty``: the
    tracked files differed from it), build type, compiler, the CMake build directory, whether
    -march=native, the instruction sets the build uses (/proc/cpuinfo names), OpenMP and the
    kernels' thread count now."""
    if _build_info is None:
        raise RuntimeError("linrope.build_info: linrope's C++ module is not built here")
    return dict(version=__version__, git_commit=_build_info.git_commit,
                git_dirty=_build_info.git_dirty, build_type=_build_info.build_type,
                compiler=_build_info.compiler, build_dir=_build_info.build_dir,
                native=_build_info.native,
                isa=list(_build_info.isa), openmp=openmp, threads=get_num_threads())


__all__ = [
    "FeatureMap", "LinearAttentionStream", "Rope", "get_num_threads", "linear_attention",
    "linear_attention_backward", "matmul", "openmp", "set_num_threads", "softmax_attention",
    "softmax_attention_backward",
    # What a forward keeps for its backward (saved= of linear_attention and its backward).
    "LinearSaved", "release_cached_memory",
    # A transformer block's pieces around attention: GELU and RMSNorm, forward and backward.
    "gelu", "gelu_backward", "rms_norm", "rms_norm_backward",
    # The C++ options structs; default-constructed, they hold every function's defaults.
    "DenominatorStats", "FeatureMapConfig", "LinearOptions", "RopeConfig", "SoftmaxOptions",
    "build_info",
    # Raised for non-finite input data; a ValueError.
    "NonFiniteError",
]
# Where the module is not built, the names it would have given are absent.
__all__ = [name for name in __all__ if name in globals()]
