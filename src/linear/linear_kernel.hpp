// Private: the per-head linear attention kernels, on raw row-major buffers whose arguments are
// already checked. Shared by the single-head calls, the multi-head [B,H,n,d] calls and the stream.
//
//   q [n x d], k [n_k x d], v [n_k x d_v] -> out [n x d_v]
//
// Stabilisation. Features come from FeatureMap::apply_stabilized: phi_i = exp(a_i) phi~_i and
// psi_j = exp(c_j) psi~_j with the largest |feature| of each row ~1. For query i let M_i be the
// largest c_j over the keys it may see (a prefix maximum when causal, so it never looks at a later
// key). Then
//   num_i = exp(a_i + M_i) sum_j <phi~_i, psi~_j> exp(c_j - M_i) v_j      (all weights <= 1)
//   den_i = exp(a_i + M_i) den~_i
//   o_i   = num~_i / (den~_i + eps exp(-(a_i + M_i)))                     (eps undone exactly)
// The state (S, z) is kept at the scale exp(M) of the largest key absorbed so far and rescaled when
// a larger one arrives, as the online softmax does with its running maximum.
#pragma once

#include <atomic>
#include <limits>
#include <linrope/attention.hpp>
#include <vector>

#include "common/check.hpp"

namespace linrope::detail {

template <class T>
using ConstRowMap = Eigen::Map<const Matrix<T>>;
template <class T>
using RowMap = Eigen::Map<Matrix<T>>;

// Running state of causal linear attention: everything the keys absorbed so far contribute.
template <class T>
struct LinearState {
  Matrix<T> S;  // [m x d_v]: sum_j exp(c_j - M) (R_j psi~_j) v_j^T (numerator features)
  Vector<T> z;  // [m]:       sum_j exp(c_j - M) psi~_j             (denominator features)
  double M = -std::numeric_limits<double>::infinity();  // log scale of S and z; -inf: empty
  void reset(Index m, Index dv) {
    S.setZero(m, dv);
    z.setZero(m);
    M = -std::numeric_limits<double>::infinity();
  }
};

// Accumulates DenominatorStats from den~_i and its log scale a_i + M_i.
class DenominatorTally {
 public:
  explicit DenominatorTally(double threshold);
  void add(double den_stabilized, double log_scale);
  DenominatorTally empty() const { return DenominatorTally(threshold_); }
  void merge(const DenominatorTally& other);
  void merge_into(DenominatorStats& stats) const;  // accumulate (min, counts)
  void store(DenominatorStats& stats) const;       // replace everything but stats.threshold

 private:
  double threshold_, log_threshold_;
  double min_ = std::numeric_limits<double>::infinity();
  Index nonpositive_ = 0, below_ = 0, count_ = 0;
};

// Raised by a kernel that read a non-finite value. The kernels check each block of q, k and v (and
// a backward's d_out) as they read it, while it is in cache: scanning the inputs first would be one
// more pass over memory (14% of elu+1's time at n = 16384, where the kernel is memory-bound; 8% of
// its causal backward's). The caller then finds the
// value with require_finite and throws. Atomic: the threads of one head may raise it together.
class NonFiniteFlag {
 public:
  template <class T>
  void check(const T* x, Index rows, Index cols) {
    if (!all_finite(ConstRowMap<T>(x, rows, cols))) raised_.store(true, std::memory_order_relaxed);
  }
  bool raised() const { return raised_.load(std::memory_order_relaxed); }

 private:
  std::atomic<bool> raised_{false};
};

// Everything a head needs besides its buffers.
struct LinearSetup {
  const FeatureMap* map;
  LinearOptions options;
  Index d, dv, m;
  // If set, the kernels check every row of q, k and v (and a backward's d_out) that is within the
  // lengths n and n_k (whether or not it is attended to) and raise the flag on a non-finite value;
  // they still finish (with unspecified outputs). If null, the inputs must already be known to be
  // finite.
  NonFiniteFlag* nonfinite = nullptr;
};

// One head's rows: q [n x d], k [nk x d], v [nk x dv] -> out [n x dv], row-major and contiguous;
// row i of q at position q_pos0 + i, row j of k and v at k_pos0 + j.
template <class T>
struct LinearHead {
  const T* q;
  const T* k;
  const T* v;
  T* out;
  Index n, nk;
  Index q_pos0, k_pos0;
};

// Non-causal: every query sees every key.
// `parallel`: spread the work over the OpenMP threads (pass false when already inside a parallel
// region, e.g. one head per thread); the result is the same bits either way. Never throws but
// std::bad_alloc.
template <class T>
void linear_noncausal(const LinearHead<T>& head, const LinearSetup& setup, DenominatorTally* tally,
                      bool parallel);

// Causal, chunked or scan by setup.options.method: query i sees key j iff
// k_pos0 + j <= q_pos0 + i, plus everything already in `state`. If absorb_all, every key ends up in
// `state` (the stream); otherwise `state` ends up holding only some of the keys, and is for the
// caller to discard.
// `parallel`: a long call is split into one segment of queries per thread, for either method (its
// last bits then depend on the thread count; see attention.hpp, "Reproducibility").
template <class T>
void linear_causal(const LinearHead<T>& head, const LinearSetup& setup, LinearState<T>& state,
                   bool absorb_all, DenominatorTally* tally, bool parallel);

// Argument checks shared by every linear entry point (throws std::invalid_argument).
void check_linear_setup(std::string_view fn, const FeatureMap& map, const LinearOptions& options,
                        Index d);

}  // namespace linrope::detail
