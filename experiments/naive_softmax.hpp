// Softmax attention the textbook way, with an explicit n x n score matrix per head: the baseline
// whose O(n^2) memory the scaling experiment measures (the library never builds that matrix).
#pragma once

#include <linrope/batched.hpp>
#include <linrope/rope.hpp>

namespace linrope::experiments {

// q [B,H,n,d], k [B,H,n,d], v [B,H,n,d_v] -> out [B,H,n,d_v], heads one after the other so that one
// n x n float matrix is alive at a time (4 n^2 bytes; 256 MiB at n = 8192). RoPE (width d) on q and
// k when `rope` is given; scale 1/sqrt(d); causal masks keys after the query. Shapes are trusted.
void naive_softmax_attention(Heads<const float> q, Heads<const float> k, Heads<const float> v,
                             Heads<float> out, bool causal, const Rope* rope);

}  // namespace linrope::experiments
