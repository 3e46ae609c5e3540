// Linear attention kernels: stabilised features, the non-causal form, the chunked causal form and
// the plain recurrent scan. See linear_kernel.hpp for the stabilisation algebra.
#include "linear/linear_kernel.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <span>
#include <type_traits>
#include <utility>

#include "common/gemm.hpp"
#include "common/parallel.hpp"
#include "common/scratch.hpp"
#include "feature_maps/feature_map_access.hpp"
#include "rope/rope_access.hpp"

namespace linrope::detail {
namespace {

constexpr double kEmpty = -std::numeric_limits<double>::infinity();

// x, a [rows x cols] block of q, k or v: raises setup.nonfinite if it holds a non-finite value
// (when the caller asked for checks).
template <class T>
void check_input(const LinearSetup& setup, const T* x, Index rows, Index cols) {
  if (setup.nonfinite) setup.nonfinite->check(x, rows, cols);
}

// Stabilised feature rows of one block of tokens, in the form the placement needs:
//   num(): features on the numerator side (rotated by R_i for NumeratorOnly and Full),
//   den(): features on the denominator side (unrotated for NumeratorOnly; the same rows otherwise),
//   log_scale(i) = a_i (or c_j for keys): phi = exp(log_scale) * features.
// Its memory is per-thread scratch (scratch.hpp): no allocation after a thread's first call.
template <class T>
class FeatureBlock {
 public:
  FeatureBlock(const LinearSetup& setup, Index capacity)
      : setup_(setup),
        capacity_(capacity),
        separate_den_(setup.options.placement == RopePlacement::NumeratorOnly),
        features_(capacity * ((separate_den_ ? 2 : 1) * setup.m +
                              (setup.options.placement == RopePlacement::BeforeMap ? setup.d : 0))),
        log_scale_(capacity) {}

  // Features of rows x [rows x d] at positions first_position, first_position + 1, ...
  void compute(const T* x, Index rows, Index first_position) {
    rows_ = rows;
    check_input(setup_, x, rows, setup_.d);
    const FeatureMap& map = *setup_.map;
    const Rope* rope = setup_.options.rope;
    const Index m = setup_.m, d = setup_.d;
    ConstRowMap<T> input(x, rows, d);
    const auto map_rows = [&](const auto& from, T* to) {
      FeatureMapAccess::stabilized<T>(map, from, RowMap<T>(to, rows, m), log_scale_.data());
    };
    switch (setup_.options.placement) {
      case RopePlacement::None:
        map_rows(input, num_data());
        break;
      case RopePlacement::BeforeMap: {
        RowMap<T> rotated(num_data() + capacity_ * m, rows, d);
        rotated = input;
        RopeAccess::rotate_rows(*rope, rotated.data(), rows, d, first_position, false);
        map_rows(rotated, num_data());
        break;
      }
      case RopePlacement::NumeratorOnly:  // den: the features; num: their rotation
        map_rows(input, den_data());
        RopeAccess::rotate_rows<T>(*rope, den_data(), num_data(), rows, m, first_position, false);
        break;
      case RopePlacement::Full:
        map_rows(input, num_data());
        RopeAccess::rotate_rows(*rope, num_data(), rows, m, first_position, false);
        break;
    }
  }

  const LinearSetup& setup() const { return setup_; }
  Index capacity() const { return capacity_; }
  Index rows() const { return rows_; }
  ConstRowMap<T> num() const { return ConstRowMap<T>(num_data(), rows_, setup_.m); }
  ConstRowMap<T> den() const { return ConstRowMap<T>(den_data(), rows_, setup_.m); }
  double log_scale(Index i) const { return log_scale_.data()[i]; }
  double max_log_scale() const {
    return rows_ ? *std::max_element(log_scale_.data(), log_scale_.data() + rows_) : kEmpty;
  }

 private:
  // [num | den (NumeratorOnly) | rotated input (BeforeMap)], each capacity rows.
  T* num_data() const { return features_.data(); }
  T* den_data() const {
    return separate_den_ ? features_.data() + capacity_ * setup_.m : features_.data();
  }

  const LinearSetup& setup_;
  Index capacity_;
  bool separate_den_;
  Scratch<T> features_;
  Scratch<double> log_scale_;
  Index rows_ = 0;
};

// Rescales the state to log scale new_max (>= state.M).
template <class T>
void raise_scale(LinearState<T>& state, double new_max) {
  if (new_max <= state.M) return;
  if (state.M != kEmpty) {
    const T factor = T(std::exp(state.M - new_max));
    state.S *= factor;
    state.z *= factor;
  }
  state.M = new_max;
}

// Adds the keys of `keys` (features) with values v [rows x d_v] to the state:
// S += num^T diag(w) V, z += den^T w, with w_j = exp(c_j - M). The weights scale the rows of V
// (d_v wide) rather than those of the features (m wide), and are skipped when every w_j is 1
// (maps that need no stabilisation, elu+1, relu and 1+cos, have c_j = 0 = M throughout).
// `next`: what the caller reads next, fetched during the product (gemm.hpp).
template <class T>
void absorb(LinearState<T>& state, const FeatureBlock<T>& keys, const T* v, Matrix<T>& weighted_v,
            Vector<T>& weights, const Prefetch& next = {}) {
  const Index rows = keys.rows(), dv = keys.setup().dv;
  if (rows == 0) return;
  check_input(keys.setup(), v, rows, dv);
  raise_scale(state, keys.max_log_scale());
  const ConstRowMap<T> values(v, rows, dv);
  bool unit = true;
  for (Index j = 0; j < rows && unit; ++j) unit = keys.log_scale(j) == state.M;
  if (!unit) {
    weights.resize(rows);
    for (Index j = 0; j < rows; ++j) weights[j] = T(std::exp(keys.log_scale(j) - state.M));
    weighted_v.noalias() = weights.asDiagonal() * values;
  }
  gemm(const_view(keys.num()).transposed(), unit ? const_view(values) : const_view(weighted_v),
       view(state.S), true, next);
  if (unit)
    state.z.noalias() += keys.den().colwise().sum().transpose();
  else
    state.z.noalias() += keys.den().transpose() * weights;
}

// Adds keys [next, end) to the state, as many at a time as `keys` holds, and leaves next = end:
// the keys that no query reads between (the causal forms' keys before a block of queries).
template <class T>
void absorb_through(LinearState<T>& state, FeatureBlock<T>& keys, const T* k, const T* v,
                    Index k_pos0, Index& next, Index end, Matrix<T>& weighted, Vector<T>& weights) {
  const Index d = keys.setup().d, dv = keys.setup().dv;
  while (next < end) {
    const Index rows = std::min(keys.capacity(), end - next);
    keys.compute(k + next * d, rows, k_pos0 + next);
    absorb(state, keys, v + next * dv, weighted, weights);
    next += rows;
  }
}

// o_i = num~_i / (den~_i + eps exp(-(a_i + M_i))); a zero row when nothing is attended to.
// numerator: d_v contiguous values. Multiplying by the reciprocal in double (one rounding more
// than dividing, far below float's) lets the loop vectorise.
template <class T>
void write_output(T* out, const T* numerator, Index dv, double den, double log_scale, double eps,
                  DenominatorTally* tally) {
  if (log_scale == kEmpty) {  // no admissible key
    std::fill(out, out + dv, T(0));
    if (tally) tally->add(0.0, 0.0);
    return;
  }
  if (tally) tally->add(den, log_scale);
  // Maps without a stabiliser (elu+1, relu, 1+cos) have log_scale 0 on every row: exp(-0) = 1
  // exactly, without the libm call.
  const double total = den + (eps > 0 ? eps * (log_scale == 0 ? 1.0 : std::exp(-log_scale)) : 0.0);
  if (total == 0 || !std::isfinite(total)) {  // 0 / 0 (eps = 0), or num / inf
    std::fill(out, out + dv, T(0));
    return;
  }
  const double inverse = 1.0 / total;
  if (!std::isfinite(inverse)) {  // a subnormal total (double, eps = 0): 1 / total overflows
    for (Index c = 0; c < dv; ++c) out[c] = T(double(numerator[c]) / total);
    return;
  }
  for (Index c = 0; c < dv; ++c) out[c] = T(double(numerator[c]) * inverse);
}

}  // namespace

DenominatorTally::DenominatorTally(double threshold)
    : threshold_(threshold),
      log_threshold_(threshold > 0 ? std::log(threshold)
                                   : -std::numeric_limits<double>::infinity()) {}

void DenominatorTally::add(double den, double log_scale) {
  ++count_;
  min_ = std::min(min_, den == 0 ? 0.0 : den * std::exp(log_scale));
  if (den <= 0) ++nonpositive_;
  if (den == 0 ? threshold_ > 0 : std::log(std::abs(den)) + log_scale < log_threshold_) ++below_;
}

void DenominatorTally::merge_into(DenominatorStats& stats) const {
  if (count_ == 0) return;
  stats.min = stats.count == 0 ? min_ : std::min(stats.min, min_);
  stats.nonpositive += nonpositive_;
  stats.below_threshold += below_;
  stats.count += count_;
}

void DenominatorTally::store(DenominatorStats& stats) const {
  stats = DenominatorStats{.threshold = threshold_};
  merge_into(stats);
}

namespace {

// Rows per feature block of the non-causal form: large enough for efficient GEMMs, small enough for
// the block's features to stay in L2. 512 when m <= 64 (elu+1, relu, 1+cos: 128 KiB of float
// features, 256 KiB for eq. 19's two copies; double twice that, not measured), which spreads the
// per-block work (packing the state, the calls) over more of their cheap rows; else 256 (FAVOR+,
// m = 256: 256 KiB, twice that for eq. 19).
Index block_rows(Index m) { return m <= 64 ? 512 : 256; }

// The non-causal form cuts its keys into parts of at least kPartRows rows (multiples of it), at
// most kMaxParts of them, each absorbed into its own state and the states merged in order; and its
// queries likewise, at multiples of the feature block. The cuts depend on the lengths only, never
// on the thread count, so the result is the same bits for any number of threads (a different cut
// would sum the state in another order). With fewer threads a thread simply takes several parts:
// the merges cost m x d_v each, nothing next to a part's m x d_v x 512 x 2.
constexpr Index kPartRows = 512;
constexpr Index kMaxParts = 8;
Index part_count(Index rows, Index unit) {
  return std::clamp<Index>(rows / std::max(unit, kPartRows), 1, kMaxParts);
}

int usable_threads(bool parallel) { return parallel && !in_parallel() ? max_threads() : 1; }

// Rows [first, first + rows) of a row-major [* x cols] buffer, as a range to prefetch (empty when
// rows is 0).
template <class T>
Prefetch::Range rows_of(const T* x, Index cols, Index first, Index rows) {
  return {x + first * cols, Index(sizeof(T)) * cols * rows};
}

// Adds keys [0, nk) (positions k_pos0..) to the state, a block at a time: the non-causal form,
// and the first pass of the causal form split across threads. Each block's state update fetches
// the next block's keys and values (gemm.hpp's Prefetch): elu+1's rows are cheap enough to map
// that waiting for them, not the arithmetic, was much of its time. With read_out's fetches,
// elu+1 non-causal at n = 16384 (8 heads, 2 threads) takes 0.85x the time.
template <class T>
void absorb_keys(LinearState<T>& state, const T* k, const T* v, Index nk, Index k_pos0,
                 const LinearSetup& setup) {
  const Index block = std::min<Index>(block_rows(setup.m), std::max<Index>(nk, 1));
  FeatureBlock<T> keys(setup, block);
  Matrix<T> weighted;
  Vector<T> weights;
  for (Index js = 0; js < nk; js += block) {
    const Index rows = std::min(block, nk - js), next_rows = std::min(block, nk - js - rows);
    keys.compute(k + js * setup.d, rows, k_pos0 + js);
    absorb(state, keys, v + js * setup.dv, weighted, weights,
           Prefetch{{rows_of(k, setup.d, js + rows, next_rows),
                     rows_of(v, setup.dv, js + rows, next_rows)}});
  }
}

// state += other, both brought to the larger of their two scales.
template <class T>
void merge(LinearState<T>& state, const LinearState<T>& other) {
  if (other.M == kEmpty) return;
  raise_scale(state, other.M);
  const T factor = T(std::exp(other.M - state.M));
  state.S += factor * other.S;
  state.z += factor * other.z;
}

// Non-causal read-out of n queries against a complete state. Each block's product fetches the
// output rows it is about to write and the next block's queries (as absorb_keys does).
template <class T>
void read_out(const LinearState<T>& state, const T* q, T* out, Index n, Index q_pos0,
              const LinearSetup& setup, DenominatorTally* tally) {
  const Index block = std::min<Index>(block_rows(setup.m), std::max<Index>(n, 1));
  FeatureBlock<T> queries(setup, block);
  Matrix<T> numerator;
  Vector<T> den;
  for (Index qs = 0; qs < n; qs += block) {
    const Index rows = std::min(block, n - qs), next_rows = std::min(block, n - qs - rows);
    queries.compute(q + qs * setup.d, rows, q_pos0 + qs);
    numerator.resize(rows, setup.dv);
    gemm(const_view(queries.num()), const_view(state.S), view(numerator), false,
         Prefetch{{rows_of(out, setup.dv, qs, rows), rows_of(q, setup.d, qs + rows, next_rows)}});
    den.noalias() = queries.den() * state.z;
    for (Index r = 0; r < rows; ++r)
      write_output(out + (qs + r) * setup.dv, numerator.data() + r * setup.dv, setup.dv,
                   double(den[r]), queries.log_scale(r) + state.M, setup.options.eps, tally);
  }
}

// [begin, end) of part t when `count` rows are split into `parts` pieces aligned to `align`.
Index split_point(Index count, Index parts, Index t, Index align) {
  return t >= parts ? count : std::min(count, (count * t / parts) / align * align);
}

}  // namespace

void DenominatorTally::merge(const DenominatorTally& other) {
  min_ = std::min(min_, other.min_);
  nonpositive_ += other.nonpositive_;
  below_ += other.below_;
  count_ += other.count_;
}

// Keys cut into parts (part_count), each absorbed into its own state, the states merged in order;
// then the queries read out in parts. Parts run on the OpenMP threads when `parallel`, else in
// turn: the same arithmetic either way.
template <class T>
void linear_noncausal(const T* q, const T* k, const T* v, T* out, Index n, Index nk, Index q_pos0,
                      Index k_pos0, const LinearSetup& setup, DenominatorTally* tally,
                      bool parallel) {
  const Index d = setup.d, dv = setup.dv;
  const int threads = usable_threads(parallel);
  LinearState<T> state;
  state.reset(setup.m, dv);
  const Index key_parts = part_count(nk, kPartRows);
  if (key_parts > 1) {
    std::vector<LinearState<T>> parts(key_parts);
    for (auto& part : parts) part.reset(setup.m, dv);
#pragma omp parallel for num_threads(std::min <Index>(threads, key_parts)) if (threads > 1)
    for (Index t = 0; t < key_parts; ++t) {
      const Index begin = split_point(nk, key_parts, t, kPartRows);
      const Index end = split_point(nk, key_parts, t + 1, kPartRows);
      absorb_keys(parts[t], k + begin * d, v + begin * dv, end - begin, k_pos0 + begin, setup);
    }
    for (const auto& part : parts) merge(state, part);
  } else {
    absorb_keys(state, k, v, nk, k_pos0, setup);
  }
  // Query parts at multiples of read_out's block, so that every block of rows, and so every
  // product's shape, is the same whatever the cut.
  const Index block = block_rows(setup.m);
  const Index query_parts = part_count(n, block);
  if (query_parts > 1) {
    std::vector<DenominatorTally> tallies(query_parts,
                                          tally ? tally->empty() : DenominatorTally(0));
#pragma omp parallel for num_threads(std::min <Index>(threads, query_parts)) if (threads > 1)
    for (Index t = 0; t < query_parts; ++t) {
      const Index begin = split_point(n, query_parts, t, block);
      const Index end = split_point(n, query_parts, t + 1, block);
      read_out(state, q + begin * d, out + begin * dv, end - begin, q_pos0 + begin, setup,
               tally ? &tallies[t] : nullptr);
    }
    if (tally)
      for (const auto& part : tallies) tally->merge(part);
  } else {
    read_out(state, q, out, n, q_pos0, setup, tally);
  }
}

namespace {

// Keys per block of a chunk's masked products (see causal_chunked): the GEMM micro-kernel's 32
// columns, the finest split of the score product that wastes no part of a tile.
constexpr Index kKeyBlock = 32;

// Chunked causal form: per chunk of queries, the state holds every key before the chunk's first
// visible key; the chunk's own keys enter through masked (rows x keys) GEMMs, a block of keys at a
// time, weighted with exp(c_j - M_i) computed once per run of queries sharing the same M_i.
template <class T>
void causal_chunked(const T* q, const T* k, const T* v, T* out, Index n, Index nk, Index q_pos0,
                    Index k_pos0, const LinearSetup& setup, LinearState<T>& state, bool absorb_all,
                    DenominatorTally* tally) {
  // A chunk longer than the sequence is the whole sequence (and must not allocate chunk_size rows).
  const Index L = std::min(setup.options.chunk_size, std::max<Index>({n, nk, 1}));
  const Index d = setup.d, dv = setup.dv;
  const Index shift = q_pos0 - k_pos0;  // query i sees key j iff j <= i + shift
  FeatureBlock<T> queries(setup, L), keys(setup, L);
  Matrix<T> weighted, numerator, scores;
  Vector<T> weights, z_running;
  std::vector<double> query_max(L), den(L);
  std::vector<T> key_weight(L);
  Index absorbed = 0;  // keys [0, absorbed) are in the state
  const auto absorb_until = [&](Index end) {
    absorb_through(state, keys, k, v, k_pos0, absorbed, end, weighted, weights);
  };
  for (Index qs = 0; qs < n; qs += L) {
    const Index rows = std::min(L, n - qs);
    const Index js = std::clamp(qs + shift, Index(0), nk);
    const Index je = std::clamp(qs + rows + shift, Index(0), nk);
    absorb_until(js);
    queries.compute(q + qs * d, rows, q_pos0 + qs);
    const Index kb = je - js;
    if (kb > 0) keys.compute(k + js * d, kb, k_pos0 + js);
    // The next chunk's rows, which this chunk's products fetch (gemm.hpp's Prefetch): its
    // queries and keys [je, next_je) during the read-out, its values and output rows during the
    // state update (elu+1 at n = 16384, 8 heads, 2 threads: 0.89x the time).
    const Index next_rows = std::min(L, n - qs - rows);
    const Index next_je = std::clamp(qs + rows + next_rows + shift, je, nk);

    // Denominators and per-query maxima M_i, admitting the chunk's keys as they become visible.
    z_running = state.z;
    double m_running = state.M;
    Index next = 0;  // next key of the chunk, relative to js
    for (Index r = 0; r < rows; ++r) {
      for (; next < kb && js + next <= qs + r + shift; ++next) {
        const double c = keys.log_scale(next);
        if (c > m_running) {
          if (m_running != kEmpty) z_running *= T(std::exp(m_running - c));
          m_running = c;
        }
        z_running += T(std::exp(c - m_running)) * keys.den().row(next).transpose();
      }
      query_max[r] = m_running;
      den[r] = m_running == kEmpty ? 0.0 : double(queries.den().row(r).dot(z_running));
    }

    // Numerators: the state's part, then the chunk's own keys.
    numerator.resize(rows, dv);
    if (state.M != kEmpty) {
      gemm(const_view(queries.num()), const_view(state.S), view(numerator), false,
           Prefetch{{rows_of(q, d, qs + rows, next_rows), rows_of(k, d, je, next_je - je)}});
      for (Index r = 0; r < rows; ++r)
        if (query_max[r] > state.M) numerator.row(r) *= T(std::exp(state.M - query_max[r]));
    } else {
      numerator.setZero();
    }
    if (kb > 0) {
      // Query r sees keys [0, visible_r) of the chunk (j <= i + shift): a triangle of the
      // rows x kb block. Both products run one block of kKeyBlock keys at a time over the rows
      // from the first that sees the block's first key, so the block above the triangle is mostly
      // never computed (a quarter of both products for the default 64 x 64 chunk, nearly half for
      // long chunks), while each key and value is still packed once. An entry left out (r, j)
      // has j >= visible_r, so the masking loop zeroes it as it zeroed the whole block's.
      scores.resize(rows, kb);
      // product(c0, r0, width): keys c0 .. c0 + width - 1, seen from row r0 on.
      const auto for_each_key_block = [&](auto product) {
        for (Index c0 = 0; c0 < kb; c0 += kKeyBlock) {
          const Index r0 = std::clamp(js + c0 - qs - shift, Index(0), rows);  // sees key c0 first
          if (r0 == rows) break;
          product(c0, r0, std::min(kKeyBlock, kb - c0));
        }
      };
      for_each_key_block([&](Index c0, Index r0, Index width) {
        gemm(const_view(queries.num().bottomRows(rows - r0)),
             const_view(keys.num().middleRows(c0, width)).transposed(),
             View<T>{scores.data() + r0 * kb + c0, rows - r0, width, kb}, false);
      });
      double weight_max = kEmpty;
      Index weight_count = 0;
      for (Index r = 0; r < rows; ++r) {
        const Index visible = std::clamp(qs + r + shift - js + 1, Index(0), kb);
        if (query_max[r] != weight_max) weight_max = query_max[r], weight_count = 0;
        for (; weight_count < visible; ++weight_count)
          key_weight[weight_count] = T(std::exp(keys.log_scale(weight_count) - weight_max));
        T* row = scores.data() + r * kb;
        for (Index j = 0; j < visible; ++j) row[j] *= key_weight[j];
        std::fill(row + visible, row + kb, T(0));
      }
      for_each_key_block([&](Index c0, Index r0, Index width) {
        gemm(ConstView<T>{scores.data() + r0 * kb + c0, rows - r0, width, kb, 1},
             const_view(ConstRowMap<T>(v + (js + c0) * dv, width, dv)),
             view(numerator.bottomRows(rows - r0)), true);
      });
    }
    for (Index r = 0; r < rows; ++r)
      write_output(out + (qs + r) * dv, numerator.data() + r * dv, dv, den[r],
                   queries.log_scale(r) + query_max[r], setup.options.eps, tally);
    if (kb > 0 && (absorb_all || next_rows > 0)) {
      absorb(state, keys, v + js * dv, weighted, weights,
             Prefetch{{rows_of(v, dv, je, next_je - je), rows_of(out, dv, qs + rows, next_rows)}});
      absorbed = je;
    } else if (kb > 0) {
      // The last chunk's keys would only serve a later call, which has none: leave them out of
      // the state (1/16 of the state updates at n = 1024), but check their values, as absorb does.
      check_input(setup, v + js * dv, kb, dv);
    }
  }
  if (absorb_all) absorb_until(nk);
}

// Queries per block of the scan: their features are computed by one product, and their steps go
// through each strip of the state together.
constexpr Index kScanBlock = 64;

// What each query of a scan block does to the state before its read-out, worked out once per block
// (scalars only) so that the pass over S can then go one strip of columns at a time. On the stack:
// a stream's one-token step allocates nothing for it.
template <class T>
struct ScanSteps {
  std::array<Index, kScanBlock> key;  // the query's own key, as a row of the block's keys; or -1
  std::array<T, kScanBlock> factor;   // the state's rescaling before that key, exp(M_old - M_new)
  std::array<T, kScanBlock> weight;   // the key's weight exp(c_j - M)
  std::array<double, kScanBlock> scale;  // the state's log scale M when the query reads it
  std::array<double, kScanBlock> den;    // the query's stabilised denominator
};

// Columns [j0, j0 + width) of S through one block's queries in order (Width: width at compile time,
// or Eigen::Dynamic). Query r rescales the strip when the state's scale rose, adds its own key
// (S += w psi_j v_j^T), and reads its numerator phi_r S into numerator row r. The strip is meant to
// fit in L1 (the caller picks its width): every query of the block then reads it from there, where
// the scan otherwise streams the whole m x d_v state from L2 once or twice per token.
// Runs of kGroup queries that each add a key and need no rescaling share one pass over the strip,
// each row loaded and stored once for all of them, so that the pass is bound by its FMAs rather
// than by the stores. Every entry of S and every sum still sees the same operations in the same
// order as one query at a time.
template <int Width, class T>
void scan_strip(T* S, Index m, Index dv, Index j0, Index width, const ScanSteps<T>& steps,
                Index rows, const T* query_features, const T* key_features, const T* v,
                T* numerator) {
  // At most four vectors wide: a Dynamic strip lives on the stack too, never on the heap.
  constexpr int kMaxWidth = Width == Eigen::Dynamic ? 256 / sizeof(T) : Width;
  using Strip = Eigen::Array<T, 1, Width, Eigen::RowMajor, 1, kMaxWidth>;
  using StripMap = Eigen::Map<Strip, Eigen::Unaligned>;
  constexpr int kVectors = std::max<int>(1, kMaxWidth * sizeof(T) / 64);
  // Values and sums: 2 x 8 zmm registers (without AVX-512 twice or four times as many ymm or xmm
  // registers, which then spill; the grouping still saves the loads and stores of S).
  constexpr int kGroup = 8 / kVectors;  // 2 to 8: kVectors is at most 4
  const auto row_of = [&](Index l) { return StripMap(S + l * dv + j0, width); };
  const auto value_of = [&](Index r) {
    return Strip(steps.weight[r] * Eigen::Map<const Strip>(v + steps.key[r] * dv + j0, width));
  };
  const auto store = [&](Index r, const Strip& sum) {
    StripMap(numerator + r * dv + j0, width) = sum;
  };
  for (Index r = 0; r < rows;) {
    if (r + kGroup <= rows &&
        std::all_of(steps.key.begin() + r, steps.key.begin() + r + kGroup,
                    [&](Index j) { return j >= 0; }) &&
        std::all_of(steps.factor.begin() + r, steps.factor.begin() + r + kGroup,
                    [](T f) { return f == T(1); })) {
      const T* query[kGroup];
      const T* key[kGroup];
      Strip value[kGroup], sum[kGroup];
      for (int t = 0; t < kGroup; ++t) {
        query[t] = query_features + (r + t) * m;
        key[t] = key_features + steps.key[r + t] * m;
        value[t] = value_of(r + t);
        sum[t] = Strip::Zero(width);
      }
      for (Index l = 0; l < m; ++l) {
        StripMap row = row_of(l);
        Strip x = row;
        for (int t = 0; t < kGroup; ++t) {
          x += key[t][l] * value[t];
          sum[t] += query[t][l] * x;
        }
        row = x;
      }
      for (int t = 0; t < kGroup; ++t) store(r + t, sum[t]);
      r += kGroup;
      continue;
    }
    if (steps.factor[r] != T(1))
      for (Index l = 0; l < m; ++l) row_of(l) *= steps.factor[r];
    const T* query = query_features + r * m;
    Strip sum = Strip::Zero(width);
    if (steps.key[r] >= 0) {
      const T* key = key_features + steps.key[r] * m;
      const Strip value = value_of(r);
      for (Index l = 0; l < m; ++l) {
        StripMap row = row_of(l);
        row += key[l] * value;
        sum += query[l] * row;
      }
    } else {
      for (Index l = 0; l < m; ++l) sum += query[l] * row_of(l);
    }
    store(r, sum);
    ++r;
  }
}

// The recurrence (Katharopoulos et al.): S += psi_j v_j^T and z += psi_j one key at a time,
// o_i = phi_i S / (phi_i z + eps). Queries go in blocks of kScanBlock: their features, and their
// own keys', are computed by block, and the block's rank-one updates and read-outs by strips of S
// (scan_strip). Keys that no query reads between enter a block at a time, as in the chunked form
// (absorb): those before a block's first query (n_k ahead of n), and those after the last query
// when absorb_all (which no caller has yet: the stream's queries and keys are the same tokens).
template <class T>
void causal_scan(const T* q, const T* k, const T* v, T* out, Index n, Index nk, Index q_pos0,
                 Index k_pos0, const LinearSetup& setup, LinearState<T>& state, bool absorb_all,
                 DenominatorTally* tally) {
  const Index d = setup.d, dv = setup.dv, m = setup.m;
  const Index shift = q_pos0 - k_pos0;  // query i sees key j iff j <= i + shift
  // Strip width: 4, 2 or 1 vectors of 64 bytes, the widest whose m x width slice of S fits in
  // 32 KiB of L1 (FAVOR+ with m = 256: 2 vectors, 32 floats), and at most 4 so that a strip's
  // values and sums stay in registers.
  constexpr Index kVector = 64 / sizeof(T);
  Index strip = 4 * kVector;
  while (strip > kVector && m * strip * Index(sizeof(T)) > 32 * 1024) strip /= 2;
  FeatureBlock<T> queries(setup, kScanBlock), keys(setup, kScanBlock);
  ScanSteps<T> steps;
  Scratch<T> numerator(kScanBlock * dv);  // the block's numerators, row-major
  Matrix<T> weighted;
  Vector<T> weights;
  Index next = 0;  // keys [0, next) are in the state
  const auto absorb_until = [&](Index end) {
    absorb_through(state, keys, k, v, k_pos0, next, end, weighted, weights);
  };
  for (Index qs = 0; qs < n; qs += kScanBlock) {
    const Index rows = std::min(kScanBlock, n - qs);
    absorb_until(std::clamp(qs + shift, next, nk));
    // Query r's own key qs + r + shift, when it exists: keys [first, last).
    const Index first = next, last = std::clamp(qs + rows + shift, next, nk);
    if (last > first) {
      keys.compute(k + first * d, last - first, k_pos0 + first);
      check_input(setup, v + first * dv, last - first, dv);
    }
    queries.compute(q + qs * d, rows, q_pos0 + qs);
    for (Index r = 0; r < rows; ++r) {
      const Index j = qs + r + shift - first;  // relative to first
      steps.key[r] = j >= 0 && j < last - first ? j : -1;
      steps.factor[r] = T(1);
      if (steps.key[r] >= 0) {
        const double c = keys.log_scale(j);
        if (c > state.M) {
          if (state.M != kEmpty) {
            steps.factor[r] = T(std::exp(state.M - c));
            state.z *= steps.factor[r];
          }
          state.M = c;
        }
        steps.weight[r] = T(std::exp(c - state.M));
        state.z += steps.weight[r] * keys.den().row(j).transpose();
      }
      steps.scale[r] = state.M;
      steps.den[r] = state.M == kEmpty ? 0.0 : double(queries.den().row(r).dot(state.z));
    }
    for (Index j0 = 0; j0 < dv; j0 += strip) {
      const Index width = std::min(strip, dv - j0);
      const auto run = [&]<int Width>(std::integral_constant<int, Width>) {
        scan_strip<Width>(state.S.data(), m, dv, j0, width, steps, rows, queries.num().data(),
                          keys.num().data(), v + first * dv, numerator.data());
      };
      if (width == kVector)
        run(std::integral_constant<int, int(kVector)>{});
      else if (width == 2 * kVector)
        run(std::integral_constant<int, int(2 * kVector)>{});
      else if (width == 4 * kVector)
        run(std::integral_constant<int, int(4 * kVector)>{});
      else
        run(std::integral_constant<int, Eigen::Dynamic>{});
    }
    for (Index r = 0; r < rows; ++r)
      write_output(out + (qs + r) * dv, numerator.data() + r * dv, dv, steps.den[r],
                   queries.log_scale(r) + steps.scale[r], setup.options.eps, tally);
    next = last;
  }
  if (absorb_all) absorb_until(nk);
}

}  // namespace

// Split across threads (when allowed and long enough): the queries are cut into one segment per
// thread at chunk (or scan block) boundaries. Pass 1: each thread absorbs the keys that separate
// its segment's start from the next one's into a partial state. The partial states are summed as a
// prefix (cheap: m x d_v each). Pass 2: each segment runs the chunked form or the scan from its
// prefix state. The key features of pass 1 are computed again in pass 2 (for the chunked form,
// measured when it was the only one split: ~25% more work for 2x the threads).
template <class T>
void linear_causal(const T* q, const T* k, const T* v, T* out, Index n, Index nk, Index q_pos0,
                   Index k_pos0, const LinearSetup& setup, LinearState<T>& state, bool absorb_all,
                   DenominatorTally* tally, bool parallel) {
  if (!absorb_all) {  // keys past the last query's horizon are never read: check them here
    const Index horizon = n > 0 ? std::clamp(n + q_pos0 - k_pos0, Index(0), nk) : 0;
    check_input(setup, k + horizon * setup.d, nk - horizon, setup.d);
    check_input(setup, v + horizon * setup.dv, nk - horizon, setup.dv);
  }
  // A call of a few tokens (a stream's step) runs as the scan whatever the method: the chunked
  // form's products pack the m x d_v state on every call, which the scan's rank-1 updates do not.
  // One-token steps, eq. 19: elu+1 1.15 -> 0.61 us, FAVOR+ 5.4 -> 3.0 us; at 4 tokens the two tie.
  constexpr Index kScanTokens = 3;
  const bool scan =
      setup.options.method == CausalMethod::Scan || (n <= kScanTokens && nk <= kScanTokens);
  const Index d = setup.d, dv = setup.dv, shift = q_pos0 - k_pos0;
  // Queries [q0, q0 + rows) against the keys from k0 on, from the state `from`.
  const auto run = [&](Index q0, Index k0, Index rows, LinearState<T>& from, bool absorb_rest,
                       DenominatorTally* part) {
    const T *q_rows = q + q0 * d, *k_rows = k + k0 * d, *v_rows = v + k0 * dv;
    T* out_rows = out + q0 * dv;
    if (scan)
      causal_scan(q_rows, k_rows, v_rows, out_rows, rows, nk - k0, q_pos0 + q0, k_pos0 + k0, setup,
                  from, absorb_rest, part);
    else
      causal_chunked(q_rows, k_rows, v_rows, out_rows, rows, nk - k0, q_pos0 + q0, k_pos0 + k0,
                     setup, from, absorb_rest, part);
  };
  const Index L =
      scan ? kScanBlock : std::min(setup.options.chunk_size, std::max<Index>({n, nk, 1}));
  const Index segments = std::min<Index>(usable_threads(parallel), n / std::max<Index>(4 * L, 256));
  if (segments < 2) {
    run(0, 0, n, state, absorb_all, tally);
    return;
  }
  std::vector<Index> query_start(segments + 1), key_start(segments + 1);
  for (Index t = 0; t <= segments; ++t) {
    query_start[t] = split_point(n, segments, t, L);
    key_start[t] = t == 0 ? 0 : std::clamp(query_start[t] + shift, Index(0), nk);
  }
  std::vector<LinearState<T>> prefix(segments);
#pragma omp parallel for num_threads(segments)
  for (Index t = 0; t < segments; ++t) {  // pass 1: prefix[t + 1] holds keys [0, key_start[t + 1])
    if (t + 1 == segments) continue;
    prefix[t + 1].reset(setup.m, dv);
    absorb_keys(prefix[t + 1], k + key_start[t] * d, v + key_start[t] * dv,
                key_start[t + 1] - key_start[t], k_pos0 + key_start[t], setup);
  }
  prefix[0] = state;
  for (Index t = 1; t < segments; ++t) {
    LinearState<T> keys_of_previous = std::move(prefix[t]);
    prefix[t] = prefix[t - 1];
    merge(prefix[t], keys_of_previous);
  }
  std::vector<DenominatorTally> tallies(segments, tally ? tally->empty() : DenominatorTally(0));
#pragma omp parallel for num_threads(segments)
  for (Index t = 0; t < segments; ++t) {  // pass 2
    const Index q0 = query_start[t], k0 = key_start[t];
    run(q0, k0, query_start[t + 1] - q0, prefix[t], absorb_all && t + 1 == segments,
        tally ? &tallies[t] : nullptr);
  }
  if (absorb_all) state = std::move(prefix[segments - 1]);
  if (tally)
    for (const auto& part : tallies) tally->merge(part);
}

template void linear_noncausal<float>(const float*, const float*, const float*, float*, Index,
                                      Index, Index, Index, const LinearSetup&, DenominatorTally*,
                                      bool);
template void linear_noncausal<double>(const double*, const double*, const double*, double*, Index,
                                       Index, Index, Index, const LinearSetup&, DenominatorTally*,
                                       bool);
template void linear_causal<float>(const float*, const float*, const float*, float*, Index, Index,
                                   Index, Index, const LinearSetup&, LinearState<float>&, bool,
                                   DenominatorTally*, bool);
template void linear_causal<double>(const double*, const double*, const double*, double*, Index,
                                    Index, Index, Index, const LinearSetup&, LinearState<double>&,
                                    bool, DenominatorTally*, bool);

}  // namespace linrope::detail
