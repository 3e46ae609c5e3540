// Private: RoPE's block kernel for float rows with AVX-512 (the portable one, rope_block.hpp,
// serves every other case, and this one's tail pairs).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include "rope/rope_block.hpp"
#include "rope/rope_tables.hpp"

namespace linrope::detail {

// The float kernel with AVX-512. Pairs 16 at a time: their angle additions in float, in one
// __m512 each, from the block centre's cos/sin and the offset table rounded to float. In double
// (8 pairs per __m512d, two conversions to float and, in the interleaved layout, two cross-lane
// permutes to widen (c, s) to (c c, s s)) rope/apply stayed at ~0.6 of copy in cache
// (16384 x 128, interleaved); in float, with B = 32 (block_size), 0.75-0.82. The float angle
// addition leaves cos and sin within 4 u_f, whatever the position: h theta is still reduced in
// double, once per block (rope_tolerance in tests/test_rope.cpp derives the bound). The pairs past
// the last multiple of 16 keep the double angle additions, 8 at a time, then one by one,
// where FMA keeps the arithmetic within the portable kernel's rounding bounds: c = fma(hc, lc,
// -hs ls) rounds once where cc - ss rounds three times, and a c - b s likewise.

// The interleaved layout, 8 pairs: x = [a0 b0 a1 b1 ..] read from `from`, C = [c0 c0 c1 c1 ..],
// S = [s0 s0 ..], x swapped = [b0 a0 ..]: fmaddsub gives a c - b s in the even slots, b c + a s
// in the odd ones; fmsubadd the inverse.
template <bool Negative>
[[gnu::always_inline]] inline void rotate_interleaved8(float* x, const float* from, __m512 C,
                                                       __m512 S) {
  const __m512 v = _mm512_loadu_ps(from);
  const __m512 bs = _mm512_mul_ps(_mm512_permute_ps(v, 0xB1), S);
  _mm512_storeu_ps(x, Negative ? _mm512_fmsubadd_ps(v, C, bs) : _mm512_fmaddsub_ps(v, C, bs));
}

// Rotates pairs k .. k+7 of row x by (c, s) in double, each rounded once to float.
template <bool Negative, bool Interleaved, bool InPlace>
[[gnu::always_inline]] inline void rotate_vector(float* __restrict x, const float* __restrict src,
                                                 Index k, Index half, __m512d c, __m512d s) {
  const float* from = InPlace ? x : src;  // see rotate_pair
  const __m256 cf = _mm512_cvtpd_ps(c), sf = _mm512_cvtpd_ps(s);
  if constexpr (Interleaved) {
    const __m512i dup = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    rotate_interleaved8<Negative>(x + 2 * k, from + 2 * k,
                                  _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(cf)),
                                  _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(sf)));
  } else {
    const __m256 a = _mm256_loadu_ps(from + k), b = _mm256_loadu_ps(from + k + half);
    const __m256 bs = _mm256_mul_ps(b, sf), as = _mm256_mul_ps(a, sf);
    _mm256_storeu_ps(x + k, Negative ? _mm256_fmadd_ps(a, cf, bs) : _mm256_fmsub_ps(a, cf, bs));
    _mm256_storeu_ps(x + k + half,
                     Negative ? _mm256_fmsub_ps(b, cf, as) : _mm256_fmadd_ps(b, cf, as));
  }
}

// Rotates pairs k .. k+15 of row x (k a multiple of 16) by (c, s), which hold those pairs in the
// float slot order (float_slot_pair).
template <bool Negative, bool Interleaved, bool InPlace>
[[gnu::always_inline]] inline void rotate_vector(float* __restrict x, const float* __restrict src,
                                                 Index k, Index half, __m512 c, __m512 s) {
  const float* from = InPlace ? x : src;  // see rotate_pair
  if constexpr (Interleaved) {
    // Pairs k .. k+7 with the in-lane duplicates (unpacklo) of their slots, k+8 .. k+15 with
    // unpackhi.
    rotate_interleaved8<Negative>(x + 2 * k, from + 2 * k, _mm512_unpacklo_ps(c, c),
                                  _mm512_unpacklo_ps(s, s));
    rotate_interleaved8<Negative>(x + 2 * k + 16, from + 2 * k + 16, _mm512_unpackhi_ps(c, c),
                                  _mm512_unpackhi_ps(s, s));
  } else {
    const __m512 a = _mm512_loadu_ps(from + k), b = _mm512_loadu_ps(from + k + half);
    const __m512 bs = _mm512_mul_ps(b, s), as = _mm512_mul_ps(a, s);
    _mm512_storeu_ps(x + k, Negative ? _mm512_fmadd_ps(a, c, bs) : _mm512_fmsub_ps(a, c, bs));
    _mm512_storeu_ps(x + k + half,
                     Negative ? _mm512_fmsub_ps(b, c, as) : _mm512_fmadd_ps(b, c, as));
  }
}

// lo and hi, each rounded to float, side by side: [lo_0 .. lo_7, hi_0 .. hi_7].
inline __m512 to_float16(__m512d lo, __m512d hi) {
  return _mm512_castpd_ps(
      _mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(_mm512_cvtpd_ps(lo))),
                         _mm256_castps_pd(_mm512_cvtpd_ps(hi)), 1));
}

// v[0, whole16(half)) rounded to float into out, in the float slot order (float_slot_pair).
// Interleaved, each 64-bit half of a 128-bit lane j of out is pairs (2j, 2j+1) of lo and then of
// hi; written with a compiled float_slot_pair, this loop became gathers, 26% of rope/apply.
inline void round_to_slots(const double* v, float* out, Index half, bool interleaved) {
  const __m512i order = _mm512_set_epi64(7, 3, 6, 2, 5, 1, 4, 0);
  for (Index k = 0; k < whole16(half); k += 16) {
    __m512d f = _mm512_castps_pd(to_float16(_mm512_loadu_pd(v + k), _mm512_loadu_pd(v + k + 8)));
    if (interleaved) f = _mm512_permutexvar_pd(order, f);
    _mm512_storeu_ps(out + k, _mm512_castpd_ps(f));
  }
}

// The angle additions of one vector of pairs, from k: 16 pairs in float (__m512) or 8 in double
// (__m512d), by the same steps. These helpers and rotate_vector are always_inline: left to GCC,
// the block loop lost ~15% (16384 x 128 interleaved, 190-200 -> 232 us).
inline __m512 load_vector(const float* p) { return _mm512_loadu_ps(p); }
inline __m512d load_vector(const double* p) { return _mm512_loadu_pd(p); }
inline __m512 mul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
inline __m512d mul(__m512d a, __m512d b) { return _mm512_mul_pd(a, b); }
inline __m512 fma(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
inline __m512d fma(__m512d a, __m512d b, __m512d c) { return _mm512_fmadd_pd(a, b, c); }
inline __m512 fms(__m512 a, __m512 b, __m512 c) { return _mm512_fmsub_ps(a, b, c); }
inline __m512d fms(__m512d a, __m512d b, __m512d c) { return _mm512_fmsub_pd(a, b, c); }

// Rows xp at h + l and xm at h - l: cos(h +- l) = ch cl -+ sh sl, sin(h +- l) = sh cl +- ch sl;
// the two rows share sh sl and ch sl.
template <bool Negative, bool Interleaved, bool InPlace, class S>
[[gnu::always_inline]] inline void rotate_two_rows(float* __restrict xp, const float* __restrict sp,
                                                   float* __restrict xm, const float* __restrict sm,
                                                   Index k, Index half, const S* __restrict hc,
                                                   const S* __restrict hs, const S* __restrict lc,
                                                   const S* __restrict ls) {
  const auto ch = load_vector(hc + k), sh = load_vector(hs + k);
  const auto cl = load_vector(lc + k), sl = load_vector(ls + k);
  const auto ss = mul(sh, sl), cs = mul(ch, sl);
  rotate_vector<Negative, Interleaved, InPlace>(xp, sp, k, half, fms(ch, cl, ss), fma(sh, cl, cs));
  rotate_vector<Negative, Interleaved, InPlace>(xm, sm, k, half, fma(ch, cl, ss), fms(sh, cl, cs));
}

// Row xp alone, at h + l.
template <bool Negative, bool Interleaved, bool InPlace, class S>
[[gnu::always_inline]] inline void rotate_one_row(float* __restrict xp, const float* __restrict sp,
                                                  Index k, Index half, const S* __restrict hc,
                                                  const S* __restrict hs, const S* __restrict lc,
                                                  const S* __restrict ls) {
  const auto ch = load_vector(hc + k), sh = load_vector(hs + k);
  const auto cl = load_vector(lc + k), sl = load_vector(ls + k);
  rotate_vector<Negative, Interleaved, InPlace>(xp, sp, k, half, fms(ch, cl, mul(sh, sl)),
                                                fma(sh, cl, mul(ch, sl)));
}

template <bool Negative, bool Interleaved, bool InPlace, Index Half>
void rotate_block_avx512(float* x0, const float* src0, Index q0, Index q_stride, Index qa, Index qb,
                         Index h, Index reach, const BlockAngles& angles, Index half_runtime) {
  const Index half = Half > 0 ? Half : half_runtime;
  const Index v16 = whole16(half), vec = half - half % 8;  // see whole16
  const double* __restrict hc = angles.hc;
  const double* __restrict hs = angles.hs;
  const float* __restrict hcf = angles.hc_f;
  const float* __restrict hsf = angles.hs_f;
  for_block_rows(x0, q0, q_stride, qa, qb, h, reach, [&](float* xp, float* xm, Index l) {
    const float* sp = source_row<float, InPlace>(x0, src0, xp);
    const float* sm = source_row<float, InPlace>(x0, src0, xm);
    const double* __restrict lc = angles.lo_cos + (reach + l) * half;
    const double* __restrict ls = angles.lo_sin + (reach + l) * half;
    const float* __restrict lcf = angles.lo_cos_f + (reach + l) * v16;
    const float* __restrict lsf = angles.lo_sin_f + (reach + l) * v16;
    if (xm != nullptr) {
      for (Index k = 0; k < v16; k += 16)
        rotate_two_rows<Negative, Interleaved, InPlace>(xp, sp, xm, sm, k, half, hcf, hsf, lcf,
                                                        lsf);
      for (Index k = v16; k < vec; k += 8)
        rotate_two_rows<Negative, Interleaved, InPlace>(xp, sp, xm, sm, k, half, hc, hs, lc, ls);
    } else {
      for (Index k = 0; k < v16; k += 16)
        rotate_one_row<Negative, Interleaved, InPlace>(xp, sp, k, half, hcf, hsf, lcf, lsf);
      for (Index k = v16; k < vec; k += 8)
        rotate_one_row<Negative, Interleaved, InPlace>(xp, sp, k, half, hc, hs, lc, ls);
    }
    if (vec < half)
      rotate_pairs_scalar<float, Negative, Interleaved, InPlace>(xp, sp, xm, sm, vec, half, lc, ls,
                                                                 hc, hs);
  });
}
}  // namespace linrope::detail

#endif  // __AVX512F__
