// Experiment 2, normalization: where RoPE enters linear attention. RoFormer's eq. 19 rotates the
// numerator only (the denominator stays a sum of positive terms); full normalisation rotates both
// (the denominator can cancel to zero or below); before_map rotates q and k before the feature
// map; none drops position. Measured: denominator statistics, output norm against n, and relative
// error against exact RoPE softmax attention, over inputs, maps, causality, lengths and seeds.
#include <algorithm>
#include <linrope/linrope.hpp>
#include <memory>

#include "experiment.hpp"
#include "inputs.hpp"
#include "metadata.hpp"
#include "sweep.hpp"

namespace linrope::experiments {

namespace {

constexpr RopePlacement kPlacements[] = {RopePlacement::None, RopePlacement::BeforeMap,
                                         RopePlacement::NumeratorOnly, RopePlacement::Full};
constexpr FeatureMapKind kMaps[] = {FeatureMapKind::EluPlusOne, FeatureMapKind::FavorPositive,
                                    FeatureMapKind::OnePlusCosine};

double relative_error(const MatrixD& approx, const MatrixD& exact) {
  const double norm = exact.norm();
  return norm > 0 ? (approx - exact).norm() / norm : (approx - exact).norm();
}

double mean_row_norm(const MatrixD& x) { return x.rowwise().norm().mean(); }

// RoPE on m features: rotary width m, or m - 1 when odd (1+cos appends a constant feature, which
// passes through unrotated).
Rope feature_rope(Index m) { return Rope(RopeConfig{.dim = m, .rotary_dim = m - m % 2}); }

}  // namespace

Outcome run_normalization(Context& context) {
  const Options& o = context.options;
  // One thread unless --threads says otherwise: many small single-head calls (see ScopedThreads).
  const ScopedThreads threads(o.threads > 0 ? o.threads : 1);
  const Index d = o.normalization.dim;
  std::vector<Index> lengths = o.normalization.lengths;
  std::sort(lengths.begin(), lengths.end());
  lengths.erase(std::unique(lengths.begin(), lengths.end()), lengths.end());
  std::vector<std::uint64_t> seeds;
  for (Index s = 0; s < o.normalization.seeds; ++s) seeds.push_back(o.seed + std::uint64_t(s));

  const std::size_t per_group = std::size(kMaps) * std::size(kPlacements);
  const std::size_t groups = lengths.size() * seeds.size() * all_input_kinds().size() * 2;
  double total_work = 0;
  for (const Index n : lengths)
    total_work += double(seeds.size() * all_input_kinds().size() * 2 * per_group) * double(n) *
                  (1 + double(n) / 256);
  Sweep sweep(context, "normalization",
              {"input", "map", "placement", "causal", "n", "seed", "d", "m", "den_min",
               "den_nonpositive_frac", "den_below_frac", "den_threshold", "out_row_norm_mean",
               "exact_row_norm_mean", "rel_error", "rel_error_norope"},
              6, groups * per_group, total_work);

  const Rope rope_d(RopeConfig{.dim = d});
  for (const Index n : lengths)
    for (const std::uint64_t seed : seeds) {
      // Feature maps of this seed (FAVOR+ draws W from it; the others are deterministic).
      std::vector<std::unique_ptr<FeatureMap>> maps;
      for (const FeatureMapKind kind : kMaps)
        maps.push_back(make_feature_map({.kind = kind,
                                         .input_dim = d,
                                         .num_features = o.normalization.features,
                                         .orthogonal = true,
                                         .seed = seed}));
      for (const InputKind input : all_input_kinds())
        for (const bool causal : {false, true}) {
          auto key = [&](const FeatureMap& map, RopePlacement placement) {
            Row row;
            row.set("input", to_string(input)).set("map", to_string(map.kind()));
            row.set("placement", to_string(placement)).set("causal", causal).set("n", n);
            return row.set("seed", Index(seed));
          };
          bool needed = false;
          for (const auto& map : maps)
            for (const RopePlacement placement : kPlacements)
              needed =
                  needed || !sweep.table().contains(sweep.table().key_of(key(*map, placement)));
          const double work = double(n) * (1 + double(n) / 256);
          if (!needed) {
            for (const auto& map : maps)
              for (const RopePlacement placement : kPlacements)
                sweep.begin(key(*map, placement), "", work);
            continue;
          }
          const Inputs x = make_inputs(input, n, d, seed);
          const MatrixD exact =
              softmax_attention(x.q, x.k, x.v, {.causal = causal, .rope = &rope_d});
          const MatrixD exact_norope = softmax_attention(x.q, x.k, x.v, {.causal = causal});
          const double exact_norm = mean_row_norm(exact);
          for (const auto& map : maps) {
            const Rope rope_m = feature_rope(map->output_dim());
            for (const RopePlacement placement : kPlacements) {
              const Row k = key(*map, placement);
              const std::string label = std::string(to_string(input)) + " " +
                                        to_string(map->kind()) + " " + to_string(placement) +
                                        (causal ? " causal" : "") + " n=" + std::to_string(n);
              if (!sweep.begin(k, label, work)) continue;
              const Rope* rope = placement == RopePlacement::None        ? nullptr
                                 : placement == RopePlacement::BeforeMap ? &rope_d
                                                                         : &rope_m;
              DenominatorStats stats;
              stats.threshold = o.normalization.threshold;
              const MatrixD out = linear_attention(
                  x.q, x.k, x.v, *map, {.causal = causal, .placement = placement, .rope = rope},
                  &stats);
              const double count = double(std::max<Index>(stats.count, 1));
              Row row = k;
              row.set("d", d).set("m", map->output_dim()).set("den_min", stats.min);
              row.set("den_nonpositive_frac", double(stats.nonpositive) / count);
              row.set("den_below_frac", double(stats.below_threshold) / count);
              row.set("den_threshold", o.normalization.threshold);
              row.set("out_row_norm_mean", mean_row_norm(out));
              row.set("exact_row_norm_mean", exact_norm);
              row.set("rel_error", relative_error(out, exact));
              row.set("rel_error_norope", relative_error(out, exact_norope));
              sweep.record(row, work);
            }
          }
        }
    }
  sweep.finish();
  Outcome outcome;
  outcome.seeds = seeds;
  return outcome;
}

}  // namespace linrope::experiments
