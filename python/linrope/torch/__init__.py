"""linrope.torch: linrope's kernels as differentiable PyTorch functions and layers (CPU tensors;
tensors on other devices, or under backend("native"), run on native/, docs/DESIGN.md "Any device").

As torch.nn.functional beside torch.nn, the package holds apart

    functional   the autograd functions over the C++ forward and backward: softmax_attention,
                 linear_attention, rope_apply, feature_map_apply, linear (F.linear on linrope's
                 matmul), gelu, rms_norm; head_decays (a decay= setting as one float per head)
    states       LinearState (causal linear attention's state) and merge_states
    layers       the torch.nn.Module layers: RotaryEmbedding, MultiheadAttention (and its
                 KeyValueCache, ShortConvCache), HeadRMSNorm, RedrawSchedule, Linear, GELU,
                 RMSNorm
    convolution  ShortConvolution, the causal depthwise convolution MultiheadAttention(short_conv=k)
                 puts on q, k and v
    distributed  causal linear attention over a sequence split across processes, the halo of a
                 short convolution, and the recovery of a failed backward (record_exchanges)
    launch       a group of local processes for torch.distributed (tests, benchmarks)

and re-exports here the names of the first four; the last two are used by their own names
(`import linrope.torch.distributed`).
"""
from linrope.torch.convolution import ShortConvolution
from linrope.torch.functional import (feature_map_apply, gelu, head_decays, linear,
                                      linear_attention, rms_norm, rope_apply, softmax_attention)
from linrope.torch.native.dispatch import backend
from linrope.torch.layers import (GELU, HeadRMSNorm, KeyValueCache, Linear, MultiheadAttention,
                                  RedrawSchedule, RMSNorm, RotaryEmbedding, ShortConvCache)
from linrope.torch.states import LinearState, merge_states

__all__ = [
    "softmax_attention", "linear_attention", "LinearState", "merge_states", "rope_apply",
    "feature_map_apply", "head_decays", "linear", "gelu", "rms_norm",
    "RotaryEmbedding", "MultiheadAttention", "KeyValueCache", "HeadRMSNorm", "RedrawSchedule",
    "Linear", "GELU", "RMSNorm", "ShortConvolution", "ShortConvCache", "backend",
]
