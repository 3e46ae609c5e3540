// Inputs for the accuracy experiments: Gaussian q, k, v and structured sequences that stress the
// normalisation differently (tokens that resemble each other, or the same token over and over).
#pragma once

#include <cstdint>
#include <linrope/types.hpp>
#include <string>
#include <vector>

namespace linrope::experiments {

enum class InputKind {
  Gaussian,    // q, k, v iid N(0, 1)
  QEqualsK,    // q = k iid N(0, 1) (self-similarity: the largest score of a query is its own key)
  RandomWalk,  // q, k mean-reverting random walks x_t = rho x_{t-1} + sqrt(1 - rho^2) g_t,
               // rho = 0.99: unit variance, neighbours correlated over ~100 positions
  Sinusoids,   // column j = sqrt(2) sin(w_j t + phase_j), w_j log-uniform in [1e-3, 1e-1]
  RepeatedToken,  // every row of q (and of k, of v) the same Gaussian token
};
const std::vector<InputKind>& all_input_kinds();
const char* to_string(InputKind kind);  // "gaussian", "q_equals_k", "random_walk", ...

struct Inputs {
  MatrixD q, k, v;
};
// n rows of width d, N(0, scale^2) entries where Gaussian, from `seed`.
Inputs make_inputs(InputKind kind, Index n, Index d, std::uint64_t seed, double scale = 1.0);

// n x d iid N(0, scale^2).
MatrixD gaussian_matrix(Index n, Index d, std::uint64_t seed, double scale = 1.0);

// Fills `count` floats with uniform values of unit variance, fast (timing inputs, where the values
// only need to be finite and varied).
void fill_uniform(float* data, std::size_t count, std::uint64_t seed);

}  // namespace linrope::experiments
