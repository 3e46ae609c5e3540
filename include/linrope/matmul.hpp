// linrope: the matrix product under the attention kernels, for the linear maps around them: a
// layer's projections and MLP (y = x W^T) and their gradients (dx = dy W, dW = dy^T x). On
// AVX-512 machines it runs linrope's own micro-kernel (src/common/gemm.hpp): 150-200 GFLOP/s on
// one core on a small model's shapes, 1.4-1.8x OpenBLAS's AVX2 kernels and about even with its
// AVX-512 ones (bench/RESULTS.md); elsewhere, and for double, Eigen's product.
#pragma once

#include <linrope/types.hpp>

namespace linrope {

// c = op(a) op(b), or c += op(a) op(b) (accumulate), where op(x) is x, or x^T when its transpose
// flag is set: a is [m x k] (stored [k x m] when transpose_a), b [k x n] ([n x k] when
// transpose_b), c [m x n]. So y = x W^T for an nn.Linear's weight W [out x in] is
// matmul(x, W, y, {.transpose_b = true}).
struct MatmulOptions {
  bool transpose_a = false;
  bool transpose_b = false;
  bool accumulate = false;
};

// Runs on linrope's threads, in fixed blocks of c's rows: the same bits whatever the thread count.
// Throws std::invalid_argument when the shapes disagree or c's memory, from its first element to
// its last, overlaps a's or b's (so two column blocks of one matrix are refused, though they share
// no element). Values are not checked: a NaN or inf in a or b propagates to c.
void matmul(const Eigen::Ref<const MatrixF>& a, const Eigen::Ref<const MatrixF>& b,
            Eigen::Ref<MatrixF> c, const MatmulOptions& options = {});
void matmul(const Eigen::Ref<const MatrixD>& a, const Eigen::Ref<const MatrixD>& b,
            Eigen::Ref<MatrixD> c, const MatmulOptions& options = {});

}  // namespace linrope
