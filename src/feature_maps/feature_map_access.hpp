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
};

}  // namespace linrope::detail
