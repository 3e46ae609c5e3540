// Private: the per-head linear attention kernels, on raw row-major buffers whose arguments are
// already checked. Shared by the single-head calls, the multi-head [B,H,n,d] calls and the stream.
//
//   q [n x d], k [n_k x d], v [n_k x d_v] -> out [n x d_v]
//
// Stabilisation. Features come from FeatureMap::apply_stabilized: phi_i = exp(a_i) phi~_i and
// psi_j = exp(c_j) psi~_j with the largest |feature| of each row ~1. For query i let M_i be the
// largest c_j over the keys it may see (a prefix maximum when causal, so it never looks at a later
// key). Then
//   num_i = exp(a_i + M_i) sum_j <phi~_i, psi~_j> exp(c_j - M_i) v_j      (all weights <= 1;
//                                                                         e^H with a decay)
//   den_i = exp(a_i + M_i) den~_i
//   o_i   = num~_i / (den~_i + eps exp(-(a_i + M_i)))                     (eps undone exactly)
// The state (S, z) is kept at the scale exp(M) of the largest key absorbed so far and rescaled when
// a larger one arrives, as the online softmax does with its running maximum.
//
// Decay (LinearOptions::decay = g = exp(l), l <= 0). g^(p_i - p_j) exp(a_i) exp(c_j) =
// exp(a_i + l (p_i - o)) exp(c_j - l (p_j - o)) for any origin o: a query's log scale takes
// + l (p_i - o), a key's - l (p_j - o) (FeatureBlock), and every form above computes the decayed
// function, and its exact gradient, unchanged (the shifts are constants, as the stabiliser's are).
// The keys' shifted scales grow by |l| a position, so the state is rescaled lazily: only when a
// key's scale passes M by more than a headroom H, to exactly that scale (LinearSetup::headroom).
// The state a call starts from and leaves is converted at its boundaries (store_state).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <linrope/attention.hpp>
#include <vector>

#include "common/check.hpp"
#include "common/nonfinite.hpp"
#include "common/parallel.hpp"

namespace linrope::detail {

template <class T>
using ConstRowMap = Eigen::Map<const Matrix<T>>;
template <class T>
using RowMap = Eigen::Map<Matrix<T>>;

template <class T>
class KeptFeatures;  // linear_blocks.hpp

// Running state of causal linear attention: everything the keys absorbed so far contribute.
template <class T>
struct LinearState {
  Matrix<T> S;  // [m x d_v]: sum_j exp(c_j - M) (R_j psi~_j) v_j^T (numerator features)
  Vector<T> z;  // [m]:       sum_j exp(c_j - M) psi~_j             (denominator features)
  double M = -std::numeric_limits<double>::infinity();  // log scale of S and z; -inf: empty
  // The largest c_j absorbed (or a loaded state's M): M <= peak <= M + headroom (LinearSetup).
  double peak = -std::numeric_limits<double>::infinity();
  void reset(Index m, Index d_v) {
    S.setZero(m, d_v);
    z.setZero(m);
    M = peak = -std::numeric_limits<double>::infinity();
  }
};

// Rescales the state to log scale new_max when it passes M by more than `headroom` (0: whenever
// it is larger), and records it in peak.
template <class T>
void raise_scale(LinearState<T>& state, double new_max, double headroom) {
  state.peak = std::max(state.peak, new_max);
  if (new_max <= state.M + headroom) return;
  if (state.M != -std::numeric_limits<double>::infinity()) {
    const T factor = T(std::exp(state.M - new_max));
    state.S *= factor;
    state.z *= factor;
  }
  state.M = new_max;
}

// The state seen `steps` positions later, with a decay of log l: its frame's origin moves (the
// header), S and z stay, and the log scales take l * steps.
template <class T>
void move_frame(LinearState<T>& state, double log_decay, Index steps) {
  if (log_decay == 0) return;
  state.M += log_decay * double(steps);
  state.peak += log_decay * double(steps);
}

// The decay of head h (LinearOptions::decay and head_decays; checked by check_linear_setup).
inline double decay_of(const LinearOptions& options, Index head) {
  return options.head_decays.empty() ? options.decay : options.head_decays[std::size_t(head)];
}

// The headroom H of the lazy rescaling with a decay: a state's weights exp(c_j - M) stay within
// e^H = 2^16. That leaves float's sums 2^112 of its 2^128 range for the features' and values'
// own sizes (and the backward's keys, which read its query state times exp(c_j - K), as much),
// while a state is rescaled only every H / |log g| positions: 364 at g = 0.97, 16 at g = 0.5.
// With H = 0 it is rescaled at every position, and each rescale breaks the scan's grouped steps
// (scan_strips.hpp): eq. 19, g = 0.97, n = 4096, 8 heads, one thread, elu+1 took 1.84x the time
// of H = ln 2^16 forward and 1.99x backward, FAVOR+ 1.02x and 1.11x. A larger H would save little
// more and give the sums less room.
inline constexpr double kDecayHeadroom = 16 * 0.6931471805599453;  // ln 2^16

// Accumulates DenominatorStats from den~_i and its log scale a_i + M_i.
class DenominatorTally {
 public:
  explicit DenominatorTally(double threshold);
  // A row that attends to keys; zero_divisor: its output was written as zeros (den~ + eps was 0
  // or not finite).
  void add(double den_stabilized, double log_scale, bool zero_divisor);
  void add_no_keys() { ++count_, ++no_keys_; }  // a row that attends to no key
  void add_without_denominator() { ++count_; }  // a row of a call without a denominator
  DenominatorTally empty() const { return DenominatorTally(threshold_); }
  void merge(const DenominatorTally& other);
  void merge_into(DenominatorStats& stats) const;  // accumulate (min, counts)
  void store(DenominatorStats& stats) const;       // replace everything but stats.threshold

 private:
  double threshold_, log_threshold_;
  double min_ = std::numeric_limits<double>::infinity();
  Index nonpositive_ = 0, below_ = 0, count_ = 0, no_keys_ = 0, zero_divisor_ = 0;
};

// What a RopePlacement asks of the kernels, decided once when the setup is made: the kernels read
// these fields, never the enum.
//   None:          num = den = phi(x)
//   BeforeMap:     num = den = phi(R_p x)                 (rotate_input)
//   NumeratorOnly: num = R_p phi(x), den = phi(x)         (rotate_features, separate_denominator)
//   Full:          num = den = R_p phi(x)                 (rotate_features)
// Without a denominator (options.denominator false) nothing reads the denominator side, so it is
// never made separate (and Full, which then equals NumeratorOnly, is refused by the checks).
struct PlacementPlan {
  bool rotate_input = false;          // the map reads R_p x (BeforeMap)
  bool rotate_features = false;       // the numerator side is R_p phi(x)
  bool separate_denominator = false;  // the denominator side is other rows: the unrotated phi(x)
};
PlacementPlan plan_placement(const LinearOptions& options);

// Everything a head needs besides its buffers. Options must already be checked
// (check_linear_setup).
struct LinearSetup {
  LinearSetup(const FeatureMap& feature_map, const LinearOptions& linear_options, Index d_in,
              Index d_v, NonFiniteFlag* flag = nullptr)
      : map(&feature_map),
        options(linear_options),
        plan(plan_placement(linear_options)),
        d(d_in),
        d_v(d_v),
        m(feature_map.output_dim()),
        origin(linear_options.k_offset - 1),
        nonfinite(flag) {
    use_decay(decay_of(linear_options, 0));
  }

  // The decay g of the head this setup runs: log_decay = log g (0: none) and the headroom of the
  // lazy rescaling it needs (kDecayHeadroom; 0 without a decay: the exact running maximum, so
  // that g = 1 runs exactly the code without a decay).
  void use_decay(double decay) {
    log_decay = decay == 1 ? 0.0 : std::log(decay);
    headroom = log_decay == 0 ? 0.0 : kDecayHeadroom;
  }

  const FeatureMap* map;
  LinearOptions options;
  PlacementPlan plan;
  Index d, d_v, m;
  double log_decay = 0, headroom = 0;
  // The origin o of the decay's shifts (the header): the position of the state the call starts
  // from, k_offset - 1, so that its log scale needs no conversion and the shifts are the size of
  // the call, whatever its positions (|l| (p - o) in double errs by |l| (p - o) 2^-53).
  Index origin;
  // If set, the kernels check every row of q, k and v (and a backward's d_out) that is within the
  // lengths n and n_k (whether or not it is attended to) and raise the flag on a non-finite value;
  // they still finish (with unspecified outputs). If null, the inputs must already be known to be
  // finite. The policy: common/nonfinite.hpp.
  NonFiniteFlag* nonfinite = nullptr;
};

// Causal: query i sees key j iff j <= i + q_offset - k_offset. Its own key, the last it sees, and
// so the number of keys before it: causal_first_key(i) (clamped to [0, n_k]).
inline Index causal_first_key(Index query, Index q_offset, Index k_offset, Index n_k) {
  return std::clamp(query + q_offset - k_offset, Index(0), n_k);
}
// The keys a causal forward of n queries reads: [0, horizon) (none without queries).
inline Index causal_horizon(Index n, Index n_k, Index q_offset, Index k_offset) {
  return n > 0 ? causal_first_key(n, q_offset, k_offset, n_k) : 0;
}

// One head's rows: q [n x d], k [n_k x d], v [n_k x d_v] -> out [n x d_v], row-major and
// contiguous; row i of q at position q_offset + i, row j of k and v at k_offset + j.
template <class T>
struct LinearHead {
  const T* q;
  const T* k;
  const T* v;
  T* out;
  Index n, n_k;
  Index q_offset, k_offset;
  // When set, the forward stores every query's (key's) features it computes here, at the row of
  // its position (a LinearSaved's slice: saved.hpp).
  KeptFeatures<T>* keep_queries = nullptr;
  KeptFeatures<T>* keep_keys = nullptr;
};

// Non-causal: every query sees every key.
// `threading`: Threads::Parallel spreads the work over the OpenMP threads (Serial when already
// inside a parallel region, e.g. one head per thread); the result is the same bits either way.
// Never throws but std::bad_alloc.
template <class T>
void linear_noncausal(const LinearHead<T>& head, const LinearSetup& setup, DenominatorTally* tally,
                      Threads threading);

// What a causal call leaves in its `state`: every key (the stream, which goes on from it), or only
// some of them, for the caller to discard.
enum class FinalState { Discarded, EveryKey };

// Causal, chunked or scan by setup.options.method: query i sees key j iff
// k_offset + j <= q_offset + i, plus everything already in `state`.
// Threads::Parallel: a long call is split into one segment of queries per thread, for either
// method (its last bits then depend on the thread count; see attention.hpp, "Reproducibility").
template <class T>
void linear_causal(const LinearHead<T>& head, const LinearSetup& setup, LinearState<T>& state,
                   FinalState final_state, DenominatorTally* tally, Threads threading);

// Argument checks shared by every linear entry point (throws std::invalid_argument); `heads`: H
// for the batched calls (head_decays' size), 1 for the others.
void check_linear_setup(std::string_view fn, const FeatureMap& map, const LinearOptions& options,
                        Index d, Index heads);

// The state in row-major buffers S [m x d_v] and z [m] at log_scale, as the public
// LinearAttentionState and HeadStates hold it; null S, or log_scale -inf: the empty state. The
// public state sits at k_offset - 1 = setup.origin, so the log scale is taken as it is.
template <class T>
LinearState<T> load_state(const T* S, const T* z, double log_scale, Index m, Index d_v) {
  LinearState<T> state;
  state.reset(m, d_v);
  if (S == nullptr || log_scale == -std::numeric_limits<double>::infinity()) return state;
  state.S = Eigen::Map<const Matrix<T>>(S, m, d_v);
  state.z = Eigen::Map<const Vector<T>>(z, m);
  state.M = state.peak = log_scale;
  return state;
}

// The state after a call of n_k keys, as the public state holds it (attention.hpp, "State in,
// state out"): at its peak, the largest scale of a key it holds, which the backward finds again
// from the keys alone (M may lag behind it by the headroom), then with a decay moved to the
// position of the call's last key, k_offset + n_k - 1 = origin + n_k. Changes `state`.
template <class T>
void store_state(LinearState<T>& state, const LinearSetup& setup, Index n_k, T* S, T* z,
                 double* log_scale) {
  raise_scale(state, state.peak, 0.0);
  move_frame(state, setup.log_decay, n_k);
  Eigen::Map<Matrix<T>>(S, state.S.rows(), state.S.cols()) = state.S;
  Eigen::Map<Vector<T>>(z, state.z.size()) = state.z;
  *log_scale = state.M;
}

}  // namespace linrope::detail
