// favor+, favor-trig and favor-hyp: random features through the projection W (projection.cpp).
#include <array>
#include <cmath>
#include <type_traits>

#include "common/gemm.hpp"
#include "common/packet_map.hpp"
#include "common/parallel.hpp"
#include "common/scratch.hpp"
#include "feature_maps/maps.hpp"

namespace linrope::detail {
namespace {

template <class T>
using RowMap = Eigen::Map<Matrix<T>>;

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

  void backward_rows(const Eigen::Ref<const MatrixF>& x, const Eigen::Ref<const MatrixF>& features,
                     const Eigen::Ref<const MatrixF>& g, Eigen::Ref<MatrixF> dx) const override {
    run_backward<float>(x, features, g, dx);
  }
  void backward_rows(const Eigen::Ref<const MatrixD>& x, const Eigen::Ref<const MatrixD>& features,
                     const Eigen::Ref<const MatrixD>& g, Eigen::Ref<MatrixD> dx) const override {
    run_backward<double>(x, features, g, dx);
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
    wt_f_ = wt_d_.cast<float>();
    wt_f_packed_ = PackedRight<float>(const_view(wt_f_));
    max_row_norm_ = w_.rowwise().norm().maxCoeff();
    half_log_f_ = 0.5 * std::log(double(num_features()));
    half_log_2f_ = 0.5 * std::log(2.0 * double(num_features()));
  }

  template <class T>
  const Matrix<T>& scaled_transpose_matrix() const {
    if constexpr (std::is_same_v<T, float>)
      return wt_f_;
    else
      return wt_d_;
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
    for_each_index(blocks, parallel ? Threads::Parallel : Threads::Serial, [&](Index b) {
      const Index first = b * kBlockRows, rows = std::min(kBlockRows, n - first);
      gemm(const_view(x.middleRows(first, rows)), wt, view(out.middleRows(first, rows).leftCols(f)),
           Write::Overwrite);
      // Two passes over the block's rows: first each row's reductions (|x|^2, max_l u_l) and so
      // its shift, then the exponentials (sines, cosines) of every row. In one pass a row's
      // exponentials waited on its own max, a chain of latencies per row that left the vector
      // units idle at small f (the study's f = 32: two packets a row); apart, the rows'
      // exponentials are independent work that the CPU overlaps. The same operations on the same
      // values: the same bits.
      std::array<RowShift<T>, kBlockRows> shifts;
      for (Index r = 0; r < rows; ++r) {
        const Index i = first + r;
        const double squared = sum_of_squares(x.data() + i * x.outerStride(), d);
        const double h = squared * inv_two_sqrt_d;
        if (std::is_same_v<T, float> && std::sqrt(squared) * projection_bound > 1e36) {
          // Rare: the float GEMM may have overflowed; redo this row in double (allocates).
          Vector<double> row(output_dim());
          row.head(f) = wt_d_.transpose() * x.row(i).transpose().template cast<double>();
          const RowShift<double> shift = shift_of_row(row.data(), h, log_scale != nullptr);
          apply_shift(row.data(), shift);
          for (Index l = 0; l < row.size(); ++l) out(i, l) = T(row[l]);
          shifts[r] = RowShift<T>{.shift = 0, .log_scale = shift.log_scale, .done = true};
        } else {
          shifts[r] = shift_of_row(&out(i, 0), h, log_scale != nullptr);
        }
        if (log_scale) log_scale[i] = shifts[r].log_scale;
      }
      for (Index r = 0; r < rows; ++r)
        if (!shifts[r].done) apply_shift(&out(first + r, 0), shifts[r]);
    });
  }

  // The gradient (FeatureMap::backward_rows). With W' = d^(-1/4) W (rows w'_l) and each
  // feature's derivative in u and in x through h = |x|^2 / (2 sqrt d):
  //   favor+     J^T g = sum_l g_l phi_l w'_l - (g . phi) x / sqrt d
  //   favor-hyp  J^T g = sum_l (g+_l phi+_l - g-_l phi-_l) w'_l - (g . phi) x / sqrt d
  //   favor-trig J^T g = sum_l (gs_l phic_l - gc_l phis_l) w'_l + (g . phi) x / sqrt d
  // (s, c: the sine and cosine halves; +, -: exp(u) and exp(-u)). Every term is a product of a
  // gradient entry and a feature, so the stabilised pair (g exp(log_scale), phi exp(-log_scale))
  // gives the same values. One product [rows x f] x [f x d] per block of rows, as in the forward.
  template <class T>
  void run_backward(const Eigen::Ref<const Matrix<T>>& x,
                    const Eigen::Ref<const Matrix<T>>& features,
                    const Eigen::Ref<const Matrix<T>>& g, Eigen::Ref<Matrix<T>> dx) const {
    const Index n = x.rows(), d = input_dim(), f = num_features();
    const Index block = std::min(kBlockRows, std::max<Index>(n, 1));
    Scratch<T> scratch(block * f);
    const double inv_sqrt_d = 1.0 / std::sqrt(double(d));
    const double h_sign = kind() == FeatureMapKind::FavorTrig ? 1.0 : -1.0;
    for (Index first = 0; first < n; first += block) {
      const Index rows = std::min(block, n - first);
      RowMap<T> products(scratch.data(), rows, f);
      // Each row's (g . phi) before the product, which does not need it: the rows' reductions are
      // then independent work, not each a chain of latencies between the product and its row's
      // update (the same operations: the same bits).
      std::array<T, kBlockRows> along_x;
      for (Index i = 0; i < rows; ++i)
        along_x[std::size_t(i)] =
            T(h_sign * inv_sqrt_d *
              dot_of(g.data() + (first + i) * g.outerStride(),
                     features.data() + (first + i) * features.outerStride(), output_dim()));
      for (Index i = 0; i < rows; ++i) {
        const auto phi = features.row(first + i).array();
        const auto grad = g.row(first + i).array();
        auto p = products.row(i).array();
        switch (kind()) {
          case FeatureMapKind::FavorPositive:
            p = grad * phi;
            break;
          case FeatureMapKind::FavorHyperbolic:
            p = grad.head(f) * phi.head(f) - grad.tail(f) * phi.tail(f);
            break;
          default:  // FavorTrig: [sin u, cos u]
            p = grad.head(f) * phi.tail(f) - grad.tail(f) * phi.head(f);
            break;
        }
      }
      gemm(const_view(products), const_view(scaled_transpose_matrix<T>()).transposed(),
           view(dx.middleRows(first, rows)), Write::Overwrite);
      for (Index i = 0; i < rows; ++i)
        dx.row(first + i) += along_x[std::size_t(i)] * x.row(first + i);
    }
  }

  // What a row's features need besides u (row[0, f) of its output): the shift its exponentials
  // take (favor+: max_l u_l, or h + ln(f) / 2 unstabilised; favor-hyp: max_l |u_l|, or
  // h + ln(2f) / 2), or for favor-trig unstabilised (scaled) the factor exp(h - ln(f) / 2) its
  // sines and cosines are multiplied by; and its log_scale (0 unstabilised). done: the row's
  // features are written already (the double path).
  template <class T>
  struct RowShift {
    T shift = 0;
    double log_scale = 0;
    bool scaled = false;
    bool done = false;
  };

  template <class T>
  RowShift<T> shift_of_row(const T* row, double h, bool stabilized) const {
    using Array = Eigen::Array<T, 1, Eigen::Dynamic>;
    const Eigen::Map<const Array> u(row, num_features());
    switch (kind()) {
      case FeatureMapKind::FavorPositive: {
        if (!stabilized) return {.shift = T(h + half_log_f_)};
        const T top = u.maxCoeff();
        return {.shift = top, .log_scale = double(top) - h - half_log_f_};
      }
      case FeatureMapKind::FavorHyperbolic: {
        if (!stabilized) return {.shift = T(h + half_log_2f_)};
        const T c = u.abs().maxCoeff();
        return {.shift = c, .log_scale = double(c) - h - half_log_2f_};
      }
      default:  // FavorTrig
        if (!stabilized) return {.shift = T(std::exp(h - half_log_f_)), .scaled = true};
        return {.log_scale = h - half_log_f_};
    }
  }

  // row[0, f) holds u on entry; on exit row[0, m) holds the row's features. The exponentials,
  // sines and cosines go through exp_shifted, sin_of and cos_of, so that a row's features are the
  // same bits wherever the row sits (packet_map.hpp).
  template <class T>
  void apply_shift(T* row, const RowShift<T>& s) const {
    using Array = Eigen::Array<T, 1, Eigen::Dynamic>;
    const Index f = num_features();
    switch (kind()) {
      case FeatureMapKind::FavorPositive:
        exp_shifted(row, row, f, s.shift);
        return;
      case FeatureMapKind::FavorHyperbolic:
        Eigen::Map<Array>(row + f, f) = -Eigen::Map<const Array>(row, f);  // exact
        exp_shifted(row + f, row + f, f, s.shift);
        exp_shifted(row, row, f, s.shift);
        return;
      default:  // FavorTrig: [sin u, cos u]
        cos_of(row, row + f, f);
        sin_of(row, row, f);
        // Unstabilised, scaled: one rounding per element, like the scalar path.
        if (s.scaled) Eigen::Map<Array>(row, 2 * f) *= s.shift;
    }
  }

  MatrixD w_;     // [f x d], as drawn
  MatrixD wt_d_;  // [d x f] = d^(-1/4) W^T: x W'^T is then W x' with the d^(-1/4) folded in
  MatrixF wt_f_;  // wt_d_ rounded once to float
  // wt_d_ and wt_f_ in the form the forward's products read (packed once, not per block of rows)
  PackedRight<double> wt_d_packed_;
  PackedRight<float> wt_f_packed_;
  double max_row_norm_ = 0;
  // log sqrt(f) and log sqrt(2 f), the features' normalisation, once per draw (per row, a libm
  // call each, they were 1.7% of a FAVOR+ attention call at the study's f = 32)
  double half_log_f_ = 0, half_log_2f_ = 0;
};

}  // namespace

std::unique_ptr<FeatureMap> make_favor_map(const FeatureMapConfig& config) {
  return std::make_unique<FavorMap>(config);
}

}  // namespace linrope::detail
