#!/usr/bin/python3
"""linrope.torch in one page: a causal FAVOR+ attention layer with RoPE on the features, forward
and backward, for RoPE in the numerator only (RoFormer eq. 19) and in the denominator too ("full").

Run it with the package on the path (the README's commands put it there):
    /usr/bin/python3 examples/torch_layer.py
It trains nothing; it prints, for each placement, the smallest denominator the layer saw and how
many were not positive (numerator_only keeps every one positive; full can reach zero), and the
gradient norm of the query projection; it exits 1 if a numerator_only denominator was not
positive.
"""
import sys

import torch

import linrope
import linrope.torch as lt

torch.manual_seed(0)
batch, n, embed_dim, heads = 2, 512, 128, 4
x = torch.randn(batch, n, embed_dim)
nonpositive = {}

for placement in ("numerator_only", "full"):
    layer = lt.MultiheadAttention(embed_dim, heads, attention="linear", feature_map="favor+",
                                  num_features=64, placement=placement, causal=True,
                                  track_stats=True, seed=1)
    out = layer(x)          # linrope's C++ forward, on linrope.get_num_threads() threads
    out.square().mean().backward()  # linrope's C++ backward, and its matmul for the projections
    stats = layer.last_stats  # the denominators of the forward just run
    nonpositive[placement] = stats["nonpositive"]
    print(f"{placement:>14}: out {tuple(out.shape)}, smallest denominator {stats['min']:.3g}, "
          f"{stats['nonpositive']} of {stats['count']} not positive, "
          f"{stats['below_threshold']} below {stats['threshold']:g}; "
          f"|grad q_proj| {layer.q_proj.weight.grad.norm():.3g}")

# The same computation without a layer: the function on [B, H, n, d] tensors, and exact softmax
# attention with RoPE on q and k as the baseline it approximates.
q, k, v = (torch.randn(batch, heads, n, 32) * 0.5 for _ in range(3))
favor = linrope.FeatureMap("favor+", 32, num_features=256, seed=1)
approx = lt.linear_attention(q, k, v, favor, causal=True, rope=linrope.Rope(256))
exact = lt.softmax_attention(q, k, v, causal=True, rope=linrope.Rope(32))
error = (approx - exact).norm() / exact.norm()
print(f"linear (eq. 19) against softmax: relative error {error:.3f} on "
      f"{linrope.get_num_threads()} threads")
sys.exit(0 if nonpositive["numerator_only"] == 0 else 1)  # eq. 19 keeps the denominator positive
