// The causal scan: the recurrence one token at a time (the RNN view of Katharopoulos et al.), with
// the state swept in cache-sized strips by blocks of queries.
#include <algorithm>
#include <array>
#include <type_traits>

#include "linear/linear_blocks.hpp"
#include "linear/linear_forms.hpp"

namespace linrope::detail {
namespace {

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

}  // namespace

// The recurrence (Katharopoulos et al.): S += psi_j v_j^T and z += psi_j one key at a time,
// o_i = phi_i S / (phi_i z + eps). Queries go in blocks of kScanBlock: their features, and their
// own keys', are computed by block, and the block's rank-one updates and read-outs by strips of S
// (scan_strip). Keys that no query reads between enter a block at a time, as in the chunked form
// (absorb): those before a block's first query (n_k ahead of n), and those after the last query
// when absorb_all (which no caller has yet: the stream's queries and keys are the same tokens).
template <class T>
void causal_scan(const LinearHead<T>& head, const LinearSetup& setup, LinearState<T>& state,
                 bool absorb_all, DenominatorTally* tally) {
  const T *q = head.q, *k = head.k, *v = head.v;
  T* out = head.out;
  const Index n = head.n, nk = head.nk, q_pos0 = head.q_pos0, k_pos0 = head.k_pos0;
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

template void causal_scan<float>(const LinearHead<float>&, const LinearSetup&, LinearState<float>&,
                                 bool, DenominatorTally*);
template void causal_scan<double>(const LinearHead<double>&, const LinearSetup&,
                                  LinearState<double>&, bool, DenominatorTally*);

}  // namespace linrope::detail
