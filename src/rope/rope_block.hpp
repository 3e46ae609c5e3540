// Private: RoPE's portable block kernel, for any T and any target: the rows of one block of
// positions, each rotated by angles put together in double (rope_kernel.cpp says how).
#pragma once

#include <linrope/types.hpp>

namespace linrope::detail {

// The rotation of pair k by (c, s): (2k, 2k+1) interleaved, (k, k + half) half, written to the row
// x and read from x itself (InPlace; src is then null) or from the separate row src. Two
// instantiations rather than src == x, so that in place the compiler still knows every access goes
// through one restrict pointer (an aliased src cost the in-place kernel 10-25%).
template <class T, bool Interleaved, bool InPlace>
inline void rotate_pair(T* __restrict x, const T* __restrict src, Index k, Index half, T c, T s) {
  const T* from = InPlace ? x : src;
  const Index ia = Interleaved ? 2 * k : k, ib = Interleaved ? 2 * k + 1 : k + half;
  const T a0 = from[ia], b0 = from[ib];
  x[ia] = a0 * c - b0 * s;
  x[ib] = a0 * s + b0 * c;
}

// The source of the destination row x: the row at the same place relative to src0 as x is to x0;
// null in place (the kernels then read x itself) and for a null x.
template <class T, bool InPlace>
inline const T* source_row(const T* x0, const T* src0, const T* x) {
  return InPlace || x == nullptr ? nullptr : src0 + (x - x0);
}

// Pairs k0 .. half-1 of the rows xp at h + l and xm at h - l (xm may be null: xp alone), read from
// sp and sm (or, InPlace, from xp and xm themselves), from the
// centre's hc/hs and the table row lc/ls of offset l. Rows h + l and h - l share the four products
// of their angle additions. The whole row in the portable kernel, the pairs past the last multiple
// of 8 (the tail) in the AVX-512 one.
template <class T, bool Negative, bool Interleaved, bool InPlace>
inline void rotate_pairs_scalar(T* __restrict xp, const T* __restrict sp, T* __restrict xm,
                                const T* __restrict sm, Index k0, Index half,
                                const double* __restrict lc, const double* __restrict ls,
                                const double* __restrict hc, const double* __restrict hs) {
  auto sign = [](double v) { return Negative ? -v : v; };
  if (xm != nullptr) {
    for (Index k = k0; k < half; ++k) {
      const double cc = hc[k] * lc[k], ss = hs[k] * ls[k];
      const double sc = hs[k] * lc[k], cs = hc[k] * ls[k];
      rotate_pair<T, Interleaved, InPlace>(xp, sp, k, half, T(cc - ss), T(sign(sc + cs)));
      rotate_pair<T, Interleaved, InPlace>(xm, sm, k, half, T(cc + ss), T(sign(sc - cs)));
    }
  } else {
    for (Index k = k0; k < half; ++k) {
      const double c = hc[k] * lc[k] - hs[k] * ls[k], s = hs[k] * lc[k] + hc[k] * ls[k];
      rotate_pair<T, Interleaved, InPlace>(xp, sp, k, half, T(c), T(sign(s)));
    }
  }
}

// Rows the pair kernels below are handed, for one block: (xp, xm, l) with xp at h + l and xm at
// h - l (null when out of range), or xp alone at h + l with l in [-R, R) (R = reach = B/2).
// Visits every |position| q in [qa, qb] within [h - R, h + R) once, the row of q at
// x0 + (q - q0) * q_stride.
template <class T, class PairFn>
inline void for_block_rows(T* x0, Index q0, Index q_stride, Index qa, Index qb, Index h,
                           Index reach, PairFn&& pair_fn) {
  auto in_range = [&](Index q) { return q >= qa && q <= qb; };
  auto row_of = [&](Index q) { return x0 + (q - q0) * q_stride; };
  for (Index l = 0; l <= reach; ++l) {
    const bool plus = l < reach && in_range(h + l), minus = l > 0 && in_range(h - l);
    if (plus && minus) {
      pair_fn(row_of(h + l), row_of(h - l), l);
    } else if (plus) {
      pair_fn(row_of(h + l), static_cast<T*>(nullptr), l);
    } else if (minus) {
      pair_fn(row_of(h - l), static_cast<T*>(nullptr), -l);
    }
  }
}

// What a block kernel reads besides x, for the block centre h: row l + R of lo_cos/lo_sin holds
// cos/sin(l theta), hc/hs cos/sin(h theta) times the magnitude, all r/2 wide, in double. lo_cos_f
// .. hs_f: the same rounded to float, for the AVX-512 float kernel only (null otherwise): pairs
// [0, whole16(r/2)) in its slot order (float_slot_pair), lo rows whole16(r/2) wide.
struct BlockAngles {
  const double *lo_cos, *lo_sin, *hc, *hs;
  const float *lo_cos_f, *lo_sin_f, *hc_f, *hs_f;
};

// The rows of one block (see for_block_rows). Each row gets its angle (h +- l) theta by one angle
// addition in double, rounded to T (sine negated when Negative), then its rotation. Half > 0 fixes
// r/2 at compile time (the common widths: loops fully unrolled, hc/hs kept in registers across
// the block); Half = 0 takes it from half_runtime. The portable kernel: any T, any target.
template <class T, bool Negative, bool Interleaved, bool InPlace, Index Half>
void rotate_block(T* x0, const T* src0, Index q0, Index q_stride, Index qa, Index qb, Index h,
                  Index reach, const BlockAngles& angles, Index half_runtime) {
  const Index half = Half > 0 ? Half : half_runtime;
  const double* __restrict hc = angles.hc;
  const double* __restrict hs = angles.hs;
  for_block_rows(x0, q0, q_stride, qa, qb, h, reach, [&](T* xp, T* xm, Index l) {
    rotate_pairs_scalar<T, Negative, Interleaved, InPlace>(
        xp, source_row<T, InPlace>(x0, src0, xp), xm, source_row<T, InPlace>(x0, src0, xm), 0, half,
        angles.lo_cos + (reach + l) * half, angles.lo_sin + (reach + l) * half, hc, hs);
  });
}

}  // namespace linrope::detail
