// The option values the linear-attention tests sweep (forward and backward alike).
#pragma once

#include <linrope/attention.hpp>
#include <linrope/feature_maps.hpp>

namespace linrope::testing {

inline constexpr FeatureMapKind kMaps[] = {
    FeatureMapKind::EluPlusOne, FeatureMapKind::Relu,          FeatureMapKind::FavorPositive,
    FeatureMapKind::FavorTrig,  FeatureMapKind::OnePlusCosine, FeatureMapKind::FavorHyperbolic};
inline constexpr RopePlacement kPlacements[] = {RopePlacement::None, RopePlacement::BeforeMap,
                                                RopePlacement::NumeratorOnly, RopePlacement::Full};
// Every causal method, the default (Scan) first. Non-causal calls have one method and ignore it.
inline constexpr CausalMethod kCausalMethods[] = {CausalMethod::Scan, CausalMethod::Chunked};

}  // namespace linrope::testing
