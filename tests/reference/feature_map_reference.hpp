// Naive references for the feature maps: plain loops in double, sharing no code with src/.
//   - the documented random stream (splitmix64 -> xoshiro256** -> Box-Muller), written out again;
//   - the projection W rebuilt with classical Gram-Schmidt instead of Householder QR: Gram-Schmidt
//     gives directly the unique QR factor with R_ii > 0, which is what the library's
//     "Householder Q times diag(sign R_ii)" must equal;
//   - every map evaluated from its formula, row by row.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <linrope/types.hpp>
#include <numbers>
#include <vector>

namespace linrope::reference {

// splitmix64 step: advances `state` and returns the next output.
inline std::uint64_t splitmix64_next(std::uint64_t& state) {
  state += 0x9e3779b97f4a7c15ULL;
  std::uint64_t z = state;
  z ^= z >> 30;
  z *= 0xbf58476d1ce4e5b9ULL;
  z ^= z >> 27;
  z *= 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return z;
}

// xoshiro256** (Blackman & Vigna), state filled from splitmix64(seed).
struct Xoshiro256StarStar {
  std::uint64_t s[4];
  explicit Xoshiro256StarStar(std::uint64_t seed) {
    std::uint64_t sm = seed;
    for (auto& word : s) word = splitmix64_next(sm);
  }
  static std::uint64_t rotate_left(std::uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  std::uint64_t next() {
    const std::uint64_t out = rotate_left(s[1] * 5, 7) * 9;
    const std::uint64_t shifted = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= shifted;
    s[3] = rotate_left(s[3], 45);
    return out;
  }
};

// The first `count` Gaussians of the stream for `seed`: Box-Muller on (u1, u2), u1 = (k1 + 1)
// 2^-53, u2 = k2 2^-53 with k the top 53 bits of an output; the cos value first, then the sin
// value.
inline std::vector<double> gaussian_stream(std::uint64_t seed, std::size_t count) {
  Xoshiro256StarStar engine(seed);
  std::vector<double> z;
  z.reserve(count + 1);
  while (z.size() < count) {
    const double u1 = double((engine.next() >> 11) + 1) * 0x1.0p-53;
    const double u2 = double(engine.next() >> 11) * 0x1.0p-53;
    const double r = std::sqrt(-2.0 * std::log(u1));
    z.push_back(r * std::cos((2.0 * std::numbers::pi) * u2));
    z.push_back(r * std::sin((2.0 * std::numbers::pi) * u2));
  }
  z.resize(count);
  return z;
}

// W [f x d] following the documented draw order (see src/feature_maps.cpp), orthogonal blocks by
// classical Gram-Schmidt on the columns of each Gaussian block G = Q R (R_ii > 0), rows of Q kept.
inline MatrixD projection(Index d, Index f, bool orthogonal, bool regularized, std::uint64_t seed) {
  // Upper bound on the draws: d^2 per block plus d per kept row.
  const Index blocks = (f + d - 1) / d;
  const std::vector<double> z = gaussian_stream(seed, std::size_t(blocks * d * d + f * d));
  std::size_t next = 0;
  MatrixD w(f, d);
  if (!orthogonal) {
    for (Index i = 0; i < f; ++i)
      for (Index j = 0; j < d; ++j) w(i, j) = z[next++];
    return w;
  }
  for (Index b = 0; b < blocks; ++b) {
    const auto size = static_cast<std::size_t>(d);
    std::vector<std::vector<double>> g(size, std::vector<double>(size));
    for (Index r = 0; r < d; ++r)
      for (Index c = 0; c < d; ++c) g[r][c] = z[next++];
    // q[c] = column c of Q.
    std::vector<std::vector<double>> q(size, std::vector<double>(size));
    for (Index c = 0; c < d; ++c) {
      std::vector<double> v(size);
      for (Index r = 0; r < d; ++r) v[r] = g[r][c];
      for (int pass = 0; pass < 2; ++pass)  // re-orthogonalise once ("twice is enough")
        for (Index p = 0; p < c; ++p) {
          double dot = 0;
          for (Index r = 0; r < d; ++r) dot += q[p][r] * v[r];
          for (Index r = 0; r < d; ++r) v[r] -= dot * q[p][r];
        }
      double norm = 0;
      for (Index r = 0; r < d; ++r) norm += v[r] * v[r];
      norm = std::sqrt(norm);
      for (Index r = 0; r < d; ++r) q[c][r] = v[r] / norm;
    }
    const Index rows = std::min(d, f - b * d);
    for (Index r = 0; r < rows; ++r) {
      double length = std::sqrt(double(d));
      if (!regularized) {
        double sum = 0;
        for (Index j = 0; j < d; ++j) {
          sum += z[next] * z[next];
          ++next;
        }
        length = std::sqrt(sum);
      }
      for (Index c = 0; c < d; ++c) w(b * d + r, c) = q[c][r] * length;
    }
  }
  return w;
}

inline MatrixD elu_plus_one(const MatrixD& x) {
  MatrixD out(x.rows(), x.cols());
  for (Index i = 0; i < x.rows(); ++i)
    for (Index j = 0; j < x.cols(); ++j) {
      const double v = x(i, j);
      out(i, j) = (v > 0 ? v : std::expm1(v)) + 1.0;  // elu, then + 1
    }
  return out;
}

inline MatrixD relu(const MatrixD& x) {
  MatrixD out(x.rows(), x.cols());
  for (Index i = 0; i < x.rows(); ++i)
    for (Index j = 0; j < x.cols(); ++j) out(i, j) = x(i, j) > 0 ? x(i, j) : 0.0;
  return out;
}

inline MatrixD one_plus_cosine(const MatrixD& x) {
  MatrixD out(x.rows(), x.cols() + 1);
  for (Index i = 0; i < x.rows(); ++i) {
    double sum = 0;
    for (Index j = 0; j < x.cols(); ++j) sum += x(i, j) * x(i, j);
    const double norm = std::sqrt(sum);
    for (Index j = 0; j < x.cols(); ++j) out(i, j) = norm > 0 ? x(i, j) / norm : 0.0;
    out(i, x.cols()) = 1.0;
  }
  return out;
}

// The pieces of a Favor map for one row: u = W x', h = |x'|^2 / 2, x' = x d^(-1/4).
struct FavorRow {
  std::vector<double> u;
  double h = 0;
};
inline FavorRow favor_row(const MatrixD& w, const MatrixD& x, Index i) {
  const Index d = x.cols();
  const double s = std::pow(double(d), -0.25);
  FavorRow row;
  for (Index j = 0; j < d; ++j) row.h += (x(i, j) * s) * (x(i, j) * s);
  row.h /= 2;
  row.u.assign(std::size_t(w.rows()), 0.0);
  for (Index l = 0; l < w.rows(); ++l)
    for (Index j = 0; j < d; ++j) row.u[l] += w(l, j) * (x(i, j) * s);
  return row;
}

// phi(x) = exp(W x' - |x'|^2/2) / sqrt(f)
inline MatrixD favor_positive(const MatrixD& w, const MatrixD& x) {
  const Index f = w.rows();
  MatrixD out(x.rows(), f);
  for (Index i = 0; i < x.rows(); ++i) {
    const FavorRow r = favor_row(w, x, i);
    for (Index l = 0; l < f; ++l) out(i, l) = std::exp(r.u[l] - r.h) / std::sqrt(double(f));
  }
  return out;
}

// phi(x) = exp(|x'|^2/2) / sqrt(f) [sin(W x'), cos(W x')]
inline MatrixD favor_trig(const MatrixD& w, const MatrixD& x) {
  const Index f = w.rows();
  MatrixD out(x.rows(), 2 * f);
  for (Index i = 0; i < x.rows(); ++i) {
    const FavorRow r = favor_row(w, x, i);
    const double scale = std::exp(r.h) / std::sqrt(double(f));
    for (Index l = 0; l < f; ++l) {
      out(i, l) = scale * std::sin(r.u[l]);
      out(i, f + l) = scale * std::cos(r.u[l]);
    }
  }
  return out;
}

// phi(x) = exp(-|x'|^2/2) / sqrt(2f) [exp(W x'), exp(-W x')]
inline MatrixD favor_hyperbolic(const MatrixD& w, const MatrixD& x) {
  const Index f = w.rows();
  MatrixD out(x.rows(), 2 * f);
  for (Index i = 0; i < x.rows(); ++i) {
    const FavorRow r = favor_row(w, x, i);
    for (Index l = 0; l < f; ++l) {
      out(i, l) = std::exp(r.u[l] - r.h) / std::sqrt(2.0 * double(f));
      out(i, f + l) = std::exp(-r.u[l] - r.h) / std::sqrt(2.0 * double(f));
    }
  }
  return out;
}

// The softmax kernel the Favor maps estimate: exp(<x, y> / sqrt(d)).
inline double softmax_kernel(const MatrixD& x, Index i, const MatrixD& y, Index j) {
  double dot = 0;
  for (Index c = 0; c < x.cols(); ++c) dot += x(i, c) * y(j, c);
  return std::exp(dot / std::sqrt(double(x.cols())));
}

}  // namespace linrope::reference
