// linrope::matmul (include/linrope/matmul.hpp): detail::gemm behind the public call's checks, cut
// into fixed blocks of c's rows for the threads.
#include <algorithm>
#include <linrope/matmul.hpp>
#include <string_view>

#include "common/check.hpp"
#include "common/gemm.hpp"
#include "common/parallel.hpp"

namespace linrope {
namespace {

using detail::ConstView;
using detail::shape_of;
using detail::throw_invalid;

// c's rows per task. The partition depends on m alone, so the bits do not depend on the thread
// count (each block is one gemm call, which is deterministic); 256 rows of a small model's
// activations (k <= 512) are 0.5 MiB of a, enough work to hide a task's start.
constexpr Index kRowBlock = 256;

template <class T>
void matmul_checked(const Eigen::Ref<const Matrix<T>>& a, const Eigen::Ref<const Matrix<T>>& b,
                    Eigen::Ref<Matrix<T>> c, const MatmulOptions& options) {
  constexpr std::string_view fn = "matmul";
  const Index m = options.transpose_a ? a.cols() : a.rows();
  const Index k = options.transpose_a ? a.rows() : a.cols();
  const Index b_k = options.transpose_b ? b.cols() : b.rows();
  const Index n = options.transpose_b ? b.rows() : b.cols();
  const char* a_is = options.transpose_a ? " (transposed: op(a) is [k x m] stored)" : "";
  const char* b_is = options.transpose_b ? " (transposed)" : "";
  if (b_k != k)
    throw_invalid(fn, "b is ", shape_of(b), b_is, " but a is ", shape_of(a), a_is,
                  ", so op(b) must have k = ", k, " rows; it has ", b_k);
  if (c.rows() != m || c.cols() != n)
    throw_invalid(fn, "c is ", shape_of(c), " but expected [", m, " x ", n, "] (op(a) is [", m,
                  " x ", k, "], op(b) [", k, " x ", n, "])");
  if (detail::spans_overlap(c, a)) throw_invalid(fn, "c overlaps a; expected separate storage");
  if (detail::spans_overlap(c, b)) throw_invalid(fn, "c overlaps b; expected separate storage");
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (!options.accumulate) c.setZero();
    return;
  }
  auto a_view = detail::const_view(a);
  if (options.transpose_a) a_view = a_view.transposed();
  auto b_view = detail::const_view(b);
  if (options.transpose_b) b_view = b_view.transposed();
  const auto write = options.accumulate ? detail::Write::Add : detail::Write::Overwrite;
  const Index blocks = (m + kRowBlock - 1) / kRowBlock;
  detail::for_each_index(blocks, detail::Threads::Parallel, [&](Index block) {
    const Index first = block * kRowBlock, rows = std::min(kRowBlock, m - first);
    const ConstView<T> a_rows{a_view.data + first * a_view.row_stride, rows, k, a_view.row_stride,
                              a_view.col_stride};
    const detail::View<T> c_rows{c.data() + first * c.outerStride(), rows, n, c.outerStride()};
    detail::gemm(a_rows, b_view, c_rows, write);
  });
}

}  // namespace

void matmul(const Eigen::Ref<const MatrixF>& a, const Eigen::Ref<const MatrixF>& b,
            Eigen::Ref<MatrixF> c, const MatmulOptions& options) {
  matmul_checked<float>(a, b, c, options);
}
void matmul(const Eigen::Ref<const MatrixD>& a, const Eigen::Ref<const MatrixD>& b,
            Eigen::Ref<MatrixD> c, const MatmulOptions& options) {
  matmul_checked<double>(a, b, c, options);
}

}  // namespace linrope
