// linrope: shared vocabulary types.
#pragma once

#include <Eigen/Core>
#include <cstddef>
#include <stdexcept>

namespace linrope {

using Index = std::ptrdiff_t;

// Every matrix in the public API is row-major: row i is the token at position offset + i.
template <class T>
using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MatrixF = Matrix<float>;
using MatrixD = Matrix<double>;

template <class T>
using Vector = Eigen::Matrix<T, Eigen::Dynamic, 1>;

// Thrown when an input's values are not finite (NaN or +-inf in q, k, v, d_out, a feature map's x,
// a state's S or z): "linear_attention: q[0, 1] has the non-finite value nan at row 3, column 0;
// expected finite values". A std::invalid_argument, so every handler of bad input still catches
// it; its own type lets a caller tell data that went bad (a diverged training run) from a call
// that was wrong. Options that are not finite (eps, scale, a rope's base) are settings, not data,
// and throw a plain std::invalid_argument.
class NonFiniteError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

}  // namespace linrope
