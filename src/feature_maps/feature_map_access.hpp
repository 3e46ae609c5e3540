// Private: the attention kernels check their inputs once per call, then map thousands of blocks;
// this skips FeatureMap's per-call checks (shapes, overlap, a finiteness pass over x) for them.
#pragma once

#include <linrope/feature_maps.hpp>

namespace linrope::detail {

struct FeatureMapAccess {
  // The stabilised map of already-checked rows: out = phi(x) exp(-log_scale).
  template <class T>
  static void stabilized(const FeatureMap& map, const Eigen::Ref<const Matrix<T>>& x,
                         Eigen::Ref<Matrix<T>> out, double* log_scale) {
    map.map_rows(x, out, log_scale, /*parallel=*/false);
  }
  // dx = J^T d_out of already-checked rows, from their stabilised features and g = d_out
  // exp(log_scale) (FeatureMap::backward_rows).
  template <class T>
  static void backward(const FeatureMap& map, const Eigen::Ref<const Matrix<T>>& x,
                       const Eigen::Ref<const Matrix<T>>& features,
                       const Eigen::Ref<const Matrix<T>>& g, Eigen::Ref<Matrix<T>> dx) {
    map.backward_rows(x, features, g, dx);
  }
};

}  // namespace linrope::detail
