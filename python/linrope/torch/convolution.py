"""linrope.torch.convolution: the short convolution of linear transformers (Zoology, Based,
flash-linear-attention's ShortConvolution), a torch.nn.Module in plain PyTorch (any device).

    ShortConvolution(channels, kernel_size, bias=False, activation="silu")

MultiheadAttention(short_conv=k) puts one on each of the projected q, k and v.
"""
import math

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["ShortConvolution"]

_ACTIVATIONS = ("silu", None)


class ShortConvolution(nn.Module):
    """A causal depthwise convolution of width k = kernel_size over time, then SiLU:

        y[b, t, c] = silu(sum_{s=0}^{k-1} weight[c, 0, s] x[b, t - (k - 1) + s, c]  (+ bias[c]))

    on x [B, n, channels] -> [B, n, channels]. Each channel has its own k taps (weight
    [channels, 1, k], torch.nn.Conv1d's layout with groups=channels: the last tap on the token
    itself). Causal: output t reads inputs t - k + 1 .. t only, so right padding never reaches a
    real token. Rows before x are `past` (forward(x, past)): the k - 1 inputs before x's first,
    zeros when None (the sequence starts at x). past_after(x, past) gives the `past` of the call
    after x, so a sequence fed in blocks gives the outputs of one call on the whole.

    As flash-linear-attention's ShortConvolution: no bias by default, and Conv1d's
    initialisation, weight (and bias) uniform in +-1/sqrt(k) (k the fan-in of a depthwise
    channel). activation None leaves out the SiLU.
    """

    def __init__(self, channels, kernel_size, bias=False, activation="silu", *, device=None,
                 dtype=None):
        super().__init__()
        for name, value, least in (("channels", channels, 1), ("kernel_size", kernel_size, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"ShortConvolution: {name} is {value!r} but expected an int "
                                 f">= {least}")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"ShortConvolution: activation is {activation!r} but expected "
                             f"'silu' or None")
        self.channels, self.kernel_size, self.activation = channels, kernel_size, activation
        factory = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size, **factory))
        self.bias = nn.Parameter(torch.empty(channels, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self):
        bound = 1 / math.sqrt(self.kernel_size)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def _with_past(self, x, past):
        """[B, k - 1 + n, channels]: past (or zeros) followed by x."""
        if x.dim() != 3 or x.shape[2] != self.channels:
            raise ValueError(f"ShortConvolution: x is {tuple(x.shape)} but expected [B, n, "
                             f"channels = {self.channels}]")
        rows = self.kernel_size - 1
        if past is None:
            past = x.new_zeros(x.shape[0], rows, self.channels)
        elif tuple(past.shape) != (x.shape[0], rows, self.channels):
            raise ValueError(f"ShortConvolution: past is {tuple(past.shape)} but expected "
                             f"[B = {x.shape[0]}, kernel_size - 1 = {rows}, channels = "
                             f"{self.channels}]")
        return torch.cat([past, x], 1)

    def forward(self, x, past=None):
        """x [B, n, channels] (and past [B, k - 1, channels], the inputs before x) -> [B, n,
        channels]."""
        rows = self._with_past(x, past)
        if x.shape[1] == 0:  # conv1d refuses an input shorter than its kernel
            return x.clone()
        y = F.conv1d(rows.transpose(1, 2), self.weight, self.bias,
                     groups=self.channels).transpose(1, 2)
        return F.silu(y) if self.activation == "silu" else y

    def past_after(self, x, past=None):
        """The last k - 1 inputs up to x's last, [B, k - 1, channels] (from past, or zeros, where
        x is shorter): the past of the call that continues after x."""
        return self._with_past(x, past)[:, x.shape[1]:]

    def extra_repr(self):
        return (f"channels={self.channels}, kernel_size={self.kernel_size}, "
                f"bias={self.bias is not None}, activation={self.activation!r}")
