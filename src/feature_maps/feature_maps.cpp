// Feature maps: names, argument checks and the public calls; the maps themselves are
// elementwise_map.cpp and favor_map.cpp (one GEMM per block of rows, then one element-wise pass),
// their projection projection.cpp.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <linrope/feature_maps.hpp>
#include <span>
#include <string>

#include "common/check.hpp"
#include "common/enum_names.hpp"
#include "common/nonfinite.hpp"
#include "common/parallel.hpp"
#include "common/scratch.hpp"
#include "feature_maps/maps.hpp"

namespace linrope {

const MatrixD& FeatureMap::projection() const {
  static const MatrixD empty;
  return empty;
}

namespace {

constexpr std::array<const char*, 6> kNames = {"elu+1",      "relu",  "favor+",
                                               "favor-trig", "1+cos", "favor-hyp"};

// Every check runs before any work (and so before any parallel region).
template <class T>
void check_arguments(const FeatureMap& map, std::string_view fn,
                     const Eigen::Ref<const Matrix<T>>& x, const Eigen::Ref<Matrix<T>>& out,
                     const std::span<double>* log_scale) {
  if (x.cols() != map.input_dim())
    detail::throw_invalid(fn, "x is ", detail::shape_of(x), " but input_dim is ", map.input_dim());
  const Index m = map.output_dim();
  if (out.rows() != x.rows() || out.cols() != m)
    detail::throw_invalid(fn, "out is ", detail::shape_of(out), " but expected ",
                          detail::Shape{x.rows(), m}, " (x.rows() x output_dim() of ",
                          to_string(map.kind()), ")");
  if (log_scale && Index(log_scale->size()) != x.rows())
    detail::throw_invalid(fn, "log_scale has size ", log_scale->size(), " but expected ", x.rows(),
                          " (x.rows())");
  if (detail::spans_overlap(x, out)) {
    // elu+1 and relu are element-wise, so exactly the same storage is fine.
    const bool in_place =
        x.data() == out.data() && x.outerStride() == out.outerStride() &&
        (map.kind() == FeatureMapKind::EluPlusOne || map.kind() == FeatureMapKind::Relu);
    if (!in_place)
      detail::throw_invalid(fn, "out overlaps x; expected separate storage (only elu+1 and relu ",
                            "may map x in place)");
  }
  detail::require_finite(fn, "x", x);
}

// FeatureMap::backward's checks, all before any work.
template <class T>
void check_backward(const FeatureMap& map, const Eigen::Ref<const Matrix<T>>& x,
                    const Eigen::Ref<const Matrix<T>>& d_out, const Eigen::Ref<Matrix<T>>& dx) {
  constexpr std::string_view fn = "FeatureMap::backward";
  if (x.cols() != map.input_dim())
    detail::throw_invalid(fn, "x is ", detail::shape_of(x), " but input_dim is ", map.input_dim());
  if (d_out.rows() != x.rows() || d_out.cols() != map.output_dim())
    detail::throw_invalid(fn, "d_out is ", detail::shape_of(d_out), " but expected ",
                          detail::Shape{x.rows(), map.output_dim()},
                          " (x.rows() x output_dim() of ", to_string(map.kind()), ")");
  if (dx.rows() != x.rows() || dx.cols() != x.cols())
    detail::throw_invalid(fn, "dx is ", detail::shape_of(dx), " but expected ", detail::shape_of(x),
                          " (the shape of x)");
  if (detail::spans_overlap(x, dx))
    detail::throw_invalid(fn, "dx overlaps x; expected separate storage");
  if (detail::spans_overlap(d_out, dx))
    detail::throw_invalid(fn, "dx overlaps d_out; expected separate storage");
  detail::require_finite_each(fn, "x", x, "d_out", d_out);  // up front: common/nonfinite.hpp
}

}  // namespace

// dx = J^T d_out a block of rows at a time (the blocks on the OpenMP threads): the stabilised
// features of the block, d_out brought to their reciprocal scale, then the map's backward_rows.
template <class T>
void FeatureMap::backward_checked(const Eigen::Ref<const Matrix<T>>& x,
                                  const Eigen::Ref<const Matrix<T>>& d_out,
                                  Eigen::Ref<Matrix<T>> dx) const {
  check_backward<T>(*this, x, d_out, dx);
  const Index n = x.rows(), m = output_dim();
  const Index blocks = (n + detail::kBlockRows - 1) / detail::kBlockRows;
  detail::for_each_index(blocks, detail::Threads::Parallel, [&](Index b) {
    const Index first = b * detail::kBlockRows, rows = std::min(detail::kBlockRows, n - first);
    detail::Scratch<T> features(rows * m), scaled(rows * m);
    detail::Scratch<double> log_scale(rows);
    Eigen::Map<Matrix<T>> f(features.data(), rows, m), g(scaled.data(), rows, m);
    map_rows(x.middleRows(first, rows), f, log_scale.data(), /*parallel=*/false);
    for (Index i = 0; i < rows; ++i)
      g.row(i) = d_out.row(first + i) * T(std::exp(log_scale.data()[i]));
    backward_rows(x.middleRows(first, rows), f, g, dx.middleRows(first, rows));
  });
}

void FeatureMap::backward(const Eigen::Ref<const MatrixF>& x,
                          const Eigen::Ref<const MatrixF>& d_out, Eigen::Ref<MatrixF> dx) const {
  backward_checked<float>(x, d_out, dx);
}
void FeatureMap::backward(const Eigen::Ref<const MatrixD>& x,
                          const Eigen::Ref<const MatrixD>& d_out, Eigen::Ref<MatrixD> dx) const {
  backward_checked<double>(x, d_out, dx);
}

void FeatureMap::apply(const Eigen::Ref<const MatrixF>& x, Eigen::Ref<MatrixF> out) const {
  check_arguments<float>(*this, "FeatureMap::apply", x, out, nullptr);
  map_rows(x, out, nullptr, /*parallel=*/true);
}
void FeatureMap::apply(const Eigen::Ref<const MatrixD>& x, Eigen::Ref<MatrixD> out) const {
  check_arguments<double>(*this, "FeatureMap::apply", x, out, nullptr);
  map_rows(x, out, nullptr, /*parallel=*/true);
}
void FeatureMap::apply_stabilized(const Eigen::Ref<const MatrixF>& x, Eigen::Ref<MatrixF> out,
                                  std::span<double> log_scale) const {
  check_arguments<float>(*this, "FeatureMap::apply_stabilized", x, out, &log_scale);
  map_rows(x, out, log_scale.data(), /*parallel=*/true);
}
void FeatureMap::apply_stabilized(const Eigen::Ref<const MatrixD>& x, Eigen::Ref<MatrixD> out,
                                  std::span<double> log_scale) const {
  check_arguments<double>(*this, "FeatureMap::apply_stabilized", x, out, &log_scale);
  map_rows(x, out, log_scale.data(), /*parallel=*/true);
}

std::unique_ptr<FeatureMap> make_feature_map(const FeatureMapConfig& config) {
  constexpr std::string_view fn = "make_feature_map";
  const int kind = static_cast<int>(config.kind);
  if (kind < 0 || kind >= int(kNames.size()))
    detail::throw_invalid(fn, "kind is ", kind, " but expected a FeatureMapKind in [0, ",
                          kNames.size() - 1, "]");
  if (config.input_dim < 1)
    detail::throw_invalid(fn, "input_dim is ", config.input_dim, " but expected input_dim >= 1");
  if (detail::is_favor(config.kind)) {
    if (config.num_features < 1)
      detail::throw_invalid(fn, "num_features is ", config.num_features,
                            " but expected num_features >= 1 for ", to_string(config.kind));
    return detail::make_favor_map(config);
  }
  return detail::make_elementwise_map(config);
}

const char* to_string(FeatureMapKind kind) {
  return detail::enum_name(kind, kNames, "FeatureMapKind");
}

FeatureMapKind feature_map_kind_from_string(std::string_view name) {
  return detail::enum_from_name<FeatureMapKind>(name, kNames, "feature_map_kind_from_string",
                                                "feature map");
}

}  // namespace linrope
