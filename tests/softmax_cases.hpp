// What the softmax forward and backward tests share: inputs that float and double see alike, and
// the ropes they sweep, each paired with its independent reference twin.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <linrope/attention.hpp>
#include <linrope/rope.hpp>
#include <memory>
#include <string>

#include "reference/random.hpp"
#include "reference/softmax_reference.hpp"

namespace linrope::testing {

// Gaussian inputs rounded to float, so that the float and double runs and the reference all see
// exactly the same numbers.
inline MatrixD input(Index rows, Index cols, std::uint64_t seed, double scale = 1.0) {
  return gaussian(rows, cols, seed, scale).cast<float>().cast<double>();
}

inline double max_row_norm(const MatrixD& m) {
  return m.rows() == 0 ? 0.0 : m.rowwise().norm().maxCoeff();
}

inline double default_scale(Index d) { return d > 0 ? 1.0 / std::sqrt(double(d)) : 1.0; }

// Bound on the error of one score scale <R q_i, R k_j> computed in T (unit roundoff u): the d-term
// dot product (<= d u), the scaling of q (u), and the rotations of q and k with cos/sin rounded to
// T (<= 4u each), all relative to scale |q_i| |k_j| (Cauchy-Schwarz); plus the angle p theta
// computed in double by both sides, off by <= |p| 2^-53 rad (theta <= 1), for q and k, twice over
// (fast and reference):
//   e_s <= scale max|q_i| max|k_j| ((d + 10) u + 4 p_max 2^-53)
// max_position: the largest |position| of a rotated row (0 without a rope).
template <class T>
double score_error(const MatrixD& q, const MatrixD& k, double scale, Index max_position) {
  const double u = std::numeric_limits<T>::epsilon() / 2;
  return scale * max_row_norm(q) * max_row_norm(k) *
         ((double(q.cols()) + 10) * u + 4 * double(max_position) * 0x1.0p-53);
}

// A rope for the kernel and its independent twin for the reference.
struct RopeCase {
  const char* name;
  Index rotary_dim;  // 0 = no rope; -1 = d; otherwise the partial width
  RopeLayout layout;
};
inline constexpr RopeCase kNoRope{"none", 0, RopeLayout::Interleaved};
inline constexpr RopeCase kRopeCases[] = {{"interleaved", -1, RopeLayout::Interleaved},
                                          {"half, partial", -2, RopeLayout::Half}};

struct Ropes {
  Ropes(const RopeCase& c, Index d) {
    if (c.rotary_dim == 0) return;
    // -2: half of d, rounded down to even (d = 8 -> 4, d = 64 -> 32).
    const Index r = c.rotary_dim == -1 ? d : std::max<Index>(2, d / 2 / 2 * 2);
    rope = std::make_unique<Rope>(RopeConfig{.dim = d, .rotary_dim = r, .layout = c.layout});
    plain = reference::PlainRope{.dim = d, .rotary_dim = r, .layout = c.layout};
  }
  const Rope* fast() const { return rope.get(); }
  const reference::PlainRope* reference() const { return rope ? &plain : nullptr; }
  std::unique_ptr<Rope> rope;
  reference::PlainRope plain;
};

// A case of the position sweeps (decoding against a cache, cross attention, offsets) that the
// forward and the backward tests run: n queries from q_offset, n_k keys from k_offset.
struct PositionCase {
  Index n, n_k, q_offset, k_offset;
  bool causal;
};

// The reference's options and the kernel's for a case, with the rope of `ropes`.
inline reference::SoftmaxReferenceOptions reference_options(const PositionCase& c,
                                                            const Ropes& ropes) {
  return {.causal = c.causal,
          .rope = ropes.reference(),
          .q_offset = c.q_offset,
          .k_offset = c.k_offset};
}
inline SoftmaxOptions kernel_options(const PositionCase& c, const Ropes& ropes, Index block_size) {
  return {.causal = c.causal,
          .rope = ropes.fast(),
          .q_offset = c.q_offset,
          .k_offset = c.k_offset,
          .block_size = block_size};
}

// The large-norm cases of the forward and the backward tests: n rows of d = 16 (q and k of row
// norm ~100 and ~1000, seeds 31 and 32; v [n x d_v], seed 33), the half-width rope, causal or not,
// blocks of 0 (the default) and 7. fn(q, k, v, ropes, options) for each, with the case CAPTUREd.
inline constexpr Index kLargeNormD = 16;
template <class Fn>
void for_each_large_norm_case(Index n, Index d_v, Fn&& fn) {
  const Index d = kLargeNormD;
  for (const double norm : {100.0, 1000.0}) {
    const double sigma = norm / std::sqrt(double(d));
    const MatrixD q = input(n, d, 31, sigma), k = input(n, d, 32, sigma), v = input(n, d_v, 33);
    const Ropes ropes(kRopeCases[1], d);
    for (const bool causal : {false, true})
      for (const Index block_size : {0, 7}) {
        CAPTURE(norm);
        CAPTURE(causal);
        CAPTURE(block_size);
        const SoftmaxOptions options{
            .causal = causal, .rope = ropes.fast(), .block_size = block_size};
        fn(q, k, v, ropes, options);
      }
  }
}

// One line naming a case, its rope and its block size, to CAPTURE.
inline std::string describe(const PositionCase& c, const RopeCase& rope, Index block_size) {
  return "n " + std::to_string(c.n) + ", n_k " + std::to_string(c.n_k) + ", q_offset " +
         std::to_string(c.q_offset) + ", k_offset " + std::to_string(c.k_offset) +
         (c.causal ? ", causal" : ", not causal") + ", rope " + rope.name + ", block_size " +
         std::to_string(block_size);
}

}  // namespace linrope::testing
