// Experiment 2, normalization: where RoPE enters linear attention. RoFormer's eq. 19 rotates the
// numerator only (the denominator stays a sum of positive terms); full normalisation rotates both
// (the denominator can cancel to zero or below); before_map rotates q and k before the feature
// map; none drops position. Measured: denominator statistics, output norm against n, and relative
// error against exact RoPE softmax attention, over inputs, maps, causality, lengths and seeds.
#include <algorithm>
#include <cmath>
#include <linrope/linrope.hpp>
#include <map>
#include <memory>

#include "experiment.hpp"
#include "inputs.hpp"
#include "metadata.hpp"
#include "stats.hpp"
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

struct Aggregate {
  std::vector<double> rel_error, nonpositive, below, den_min, out_norm, exact_norm;
};
using GroupKey =
    std::tuple<std::string, std::string, std::string, bool, Index>;  // input map placement causal n

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

  // ---- Aggregate over seeds (from the whole table) ------------------------------------------
  const CsvTable& t = sweep.table();
  std::map<GroupKey, Aggregate> agg;
  for (std::size_t r = 0; r < t.size(); ++r) {
    if (t.number(r, "d") != double(d)) continue;
    Aggregate& a = agg[{t.text(r, "input"), t.text(r, "map"), t.text(r, "placement"),
                        t.text(r, "causal") == "1", Index(t.number(r, "n"))}];
    a.rel_error.push_back(t.number(r, "rel_error"));
    a.nonpositive.push_back(t.number(r, "den_nonpositive_frac"));
    a.below.push_back(t.number(r, "den_below_frac"));
    a.den_min.push_back(t.number(r, "den_min"));
    a.out_norm.push_back(t.number(r, "out_row_norm_mean"));
    a.exact_norm.push_back(t.number(r, "exact_row_norm_mean"));
  }
  Outcome outcome;
  outcome.seeds = seeds;
  nlohmann::json groups_json = nlohmann::json::array();
  for (const auto& [key, a] : agg) {
    const auto& [input, map, placement, causal, n] = key;
    groups_json.push_back({{"input", input},
                           {"map", map},
                           {"placement", placement},
                           {"causal", causal},
                           {"n", n},
                           {"seeds", a.rel_error.size()},
                           {"rel_error_mean", mean(a.rel_error)},
                           {"rel_error_std", std_dev(a.rel_error)},
                           {"den_nonpositive_frac_mean", mean(a.nonpositive)},
                           {"den_below_frac_mean", mean(a.below)},
                           {"den_min", minimum(a.den_min)},
                           {"out_row_norm_mean", mean(a.out_norm)},
                           {"exact_row_norm_mean", mean(a.exact_norm)}});
  }
  outcome.summary["groups"] = groups_json;

  // ---- Report -------------------------------------------------------------------------------
  Section& s = outcome.section;
  s.title =
      "2. Normalisation: RoPE in the numerator only (RoFormer eq. 19) against the alternatives";
  s.figures = {
      {"normalization_denominators.png",
       "Fraction of non-positive denominators against n (mean over seeds), per map and input"},
      {"normalization_error.png",
       "Relative error against exact RoPE softmax attention (mean +- std over seeds); solid "
       "non-causal, dashed causal"},
      {"normalization_output_norm.png",
       "Mean row norm of the output against n; black: exact RoPE softmax"}};
  const Index n_max = lengths.back(), n_min = lengths.front();
  const std::string setup =
      "Single head, d = " + std::to_string(d) + ", double precision, " +
      std::to_string(seeds.size()) +
      " seeds; maps elu+1 (m = d), favor+ (m = " + std::to_string(o.normalization.features) +
      " orthogonal positive features) and "
      "1+cos (m = d + 1); numerator_only and full put RoPE of width m on the "
      "features, before_map RoPE of width d on q and k. Inputs: gaussian (q, "
      "k, v entries N(0, 1)), q_equals_k, random_walk (AR(1) with rho = "
      "0.99, unit variance), sinusoids (periods 60 to 6000 positions), "
      "repeated_token (one token at every position). Reference: exact "
      "softmax attention with RoPE of width d, scale 1/sqrt(d).";
  s.paragraphs.push_back(setup);

  // Denominators: numerator_only against full, over everything measured.
  auto placement_den = [&](const std::string& placement) {
    double min_den = INFINITY, worst_frac = 0;
    std::size_t configs_with_nonpositive = 0, configs = 0;
    GroupKey worst_at;
    for (const auto& [key, a] : agg) {
      if (std::get<2>(key) != placement) continue;
      min_den = std::min(min_den, minimum(a.den_min));
      const double frac = mean(a.nonpositive);
      ++configs;
      if (maximum(a.nonpositive) > 0) ++configs_with_nonpositive;
      if (frac > worst_frac) worst_frac = frac, worst_at = key;
    }
    return std::tuple{min_den, worst_frac, worst_at, configs_with_nonpositive, configs};
  };
  {
    const auto [nmin, nworst, nat, nbad, nconf] = placement_den("numerator_only");
    const auto [fmin, fworst, fat, fbad, fconf] = placement_den("full");
    std::string p;
    if (nbad == 0)
      p = "Numerator-only kept every denominator positive (smallest " + fmt(nmin, 3) +
          " over all " + std::to_string(nconf) + " input/map/causal/length configurations)";
    else
      p = "Numerator-only had non-positive denominators in " + std::to_string(nbad) + " of " +
          std::to_string(nconf) + " configurations (smallest " + fmt(nmin, 3) + ")";
    if (fbad == 0) {
      p += ", and so did full normalisation here (smallest " + fmt(fmin, 3) + ").";
    } else {
      const auto& [input, map, placement, causal, n] = fat;
      p += ", while full normalisation had non-positive denominators in " + std::to_string(fbad) +
           " of " + std::to_string(fconf) + " configurations, worst " + percent(fworst) +
           " of the rows (" + map + ", " + input + ", " + (causal ? "causal" : "non-causal") +
           ", n = " + std::to_string(n) + "); its smallest denominator was " + fmt(fmin, 3) + ".";
    }
    // Full at n_max, Gaussian, per map.
    std::vector<std::string> per_map;
    for (const FeatureMapKind kind : kMaps)
      for (const bool causal : {false, true})
        if (const auto a = agg.find({"gaussian", to_string(kind), "full", causal, n_max});
            a != agg.end())
          per_map.push_back(std::string(to_string(kind)) + (causal ? " causal " : " ") +
                            percent(mean(a->second.nonpositive)));
    if (!per_map.empty()) {
      p += " On Gaussian inputs at n = " + std::to_string(n_max) +
           ", the share of non-positive full-normalisation denominators was: ";
      for (std::size_t i = 0; i < per_map.size(); ++i) p += (i ? ", " : "") + per_map[i];
      p += ".";
    }
    s.paragraphs.push_back(p);
  }

  // Accuracy tables at n_max.
  for (const bool causal : {false, true}) {
    std::string table = "Relative error against exact RoPE softmax attention, " +
                        std::string(causal ? "causal" : "non-causal") +
                        ", n = " + std::to_string(n_max) +
                        ", mean +- std over seeds:\n\n| input | placement |";
    for (const FeatureMapKind kind : kMaps) table += " " + std::string(to_string(kind)) + " |";
    table += "\n|---|---|";
    for (std::size_t i = 0; i < std::size(kMaps); ++i) table += "---|";
    table += "\n";
    for (const InputKind input : all_input_kinds())
      for (const RopePlacement placement : kPlacements) {
        table += "| " + std::string(to_string(input)) + " | " + to_string(placement) + " |";
        for (const FeatureMapKind kind : kMaps) {
          const auto a =
              agg.find({to_string(input), to_string(kind), to_string(placement), causal, n_max});
          // Appended piece by piece: GCC 12 warns falsely (-Wrestrict) on " " + std::string.
          if (a != agg.end())
            table.append(" ")
                .append(fmt(mean(a->second.rel_error), 3))
                .append(" +- ")
                .append(fmt(std_dev(a->second.rel_error), 2));
          table += " |";
        }
        table += "\n";
      }
    s.paragraphs.push_back(table);
  }
  // Which placement is most accurate, per map, counted over inputs (non-causal and causal, n_max).
  {
    std::string p = "Most accurate placement at n = " + std::to_string(n_max) +
                    " (lowest mean error), counted over the " +
                    std::to_string(all_input_kinds().size()) + " inputs x 2 causal settings: ";
    std::vector<std::string> per_map;
    for (const FeatureMapKind kind : kMaps) {
      std::map<std::string, int> wins;
      for (const InputKind input : all_input_kinds())
        for (const bool causal : {false, true}) {
          std::string best;
          double best_error = INFINITY;
          for (const RopePlacement placement : kPlacements) {
            const auto a =
                agg.find({to_string(input), to_string(kind), to_string(placement), causal, n_max});
            if (a != agg.end() && mean(a->second.rel_error) < best_error)
              best_error = mean(a->second.rel_error), best = to_string(placement);
          }
          if (!best.empty()) ++wins[best];
        }
      std::string text = std::string(to_string(kind)) + " (";
      bool first = true;
      for (const auto& [placement, count] : wins) {
        text += (first ? "" : ", ") + placement + " " + std::to_string(count);
        first = false;
      }
      per_map.push_back(text + ")");
    }
    for (std::size_t i = 0; i < per_map.size(); ++i) p += (i ? "; " : "") + per_map[i];
    s.paragraphs.push_back(p + ".");
  }
  // Output norm growth, Gaussian, non-causal.
  if (n_max > n_min) {
    std::string p = "Output norm from n = " + std::to_string(n_min) +
                    " to n = " + std::to_string(n_max) + " (Gaussian, non-causal, mean row norm): ";
    std::vector<std::string> parts;
    if (const auto a = agg.find({"gaussian", "favor+", "none", false, n_min}),
        b = agg.find({"gaussian", "favor+", "none", false, n_max});
        a != agg.end() && b != agg.end())
      parts.push_back("exact RoPE softmax " + fmt(mean(a->second.exact_norm), 3) + " -> " +
                      fmt(mean(b->second.exact_norm), 3));
    for (const FeatureMapKind kind : kMaps)
      for (const RopePlacement placement : {RopePlacement::NumeratorOnly, RopePlacement::Full}) {
        const auto a = agg.find({"gaussian", to_string(kind), to_string(placement), false, n_min});
        const auto b = agg.find({"gaussian", to_string(kind), to_string(placement), false, n_max});
        if (a == agg.end() || b == agg.end()) continue;
        parts.push_back(std::string(to_string(kind)) + " " + to_string(placement) + " " +
                        fmt(mean(a->second.out_norm), 3) + " -> " +
                        fmt(mean(b->second.out_norm), 3) + " (x" +
                        fmt(mean(b->second.out_norm) / mean(a->second.out_norm), 3) + ")");
      }
    for (std::size_t i = 0; i < parts.size(); ++i) p += (i ? "; " : "") + parts[i];
    s.paragraphs.push_back(p + ".");
  }
  return outcome;
}

}  // namespace linrope::experiments
