// Feature maps for the tests: the kinds they sweep, which kinds are FAVOR+ (random features), and
// one way to build a map. Each test file keeps its own choice of d, f and seed (and says why);
// what a map is made of is written here once.
#pragma once

#include <cstdint>
#include <linrope/feature_maps.hpp>
#include <memory>

namespace linrope::testing {

// Every feature map.
inline constexpr FeatureMapKind kMaps[] = {
    FeatureMapKind::EluPlusOne, FeatureMapKind::Relu,          FeatureMapKind::FavorPositive,
    FeatureMapKind::FavorTrig,  FeatureMapKind::OnePlusCosine, FeatureMapKind::FavorHyperbolic};
// The FAVOR+ maps: a random projection W of num_features >= 1 rows. The others are deterministic
// and ignore num_features.
inline constexpr FeatureMapKind kFavorMaps[] = {
    FeatureMapKind::FavorPositive, FeatureMapKind::FavorTrig, FeatureMapKind::FavorHyperbolic};

inline bool is_favor(FeatureMapKind kind) {
  return kind == FeatureMapKind::FavorPositive || kind == FeatureMapKind::FavorTrig ||
         kind == FeatureMapKind::FavorHyperbolic;
}

// f random features for a FAVOR+ map, 0 for a deterministic one.
inline Index favor_features(FeatureMapKind kind, Index f) { return is_favor(kind) ? f : 0; }

// A map of `kind` on d inputs with num_features = f as given (so a test can hand a deterministic
// map a non-zero f and check that it is ignored; use favor_features to give it 0).
inline std::unique_ptr<FeatureMap> make_map(FeatureMapKind kind, Index d, Index f = 0,
                                            std::uint64_t seed = 7, bool orthogonal = true,
                                            bool regularized = false) {
  FeatureMapConfig config;
  config.kind = kind;
  config.input_dim = d;
  config.num_features = f;
  config.orthogonal = orthogonal;
  config.seed = seed;
  config.regularized = regularized;
  return make_feature_map(config);
}

}  // namespace linrope::testing
