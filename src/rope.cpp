// RoPE: configuration checks, scaled frequencies, and the element-wise rotation kernel.
#include <algorithm>
#include <array>
#include <cassert>
#include <cmath>
#include <complex>
#include <linrope/rope.hpp>
#include <numbers>
#include <span>
#include <type_traits>
#include <vector>

#include "check.hpp"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace linrope {
namespace {

constexpr std::string_view kFn = "Rope";
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

void check_config(const RopeConfig& c) {
  if (c.dim < 1) detail::throw_invalid(kFn, "dim is ", c.dim, " but expected dim >= 1");
  const Index r = c.rotary_dim == 0 ? c.dim : c.rotary_dim;
  if (r < 0 || r % 2 != 0)
    detail::throw_invalid(kFn, "rotary_dim is ", r, " but expected an even number >= 2",
                          c.rotary_dim == 0 ? " (rotary_dim = 0 means dim)" : "");
  if (r > c.dim)
    detail::throw_invalid(kFn, "rotary_dim is ", r, " but expected rotary_dim <= dim = ", c.dim);
  if (!std::isfinite(c.base) || c.base <= 0)
    detail::throw_invalid(kFn, "base is ", c.base, " but expected a finite base > 0");
  const RopeScaling& s = c.scaling;
  if (s.kind == RopeScalingKind::None) return;
  if (!std::isfinite(s.factor) || s.factor <= 0)
    detail::throw_invalid(kFn, "scaling.factor is ", s.factor, " but expected a finite factor > 0");
  if (s.kind == RopeScalingKind::Ntk && r <= 2)
    detail::throw_invalid(kFn, "rotary_dim is ", r,
                          " but Ntk scaling needs rotary_dim > 2 (base * s^(r/(r-2)))");
  if (s.kind == RopeScalingKind::Yarn) {
    if (s.original_max_position <= 0)
      detail::throw_invalid(kFn, "scaling.original_max_position is ", s.original_max_position,
                            " but Yarn needs original_max_position > 0");
    if (!std::isfinite(s.beta_fast) || !std::isfinite(s.beta_slow) || s.beta_fast <= s.beta_slow)
      detail::throw_invalid(kFn, "scaling.beta_fast is ", s.beta_fast, " and beta_slow is ",
                            s.beta_slow, " but Yarn needs finite beta_fast > beta_slow");
  }
}

}  // namespace

Rope::Rope(const RopeConfig& config) : config_(config) {
  check_config(config);
  rotary_dim_ = config.rotary_dim == 0 ? config.dim : config.rotary_dim;
  const Index half = rotary_dim_ / 2;
  const RopeScaling& s = config.scaling;
  double base = config.base;
  if (s.kind == RopeScalingKind::Ntk)
    base *= std::pow(s.factor, double(rotary_dim_) / double(rotary_dim_ - 2));
  theta_.resize(half);
  for (Index i = 0; i < half; ++i)
    theta_[i] = std::pow(base, -2.0 * double(i) / double(rotary_dim_));
  if (s.kind == RopeScalingKind::Linear) {
    for (double& t : theta_) t /= s.factor;
  } else if (s.kind == RopeScalingKind::Yarn) {
    for (double& t : theta_) {
      const double turns = double(s.original_max_position) * t / (2 * std::numbers::pi);
      const double gamma =
          std::clamp((turns - s.beta_slow) / (s.beta_fast - s.beta_slow), 0.0, 1.0);
      t = (1 - gamma) * t / s.factor + gamma * t;
    }
    if (s.factor > 1) magnitude_ = 0.1 * std::log(s.factor) + 1.0;
  }
  // With B = table_block_ and R = B/2: table_cos_/sin_ row l + R: cos/sin(l theta), l = -R .. R.
  // block_cos_/sin_ rows 0 .. B-1: cos/sin(B l theta), rows B .. 2B-1: cos/sin(B^2 l theta),
  // l = 0 .. B-1. Each row r/2 wide.
  const Index B = table_block_ = block_size(half), R = B / 2;
  table_cos_.resize((2 * R + 1) * half);
  table_sin_.resize((2 * R + 1) * half);
  block_cos_.resize(2 * B * half);
  block_sin_.resize(2 * B * half);
  for (Index l = -R; l <= R; ++l)
    for (Index k = 0; k < half; ++k) {
      table_cos_[(l + R) * half + k] = std::cos(double(l) * theta_[k]);
      table_sin_[(l + R) * half + k] = std::sin(double(l) * theta_[k]);
    }
  for (Index l = 0; l < B; ++l)
    for (Index k = 0; k < half; ++k) {
      block_cos_[l * half + k] = std::cos(double(l * B) * theta_[k]);
      block_sin_[l * half + k] = std::sin(double(l * B) * theta_[k]);
      block_cos_[(B + l) * half + k] = std::cos(double(l * B * B) * theta_[k]);
      block_sin_[(B + l) * half + k] = std::sin(double(l * B * B) * theta_[k]);
    }
#if defined(__AVX512F__)  // only the AVX-512 float kernel reads them
  const Index v16 = whole16(half);
  const bool interleaved = config.layout == RopeLayout::Interleaved;
  table_cos_f_.resize((2 * R + 1) * v16);
  table_sin_f_.resize((2 * R + 1) * v16);
  for (Index l = 0; l <= 2 * R; ++l)
    for (Index s = 0; s < v16; ++s) {
      table_cos_f_[l * v16 + s] = float(table_cos_[l * half + float_slot_pair(s, interleaved)]);
      table_sin_f_[l * v16 + s] = float(table_sin_[l * half + float_slot_pair(s, interleaved)]);
    }
#endif
}

namespace {

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

#if defined(__AVX512F__)
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
// the block loop lost ~15% (16384 x 128 interleaved, 190-200 -> 232 us), as in stop 10's item 15.
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
#endif

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
// the last few (theta, top). A rope call that starts a new Rotator at |p| >= B^3 (4096 rows when
// B = 16) would otherwise pay r/2 of each again, however few its rows: a stream's one-token step
// of FAVOR+ (m = 256) spent 30% of its time there. The cache holds the frequencies themselves,
// not the Rope's address, so a Rope destroyed and another built in its place can never match
// wrongly; the values are the ones the libm calls give, so results are bitwise the same.
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
  Rotator(std::span<const double> theta, const std::vector<double>& lo_cos,
          const std::vector<double>& lo_sin, const std::vector<float>& lo_cos_f,
          const std::vector<float>& lo_sin_f, const std::vector<double>& mid_cos,
          const std::vector<double>& mid_sin, double magnitude, RopeLayout layout, bool inverse,
          Index dim, Index block)
      : theta_(theta),
        lo_cos_(lo_cos.data()),
        lo_sin_(lo_sin.data()),
        lo_cos_f_(lo_cos_f.data()),
        lo_sin_f_(lo_sin_f.data()),
        mid_cos_(mid_cos.data()),
        mid_sin_(mid_sin.data()),
        half_(Index(theta.size())),
        scale_(inverse ? 1.0 / magnitude : magnitude),
        dim_(dim),
        dim_bytes_(Index(sizeof(T)) * dim),
        block_rows_(block),
        reach_(block / 2),
        mid2_(block * block),
        top_span_(block * block * block) {
    double* buffers = inline_or_heap(inline_, heap_, 6 * half_);
    top_cos_ = buffers;
    top_sin_ = buffers + half_;
    span_cos_ = buffers + 2 * half_;
    span_sin_ = buffers + 3 * half_;
    block_cos_ = buffers + 4 * half_;
    block_sin_ = buffers + 5 * half_;
    interleaved_ = layout == RopeLayout::Interleaved;
    if constexpr (kFloatAngles) {
      float* floats = inline_or_heap(inline_f_, heap_f_, 2 * half_);
      block_cos_f_ = floats;
      block_sin_f_ = floats + half_;
    }
    pick_directions<false>(interleaved_, inverse, forward_[0], backward_[0]);
    pick_directions<true>(interleaved_, inverse, forward_[1], backward_[1]);
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

  // The kernels for p >= 0 (forward) and p < 0 (backward); the inverse turns the other way:
  // negative angles for p >= 0, positive ones for p < 0.
  template <bool InPlace>
  void pick_directions(bool interleaved, bool inverse, BlockKernel<T>& forward,
                       BlockKernel<T>& backward) const {
    const BlockKernel<T> neg = interleaved ? pick_kernel<T, true, true, InPlace>(half_)
                                           : pick_kernel<T, true, false, InPlace>(half_);
    const BlockKernel<T> pos = interleaved ? pick_kernel<T, false, true, InPlace>(half_)
                                           : pick_kernel<T, false, false, InPlace>(half_);
    forward = inverse ? neg : pos;
    backward = inverse ? pos : neg;
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
void Rope::rotate_rows(T* x, Index rows, Index stride, Index first_position, bool inverse) const {
  assert(first_position >= -kMaxPosition && first_position <= kMaxPosition &&
         rows - 1 <= kMaxPosition - first_position);
  Rotator<T>(theta_, table_cos_, table_sin_, table_cos_f_, table_sin_f_, block_cos_, block_sin_,
             magnitude_, config_.layout, inverse, config_.dim, table_block_)
      .run(x, rows, stride, first_position);
}

template <class T>
void Rope::apply_checked(Eigen::Ref<Matrix<T>> x, Index first_position, bool inverse) const {
  const std::string_view fn = inverse ? "Rope::apply_inverse" : "Rope::apply";
  if (x.cols() != config_.dim)
    detail::throw_invalid(fn, "x is ", detail::shape_of(x),
                          " but the rope has dim = ", config_.dim);
  if (first_position < -kMaxPosition || first_position > kMaxPosition ||
      x.rows() - 1 > kMaxPosition - first_position)
    detail::throw_invalid(fn, "first_position is ", first_position, " with ", x.rows(),
                          " rows but expected every position within +-2^53 = ", kMaxPosition);
  rotate_rows(x.data(), x.rows(), x.outerStride(), first_position, inverse);
}

template <class T>
void Rope::apply_checked(Eigen::Ref<Matrix<T>> x, std::span<const Index> positions,
                         bool inverse) const {
  const std::string_view fn = inverse ? "Rope::apply_inverse" : "Rope::apply";
  if (x.cols() != config_.dim)
    detail::throw_invalid(fn, "x is ", detail::shape_of(x),
                          " but the rope has dim = ", config_.dim);
  if (Index(positions.size()) != x.rows())
    detail::throw_invalid(fn, "positions has ", positions.size(), " entries but x has ", x.rows(),
                          " rows");
  for (std::size_t i = 0; i < positions.size(); ++i)
    if (positions[i] < -kMaxPosition || positions[i] > kMaxPosition)
      detail::throw_invalid(fn, "positions[", i, "] is ", positions[i],
                            " but expected a position within +-2^53 = ", kMaxPosition);
  Rotator<T> rotator(theta_, table_cos_, table_sin_, table_cos_f_, table_sin_f_, block_cos_,
                     block_sin_, magnitude_, config_.layout, inverse, config_.dim, table_block_);
  for (Index i = 0; i < x.rows(); ++i) rotator.row(x.data() + i * x.outerStride(), positions[i]);
}

void Rope::apply(Eigen::Ref<MatrixF> x, Index p) const { apply_checked<float>(x, p, false); }
void Rope::apply(Eigen::Ref<MatrixD> x, Index p) const { apply_checked<double>(x, p, false); }
void Rope::apply(Eigen::Ref<MatrixF> x, std::span<const Index> p) const {
  apply_checked<float>(x, p, false);
}
void Rope::apply(Eigen::Ref<MatrixD> x, std::span<const Index> p) const {
  apply_checked<double>(x, p, false);
}
void Rope::apply_inverse(Eigen::Ref<MatrixF> x, Index p) const { apply_checked<float>(x, p, true); }
void Rope::apply_inverse(Eigen::Ref<MatrixD> x, Index p) const {
  apply_checked<double>(x, p, true);
}
void Rope::apply_inverse(Eigen::Ref<MatrixF> x, std::span<const Index> p) const {
  apply_checked<float>(x, p, true);
}
void Rope::apply_inverse(Eigen::Ref<MatrixD> x, std::span<const Index> p) const {
  apply_checked<double>(x, p, true);
}

template <class T>
void Rope::rotate_rows(const T* from, T* to, Index rows, Index stride, Index first_position,
                       bool inverse) const {
  assert(first_position >= -kMaxPosition && first_position <= kMaxPosition &&
         rows - 1 <= kMaxPosition - first_position);
  Rotator<T>(theta_, table_cos_, table_sin_, table_cos_f_, table_sin_f_, block_cos_, block_sin_,
             magnitude_, config_.layout, inverse, config_.dim, table_block_)
      .run(to, rows, stride, first_position, from);
}

template void Rope::rotate_rows<float>(float*, Index, Index, Index, bool) const;
template void Rope::rotate_rows<double>(double*, Index, Index, Index, bool) const;
template void Rope::rotate_rows<float>(const float*, float*, Index, Index, Index, bool) const;
template void Rope::rotate_rows<double>(const double*, double*, Index, Index, Index, bool) const;

std::vector<double> rope_decay_curve(const Rope& rope, Index max_distance) {
  if (max_distance < 0)
    detail::throw_invalid("rope_decay_curve", "max_distance is ", max_distance,
                          " but expected max_distance >= 0");
  const std::vector<double> theta = rope.frequencies();
  const Index half = Index(theta.size());
  std::vector<double> curve(max_distance + 1);
  for (Index m = 0; m <= max_distance; ++m) {
    std::complex<double> partial = 0;  // S_j = sum_{i<j} exp(1j m theta_i)
    double total = 0;
    for (Index j = 1; j <= half; ++j) {
      partial += std::polar(1.0, double(m) * theta[j - 1]);
      total += std::abs(partial);
    }
    curve[m] = total / double(half);
  }
  return curve;
}

std::vector<double> rope_decay_curve(Index dim, double base, Index max_distance) {
  return rope_decay_curve(Rope(RopeConfig{.dim = dim, .base = base}), max_distance);
}

}  // namespace linrope
