// RoPE's kernel: picks a block kernel (rope_block.hpp, rope_block_avx512.hpp) and walks the rows
// block by block, keeping the cos/sin of the current block centre (Rotator).
#include <algorithm>
#include <array>
#include <cassert>
#include <cmath>
#include <span>
#include <type_traits>
#include <vector>

#include "rope/rope_access.hpp"
#include "rope/rope_block.hpp"
#include "rope/rope_block_avx512.hpp"
#include "rope/rope_tables.hpp"

namespace linrope::detail {
namespace {

// Angles. With a block size B (16 or 32, see block_size), a position's magnitude is written
// |p| = h + l with h a multiple of B (the block centre) and l in [-B/2, B/2), and
// h = top + B^2 m2 + B m1 with top a multiple of B^3 and m1, m2 in [0, B). cos/sin(l theta),
// (B m1 theta) and (B^2 m2 theta) come from three small tables, cos/sin(top theta) from
// std::cos/sin once per B^3 consecutive rows, and angle additions in double join them: error
// ~|p theta| u_d + a few u_d, where a float angle at p = 10^6 is already off by ~0.06 rad.
// Per row that is one angle addition per pair, fused with the rotation (in float in the AVX-512
// float kernel, from the centre's and the table's cos/sin rounded to float: rotate_block_avx512);
// the rest runs once per block or less. Rows h + l and h - l share the four products of their angle
// additions (cos(h +- l) = ch cl -+ sh sl, sin(h +- l) = sh cl +- ch sl), which halves the
// multiplications of the per-row work. A std::sincos per pair per block would cost as much as the
// rotation itself.

// Software prefetch of the next block's rows, one per 64-byte line, only for x of 16 MB or more:
// there the centre-outwards row order of the kernel defeats the hardware prefetcher (rope at
// n = 65536, d = 128 went from 20 to 38 GB/s on the 32 MB-L3 development machine); below, x is
// cache-resident and the prefetch instructions only cost (~10% at 2-8 MB).
constexpr Index kPrefetchStride = 64;
constexpr Index kPrefetchBytes = Index(1) << 24;

template <class T>
using BlockKernel = void (*)(T*, const T*, Index, Index, Index, Index, Index, Index,
                             const BlockAngles&, Index);

template <class T, bool Negative, bool Interleaved, bool InPlace>
BlockKernel<T> pick_kernel(Index half) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    switch (half) {
      case 16:
        return rotate_block_avx512<Negative, Interleaved, InPlace, 16>;
      case 32:
        return rotate_block_avx512<Negative, Interleaved, InPlace, 32>;
      case 64:
        return rotate_block_avx512<Negative, Interleaved, InPlace, 64>;
      case 128:
        return rotate_block_avx512<Negative, Interleaved, InPlace, 128>;
      default:
        return rotate_block_avx512<Negative, Interleaved, InPlace, 0>;
    }
  }
#endif
  switch (half) {
    case 16:
      return rotate_block<T, Negative, Interleaved, InPlace, 16>;
    case 32:
      return rotate_block<T, Negative, Interleaved, InPlace, 32>;
    case 64:
      return rotate_block<T, Negative, Interleaved, InPlace, 64>;
    default:
      return rotate_block<T, Negative, Interleaved, InPlace, 0>;
  }
}

// Room for n values: in `in` when they fit, else in `heap`.
template <class V, std::size_t N>
V* inline_or_heap(std::array<V, N>& in, std::vector<V>& heap, Index n) {
  if (n <= Index(N)) return in.data();
  heap.resize(std::size_t(n));
  return heap.data();
}

// cos/sin(top theta_k) for every k, into cos_out/sin_out: std::cos/sin, remembered per thread for
// the last four (theta, top), 3 x r/2 doubles each, so bounded. A rope call that starts a new
// Rotator at |p| >= B^3 (4096 rows when B = 16) would otherwise pay r/2 of each again, however few
// its rows: a stream's one-token step of FAVOR+ (m = 256) spent 30% of its time there. The cache
// holds the frequencies themselves, not the Rope's address, so a Rope destroyed and another built
// in its place can never match wrongly; the values are the ones the libm calls give, so results are
// bitwise the same.
void top_angles(std::span<const double> theta, Index top, double* cos_out, double* sin_out) {
  struct Entry {
    Index top = 0;
    std::vector<double> theta, cos, sin;
  };
  constexpr std::size_t kEntries = 4;  // e.g. the ropes of q and of k, on features and on x
  thread_local std::array<Entry, kEntries> cache;
  thread_local std::size_t next_victim = 0;
  const auto same_theta = [&](const Entry& e) {
    return std::equal(e.theta.begin(), e.theta.end(), theta.begin(), theta.end());
  };
  auto hit = std::find_if(cache.begin(), cache.end(),
                          [&](const Entry& e) { return e.top == top && same_theta(e); });
  if (hit == cache.end()) {
    // The key (theta, top) is written last: an allocation that throws on the way leaves an entry
    // with no frequencies, which matches nothing.
    hit = cache.begin() + next_victim;
    hit->theta.clear();
    hit->cos.resize(theta.size());
    hit->sin.resize(theta.size());
    for (std::size_t k = 0; k < theta.size(); ++k) {
      const double angle = double(top) * theta[k];
      hit->cos[k] = std::cos(angle);
      hit->sin[k] = std::sin(angle);
    }
    hit->theta.assign(theta.begin(), theta.end());
    hit->top = top;
    next_victim = (next_victim + 1) % kEntries;
  }
  std::copy(hit->cos.begin(), hit->cos.end(), cos_out);
  std::copy(hit->sin.begin(), hit->sin.end(), sin_out);
}

// Rotates rows of x in place. A row at position p turns by -|p| theta when p < 0 (cos is even,
// sin odd), so that every table angle is at most ~|p| theta and the rounding error stays
// ~|p theta| u_d on both sides of 0. Keeps cos/sin (times the magnitude) of the current block
// centre h, and cos/sin of its B^2- and B^3-row spans, recomputing each only when a position
// leaves it. Those six r/2-wide buffers live inside the object up to r/2 = kInlinePairs (the
// linear-attention kernels call rotate_rows once per chunk of rows; no heap allocation there).
template <class T>
class Rotator {
 public:
  Rotator(const Rope& rope, const RopeTables& tables, std::span<const double> theta, Turn turn)
      : theta_(theta),
        lo_cos_(tables.lo_cos.data()),
        lo_sin_(tables.lo_sin.data()),
        lo_cos_f_(tables.lo_cos_f.data()),
        lo_sin_f_(tables.lo_sin_f.data()),
        mid_cos_(tables.mid_cos.data()),
        mid_sin_(tables.mid_sin.data()),
        half_(Index(theta.size())),
        scale_(turn == Turn::Inverse ? 1.0 / rope.magnitude() : rope.magnitude()),
        dim_(rope.dim()),
        dim_bytes_(Index(sizeof(T)) * rope.dim()),
        block_rows_(tables.block),
        reach_(tables.block / 2),
        mid2_(tables.block * tables.block),
        top_span_(tables.block * tables.block * tables.block) {
    double* buffers = inline_or_heap(inline_, heap_, 6 * half_);
    top_cos_ = buffers;
    top_sin_ = buffers + half_;
    span_cos_ = buffers + 2 * half_;
    span_sin_ = buffers + 3 * half_;
    block_cos_ = buffers + 4 * half_;
    block_sin_ = buffers + 5 * half_;
    interleaved_ = rope.config().layout == RopeLayout::Interleaved;
    if constexpr (kFloatAngles) {
      float* floats = inline_or_heap(inline_f_, heap_f_, 2 * half_);
      block_cos_f_ = floats;
      block_sin_f_ = floats + half_;
    }
    const bool reverse = turn != Turn::Apply;
    pick_directions<false>(interleaved_, reverse, forward_[0], backward_[0]);
    pick_directions<true>(interleaved_, reverse, forward_[1], backward_[1]);
  }
  Rotator(const Rotator&) = delete;
  Rotator& operator=(const Rotator&) = delete;

  // x [rows x dim] with row stride `stride`, row i at position first + i. Rows are read from src
  // (same stride; null: in place); the columns past the rotary width are then copied over too.
  void run(T* x, Index rows, Index stride, Index first, const T* src = nullptr) {
    if (rows <= 0) return;
    const T* source = src ? src : x;
    const int in_place = source == x ? 1 : 0;
    prefetch_ = rows * stride * Index(sizeof(T)) >= kPrefetchBytes;
    const Index last = first + rows - 1;
    if (first < 0) {  // rows 0 .. at p = first .. min(last, -1): |p| from -first down to qa
      const Index qb = -first, qa = last < 0 ? -last : 1;
      blocks(backward_[in_place], x, source, qb, -stride, qa, qb);
    }
    if (last >= 0) {  // rows at p = max(first, 0) .. last
      const Index qa = std::max<Index>(first, 0);
      blocks(forward_[in_place], x + (qa - first) * stride, source + (qa - first) * stride, qa,
             stride, qa, last);
    }
    if (source != x && 2 * half_ < dim_)  // out of place: the unrotated columns too
      for (Index i = 0; i < rows; ++i)
        std::copy(source + i * stride + 2 * half_, source + i * stride + dim_,
                  x + i * stride + 2 * half_);
  }

  // One row at position p, in place.
  void row(T* x, Index p) {
    const Index q = p < 0 ? -p : p;
    blocks(p < 0 ? backward_[1] : forward_[1], x, x, q, 0, q, q);
  }

 private:
  static constexpr Index kInlinePairs = 128;  // r = 256: the m = 256 features of linear attention
#if defined(__AVX512F__)
  static constexpr bool kFloatAngles = std::is_same_v<T, float>;  // rotate_block_avx512
#else
  static constexpr bool kFloatAngles = false;
#endif

  // The kernels for p >= 0 (forward) and p < 0 (backward); R^-1 and R^T turn the other way
  // (`reverse`): negative angles for p >= 0, positive ones for p < 0.
  template <bool InPlace>
  void pick_directions(bool interleaved, bool reverse, BlockKernel<T>& forward,
                       BlockKernel<T>& backward) const {
    const BlockKernel<T> neg = interleaved ? pick_kernel<T, true, true, InPlace>(half_)
                                           : pick_kernel<T, true, false, InPlace>(half_);
    const BlockKernel<T> pos = interleaved ? pick_kernel<T, false, true, InPlace>(half_)
                                           : pick_kernel<T, false, false, InPlace>(half_);
    forward = reverse ? neg : pos;
    backward = reverse ? pos : neg;
  }

  // All blocks that meet |positions| [qa, qb]; the row of q at x0 + (q - q0) * q_stride.
  void blocks(BlockKernel<T> kernel, T* x0, const T* src0, Index q0, Index q_stride, Index qa,
              Index qb) {
    for (Index h = centre_of(qa, block_rows_); h - reach_ <= qb; h += block_rows_) {
      // The kernel visits a block's rows from the centre outwards, which the hardware prefetcher
      // does not follow; fetch the next block's rows (in memory order) while this one computes.
      if (prefetch_) {
        const Index na = std::max(qa, h + reach_), nb = std::min(qb, h + reach_ + block_rows_ - 1);
        for (Index q = na; q <= nb; ++q) {
          const char* r = reinterpret_cast<const char*>(src0 + (q - q0) * q_stride);
          for (Index byte = 0; byte < dim_bytes_; byte += kPrefetchStride)
            __builtin_prefetch(r + byte, 1);
        }
      }
      seek_block(h);
      kernel(x0, src0, q0, q_stride, qa, qb, h, reach_,
             BlockAngles{lo_cos_, lo_sin_, block_cos_, block_sin_, lo_cos_f_, lo_sin_f_,
                         block_cos_f_, block_sin_f_},
             half_);
    }
  }

  // (c, s) <- scale (c a - s b, s a + c b): angle addition, i.e. multiplication by e^(i beta).
  static void add_angle(const double* __restrict c, const double* __restrict s,
                        const double* __restrict a, const double* __restrict b, double scale,
                        double* __restrict out_c, double* __restrict out_s, Index n) {
    for (Index k = 0; k < n; ++k) {
      const double oc = c[k] * a[k] - s[k] * b[k], os = s[k] * a[k] + c[k] * b[k];
      out_c[k] = scale * oc;
      out_s[k] = scale * os;
    }
  }

  void seek_block(Index h) {  // h >= 0, a multiple of B
    if (block_valid_ && h == block_) return;
    const Index span = h - h % mid2_, top = h - h % top_span_;
    if (!span_valid_ || span != span_) {
      if (!top_valid_ || top != top_) {
        // Every run from position 0 to B^3 - 1 (32768 or 4096 rows) stays at top = 0: no libm
        // calls there (r/2 sincos per call were ~5% of rotate_rows at 4096 rows of 64).
        if (top == 0) {
          std::fill(top_cos_, top_cos_ + half_, 1.0);
          std::fill(top_sin_, top_sin_ + half_, 0.0);
        } else {
          top_angles(theta_, top, top_cos_, top_sin_);
        }
        top_ = top;
        top_valid_ = true;
      }
      const Index row2 = (block_rows_ + (span - top) / mid2_) * half_;
      add_angle(top_cos_, top_sin_, mid_cos_ + row2, mid_sin_ + row2, 1.0, span_cos_, span_sin_,
                half_);
      span_ = span;
      span_valid_ = true;
    }
    const Index row1 = ((h - span) / block_rows_) * half_;
    add_angle(span_cos_, span_sin_, mid_cos_ + row1, mid_sin_ + row1, scale_, block_cos_,
              block_sin_, half_);
#if defined(__AVX512F__)
    if constexpr (kFloatAngles) {
      round_to_slots(block_cos_, block_cos_f_, half_, interleaved_);
      round_to_slots(block_sin_, block_sin_f_, half_, interleaved_);
    }
#endif
    block_ = h;
    block_valid_ = true;
  }

  std::span<const double> theta_;
  const double *lo_cos_, *lo_sin_;
  const float *lo_cos_f_, *lo_sin_f_;
  const double *mid_cos_, *mid_sin_;
  Index half_;
  double scale_;
  Index dim_, dim_bytes_;
  Index block_rows_, reach_, mid2_, top_span_;  // B, B/2, B^2, B^3
  bool prefetch_ = false;
  BlockKernel<T> forward_[2], backward_[2];  // [out of place, in place], for p >= 0 and p < 0
  bool top_valid_ = false, span_valid_ = false, block_valid_ = false;
  Index top_ = 0, span_ = 0, block_ = 0;
  // Six r/2-wide buffers, in this order, in inline_ or (r/2 > kInlinePairs) heap_.
  double *top_cos_ = nullptr, *top_sin_ = nullptr, *span_cos_ = nullptr, *span_sin_ = nullptr,
         *block_cos_ = nullptr, *block_sin_ = nullptr;
  std::array<double, 6 * kInlinePairs> inline_;
  std::vector<double> heap_;
  // block_cos_/sin_ rounded to float in the float kernel's slot order (kFloatAngles only; else
  // null), in inline_f_ or (r/2 > kInlinePairs) heap_f_.
  bool interleaved_ = false;
  float *block_cos_f_ = nullptr, *block_sin_f_ = nullptr;
  std::array<float, kFloatAngles ? 2 * kInlinePairs : 0> inline_f_;
  std::vector<float> heap_f_;
};

}  // namespace

template <class T>
void RopeAccess::rotate_rows(const Rope& rope, T* x, Index rows, Index stride, Index first,
                             Turn turn) {
  assert(first >= -kMaxPosition && first <= kMaxPosition && rows - 1 <= kMaxPosition - first);
  Rotator<T>(rope, *rope.tables_, rope.theta_, turn).run(x, rows, stride, first);
}

template <class T>
void RopeAccess::rotate_rows(const Rope& rope, const T* from, T* to, Index rows, Index stride,
                             Index first, Turn turn) {
  assert(first >= -kMaxPosition && first <= kMaxPosition && rows - 1 <= kMaxPosition - first);
  Rotator<T>(rope, *rope.tables_, rope.theta_, turn).run(to, rows, stride, first, from);
}

template <class T>
void RopeAccess::rotate_rows(const Rope& rope, T* x, Index rows, Index stride,
                             std::span<const Index> positions, Turn turn) {
  assert(Index(positions.size()) == rows);
  Rotator<T> rotator(rope, *rope.tables_, rope.theta_, turn);
  for (Index i = 0; i < rows; ++i) rotator.row(x + i * stride, positions[std::size_t(i)]);
}

template void RopeAccess::rotate_rows<float>(const Rope&, float*, Index, Index, Index, Turn);
template void RopeAccess::rotate_rows<double>(const Rope&, double*, Index, Index, Index, Turn);
template void RopeAccess::rotate_rows<float>(const Rope&, const float*, float*, Index, Index, Index,
                                             Turn);
template void RopeAccess::rotate_rows<double>(const Rope&, const double*, double*, Index, Index,
                                              Index, Turn);
template void RopeAccess::rotate_rows<float>(const Rope&, float*, Index, Index,
                                             std::span<const Index>, Turn);
template void RopeAccess::rotate_rows<double>(const Rope&, double*, Index, Index,
                                              std::span<const Index>, Turn);

}  // namespace linrope::detail
