// Private: the angle tables a Rope builds once and its kernel reads (rope_kernel.cpp says how a
// row's angles are put together from them), and the layout facts both sides share.
#pragma once

#include <linrope/rope.hpp>
#include <span>
#include <vector>

namespace linrope::detail {

// Positions are limited to |p| <= 2^53: beyond, p is not exact in the double angle p * theta (and
// -p or p + rows could overflow).
constexpr Index kMaxPosition = Index(1) << 53;

// Rows per block: 32 while the offset table the kernel reads per row ((B + 1) x r/2 cos/sin
// pairs) stays ~16 KB, so that it shares L1 with the rows in flight; else 16. Larger blocks spread
// the per-block work (angle additions for the centre, two unpaired rows) over more rows. The
// portable kernel reads the table in double: B = 32 up to r/2 = 32 (+15% at r = 64 in cache; at
// r = 128 its 33 KB table cost ~20% once x no longer fitted in cache). The AVX-512 float kernel
// reads it in float (17 KB at r = 128, B = 32): up to r/2 = 64, rope/apply at r = 128 went from
// 0.70 to 0.75-0.82 of copy in cache and 0.63 to 0.83-0.87 out of it; double rows in the same
// build (the double table) were no slower.
inline Index block_size(Index half) {
#if defined(__AVX512F__)
  return half <= 64 ? 32 : 16;
#else
  return half <= 32 ? 32 : 16;
#endif
}

// The AVX-512 float kernel takes pairs 16 at a time, [0, whole16(half)), in float; the rest as
// 8-pair vectors and then one by one, in double.
inline Index whole16(Index half) { return half - half % 16; }

// Which pair the float kernel keeps in slot s of its tables (pairs in groups of 16): the pair
// itself in the half layout. In the interleaved one, each 128-bit lane j of a group holds pairs
// (2j, 2j+1, 8+2j, 9+2j), so that unpacklo/unpackhi of a vector with itself give
// (c0 c0 c1 c1 .. c7 c7) and (c8 c8 .. c15 c15), the cosines next to the pairs they rotate, with
// one in-lane shuffle each.
inline Index float_slot_pair(Index s, bool interleaved) {
  if (!interleaved) return s;
  const Index group = s - s % 16, lane = s % 16 / 4, e = s % 4;
  return group + (e < 2 ? 2 * lane + e : 8 + 2 * lane + e - 2);
}

// The block centre of |p| = q >= 0: the multiple of B nearest to q, ties (l = -B/2) upwards.
inline Index centre_of(Index q, Index block) { return (q + block / 2) / block * block; }

// With B = block rows per block and R = B/2, each row r/2 wide:
//   lo_cos/lo_sin row l + R: cos/sin(l theta), l = -R .. R;
//   mid_cos/mid_sin rows 0 .. B-1: cos/sin(B l theta), rows B .. 2B-1: cos/sin(B^2 l theta);
//   lo_cos_f/lo_sin_f: lo_cos/lo_sin rounded to float, pairs [0, whole16(r/2)) in the order the
//   AVX-512 float kernel loads them (float_slot_pair), row-major [B + 1 x whole16(r/2)]; empty
//   without AVX-512.
struct RopeTables {
  RopeTables(std::span<const double> theta, RopeLayout layout);
  Index block;
  std::vector<double> lo_cos, lo_sin, mid_cos, mid_sin;
  std::vector<float> lo_cos_f, lo_sin_f;
};

}  // namespace linrope::detail
