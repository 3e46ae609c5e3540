// The option values the linear-attention tests sweep (forward and backward alike).
#pragma once

#include <linrope/attention.hpp>
#include <linrope/feature_maps.hpp>

#include "map_cases.hpp"

namespace linrope::testing {

// The maps swept: kMaps (map_cases.hpp).
inline constexpr RopePlacement kPlacements[] = {RopePlacement::None, RopePlacement::BeforeMap,
                                                RopePlacement::NumeratorOnly, RopePlacement::Full};
// Every causal method, the default (Scan) first. Non-causal calls have one method and ignore it.
inline constexpr CausalMethod kCausalMethods[] = {CausalMethod::Scan, CausalMethod::Chunked};

}  // namespace linrope::testing
