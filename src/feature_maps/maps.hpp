// Private: the two families of feature maps behind make_feature_map, and what they share.
#pragma once

#include <cstdint>
#include <linrope/feature_maps.hpp>
#include <memory>

namespace linrope::detail {

// Rows per block of the fused kernel: a float block of 128 x 256 features is 128 KiB, so the GEMM
// writes it and the element-wise pass reads it back while it is still in L2. Blocks are the unit of
// OpenMP work; a call with a single block (e.g. one chunk of an attention kernel) never starts a
// team.
inline constexpr Index kBlockRows = 128;

// sum_j a[j] b[j] in double. Eight independent accumulators let the compiler vectorise the loop (a
// single running sum is a serial chain it may not reorder); the order of the sum is fixed, so the
// result does not depend on where a and b sit (an Eigen reduction would peel to the first
// aligned element first).
template <class T>
double dot_of(const T* a, const T* b, Index d) {
  double acc[8] = {};
  Index j = 0;
  for (; j + 8 <= d; j += 8)
    for (int k = 0; k < 8; ++k) acc[k] += double(a[j + k]) * double(b[j + k]);
  for (; j < d; ++j) acc[0] += double(a[j]) * double(b[j]);
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}
template <class T>
double sum_of_squares(const T* p, Index d) {
  return dot_of(p, p, d);
}

// elu+1, relu and 1+cos: element-wise (1+cos per row), no parameters.
std::unique_ptr<FeatureMap> make_elementwise_map(const FeatureMapConfig& config);
// The maps whose features come from a random projection W: only they depend on num_features,
// orthogonal, regularized and the seed.
inline bool is_favor(FeatureMapKind kind) {
  return kind == FeatureMapKind::FavorPositive || kind == FeatureMapKind::FavorTrig ||
         kind == FeatureMapKind::FavorHyperbolic;
}
// favor+, favor-trig and favor-hyp: a seeded random projection W, then exponentials or sin/cos.
std::unique_ptr<FeatureMap> make_favor_map(const FeatureMapConfig& config);

// W is drawn from linrope::Random (linrope/random.hpp): platform-independent Gaussians.

// W [f x d], in the order the stream is consumed:
//   iid:        W(i, j) for i = 0..f-1, j = 0..d-1 (row by row).
//   orthogonal: per block of d rows: a Gaussian G [d x d] row by row; Q R = G (Householder, in
//               double); Q <- Q diag(sign R_ii), the unique factor with R_ii > 0, Haar-distributed
//               (Mezzadri 2007: without the fold Eigen's Householder makes Q(0,0) < 0 always);
//               then, for each row r of the block that is kept (the last block is cut at f), the
//               row r of Q times the norm of d fresh Gaussians, or times sqrt(d) when regularized
//               (which consumes nothing).
MatrixD draw_projection(Index d, Index f, bool orthogonal, bool regularized, std::uint64_t seed);

}  // namespace linrope::detail
