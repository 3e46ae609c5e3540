// Private: the matrix products of the attention kernels, C = A B or C += A B, on strided views.
//
// Every kernel's time goes mostly into products whose inner dimension is small (d = 64 for the
// feature projection, a block of 64-256 rows for the state update). On AVX-512 machines a packed
// micro-kernel of our own runs these at about twice the rate of Eigen's (whose 48 x 4 register
// tile is load-bound there); elsewhere, and for double, Eigen does the work. Single-threaded and
// deterministic: the same inputs give bitwise the same C whatever thread calls it.
#pragma once

#include <linrope/types.hpp>
#include <type_traits>

namespace linrope::detail {

// A read-only matrix: element (i, j) at data[i * row_stride + j * col_stride]. One of the strides
// must be 1 (a row-major or column-major block), which is all the kernels need.
template <class T>
struct ConstView {
  const T* data;
  Index rows, cols, row_stride, col_stride;
  ConstView transposed() const { return {data, cols, rows, col_stride, row_stride}; }
};

// A writable row-major block: element (i, j) at data[i * row_stride + j].
template <class T>
struct View {
  T* data;
  Index rows, cols, row_stride;
};

// Views of Eigen matrices, maps and blocks (anything with data() and strides).
template <class M>
ConstView<typename M::Scalar> const_view(const M& m) {
  if constexpr (M::IsRowMajor)
    return {m.data(), m.rows(), m.cols(), m.outerStride(), m.innerStride()};
  else
    return {m.data(), m.rows(), m.cols(), m.innerStride(), m.outerStride()};
}
template <class M>
View<typename std::remove_reference_t<M>::Scalar> view(M&& m) {
  static_assert(std::remove_reference_t<M>::IsRowMajor, "a product's output must be row-major");
  return {m.data(), m.rows(), m.cols(), m.outerStride()};
}

// c = a b (accumulate: c += a b). Shapes must agree: a [m x k], b [k x n], c [m x n]; c must not
// overlap a or b. Never throws but std::bad_alloc (packing buffers, grown once per thread).
template <class T>
void gemm(ConstView<T> a, ConstView<T> b, View<T> c, bool accumulate);

}  // namespace linrope::detail
