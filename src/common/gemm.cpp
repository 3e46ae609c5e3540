// The products of gemm.hpp: a packed AVX-512 micro-kernel for float, Eigen for everything else.
#include "common/gemm.hpp"

#include <algorithm>
#include <cassert>
#include <type_traits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace linrope::detail {
namespace {

// Eigen's product on the same views (double, and float without AVX-512).
template <class T, class F>
void with_eigen_map(ConstView<T> v, F&& use) {
  using Eigen::OuterStride;
  if (v.col_stride == 1) {
    use(Eigen::Map<const Matrix<T>, 0, OuterStride<>>(v.data, v.rows, v.cols,
                                                      OuterStride<>(v.row_stride)));
  } else {
    assert(v.row_stride == 1);
    using ColMajor = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>;
    use(Eigen::Map<const ColMajor, 0, OuterStride<>>(v.data, v.rows, v.cols,
                                                     OuterStride<>(v.col_stride)));
  }
}

// Always Eigen's blocked GEMM (or its GEMV for a single row or column), never its
// coefficient-based product: `out.noalias() += a * b` takes that path when rows + cols + depth
// < 20, and there the output elements before the first 16/32/64-byte aligned address are summed
// in another order than the rest, so the same product written at another address rounded
// differently (causal softmax merges key-slice states kept in a buffer whose alignment depends on
// the allocator). The blocked kernels load unaligned and sum every element of C in the same
// order, wherever a, b and c sit.
// generic_product_impl is an Eigen internal, not a documented API, and every determinism guarantee
// of the kernels rests on it. tests/test_gemm.cpp, "gemm's Eigen path
// (Eigen::internal::generic_product_impl, GemmProduct): same bits at every alignment, thread count
// and call", is the test that catches an Eigen upgrade changing it (the name alone breaks the
// build if Eigen drops it).
template <class T>
void gemm_eigen(ConstView<T> a, ConstView<T> b, View<T> c, bool accumulate) {
  Eigen::Map<Matrix<T>, 0, Eigen::OuterStride<>> out(c.data, c.rows, c.cols,
                                                     Eigen::OuterStride<>(c.row_stride));
  if (!accumulate) out.setZero();
  with_eigen_map(a, [&](const auto& am) {
    with_eigen_map(b, [&](const auto& bm) {
      using Lhs = std::decay_t<decltype(am)>;
      using Rhs = std::decay_t<decltype(bm)>;
      Eigen::internal::generic_product_impl<Lhs, Rhs, Eigen::DenseShape, Eigen::DenseShape,
                                            Eigen::GemmProduct>::scaleAndAddTo(out, am, bm, T(1));
    });
  });
}

#ifdef __AVX512F__

// Register tile kMR x kNR: 8 x 2 = 16 zmm accumulators (enough to hide the FMA latency on two
// pipes), 2 loads of B and 8 broadcasts of A per 16 FMAs. 8 rows rather than 12 because the
// kernels' blocks are 64 or 256 rows: a 12-row tile wastes 12% of a 64-row product on padding
// (measured: 64 x 256 x 64 at 197 GFLOP/s with 12 rows, 220 with 8, one core). Cache blocks: a
// kKC x kNR panel of B (32 KiB) stays in L1 while the kMC x kKC block of A (96 KiB) streams from
// L2; kKC = 256 keeps the common inner sizes (m = 256 features, 256-key blocks) in one pass.
constexpr Index kMR = 8, kNR = 32, kKC = 256, kMC = 96, kNC = 512;
// A column-major A is read in place only up to this column stride (floats): elu+1's 64-wide
// features. Wider columns map onto few L1 sets (a 1 KiB stride: 4 of 64), so FAVOR+'s 256-wide
// ones are packed. (End-to-end A/B runs of both choices differed by less than this machine's
// run-to-run noise, +-15%; the limit follows the cache argument, not a measurement.)
constexpr Index kColumnInPlace = 64;

// A C whose rows are at least this many floats (4 KiB) apart is fetched ahead (micro_kernel).
constexpr Index kFarRows = 1024;

__mmask16 first_lanes(Index count) {
  return count >= 16 ? __mmask16(0xFFFF) : count <= 0 ? __mmask16(0) : __mmask16((1u << count) - 1);
}

// r[i] = row i of a 16 x 16 block -> r[j] = column j: pairs, then quads, then 128-bit lanes.
void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]),
                  c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
      t[8 * i + j + 4] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
  }
}

// Packs x[r0 .. r0+rows, c0 .. c0+depth] as panels of Width rows, each stored depth-major (Width
// values per column), rows beyond `rows` zero-filled so that the micro-kernel needs no edge case
// there. A's blocks are packed as they are (Width = kMR), B's as their transpose (Width = kNR).
template <Index Width>
void pack_panels(ConstView<float> x, Index r0, Index c0, Index rows, Index depth, float* to) {
  for (Index r = 0; r < rows; r += Width, to += Width * depth) {
    const Index live = std::min(Width, rows - r);
    const float* from = x.data + (r0 + r) * x.row_stride + c0 * x.col_stride;
    if (x.row_stride == 1) {  // the panel's rows are adjacent: Width consecutive values per column
      for (Index p = 0; p < depth; ++p)
        for (Index g = 0; g < Width; g += 16) {  // masked: zeros past `live`, nothing past Width
          const __m512 values =
              _mm512_maskz_loadu_ps(first_lanes(live - g), from + p * x.col_stride + g);
          _mm512_mask_storeu_ps(to + p * Width + g, first_lanes(Width - g), values);
        }
      continue;
    }
    // Rows are contiguous: transpose 16 x 16 blocks in registers (a scalar gather here cost as
    // much as a quarter of the product when B = K^T).
    assert(x.col_stride == 1);
    for (Index g = 0; g < Width; g += 16) {
      const Index group = std::min<Index>(16, Width - g);
      for (Index p = 0; p < depth; p += 16) {
        const __mmask16 columns = first_lanes(depth - p);
        __m512 block[16];
        for (Index i = 0; i < 16; ++i)
          block[i] = g + i < live
                         ? _mm512_maskz_loadu_ps(columns, from + (g + i) * x.row_stride + p)
                         : _mm512_setzero_ps();
        transpose16(block);
        const __mmask16 lanes = first_lanes(group);
        for (Index j = 0; j < std::min<Index>(16, depth - p); ++j)
          _mm512_mask_storeu_ps(to + (p + j) * Width + g, lanes, block[j]);
      }
    }
  }
}

// c[0 .. Rows, 0 .. cols] (+)= A panel x packed B panel over kc, with A's element (i, p) at
// a[i * row_step + p * col_step]: packed (1, kMR), a row-major A in place (lda, 1) or a
// column-major one in place (1, lda). Fetches up to kc / 2 lines of `feed` into L2, one per two
// steps (4 Rows FMAs, 32 in a full tile) while they last.
template <Index Rows>
void micro_kernel(Index kc, const float* a, Index row_step, Index col_step, const float* b,
                  float* c, Index ldc, Index cols, bool accumulate, LineFeed& feed) {
  const float* row_of[Rows];
#pragma GCC unroll 8
  for (Index i = 0; i < Rows; ++i) row_of[i] = a + i * row_step;
  __m512 acc[Rows][2];
#pragma GCC unroll 8
  for (Index i = 0; i < Rows; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  const auto step = [&](Index p) __attribute__((always_inline)) {
    const __m512 b0 = _mm512_load_ps(b + p * kNR), b1 = _mm512_load_ps(b + p * kNR + 16);
#pragma GCC unroll 8
    for (Index i = 0; i < Rows; ++i) {
      const __m512 ai = _mm512_set1_ps(row_of[i][p * col_step]);
      acc[i][0] = _mm512_fmadd_ps(ai, b0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(ai, b1, acc[i][1]);
    }
  };
  // C's tile is read after the k loop. Where its rows are a page or more apart (softmax's dk^T
  // and dv^T, 16 KiB), every row is a separate stream the hardware prefetcher does not follow and
  // each tile waited on its loads: fetch its lines now, so that the loop hides their latency.
  // Closer rows are left alone: fetching them cost FAVOR+'s backward (C rows 256 floats apart,
  // mostly in cache) 5%.
  if (accumulate && ldc >= kFarRows)
#pragma GCC unroll 8
    for (Index i = 0; i < Rows; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc + 16), _MM_HINT_T0);
    }
  const LineFeed::Run run = feed.take(kc / 2);
  Index p = 0;
  for (Index line = 0; line < run.count; ++line, p += 2) {
    _mm_prefetch(reinterpret_cast<const char*>((run.first + line) * LineFeed::kLineBytes),
                 _MM_HINT_T1);
    step(p);
    step(p + 1);
  }
  for (; p < kc; ++p) step(p);
  const __mmask16 m0 = first_lanes(cols), m1 = first_lanes(cols - 16);
#pragma GCC unroll 8
  for (Index i = 0; i < Rows; ++i) {
    float* row = c + i * ldc;
    if (accumulate) {
      acc[i][0] = _mm512_add_ps(acc[i][0], _mm512_maskz_loadu_ps(m0, row));
      acc[i][1] = _mm512_add_ps(acc[i][1], _mm512_maskz_loadu_ps(m1, row + 16));
    }
    _mm512_mask_storeu_ps(row, m0, acc[i][0]);
    _mm512_mask_storeu_ps(row + 16, m1, acc[i][1]);
  }
}

// One tile of 1 .. kMR rows. A short tile runs as tiles of 4, 2 and 1 rows rather than as a full
// one: a one-token call (a stream's step) would otherwise do kMR times its arithmetic. Each row's
// sums are the same either way, in the same order.
void micro_tile(Index kc, const float* a, Index row_step, Index col_step, const float* b, float* c,
                Index ldc, Index rows, Index cols, bool accumulate, LineFeed& feed) {
  if (rows == kMR) {
    micro_kernel<kMR>(kc, a, row_step, col_step, b, c, ldc, cols, accumulate, feed);
    return;
  }
  Index i = 0;
  const auto tail = [&]<Index Rows>() {
    if (rows - i < Rows) return;
    micro_kernel<Rows>(kc, a + i * row_step, row_step, col_step, b, c + i * ldc, ldc, cols,
                       accumulate, feed);
    i += Rows;
  };
  tail.template operator()<4>();
  tail.template operator()<2>();
  tail.template operator()<1>();
}

// Packing buffers, 64-byte aligned for the aligned loads of B, allocated once per thread: their
// sizes are the cache-block constants (96 x 256 and 512 x 256 floats, 608 KiB a thread in all).
std::vector<float, Eigen::aligned_allocator<float>>& buffer(int which, Index size) {
  thread_local std::vector<float, Eigen::aligned_allocator<float>> buffers[2];
  auto& b = buffers[which];
  if (Index(b.size()) < size) b.resize(size);
  return b;
}

Index round_up(Index count, Index multiple) { return (count + multiple - 1) / multiple * multiple; }

// The packed form of a whole B [k x n]: its kKC x kNC cache blocks in the order gemm_packed visits
// them (columns outer), each as pack_panels<kNR> lays it out. Block (jc, pc) starts at
// jc k + round_up(nc, kNR) pc, the earlier column blocks being full (kNC is a multiple of kNR).
Index packed_offset(Index k, Index jc, Index pc, Index nc) {
  return jc * k + round_up(nc, kNR) * pc;
}

void pack_right(ConstView<float> b, float* to) {
  const Index k = b.rows, n = b.cols;
  for (Index jc = 0; jc < n; jc += kNC)
    for (Index pc = 0; pc < k; pc += kKC) {
      const Index nc = std::min(kNC, n - jc), kc = std::min(kKC, k - pc);
      pack_panels<kNR>(b.transposed(), jc, pc, nc, kc, to + packed_offset(k, jc, pc, nc));
    }
}

// B's packed kc x nc block at (pc, jc): panel jr / kNR (kNR columns, depth-major) at
// data + jr depth, where depth >= kc (a PackedBlock's panels may be deeper than the rows it uses).
struct PackedPanels {
  const float* data;
  Index depth;
};

// c (+)= a b, with b_block(jc, pc, nc, kc) giving B's PackedPanels at (pc, jc): packed on the
// spot, or taken from a PackedRight.
template <class BlockOfB>
void gemm_packed(ConstView<float> a, Index n, View<float> c, bool accumulate, const Prefetch& next,
                 BlockOfB b_block) {
  const Index m = a.rows, k = a.cols;
  LineFeed feed(next);
  float* packed_a = buffer(0, kMC * kKC).data();
  for (Index jc = 0; jc < n; jc += kNC) {
    const Index nc = std::min(kNC, n - jc);
    for (Index pc = 0; pc < k; pc += kKC) {
      const Index kc = std::min(kKC, k - pc);
      const bool add = accumulate || pc > 0;
      const PackedPanels packed_b = b_block(jc, pc, nc, kc);
      for (Index ic = 0; ic < m; ic += kMC) {
        const Index mc = std::min(kMC, m - ic);
        // A is read in place when packing would cost about as much as the product (one or two
        // panels of B: the read-out's d_v = 64 columns) or buys nothing: rows of at most 2 kKC
        // floats (the feature projection's d = 64; a model's MLP width 512) lie close enough,
        // and a column-major A (the state update's features^T) already has its kMR values per k
        // side by side. Rows 2 KiB apart put a tile's 8 rows in two L1 sets, 4 ways each (the
        // MLP's k = 512 products: 127-132 -> 203-208 GFLOP/s, bench_gemm mlp_down and up_dx);
        // widely strided rows are packed: rows 4 KiB apart would all fight over one set.
        Index row_step = 1, col_step = kMR, panel_step = kc;  // packed
        const float* panel = packed_a;
        if (a.col_stride == 1 && (nc <= 2 * kNR || a.row_stride <= 2 * kKC)) {
          row_step = panel_step = a.row_stride, col_step = 1;
          panel = a.data + ic * a.row_stride + pc;
        } else if (a.row_stride == 1 && a.col_stride <= kColumnInPlace) {
          row_step = panel_step = 1, col_step = a.col_stride;
          panel = a.data + ic + pc * a.col_stride;
        } else {
          pack_panels<kMR>(a, ic, pc, mc, kc, packed_a);
        }
        for (Index jr = 0; jr < nc; jr += kNR)
          for (Index ir = 0; ir < mc; ir += kMR)
            micro_tile(kc, panel + ir * panel_step, row_step, col_step,
                       packed_b.data + jr * packed_b.depth,
                       c.data + (ic + ir) * c.row_stride + jc + jr, c.row_stride,
                       std::min(kMR, mc - ir), std::min(kNR, nc - jr), add, feed);
      }
    }
  }
}

void gemm_packed(ConstView<float> a, ConstView<float> b, View<float> c, bool accumulate,
                 const Prefetch& next) {
  float* packed_b = buffer(1, kNC * kKC).data();
  gemm_packed(a, b.cols, c, accumulate, next, [&](Index jc, Index pc, Index nc, Index kc) {
    pack_panels<kNR>(b.transposed(), jc, pc, nc, kc, packed_b);
    return PackedPanels{packed_b, kc};
  });
}

// The panels of a PackedRight's block hold its columns as they are in the whole: the block's
// column col0 + jc lies in the whole's cache block at jc0 (a multiple of kNC), kc0 deep.
void gemm_packed(ConstView<float> a, const PackedBlock<float>& b, View<float> c, bool accumulate,
                 const Prefetch& next) {
  const PackedRight<float>& whole = *b.whole;
  gemm_packed(a, b.cols, c, accumulate, next, [&](Index jc, Index pc, Index, Index) {
    const Index column = b.col0 + jc, jc0 = column / kNC * kNC;
    const Index kc0 = std::min(kKC, whole.rows() - pc);
    const Index offset = packed_offset(whole.rows(), jc0, pc, std::min(kNC, whole.cols() - jc0));
    return PackedPanels{whole.data() + offset + (column - jc0) * kc0, kc0};
  });
}

// The whole of a PackedRight: its block from column 0, every row (the same panels at the same
// depths as packed_offset lays them out).
void gemm_packed(ConstView<float> a, const PackedRight<float>& b, View<float> c, bool accumulate,
                 const Prefetch& next) {
  gemm_packed(a, b.block(b.rows(), 0, b.cols()), c, accumulate, next);
}

#endif  // __AVX512F__

// Products with nothing to compute: c empty, or the empty sum (k = 0). Returns whether c is done.
template <class T>
bool trivial_product(Index k, View<T> c, bool accumulate) {
  if (c.rows == 0 || c.cols == 0) return true;
  if (k > 0) return false;
  if (!accumulate)
    for (Index i = 0; i < c.rows; ++i)
      std::fill(c.data + i * c.row_stride, c.data + i * c.row_stride + c.cols, T(0));
  return true;
}

// Eigen's operand for b: the view itself, or the row-major copy a PackedRight holds off AVX-512.
template <class T>
ConstView<T> eigen_operand(ConstView<T> b) {
  return b;
}
template <class T>
ConstView<T> eigen_operand(const PackedRight<T>& b) {
  return {b.data(), b.rows(), b.cols(), b.cols(), 1};
}

template <class T>
ConstView<T> eigen_operand(const PackedBlock<T>& b) {
  return {b.whole->data() + b.col0, b.rows, b.cols, b.whole->cols(), 1};
}

// The gemm overloads: b is a ConstView, a PackedRight or a PackedBlock.
template <class T, class Right>
void product(ConstView<T> a, const Right& b, View<T> c, bool accumulate,
             [[maybe_unused]] const Prefetch& next) {
  if (trivial_product(a.cols, c, accumulate)) return;
#ifdef __AVX512F__
  if constexpr (kPackedKernel<T>) {
    gemm_packed(a, b, c, accumulate, next);
    return;
  }
#endif
  gemm_eigen(a, eigen_operand(b), c, accumulate);
}

}  // namespace

template <class T>
void gemm(ConstView<T> a, ConstView<T> b, View<T> c, Write write, Prefetch next) {
  assert(a.cols == b.rows && c.rows == a.rows && c.cols == b.cols);
  product(a, b, c, write == Write::Add, next);
}

template <class T>
PackedRight<T>::PackedRight(ConstView<T> b) : rows_(b.rows), cols_(b.cols) {
#ifdef __AVX512F__
  if constexpr (kPackedKernel<T>) {
    data_.resize(round_up(cols_, kNR) * rows_);
    pack_right(b, data_.data());
    return;
  }
#endif
  data_.resize(rows_ * cols_);  // a row-major copy for Eigen
  for (Index i = 0; i < rows_; ++i)
    for (Index j = 0; j < cols_; ++j)
      data_[i * cols_ + j] = b.data[i * b.row_stride + j * b.col_stride];
}

template <class T>
void gemm(ConstView<T> a, const PackedRight<T>& b, View<T> c, Write write) {
  assert(a.cols == b.rows() && c.rows == a.rows && c.cols == b.cols());
  product(a, b, c, write == Write::Add, Prefetch{});
}

template <class T>
bool PackedRight<T>::blockable(Index col0) const {
#ifdef __AVX512F__
  static_assert(kPackedPanel == kNR);
  if (kPackedKernel<T> && rows_ > kKC && col0 % kNC != 0) return false;
#endif
  return col0 % kPackedPanel == 0;
}

template <class T>
PackedBlock<T> PackedRight<T>::block(Index rows, Index col0, Index cols) const {
  assert(rows >= 0 && rows <= rows_ && col0 >= 0 && cols >= 0 && col0 + cols <= cols_);
  assert(blockable(col0));
  return {this, rows, col0, cols};
}

template <class T>
void gemm(ConstView<T> a, const PackedBlock<T>& b, View<T> c, Write write) {
  assert(a.cols == b.rows && c.rows == a.rows && c.cols == b.cols);
  product(a, b, c, write == Write::Add, Prefetch{});
}

template void gemm<float>(ConstView<float>, ConstView<float>, View<float>, Write, Prefetch);
template void gemm<double>(ConstView<double>, ConstView<double>, View<double>, Write, Prefetch);
template class PackedRight<float>;
template class PackedRight<double>;
template void gemm<float>(ConstView<float>, const PackedRight<float>&, View<float>, Write);
template void gemm<double>(ConstView<double>, const PackedRight<double>&, View<double>, Write);
template void gemm<float>(ConstView<float>, const PackedBlock<float>&, View<float>, Write);
template void gemm<double>(ConstView<double>, const PackedBlock<double>&, View<double>, Write);

}  // namespace linrope::detail
