#include "inputs.hpp"

#include <cmath>
#include <linrope/random.hpp>
#include <stdexcept>

namespace linrope::experiments {

const std::vector<InputKind>& all_input_kinds() {
  static const std::vector<InputKind> kinds = {InputKind::Gaussian, InputKind::QEqualsK,
                                               InputKind::RandomWalk, InputKind::Sinusoids,
                                               InputKind::RepeatedToken};
  return kinds;
}

const char* to_string(InputKind kind) {
  switch (kind) {
    case InputKind::Gaussian:
      return "gaussian";
    case InputKind::QEqualsK:
      return "q_equals_k";
    case InputKind::RandomWalk:
      return "random_walk";
    case InputKind::Sinusoids:
      return "sinusoids";
    case InputKind::RepeatedToken:
      return "repeated_token";
  }
  return "?";
}

MatrixD gaussian_matrix(Index n, Index d, std::uint64_t seed, double scale) {
  Random random(seed);
  MatrixD m(n, d);
  for (Index i = 0; i < n; ++i)
    for (Index j = 0; j < d; ++j) m(i, j) = scale * random.gaussian();
  return m;
}

namespace {

MatrixD random_walk(Index n, Index d, std::uint64_t seed, double scale) {
  constexpr double kRho = 0.99;
  const double step = std::sqrt(1 - kRho * kRho);
  Random random(seed);
  MatrixD m(n, d);
  for (Index j = 0; j < d; ++j) m(0, j) = random.gaussian();
  for (Index i = 1; i < n; ++i)
    for (Index j = 0; j < d; ++j) m(i, j) = kRho * m(i - 1, j) + step * random.gaussian();
  return scale * m;
}

MatrixD sinusoids(Index n, Index d, std::uint64_t seed, double scale) {
  Random random(seed);
  MatrixD m(n, d);
  for (Index j = 0; j < d; ++j) {
    const double w = std::pow(10.0, -3.0 + 2.0 * random.uniform());
    const double phase = 2 * 3.141592653589793 * random.uniform();
    for (Index i = 0; i < n; ++i)
      m(i, j) = scale * std::sqrt(2.0) * std::sin(w * double(i) + phase);
  }
  return m;
}

MatrixD repeated(Index n, Index d, std::uint64_t seed, double scale) {
  const MatrixD token = gaussian_matrix(1, d, seed, scale);
  return token.replicate(n, 1);
}

}  // namespace

Inputs make_inputs(InputKind kind, Index n, Index d, std::uint64_t seed, double scale) {
  if (n < 1 || d < 1)
    throw std::invalid_argument("make_inputs: n = " + std::to_string(n) +
                                ", d = " + std::to_string(d) + " but both must be >= 1");
  // Distinct streams for q, k and v from one seed.
  const std::uint64_t sq = seed * 3 + 0x51ed, sk = seed * 3 + 0x51ee, sv = seed * 3 + 0x51ef;
  switch (kind) {
    case InputKind::Gaussian:
      return {gaussian_matrix(n, d, sq, scale), gaussian_matrix(n, d, sk, scale),
              gaussian_matrix(n, d, sv)};
    case InputKind::QEqualsK: {
      MatrixD q = gaussian_matrix(n, d, sq, scale);
      MatrixD k = q;
      return {std::move(q), std::move(k), gaussian_matrix(n, d, sv)};
    }
    case InputKind::RandomWalk:
      return {random_walk(n, d, sq, scale), random_walk(n, d, sk, scale),
              gaussian_matrix(n, d, sv)};
    case InputKind::Sinusoids:
      return {sinusoids(n, d, sq, scale), sinusoids(n, d, sk, scale), gaussian_matrix(n, d, sv)};
    case InputKind::RepeatedToken:
      return {repeated(n, d, sq, scale), repeated(n, d, sk, scale), repeated(n, d, sv, 1.0)};
  }
  throw std::invalid_argument("make_inputs: unknown input kind");
}

void fill_uniform(float* data, std::size_t count, std::uint64_t seed) {
  Random random(seed);
  // Uniform on [-sqrt(3), sqrt(3)) has unit variance; 2 floats per 64-bit draw.
  constexpr float kScale = float(2 * 1.7320508075688772 / 4294967296.0);
  std::size_t i = 0;
  for (; i + 1 < count; i += 2) {
    const std::uint64_t bits = random.next();
    data[i] = float(std::uint32_t(bits)) * kScale - 1.7320508f;
    data[i + 1] = float(std::uint32_t(bits >> 32)) * kScale - 1.7320508f;
  }
  if (i < count) data[i] = float(std::uint32_t(random.next())) * kScale - 1.7320508f;
}

}  // namespace linrope::experiments
