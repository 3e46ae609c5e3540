// linrope: shared vocabulary types.
#pragma once

#include <Eigen/Core>
#include <cstddef>

namespace linrope {

using Index = std::ptrdiff_t;

// Every matrix in the public API is row-major: row i is the token at position offset + i.
template <class T>
using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MatrixF = Matrix<float>;
using MatrixD = Matrix<double>;

template <class T>
using Vector = Eigen::Matrix<T, Eigen::Dynamic, 1>;

}  // namespace linrope
