// Deterministic test inputs: a fixed generator (mt19937_64 is specified bit-exactly by the
// standard) and our own Box-Muller, because std::normal_distribution differs between standard
// libraries.
#pragma once

#include <cmath>
#include <cstdint>
#include <linrope/types.hpp>
#include <numbers>
#include <random>

namespace linrope::testing {

class Gaussian {
 public:
  explicit Gaussian(std::uint64_t seed) : engine_(seed) {}
  double operator()() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    // u1 in (0, 1]: never log(0).
    const double u1 = (double(engine_() >> 11) + 1.0) * 0x1.0p-53;
    const double u2 = double(engine_() >> 11) * 0x1.0p-53;
    const double radius = std::sqrt(-2.0 * std::log(u1));
    spare_ = radius * std::sin(2 * std::numbers::pi * u2);
    has_spare_ = true;
    return radius * std::cos(2 * std::numbers::pi * u2);
  }
  double uniform() { return double(engine_() >> 11) * 0x1.0p-53; }

 private:
  std::mt19937_64 engine_;
  double spare_ = 0;
  bool has_spare_ = false;
};

// rows x cols of N(0, scale^2), filled row by row.
inline MatrixD gaussian(Index rows, Index cols, std::uint64_t seed, double scale = 1.0) {
  Gaussian g(seed);
  MatrixD m(rows, cols);
  for (Index i = 0; i < rows; ++i)
    for (Index j = 0; j < cols; ++j) m(i, j) = scale * g();
  return m;
}

}  // namespace linrope::testing
