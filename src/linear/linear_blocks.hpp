// Private: the pieces every linear-attention form is built from: the stabilised feature rows of a
// block of tokens (FeatureBlock), the state updates (absorb, merge, rescale) and the output row.
// The algebra is in linear_kernel.hpp.
#pragma once

#include <algorithm>
#include <cassert>
#include <cmath>
#include <vector>

#include "common/gemm.hpp"
#include "common/parallel.hpp"
#include "common/scratch.hpp"
#include "feature_maps/feature_map_access.hpp"
#include "linear/linear_kernel.hpp"
#include "rope/rope_access.hpp"

namespace linrope::detail {

inline constexpr double kEmpty = -std::numeric_limits<double>::infinity();

// x, a [rows x cols] block of q, k or v: raises setup.nonfinite if it holds a non-finite value
// (when the caller asked for checks; the policy: common/nonfinite.hpp).
template <class T>
void check_input(const LinearSetup& setup, const T* x, Index rows, Index cols) {
  if (setup.nonfinite) setup.nonfinite->check(ConstRowMap<T>(x, rows, cols));
}

// Some rows of stabilised features (a FeatureBlock's, or a part of them), in the form the
// placement needs:
//   num(): features on the numerator side (rotated by R_i for NumeratorOnly and Full),
//   den(): features on the denominator side (unrotated for NumeratorOnly; the same rows otherwise),
//   log_scale(i) = a_i (or c_j for keys): phi = exp(log_scale) * features;
// and, for the backward, plain(): the map's own output before any rotation (kept for Full only
// when asked, Plain::Kept).
template <class T>
class FeatureRows {
 public:
  FeatureRows(const LinearSetup& setup, const T* num, const T* den, const T* plain,
              const double* log_scale, Index rows)
      : setup_(&setup), num_(num), den_(den), plain_(plain), log_scale_(log_scale), rows_(rows) {}

  const LinearSetup& setup() const { return *setup_; }
  Index rows() const { return rows_; }
  ConstRowMap<T> num() const { return ConstRowMap<T>(num_, rows_, setup_->m); }
  ConstRowMap<T> den() const { return ConstRowMap<T>(den_, rows_, setup_->m); }
  ConstRowMap<T> plain() const { return ConstRowMap<T>(plain_, rows_, setup_->m); }
  double log_scale(Index i) const { return log_scale_[i]; }
  double max_log_scale() const {
    return rows_ ? *std::max_element(log_scale_, log_scale_ + rows_) : kEmpty;
  }

 private:
  const LinearSetup* setup_;
  const T *num_, *den_, *plain_;
  const double* log_scale_;
  Index rows_;
};

// Whether a FeatureBlock keeps the map's own output beside its rotation where the forward would not
// need it (Full): the backward's map gradient reads it.
enum class Plain { Dropped, Kept };

// Which side of the products a FeatureBlock's rows stand on. With a decay (LinearSetup), a query's
// log scale takes + log_decay (p - origin) and a key's - log_decay (p - origin), so that
// exp(a_i + c_j) carries g^(p_i - p_j) (linear_kernel.hpp).
enum class Role { Queries, Keys };

// The map's own rows of x [rows x d] at positions offset.. into plain [rows x m] and their log
// scales, shifted by the decay (Role): phi(x) for every placement but BeforeMap, phi(R_p x) there
// (rotated: scratch of rows x d for R_p x). No rotation of the features themselves.
template <class T>
void map_plain(const LinearSetup& setup, Role role, const T* x, Index rows, Index offset, T* plain,
               double* log_scale, T* rotated) {
  check_input(setup, x, rows, setup.d);
  const Index m = setup.m, d = setup.d;
  const auto map_rows = [&](const auto& from) {
    FeatureMapAccess::stabilized<T>(*setup.map, from, RowMap<T>(plain, rows, m), log_scale);
  };
  if (setup.plan.rotate_input) {
    RopeAccess::rotate_rows<T>(*setup.options.rope, x, rotated, rows, d, offset, Turn::Apply);
    map_rows(ConstRowMap<T>(rotated, rows, d));
  } else {
    map_rows(ConstRowMap<T>(x, rows, d));
  }
  if (setup.log_decay != 0) {
    const double slope = role == Role::Queries ? setup.log_decay : -setup.log_decay;
    for (Index r = 0; r < rows; ++r) log_scale[r] += slope * double(offset + r - setup.origin);
  }
}

template <class T>
class KeptFeatures;

// The stabilised features (FeatureRows) of up to `capacity` tokens, computed here. Its memory is
// per-thread scratch (scratch.hpp: no allocation after a thread's first call). With keep_into,
// every row it computes is also stored, plain, in a KeptFeatures (a forward keeping its features
// for the backward: saved.hpp).
template <class T>
class FeatureBlock {
 public:
  FeatureBlock(const LinearSetup& setup, Role role, Index capacity, Plain plain = Plain::Dropped)
      : setup_(setup),
        role_(role),
        capacity_(capacity),
        separate_plain_(setup.plan.rotate_features &&
                        (setup.plan.separate_denominator || plain == Plain::Kept)),
        features_(capacity *
                  ((separate_plain_ ? 2 : 1) * setup.m + (setup.plan.rotate_input ? setup.d : 0))),
        log_scale_(capacity) {}

  // Features of rows x [rows x d] at positions offset, offset + 1, ...; they
  // become rows [0, rows).
  void compute(const T* x, Index rows, Index offset) {
    compute_at(0, x, rows, offset);
    rows_ = rows;
  }
  // The same into rows [at, at + rows), leaving rows() as it is (see fill()).
  void compute_at(Index at, const T* x, Index rows, Index offset) {
    const Index m = setup_.m;
    T* num = num_data() + at * m;
    const bool rotates = setup_.plan.rotate_features;
    // den (or the backward): the features; num: their rotation
    T* plain = rotates && separate_plain_ ? plain_data() + at * m : num;
    map_plain(setup_, role_, x, rows, offset, plain, log_scale_.data() + at,
              rotated_input_data() + at * setup_.d);
    if (sink_) sink_->store(offset, plain, log_scale_.data() + at, rows);
    if (rotates && plain != num)
      RopeAccess::rotate_rows<T>(*setup_.options.rope, plain, num, rows, m, offset, Turn::Apply);
    else if (rotates)
      RopeAccess::rotate_rows(*setup_.options.rope, num, rows, m, offset, Turn::Apply);
  }
  // Declares rows [0, rows) computed (by compute_at, possibly on several threads).
  void fill(Index rows) { rows_ = rows; }
  // From now on, also store every computed row in `sink` (null: stop), at its position's row.
  void keep_into(KeptFeatures<T>* sink) { sink_ = sink; }

  const LinearSetup& setup() const { return setup_; }
  Index capacity() const { return capacity_; }
  Index rows() const { return rows_; }
  ConstRowMap<T> num() const { return ConstRowMap<T>(num_data(), rows_, setup_.m); }
  ConstRowMap<T> den() const { return ConstRowMap<T>(den_data(), rows_, setup_.m); }
  double log_scale(Index i) const { return log_scale_.data()[i]; }
  double max_log_scale() const { return range(0, rows_).max_log_scale(); }
  // Rows [first, first + rows).
  FeatureRows<T> range(Index first, Index rows) const {
    const Index m = setup_.m;
    return FeatureRows<T>(setup_, num_data() + first * m, den_data() + first * m,
                          plain_data() + first * m, log_scale_.data() + first, rows);
  }
  FeatureRows<T> all() const { return range(0, rows_); }

 private:
  // [num | plain (NumeratorOnly; Full for the backward) | rotated input (BeforeMap, the map's
  // input)], each capacity rows.
  T* num_data() const { return features_.data(); }
  T* plain_data() const {
    return separate_plain_ ? features_.data() + capacity_ * setup_.m : features_.data();
  }
  T* den_data() const { return setup_.plan.separate_denominator ? plain_data() : num_data(); }
  T* rotated_input_data() const {
    return features_.data() + capacity_ * setup_.m * (separate_plain_ ? 2 : 1);
  }

  const LinearSetup& setup_;
  Role role_;
  Index capacity_;
  bool separate_plain_;
  Scratch<T> features_;
  Scratch<double> log_scale_;
  Index rows_ = 0;
  KeptFeatures<T>* sink_ = nullptr;
};

// A whole sequence's features, kept between the passes of a backward, in the form the map gives
// them: each row's plain features (phi~(x), of R_p x for BeforeMap) and log scale (with the
// decay's shift), never their rotation. A block that needs the numerator side rotates its rows
// when it reads them (KeptBlock): one rotation more per block and pass, where keeping both sides
// (NumeratorOnly, Full) doubled what the passes write and read from memory, O(n m) each.
// Its memory is the calling thread's scratch, kept after the call (scratch.hpp, Lifetime::Thread),
// so that a training loop's calls allocate nothing after the first; other threads may read and
// write it while it lives. Or the caller's memory (a LinearSaved slice, saved.hpp): a forward's
// FeatureBlocks store into it (store), and its backward finds the first `given` rows there.
template <class T>
class KeptFeatures {
 public:
  // Rows [0, capacity) at positions first_position.., computed by compute_at, in scratch.
  KeptFeatures(const LinearSetup& setup, Role role, Index capacity, Index first_position)
      : KeptFeatures(setup, role, capacity, first_position, nullptr, nullptr, 0) {}
  // The same in `plain` [capacity x m] and `log_scale` [capacity], whose rows [0, given) already
  // hold the features (compute_at leaves them: they are read, never written). A backward reading a
  // forward's rows passes capacity = given: it computes none.
  KeptFeatures(const LinearSetup& setup, Role role, Index capacity, Index first_position, T* plain,
               double* log_scale, Index given)
      : setup_(setup),
        role_(role),
        first_position_(first_position),
        capacity_(capacity),
        own_plain_(plain ? 0 : capacity * setup.m, plain ? Lifetime::Call : Lifetime::Thread),
        own_log_scale_(plain ? 0 : capacity, plain ? Lifetime::Call : Lifetime::Thread),
        plain_(plain ? plain : own_plain_.data()),
        log_scale_(plain ? log_scale : own_log_scale_.data()),
        given_(given),
        rows_(given) {}

  // Features of rows [at, at + rows) from x [rows x d] (the rows' own inputs), unless given.
  void compute_at(Index at, const T* x, Index rows) {
    if (at + rows <= given_) return;
    assert(at >= given_ && at + rows <= capacity_);
    Scratch<T> rotated(setup_.plan.rotate_input ? rows * setup_.d : 0);
    map_plain(setup_, role_, x, rows, first_position_ + at, plain_ + at * setup_.m, log_scale_ + at,
              rotated.data());
  }
  // Rows at positions position.. that a FeatureBlock computed: plain [rows x m], their log scales.
  void store(Index position, const T* plain, const double* log_scale, Index rows) {
    const Index at = position - first_position_, m = setup_.m;
    assert(at >= 0 && at + rows <= capacity_);
    std::copy(plain, plain + rows * m, plain_ + at * m);
    std::copy(log_scale, log_scale + rows, log_scale_ + at);
  }
  // Declares rows [0, rows) computed (by compute_at, possibly on several threads).
  void fill(Index rows) { rows_ = rows; }

  const LinearSetup& setup() const { return setup_; }
  Index rows() const { return rows_; }
  Index position(Index row) const { return first_position_ + row; }
  const T* plain(Index row) const { return plain_ + row * setup_.m; }
  const double* log_scales(Index row) const { return log_scale_ + row; }
  double max_log_scale() const {
    return rows_ ? *std::max_element(log_scale_, log_scale_ + rows_) : kEmpty;
  }

 private:
  const LinearSetup& setup_;
  Role role_;
  Index first_position_, capacity_;
  Scratch<T> own_plain_;
  Scratch<double> own_log_scale_;
  T* plain_;
  double* log_scale_;
  Index given_, rows_;
};

// Rows [first, first + count) of KeptFeatures in the placement's form (FeatureRows): the kept rows
// themselves, and for NumeratorOnly and Full their rotation, made here in scratch.
template <class T>
class KeptBlock {
 public:
  KeptBlock(const KeptFeatures<T>& kept, Index first, Index count)
      : num_(kept.setup().plan.rotate_features ? count * kept.setup().m : 0),
        rows_(make(kept, first, count, num_.data())) {}

  const FeatureRows<T>& rows() const { return rows_; }

 private:
  static FeatureRows<T> make(const KeptFeatures<T>& kept, Index first, Index count, T* num) {
    const LinearSetup& setup = kept.setup();
    const T* plain = kept.plain(first);
    if (!setup.plan.rotate_features)
      return FeatureRows<T>(setup, plain, plain, plain, kept.log_scales(first), count);
    RopeAccess::rotate_rows<T>(*setup.options.rope, plain, num, count, setup.m,
                               kept.position(first), Turn::Apply);
    return FeatureRows<T>(setup, num, setup.plan.separate_denominator ? plain : num, plain,
                          kept.log_scales(first), count);
  }

  Scratch<T> num_;
  FeatureRows<T> rows_;
};

// What admitting one key did to the running scale: the numerator side must be rescaled by
// `factor` (1: no change) before it takes the key with `weight` = exp(c_j - M) (at most
// e^headroom).
template <class T>
struct Admitted {
  T factor = T(1), weight = T(1);
};

// The causal forms' prefix, one key at a time: z = sum_j exp(c_j - M) e_j at M, the largest c_j
// admitted so far (with a headroom H > 0: the last c_j that passed M by more than H, so that a
// decay's rising scales rescale z every H / |log g| keys rather than at each). Admits key j (log
// scale c, denominator-side features e [m]). Every causal form calls this, forward (the scan, the
// chunked form's denominators) and backward (its sweep over the queries), so that their
// denominators see the same operations in the same order.
template <class T>
Admitted<T> admit_key(Vector<T>& z, double& M, double c, const T* e, double headroom) {
  Admitted<T> a;
  if (c > M + headroom) {
    if (M != kEmpty) {
      a.factor = T(std::exp(M - c));
      z *= a.factor;
    }
    M = c;
  }
  a.weight = T(std::exp(c - M));
  z += a.weight * Eigen::Map<const Vector<T>>(e, z.size());
  return a;
}

// Adds the keys of `keys` (features) with values v [rows x d_v] to the state:
// S += num^T diag(w) V, z += den^T w, with w_j = exp(c_j - M). The weights scale the rows of V
// (d_v wide) rather than those of the features (m wide), and are skipped when every w_j is 1
// (maps that need no stabilisation, elu+1, relu and 1+cos, have c_j = 0 = M throughout, without a
// decay).
// `next`: what the caller reads next, fetched during the product (gemm.hpp).
template <class T, class Keys>
void absorb(LinearState<T>& state, const Keys& keys, const T* v, Matrix<T>& weighted_v,
            Vector<T>& weights, const Prefetch& next = {}) {
  const Index rows = keys.rows(), d_v = keys.setup().d_v;
  if (rows == 0) return;
  check_input(keys.setup(), v, rows, d_v);
  raise_scale(state, keys.max_log_scale(), keys.setup().headroom);
  const ConstRowMap<T> values(v, rows, d_v);
  bool unit = true;
  for (Index j = 0; j < rows && unit; ++j) unit = keys.log_scale(j) == state.M;
  if (!unit) {
    weights.resize(rows);
    for (Index j = 0; j < rows; ++j) weights[j] = T(std::exp(keys.log_scale(j) - state.M));
    weighted_v.noalias() = weights.asDiagonal() * values;
  }
  gemm(const_view(keys.num()).transposed(), unit ? const_view(values) : const_view(weighted_v),
       view(state.S), Write::Add, next);
  if (unit)
    state.z.noalias() += keys.den().colwise().sum().transpose();
  else
    state.z.noalias() += keys.den().transpose() * weights;
}

// Adds keys [next, end) to the state, as many at a time as `keys` holds, and leaves next = end:
// the keys that no query reads between (the causal forms' keys before a block of queries).
template <class T>
void absorb_through(LinearState<T>& state, FeatureBlock<T>& keys, const T* k, const T* v,
                    Index k_offset, Index& next, Index end, Matrix<T>& weighted,
                    Vector<T>& weights) {
  const Index d = keys.setup().d, d_v = keys.setup().d_v;
  while (next < end) {
    const Index rows = std::min(keys.capacity(), end - next);
    keys.compute(k + next * d, rows, k_offset + next);
    absorb(state, keys, v + next * d_v, weighted, weights);
    next += rows;
  }
}

// The stabilised divisor D~_i of output row i, o_i = num~_i / D~_i, given den~_i and its log
// scale a_i + M_i:
//   with a denominator:    den~_i + eps exp(-(a_i + M_i))   (o_i = num_i / (den_i + eps))
//   without (denominator false): exp(-(a_i + M_i))          (o_i = num_i: the shifts undone)
// or 0 when the row's output is zero: nothing attended to (log_scale kEmpty), 0 / 0 (eps = 0),
// num / inf, or, without a denominator, a scale outside double's range. Maps without a stabiliser
// (elu+1, relu, 1+cos) have log_scale 0 on every row: exp(-0) = 1 exactly, without the libm call.
inline double output_divisor(double den, double log_scale, const LinearOptions& options) {
  if (log_scale == kEmpty) return 0.0;
  const auto shift = [&] { return log_scale == 0 ? 1.0 : std::exp(-log_scale); };
  const double total = !options.denominator ? shift()
                       : options.eps > 0    ? den + options.eps * shift()
                                            : den;
  return total == 0 || !std::isfinite(total) ? 0.0 : total;
}

// o_i = num~_i / D~_i (output_divisor); a zero row when nothing is attended to.
// numerator: d_v contiguous values. Multiplying by the reciprocal in double (one rounding more
// than dividing, far below float's) lets the loop vectorise.
template <class T>
void write_output(T* out, const T* numerator, Index d_v, double den, double log_scale,
                  const LinearOptions& options, DenominatorTally* tally) {
  const double total = output_divisor(den, log_scale, options);
  if (tally) {
    if (log_scale == kEmpty)
      tally->add_no_keys();
    else if (!options.denominator)
      tally->add_without_denominator();
    else
      tally->add(den, log_scale, total == 0);
  }
  if (total == 0) {
    std::fill(out, out + d_v, T(0));
    return;
  }
  const double inverse = 1.0 / total;
  if (!std::isfinite(inverse)) {  // a subnormal total (double, eps = 0): 1 / total overflows
    for (Index c = 0; c < d_v; ++c) out[c] = T(double(numerator[c]) / total);
    return;
  }
  for (Index c = 0; c < d_v; ++c) out[c] = T(double(numerator[c]) * inverse);
}

// Rows per feature block of the non-causal form: large enough for efficient GEMMs, small enough for
// the block's features to stay in L2. 512 when m <= 64 (elu+1, relu, 1+cos: 128 KiB of float
// features, 256 KiB for eq. 19's two copies; double twice that, not measured), which spreads the
// per-block work (packing the state, the calls) over more of their cheap rows; else 256 (FAVOR+,
// m = 256: 256 KiB, twice that for eq. 19).
inline Index block_rows(Index m) { return m <= 64 ? 512 : 256; }

// Rows [first, first + rows) of a row-major [* x cols] buffer, as a range to prefetch (empty when
// rows is 0).
template <class T>
Prefetch::Range rows_of(const T* x, Index cols, Index first, Index rows) {
  return {x + first * cols, Index(sizeof(T)) * cols * rows};
}

// Adds keys [0, n_k) (positions k_offset..) to the state, a block at a time: the non-causal form,
// and the first pass of the causal form split across threads. With `keep`, their features are
// computed into rows [keep_at, keep_at + n_k) of it instead of scratch (the backward reuses them);
// with `sink`, computed in scratch and also stored there (a forward keeping them: saved.hpp).
// Each block's state update fetches the next block's keys and values (gemm.hpp's Prefetch): elu+1's
// rows are cheap enough to map that waiting for them, not the arithmetic, was much of its time.
// With read_out's fetches, elu+1 non-causal at n = 16384 (8 heads, 2 threads) takes 0.85x the time.
template <class T>
void absorb_keys(LinearState<T>& state, const T* k, const T* v, Index n_k, Index k_offset,
                 const LinearSetup& setup, KeptFeatures<T>* keep = nullptr, Index keep_at = 0,
                 KeptFeatures<T>* sink = nullptr) {
  const Index block = std::min<Index>(block_rows(setup.m), std::max<Index>(n_k, 1));
  FeatureBlock<T> keys(setup, Role::Keys, keep ? 0 : block);
  keys.keep_into(sink);
  Matrix<T> weighted;
  Vector<T> weights;
  for (Index js = 0; js < n_k; js += block) {
    const Index rows = std::min(block, n_k - js), next_rows = std::min(block, n_k - js - rows);
    const Prefetch next{
        {rows_of(k, setup.d, js + rows, next_rows), rows_of(v, setup.d_v, js + rows, next_rows)}};
    if (keep) {
      keep->compute_at(keep_at + js, k + js * setup.d, rows);
      const KeptBlock<T> kept(*keep, keep_at + js, rows);
      absorb(state, kept.rows(), v + js * setup.d_v, weighted, weights, next);
    } else {
      keys.compute(k + js * setup.d, rows, k_offset + js);
      absorb(state, keys, v + js * setup.d_v, weighted, weights, next);
    }
  }
}

// Features of rows [begin, end) of x into `kept`, a block at a time.
template <class T>
void keep_features(KeptFeatures<T>& kept, const T* x, Index begin, Index end) {
  const Index block = block_rows(kept.setup().m), d = kept.setup().d;
  for (Index at = begin; at < end; at += block)
    kept.compute_at(at, x + at * d, std::min(block, end - at));
}

// The non-causal form cuts its keys into parts of at least kPartRows rows (multiples of it), at
// most kMaxParts of them, each absorbed into its own state and the states merged in order; and its
// queries likewise, at multiples of the feature block. The cuts depend on the lengths only, never
// on the thread count, so the result is the same bits for any number of threads (a different cut
// would sum the state in another order). With fewer threads a thread simply takes several parts:
// the merges cost m x d_v each, nothing next to a part's m x d_v x 512 x 2.
inline constexpr Index kPartRows = 512;
inline constexpr Index kMaxParts = 8;
inline Index part_count(Index rows, Index unit) {
  return std::clamp<Index>(rows / std::max(unit, kPartRows), 1, kMaxParts);
}

// state = every key [0, n_k) (positions k_offset..), absorbed in parts (part_count) on `threads`
// threads, the parts merged in order (linear_noncausal.cpp). keep, sink: as absorb_keys'.
template <class T>
void absorb_key_parts(LinearState<T>& state, const T* k, const T* v, Index n_k, Index k_offset,
                      const LinearSetup& setup, int threads, KeptFeatures<T>* keep = nullptr,
                      KeptFeatures<T>* sink = nullptr);

// state += other, both brought to the larger of their two scales (state's own, when other's
// passes it by at most `headroom`: raise_scale).
template <class T>
void merge(LinearState<T>& state, const LinearState<T>& other, double headroom) {
  if (other.M == kEmpty) return;
  raise_scale(state, other.M, headroom);
  state.peak = std::max(state.peak, other.peak);
  const T factor = T(std::exp(other.M - state.M));
  state.S += factor * other.S;
  state.z += factor * other.z;
}

// [begin, end) of part t when `count` rows are split into `parts` pieces aligned to `align`.
inline Index split_point(Index count, Index parts, Index t, Index align) {
  return t >= parts ? count : std::min(count, (count * t / parts) / align * align);
}

}  // namespace linrope::detail
