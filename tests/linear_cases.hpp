// What the linear-attention tests share (forward, backward and batched): the option values they
// sweep, the rope a placement needs, and the reference spec matching a call's options.
#pragma once

#include <linrope/attention.hpp>
#include <linrope/feature_maps.hpp>
#include <linrope/rope.hpp>
#include <optional>

#include "map_cases.hpp"
#include "reference/linear_reference.hpp"

namespace linrope::testing {

// The maps swept: kMaps (map_cases.hpp).
inline constexpr RopePlacement kPlacements[] = {RopePlacement::None, RopePlacement::BeforeMap,
                                                RopePlacement::NumeratorOnly, RopePlacement::Full};
// Every causal method, the default (Scan) first. Non-causal calls have one method and ignore it.
inline constexpr CausalMethod kCausalMethods[] = {CausalMethod::Scan, CausalMethod::Chunked};

// The rope a placement needs, on inputs of width d whose features have width m: width d before
// the map, m on the features; rotary width the largest even number <= width, two less when
// `partial` (if that leaves at least 2). Base, layout and scaling are the caller's.
inline RopeConfig placement_rope(RopePlacement placement, Index d, Index m, bool partial) {
  const Index width = placement == RopePlacement::BeforeMap ? d : m;
  Index r = width - width % 2;
  if (partial && r > 2) r -= 2;
  RopeConfig config;
  config.dim = width;
  config.rotary_dim = r;
  return config;
}

// The options of a call, its method and chunk left at their defaults.
inline LinearOptions linear_options(bool causal, RopePlacement placement, const Rope* rope,
                                    double eps, Index q_offset, Index k_offset) {
  LinearOptions options;
  options.causal = causal;
  options.placement = placement;
  options.rope = rope;
  options.eps = eps;
  options.q_offset = q_offset;
  options.k_offset = k_offset;
  return options;
}

// The reference's spec for a kernel call with `options`, whose rope the reference sees as `rope`.
inline reference::LinearSpec reference_spec(const LinearOptions& options,
                                            const std::optional<reference::RopeSpec>& rope) {
  return {.causal = options.causal,
          .placement = options.placement,
          .rope = rope,
          .eps = options.eps,
          .q_offset = options.q_offset,
          .k_offset = options.k_offset,
          .denominator = options.denominator,
          .decay = options.decay};
}

}  // namespace linrope::testing
