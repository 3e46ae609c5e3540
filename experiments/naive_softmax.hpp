// Softmax attention the textbook way, with an explicit n x n score matrix per head: the baseline
// whose O(n^2) memory the scaling experiment measures (the library never builds that matrix).
#pragma once

#include <linrope/batched.hpp>
#include <linrope/rope.hpp>

namespace linrope::experiments {

// q [B,H,n,d], k [B,H,n,d], v [B,H,n,d_v] -> out [B,H,n,d_v]. RoPE (width d) on q and k when
// `rope` is given; scale 1/sqrt(d); causal masks keys after the query. Shapes are trusted.
// Parallel over heads, one head per thread at a time, each with its own n x n float matrix:
// 4 n^2 bytes per thread (256 MiB at n = 8192). One parallel region per call: on a loaded machine
// finer-grained parallelism (Eigen's threaded GEMM, a parallel loop per head) waited on
// descheduled threads and ran 20-50x slower than one thread (measured at n = 512, load 5 on 2
// cores).
void naive_softmax_attention(Heads<const float> q, Heads<const float> k, Heads<const float> v,
                             Heads<float> out, bool causal, const Rope* rope);

}  // namespace linrope::experiments
