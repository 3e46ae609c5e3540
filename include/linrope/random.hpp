// linrope: the seeded random stream behind the feature maps' projections (and the experiments'
// inputs): xoshiro256** seeded through splitmix64 (the seeding its authors recommend), and a
// Box-Muller transform written here, because std::normal_distribution differs between standard
// libraries. A seed gives bit-identical numbers on every platform: integer arithmetic is exact,
// the Gaussians depend only on std::log/sqrt/cos/sin, and no expression has an a * b + c that a
// compiler could contract into an FMA.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <numbers>

namespace linrope {

class Random {
 public:
  explicit Random(std::uint64_t seed) {
    for (auto& word : state_) word = splitmix64(seed);
  }

  // 64 random bits (xoshiro256**).
  std::uint64_t next() {
    const std::uint64_t result = rotl(state_[1] * 5, 7) * 9;
    const std::uint64_t t = state_[1] << 17;
    state_[2] ^= state_[0];
    state_[3] ^= state_[1];
    state_[1] ^= state_[2];
    state_[0] ^= state_[3];
    state_[2] ^= t;
    state_[3] = rotl(state_[3], 45);
    return result;
  }

  // Uniform in [0, 1), 53 random bits.
  double uniform() { return double(next() >> 11) * 0x1.0p-53; }

  // N(0, 1): Box-Muller on two uniforms, the cosine one first, the sine one kept for the next call.
  double gaussian() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double u1 = double((next() >> 11) + 1) * 0x1.0p-53;  // (0, 1]: log(u1) is finite
    const double u2 = uniform();
    const double radius = std::sqrt(-2.0 * std::log(u1));
    const double angle = (2.0 * std::numbers::pi) * u2;
    spare_ = radius * std::sin(angle);
    has_spare_ = true;
    return radius * std::cos(angle);
  }

 private:
  static std::uint64_t splitmix64(std::uint64_t& s) {
    std::uint64_t z = (s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  static std::uint64_t rotl(std::uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

  std::array<std::uint64_t, 4> state_{};
  double spare_ = 0;
  bool has_spare_ = false;
};

}  // namespace linrope
