// linrope: RMSNorm (Zhang and Sennrich 2019), the normalisation before each sub-layer of a pre-norm
// transformer, forward and backward in one pass over each row. The study's model spends 9 of them
// a step; as a PyTorch expression (pow, mean, rsqrt, two products, and their gradients) one took
// ~40 ms forward and backward on a [4096 x 128] input, this ~1.1 ms (bench/RESULTS.md).
#pragma once

#include <linrope/types.hpp>

namespace linrope {

// y[i, j] = x[i, j] * inv_rms[i] * weight[j], where inv_rms[i] = 1 / sqrt(mean_j x[i, j]^2 + eps):
// x and y [n x d], weight [d], inv_rms [n] written too (the backward's input). eps must be finite
// and > 0, d >= 1. Rows run on linrope's threads; each row's result does not depend on the thread
// count. Throws std::invalid_argument naming the argument whose shape disagrees, or y overlapping
// x. Values are not checked: a NaN or inf in x propagates to its row.
void rms_norm(const Eigen::Ref<const MatrixF>& x, const Eigen::Ref<const Vector<float>>& weight,
              float eps, Eigen::Ref<MatrixF> y, Eigen::Ref<Vector<float>> inv_rms);
void rms_norm(const Eigen::Ref<const MatrixD>& x, const Eigen::Ref<const Vector<double>>& weight,
              double eps, Eigen::Ref<MatrixD> y, Eigen::Ref<Vector<double>> inv_rms);

// The gradients of rms_norm for d_y = dL/dy, given its x, weight and inv_rms (r below):
//   d_x[i, j]   = r_i g_ij - r_i^3 x_ij / d * sum_l g_il x_il,   g_ij = d_y[i, j] weight[j]
//   d_weight[j] = sum_i d_y[i, j] x[i, j] r_i
// d_weight's sum runs over fixed blocks of rows, added in order: the same bits whatever the
// thread count.
void rms_norm_backward(const Eigen::Ref<const MatrixF>& x,
                       const Eigen::Ref<const Vector<float>>& weight,
                       const Eigen::Ref<const Vector<float>>& inv_rms,
                       const Eigen::Ref<const MatrixF>& d_y, Eigen::Ref<MatrixF> d_x,
                       Eigen::Ref<Vector<float>> d_weight);
void rms_norm_backward(const Eigen::Ref<const MatrixD>& x,
                       const Eigen::Ref<const Vector<double>>& weight,
                       const Eigen::Ref<const Vector<double>>& inv_rms,
                       const Eigen::Ref<const MatrixD>& d_y, Eigen::Ref<MatrixD> d_x,
                       Eigen::Ref<Vector<double>> d_weight);

}  // namespace linrope
