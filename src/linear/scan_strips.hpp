// Private: the engine every causal scan runs on, the forward's and the backward's three.
//
// A scan is a run of steps over a state X [rows x cols], row-major. Step r does, in order:
//   X   *= factor_r                          (the state's log scale moved)
//   X   += weight_r key_r value_r^T          (when key_r is set: one token absorbed;
//                                             key_r [rows], value_r [cols])
//   out_r = read_r^T X                       (read_r [rows] -> out_r [cols])
// The forward scan is the recurrence of Katharopoulos et al. with X = S [m x d_v]: read = phi_i,
// key = psi_i's key, value = v_j. The backward (linear_scan_backward.cpp) runs the same engine on
// S^T [d_v x m] (read = g~_i, key = v_j, value = psi~_j: the gradient of the query features) and
// on the queries' state U [m x d_v] and U^T [d_v x m] from the last token back (the gradients of
// the values and of the key features): one kernel, four uses.
//
// The state is swept a strip of columns at a time, every step of a block through one strip before
// the next strip: the strip (rows x width) is chosen to fit in L1, so that all the block's steps
// read it from there, where one step at a time would stream the whole state from L2 once or twice
// per token. A long scan keeps its state in panels (ScanState below), each strip's columns
// together, so that the strip is one contiguous block of L1 rather than rows a state's width
// apart, which share too few of L1's sets to stay in it.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <array>
#include <linrope/types.hpp>
#include <type_traits>

#include "common/scratch.hpp"

namespace linrope::detail {

// Steps per block of a scan: the rows whose features one product computes, and that go through
// each strip of the state together.
constexpr Index kScanBlock = 64;

// The operands of up to kScanBlock steps. On the stack: a stream's one-token step allocates
// nothing for it.
template <class T>
struct ScanSteps {
  Index count = 0;
  std::array<const T*, kScanBlock> read;   // [rows]
  std::array<const T*, kScanBlock> key;    // [rows], or null: nothing absorbed at this step
  std::array<const T*, kScanBlock> value;  // [cols] (read only when key is set)
  std::array<T*, kScanBlock> out;          // [cols], written
  std::array<T, kScanBlock> factor;        // 1: no rescaling
  std::array<T, kScanBlock> weight;        // the absorbed token's weight
};

// The strip of a state with `rows` rows: 2 or 1 vectors of 64 bytes, the wider whose rows x width
// slice fits in 32 KiB of L1 (the forward's S with m = 256: 32 floats; S^T with d_v = 64 too).
// Four vectors (groups of 2 steps) measured slower: FAVOR+ eq. 19 causal, n = 4096, 8 heads, 2
// threads, Xeon with AVX-512: backward 74.0 ms at 4 vectors, 67.6 at 2, 77.5 at 1; forward 22.2,
// 21.5, 23.5 ms. The strips depend on the shapes only: the same bits on every call.
template <class T>
Index strip_width(Index rows) {
  constexpr Index kVector = 64 / sizeof(T);
  Index strip = 2 * kVector;
  while (strip > kVector && rows * strip * Index(sizeof(T)) > 32 * 1024) strip /= 2;
  return strip;
}

// A scan's state X [rows x cols] where the engine reads it: in place, row-major (row l at
// data + l cols), or in panels, the columns of each strip stored together: the strip at column c0,
// of width w = min(strip_width(rows), cols - c0), is [rows x w] row-major at data + c0 rows. A
// row-major state's strip has its rows a state's width apart: at 256 B (U, S: d_v = 64) or 1 KiB
// (S^T, U^T: m = 256), its lines fall into a half or an eighth of L1's 64 sets, 16 to a set in
// 12-way L1s (Zen 5, Sapphire Rapids), and every pass over the strip reloads it from L2. In panels
// it is contiguous. The layout changes no arithmetic: the same bits either way.
template <class T>
struct ScanState {
  T* data;
  Index rows, cols;
  bool panels;
};

// Scans of at least this many steps keep their state in panels (PanelState); fewer (a stream's
// step) read it in place.
constexpr Index kPanelSteps = 4 * kScanBlock;

// X in panels, in this thread's scratch: load from a row-major matrix (or any [rows x cols]
// expression, such as a transpose), scan, store back. The copies cost 2 rows cols, which a long
// scan (64 steps or more a strip: 4 rows cols FLOPs each) repays.
template <class T>
class PanelState {
 public:
  PanelState(Index rows, Index cols)
      : rows_(rows), cols_(cols), strip_(strip_width<T>(rows)), memory_(rows * cols) {}

  ScanState<T> state() { return {memory_.data(), rows_, cols_, true}; }
  template <class Source>
  void load(const Source& x) {
    for (Index c0 = 0; c0 < cols_; c0 += strip_) panel(c0) = x.middleCols(c0, width(c0));
  }
  template <class Target>
  void store(Target&& x) {
    for (Index c0 = 0; c0 < cols_; c0 += strip_) x.middleCols(c0, width(c0)) = panel(c0);
  }

 private:
  Index width(Index c0) const { return std::min(strip_, cols_ - c0); }
  Eigen::Map<Matrix<T>> panel(Index c0) {
    return Eigen::Map<Matrix<T>>(memory_.data() + c0 * rows_, rows_, width(c0));
  }

  Index rows_, cols_, strip_;
  Scratch<T> memory_;
};

namespace scan_detail {

// Columns [c0, c0 + width) of X through the steps in order (Width: width at compile time, or
// Eigen::Dynamic). Runs of kGroup steps that each absorb a token and need no rescaling share one
// pass over the strip, each row of X loaded and stored once for all of them, so that the pass is
// bound by its FMAs rather than by the stores. Every entry of X and every sum still sees the same
// operations in the same order as one step at a time.
template <int Width, class T>
void strip(const ScanState<T>& X, Index c0, Index width, const ScanSteps<T>& s) {
  // At most two vectors wide (scan_steps): a Dynamic strip lives on the stack too, never on the
  // heap.
  constexpr int kMaxWidth = Width == Eigen::Dynamic ? 128 / sizeof(T) : Width;
  using Strip = Eigen::Array<T, 1, Width, Eigen::RowMajor, 1, kMaxWidth>;
  using StripMap = Eigen::Map<Strip, Eigen::Unaligned>;
  constexpr int kVectors = std::max<int>(1, kMaxWidth * sizeof(T) / 64);
  // Values and sums: 2 x 8 zmm registers (without AVX-512 twice or four times as many ymm or xmm
  // registers, which then spill; the grouping still saves the loads and stores of X).
  constexpr int kGroup = 8 / kVectors;  // 4 or 8: kVectors is at most 2
  const Index rows = X.rows, stride = X.panels ? width : X.cols;
  T* const base = X.data + (X.panels ? c0 * rows : c0);
  const auto row_of = [&](Index l) { return StripMap(base + l * stride, width); };
  const auto value_of = [&](Index r) {
    return Strip(s.weight[r] * Eigen::Map<const Strip>(s.value[r] + c0, width));
  };
  const auto store = [&](Index r, const Strip& sum) { StripMap(s.out[r] + c0, width) = sum; };
  for (Index r = 0; r < s.count;) {
    if (r + kGroup <= s.count &&
        std::all_of(s.key.begin() + r, s.key.begin() + r + kGroup,
                    [](const T* key) { return key != nullptr; }) &&
        std::all_of(s.factor.begin() + r, s.factor.begin() + r + kGroup,
                    [](T f) { return f == T(1); })) {
      const T* read[kGroup];
      const T* key[kGroup];
      Strip value[kGroup], sum[kGroup];
      for (int t = 0; t < kGroup; ++t) {
        read[t] = s.read[r + t];
        key[t] = s.key[r + t];
        value[t] = value_of(r + t);
        sum[t] = Strip::Zero(width);
      }
      for (Index l = 0; l < rows; ++l) {
        StripMap row = row_of(l);
        Strip x = row;
        for (int t = 0; t < kGroup; ++t) {
          x += key[t][l] * value[t];
          sum[t] += read[t][l] * x;
        }
        row = x;
      }
      for (int t = 0; t < kGroup; ++t) store(r + t, sum[t]);
      r += kGroup;
      continue;
    }
    if (s.factor[r] != T(1))
      for (Index l = 0; l < rows; ++l) row_of(l) *= s.factor[r];
    const T* read = s.read[r];
    Strip sum = Strip::Zero(width);
    if (s.key[r]) {
      const T* key = s.key[r];
      const Strip value = value_of(r);
      for (Index l = 0; l < rows; ++l) {
        StripMap row = row_of(l);
        row += key[l] * value;
        sum += read[l] * row;
      }
    } else {
      for (Index l = 0; l < rows; ++l) sum += read[l] * row_of(l);
    }
    store(r, sum);
    ++r;
  }
}

}  // namespace scan_detail

// Runs the steps over X (see the top of this file), a strip (strip_width) at a time.
template <class T>
void scan_steps(const ScanState<T>& X, const ScanSteps<T>& steps) {
  constexpr Index kVector = 64 / sizeof(T);
  const Index strip = strip_width<T>(X.rows);
  for (Index c0 = 0; c0 < X.cols; c0 += strip) {
    const Index width = std::min(strip, X.cols - c0);
    const auto run = [&]<int Width>(std::integral_constant<int, Width>) {
      scan_detail::strip<Width>(X, c0, width, steps);
    };
    if (width == kVector)
      run(std::integral_constant<int, int(kVector)>{});
    else if (width == 2 * kVector)
      run(std::integral_constant<int, int(2 * kVector)>{});
    else
      run(std::integral_constant<int, Eigen::Dynamic>{});
  }
}

// The same on a row-major X [rows x cols], in place.
template <class T>
void scan_steps(T* X, Index rows, Index cols, const ScanSteps<T>& steps) {
  scan_steps(ScanState<T>{X, rows, cols, false}, steps);
}

}  // namespace linrope::detail
