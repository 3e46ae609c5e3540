// favor+, favor-trig and favor-hyp: random features through the projection W (projection.cpp).
#include <cmath>
#include <type_traits>

#include "common/gemm.hpp"
#include "common/packet_map.hpp"
#include "common/parallel.hpp"
#include "feature_maps/maps.hpp"

namespace linrope::detail {
namespace {

// With x' = x d^(-1/4), u = W x' (f projections), h = |x'|^2 / 2 = |x|^2 / (2 sqrt d):
//   favor+     phi_l = exp(u_l - h) / sqrt(f)
//   favor-trig phi   = exp(h) / sqrt(f) [sin u, cos u]
//   favor-hyp  phi   = exp(-h) / sqrt(2f) [exp(u), exp(-u)]
// apply_stabilized writes out = phi * exp(-log_scale[i]); per row i (c = max_l |u_l| for hyp):
//   favor+      log_scale = max_l u_l - h - ln(f) / 2    out_l = exp(u_l - max_l u_l)
//   favor-hyp   log_scale = c - h - ln(2f) / 2           out = [exp(u - c), exp(-u - c)]
//   favor-trig  log_scale = h - ln(f) / 2                out = [sin u, cos u]
// so the largest feature of a row is exactly 1 for favor+ and favor-hyp, and in [1/sqrt 2, 1] for
// favor-trig (sin^2 + cos^2 = 1); the whole scale lives in log_scale, in double.
//
// Precision: W is pre-scaled by d^(-1/4) in double and rounded once to T; h is accumulated in
// double from the T inputs; the constants (h + ln(f)/2, ...) are formed in double and rounded once
// to T. Float range: the GEMM cannot overflow unless |x'| max_l |w_l| > FLT_MAX; a row where that
// bound exceeds 1e36 is recomputed in double from the double W, so float features are finite for
// every finite float x. Double: finite while |x| < ~1e150 (beyond that |x|^2 itself leaves double
// range).
class FavorMap final : public FeatureMap {
 public:
  explicit FavorMap(const FeatureMapConfig& config) : FeatureMap(config) { draw(); }

  Index output_dim() const override {
    return kind() == FeatureMapKind::FavorPositive ? num_features() : 2 * num_features();
  }
  bool nonnegative() const override { return kind() != FeatureMapKind::FavorTrig; }
  const MatrixD& projection() const override { return w_; }

  void map_rows(const Eigen::Ref<const MatrixF>& x, Eigen::Ref<MatrixF> out, double* log_scale,
                bool parallel) const override {
    run<float>(x, out, log_scale, parallel);
  }
  void map_rows(const Eigen::Ref<const MatrixD>& x, Eigen::Ref<MatrixD> out, double* log_scale,
                bool parallel) const override {
    run<double>(x, out, log_scale, parallel);
  }

  void redraw(std::uint64_t seed) override {
    config_.seed = seed;
    draw();
  }

 private:
  Index num_features() const { return config_.num_features; }

  void draw() {
    const Index d = input_dim();
    w_ = draw_projection(d, num_features(), config_.orthogonal, config_.regularized, config_.seed);
    wt_d_ = w_.transpose() * std::pow(double(d), -0.25);
    wt_d_packed_ = PackedRight<double>(const_view(wt_d_));
    const MatrixF wt_f = wt_d_.cast<float>();
    wt_f_packed_ = PackedRight<float>(const_view(wt_f));
    max_row_norm_ = w_.rowwise().norm().maxCoeff();
  }

  template <class T>
  const PackedRight<T>& scaled_transpose() const {
    if constexpr (std::is_same_v<T, float>)
      return wt_f_packed_;
    else
      return wt_d_packed_;
  }

  // x [n x d] -> out [n x m]; log_scale == nullptr means unstabilised (apply).
  template <class T>
  void run(const Eigen::Ref<const Matrix<T>>& x, Eigen::Ref<Matrix<T>> out, double* log_scale,
           bool parallel) const {
    const Index n = x.rows(), d = input_dim(), f = num_features();
    const PackedRight<T>& wt = scaled_transpose<T>();
    const double inv_two_sqrt_d = 0.5 / std::sqrt(double(d));
    // |u_l| <= |x'| |w_l| bounds every partial sum of the GEMM too (Cauchy-Schwarz on |x'_j w_lj|).
    const double projection_bound = std::pow(double(d), -0.25) * max_row_norm_;
    const Index blocks = (n + kBlockRows - 1) / kBlockRows;
    for_each_index(blocks, parallel, [&](Index b) {
      const Index first = b * kBlockRows, rows = std::min(kBlockRows, n - first);
      gemm(const_view(x.middleRows(first, rows)), wt, view(out.middleRows(first, rows).leftCols(f)),
           false);
      for (Index i = first; i < first + rows; ++i) {
        const double squared = sum_of_squares(x.data() + i * x.outerStride(), d);
        const double h = squared * inv_two_sqrt_d;
        double scale = 0;
        if (std::is_same_v<T, float> && std::sqrt(squared) * projection_bound > 1e36) {
          // Rare: the float GEMM may have overflowed; redo this row in double (allocates).
          Vector<double> row(output_dim());
          row.head(f) = wt_d_.transpose() * x.row(i).transpose().template cast<double>();
          scale = finish_row<double>(row.data(), h, log_scale != nullptr);
          for (Index l = 0; l < row.size(); ++l) out(i, l) = T(row[l]);
        } else {
          scale = finish_row<T>(&out(i, 0), h, log_scale != nullptr);
        }
        if (log_scale) log_scale[i] = scale;
      }
    });
  }

  // row[0, f) holds u on entry; on exit row[0, m) holds the features of one row. Returns log_scale.
  // The exponentials, sines and cosines go through exp_shifted, sin_of and cos_of, so that
  // a row's features are the same bits wherever the row sits (packet_map.hpp).
  template <class T>
  double finish_row(T* row, double h, bool stabilized) const {
    using Array = Eigen::Array<T, 1, Eigen::Dynamic>;
    const Index f = num_features();
    Eigen::Map<Array> u(row, f);
    const double half_log_f = 0.5 * std::log(double(f));
    switch (kind()) {
      case FeatureMapKind::FavorPositive: {
        if (!stabilized) {
          exp_shifted(row, row, f, T(h + half_log_f));
          return 0;
        }
        const T top = u.maxCoeff();
        exp_shifted(row, row, f, top);
        return double(top) - h - half_log_f;
      }
      case FeatureMapKind::FavorHyperbolic: {
        const double half_log_2f = 0.5 * std::log(2.0 * double(f));
        const T c = stabilized ? u.abs().maxCoeff() : T(h + half_log_2f);
        Eigen::Map<Array>(row + f, f) = -u;  // exact
        exp_shifted(row + f, row + f, f, c);
        exp_shifted(row, row, f, c);
        return stabilized ? double(c) - h - half_log_2f : 0;
      }
      default: {  // FavorTrig
        cos_of(row, row + f, f);
        sin_of(row, row, f);
        if (!stabilized) {
          const T scale = T(std::exp(h - half_log_f));
          Eigen::Map<Array>(row, 2 * f) *= scale;  // one rounding per element, like the scalar path
          return 0;
        }
        return h - half_log_f;
      }
    }
  }

  MatrixD w_;     // [f x d], as drawn
  MatrixD wt_d_;  // [d x f] = d^(-1/4) W^T: x W'^T is then W x' with the d^(-1/4) folded in
  // wt_d_, and wt_d_ rounded once to float, in the form the products read (packed once, not per
  // block of rows)
  PackedRight<double> wt_d_packed_;
  PackedRight<float> wt_f_packed_;
  double max_row_norm_ = 0;
};

}  // namespace

std::unique_ptr<FeatureMap> make_favor_map(const FeatureMapConfig& config) {
  return std::make_unique<FavorMap>(config);
}

}  // namespace linrope::detail
