// Linear attention kernels: stabilised features, the non-causal form, the chunked causal form and
// the plain recurrent scan. See linear_kernel.hpp for the stabilisation algebra.
#include "linear_kernel.hpp"

#include <algorithm>
#include <cmath>
#include <span>

#include "feature_map_access.hpp"
#include "gemm.hpp"
#include "parallel.hpp"
#include "scratch.hpp"

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
        rope->rotate_rows(rotated.data(), rows, d, first_position, false);
        map_rows(rotated, num_data());
        break;
      }
      case RopePlacement::NumeratorOnly:  // den: the features; num: their rotation
        map_rows(input, den_data());
        rope->rotate_rows<T>(den_data(), num_data(), rows, m, first_position, false);
        break;
      case RopePlacement::Full:
        map_rows(input, num_data());
        rope->rotate_rows(num_data(), rows, m, first_position, false);
        break;
    }
  }

  const LinearSetup& setup() const { return setup_; }
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

// A thread's share of the rows, when the non-causal form splits a sequence: at least this many,
// in multiples of it.
constexpr Index kSplitRows = 256;

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

// Split across threads (when allowed and long enough): each thread absorbs a slice of the keys into
// its own state, the states are merged, then each thread reads out a slice of the queries.
template <class T>
void linear_noncausal(const T* q, const T* k, const T* v, T* out, Index n, Index nk, Index q_pos0,
                      Index k_pos0, const LinearSetup& setup, DenominatorTally* tally,
                      bool parallel) {
  const Index d = setup.d, dv = setup.dv;
  const int threads = usable_threads(parallel);
  LinearState<T> state;
  state.reset(setup.m, dv);
  const Index key_parts = std::min<Index>(threads, nk / kSplitRows);
  if (key_parts > 1) {
    std::vector<LinearState<T>> parts(key_parts);
#pragma omp parallel for num_threads(key_parts)
    for (Index t = 0; t < key_parts; ++t) {
      const Index begin = split_point(nk, key_parts, t, kSplitRows);
      const Index end = split_point(nk, key_parts, t + 1, kSplitRows);
      parts[t].reset(setup.m, dv);
      absorb_keys(parts[t], k + begin * d, v + begin * dv, end - begin, k_pos0 + begin, setup);
    }
    for (const auto& part : parts) merge(state, part);
  } else {
    absorb_keys(state, k, v, nk, k_pos0, setup);
  }
  const Index query_parts = std::min<Index>(threads, n / kSplitRows);
  if (query_parts > 1) {
    std::vector<DenominatorTally> tallies(query_parts,
                                          tally ? tally->empty() : DenominatorTally(0));
#pragma omp parallel for num_threads(query_parts)
    for (Index t = 0; t < query_parts; ++t) {
      const Index begin = split_point(n, query_parts, t, kSplitRows);
      const Index end = split_point(n, query_parts, t + 1, kSplitRows);
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
    while (absorbed < end) {
      const Index rows = std::min(L, end - absorbed);
      keys.compute(k + absorbed * d, rows, k_pos0 + absorbed);
      absorb(state, keys, v + absorbed * dv, weighted, weights);
      absorbed += rows;
    }
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

// The plain recurrence (Katharopoulos et al.): S += psi_j v_j^T and z += psi_j one key at a time,
// o_i = phi_i S / (phi_i z + eps). Features are still computed in blocks; the state is not.
template <class T>
void causal_scan(const T* q, const T* k, const T* v, T* out, Index n, Index nk, Index q_pos0,
                 Index k_pos0, const LinearSetup& setup, LinearState<T>& state, bool absorb_all,
                 DenominatorTally* tally) {
  const Index block = 64, d = setup.d, dv = setup.dv;
  const Index shift = q_pos0 - k_pos0;
  FeatureBlock<T> queries(setup, block), keys(setup, block);
  Matrix<T> numerator(1, dv);  // one query's, reused: no allocation per token
  Index key_block_start = 0, next = 0;
  const auto admit = [&](Index j) {
    if (j >= key_block_start + keys.rows()) {
      key_block_start = j;
      keys.compute(k + j * d, std::min(block, nk - j), k_pos0 + j);
    }
    const Index r = j - key_block_start;
    check_input(setup, v + j * dv, 1, dv);
    raise_scale(state, keys.log_scale(r));
    const T w = T(std::exp(keys.log_scale(r) - state.M));
    state.S.noalias() += (w * keys.num().row(r)).transpose() * ConstRowMap<T>(v + j * dv, 1, dv);
    state.z += w * keys.den().row(r).transpose();
  };
  for (Index qs = 0; qs < n; qs += block) {
    const Index rows = std::min(block, n - qs);
    queries.compute(q + qs * d, rows, q_pos0 + qs);
    for (Index r = 0; r < rows; ++r) {
      for (; next < nk && next <= qs + r + shift; ++next) admit(next);
      const double den = state.M == kEmpty ? 0.0 : double(queries.den().row(r).dot(state.z));
      numerator.noalias() = queries.num().row(r) * state.S;
      write_output(out + (qs + r) * dv, numerator.data(), dv, den, queries.log_scale(r) + state.M,
                   setup.options.eps, tally);
    }
  }
  if (absorb_all)
    for (; next < nk; ++next) admit(next);
}

}  // namespace

// Split across threads (chunked form, when allowed and long enough): the queries are cut into one
// segment per thread at chunk boundaries. Pass 1: each thread absorbs the keys that separate its
// segment's start from the next one's into a partial state. The partial states are summed as a
// prefix (cheap: m x d_v each). Pass 2: each segment runs the chunked form from its prefix state.
// The key features of pass 1 are computed again in pass 2: ~25% more work for 2x the threads.
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
  if (setup.options.method == CausalMethod::Scan || (n <= kScanTokens && nk <= kScanTokens)) {
    causal_scan(q, k, v, out, n, nk, q_pos0, k_pos0, setup, state, absorb_all, tally);
    return;
  }
  const Index L = std::min(setup.options.chunk_size, std::max<Index>({n, nk, 1}));
  const Index segments = std::min<Index>(usable_threads(parallel), n / std::max<Index>(4 * L, 256));
  if (segments < 2) {
    causal_chunked(q, k, v, out, n, nk, q_pos0, k_pos0, setup, state, absorb_all, tally);
    return;
  }
  const Index d = setup.d, dv = setup.dv, shift = q_pos0 - k_pos0;
  std::vector<Index> query_start(segments + 1), key_start(segments + 1);
  for (Index t = 0; t <= segments; ++t) {
    query_start[t] = split_point(n, segments, t, L);
    key_start[t] = t == 0 ? 0 : std::clamp(query_start[t] + shift, Index(0), nk);
  }
  std::vector<LinearState<T>> prefix(segments);
#pragma omp parallel for num_threads(segments)
  for (Index t = 0; t < segments;
       ++t) {  // pass 1: prefix[t + 1] will hold keys [0, key_start[t + 1])
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
    causal_chunked(q + q0 * d, k + k0 * d, v + k0 * dv, out + q0 * dv, query_start[t + 1] - q0,
                   nk - k0, q_pos0 + q0, k_pos0 + k0, setup, prefix[t],
                   absorb_all && t + 1 == segments, tally ? &tallies[t] : nullptr);
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
