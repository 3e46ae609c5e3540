"""linrope.torch.native: linrope.torch's functions in PyTorch ops on any device (CUDA, or the CPU
when forced), the same functions with the same arguments and results as the C++ kernels
(docs/DESIGN.md, "Any device"):

    dispatch       backend("auto" | "native"): which path a call takes (re-exported by
                   linrope.torch), and runs_native, the choice itself
    linear         linear_attention: every map, placement, causal and not, eps, no denominator,
                   decay, state in and out, lengths, denominator statistics; causal as a chunked
                   form with the stabiliser's running maximum, O(n) memory
    softmax        softmax_attention: RoPE, then scaled_dot_product_attention where it applies,
                   else a blocked softmax with its own backward, O(n) memory
    rope           rope_apply and the rotation the others use (angles in float64)
    feature_maps   feature_map_apply and the stabilised features, with the maps' own W
    checks         the argument checks, in the C++ module's words

linrope.torch.functional sends a call here when runs_native says so; nothing here calls the C++
module: a rope and a feature map are read through their attributes (frequencies(), projection).
"""
from linrope.torch.native.dispatch import backend, runs_native
from linrope.torch.native.feature_maps import feature_map_apply
from linrope.torch.native.linear import linear_attention
from linrope.torch.native.rope import rope_apply
from linrope.torch.native.softmax import softmax_attention

__all__ = ["backend", "feature_map_apply", "linear_attention", "rope_apply", "runs_native",
           "softmax_attention"]
