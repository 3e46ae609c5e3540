// Experiment 3, favor-error: how well FAVOR+ random features approximate the softmax kernel
// exp(<q, k> / sqrt(d)) as the number of features m grows, for iid and orthogonal projections,
// positive and trigonometric features (the setting of Performer's Fig. 4: L tokens, d = 16):
// the MSE of phi(q).phi(k) on sampled pairs, and the relative error of the attention output
// against exact softmax attention (no RoPE, placement None, non-causal). The input scale is swept
// too: it decides which features win (the estimators' variances grow like exp(|q'|^2 + |k'|^2)).
#include <algorithm>
#include <cmath>
#include <linrope/linrope.hpp>
#include <linrope/random.hpp>
#include <map>

#include "experiment.hpp"
#include "fit.hpp"
#include "inputs.hpp"
#include "metadata.hpp"
#include "stats.hpp"
#include "sweep.hpp"

namespace linrope::experiments {

namespace {

struct Variant {
  const char* features;  // "positive" | "trig"
  const char* sampling;  // "iid" | "orthogonal"
  FeatureMapKind kind;
  bool orthogonal;
};
constexpr Variant kVariants[] = {
    {"positive", "orthogonal", FeatureMapKind::FavorPositive, true},
    {"positive", "iid", FeatureMapKind::FavorPositive, false},
    {"trig", "orthogonal", FeatureMapKind::FavorTrig, true},
    {"trig", "iid", FeatureMapKind::FavorTrig, false},
};

struct Cell {
  std::vector<double> mse, rel_mse, attn;
};
using CellKey =
    std::tuple<std::string, std::string, Index, std::string>;  // features sampling m scale

}  // namespace

Outcome run_favor_error(Context& context) {
  const Options& o = context.options;
  // One thread unless --threads says otherwise: many small single-head calls (see ScopedThreads).
  const ScopedThreads threads(o.threads > 0 ? o.threads : 1);
  const Index L = o.favor_error.length, d = o.favor_error.dim, P = o.favor_error.pairs;
  std::vector<std::uint64_t> seeds;
  for (Index s = 0; s < o.favor_error.seeds; ++s) seeds.push_back(o.seed + std::uint64_t(s));
  double total_work = 0;
  for (const Index m : o.favor_error.features)
    total_work +=
        double(m) * double(std::size(kVariants) * seeds.size() * o.favor_error.scales.size());
  Sweep sweep(context, "favor_error",
              {"features", "sampling", "m", "seed", "n", "d", "scale", "pairs", "output_dim",
               "kernel_mse", "kernel_rel_mse", "attn_rel_error"},
              7,
              seeds.size() * std::size(kVariants) * o.favor_error.features.size() *
                  o.favor_error.scales.size(),
              total_work);

  for (const double scale : o.favor_error.scales)
    for (const std::uint64_t seed : seeds) {
      auto key = [&](const Variant& v, Index m) {
        Row row;
        row.set("features", v.features).set("sampling", v.sampling).set("m", m);
        row.set("seed", Index(seed)).set("n", L).set("d", d);
        return row.set("scale", scale);
      };
      bool needed = false;
      for (const auto& v : kVariants)
        for (const Index m : o.favor_error.features)
          needed = needed || !sweep.table().contains(sweep.table().key_of(key(v, m)));
      if (!needed) {
        for (const auto& v : kVariants)
          for (const Index m : o.favor_error.features) sweep.begin(key(v, m), "", double(m));
        continue;
      }
      // The same q, k, v and pairs for every scale (scaled copies), so that scales compare alike.
      const MatrixD q = gaussian_matrix(L, d, seed * 3 + 1, scale);
      const MatrixD k = gaussian_matrix(L, d, seed * 3 + 2, scale);
      const MatrixD v = gaussian_matrix(L, d, seed * 3 + 3);
      const MatrixD exact_attention = softmax_attention(q, k, v);
      Random random(seed * 3 + 4);
      std::vector<Index> qi(static_cast<std::size_t>(P)), kj(qi.size());
      Vector<double> exact(P);
      const double inv_sqrt_d = 1 / std::sqrt(double(d));
      for (std::size_t p = 0; p < qi.size(); ++p) {
        qi[p] = Index(random.uniform() * double(L));
        kj[p] = Index(random.uniform() * double(L));
        exact(Index(p)) = std::exp(q.row(qi[p]).dot(k.row(kj[p])) * inv_sqrt_d);
      }
      const double mean_square = exact.squaredNorm() / double(P);
      for (const auto& variant : kVariants)
        for (const Index m : o.favor_error.features) {
          const Row row_key = key(variant, m);
          const std::string label = std::string(variant.features) + " " + variant.sampling +
                                    " m=" + std::to_string(m) + " scale=" + format_number(scale) +
                                    " seed=" + std::to_string(seed);
          if (!sweep.begin(row_key, label, double(m))) continue;
          const auto map = make_feature_map({.kind = variant.kind,
                                             .input_dim = d,
                                             .num_features = m,
                                             .orthogonal = variant.orthogonal,
                                             .seed = seed});
          MatrixD phi_q(L, map->output_dim()), phi_k(L, map->output_dim());
          map->apply(q, phi_q);
          map->apply(k, phi_k);
          double mse = 0;
          for (std::size_t p = 0; p < qi.size(); ++p) {
            const double error = phi_q.row(qi[p]).dot(phi_k.row(kj[p])) - exact(Index(p));
            mse += error * error / double(P);
          }
          const MatrixD out = linear_attention(q, k, v, *map, {.placement = RopePlacement::None});
          Row row = row_key;
          row.set("pairs", P).set("output_dim", map->output_dim()).set("kernel_mse", mse);
          row.set("kernel_rel_mse", mse / mean_square);
          row.set("attn_rel_error", (out - exact_attention).norm() / exact_attention.norm());
          sweep.record(row, double(m));
        }
    }
  sweep.finish();

  // ---- Aggregate over seeds ---------------------------------------------------------------
  const CsvTable& t = sweep.table();
  std::map<CellKey, Cell> cells;
  for (std::size_t r = 0; r < t.size(); ++r) {
    if (t.number(r, "n") != double(L) || t.number(r, "d") != double(d)) continue;
    Cell& c = cells[{t.text(r, "features"), t.text(r, "sampling"), Index(t.number(r, "m")),
                     t.text(r, "scale")}];
    c.mse.push_back(t.number(r, "kernel_mse"));
    c.rel_mse.push_back(t.number(r, "kernel_rel_mse"));
    c.attn.push_back(t.number(r, "attn_rel_error"));
  }
  Outcome outcome;
  outcome.seeds = seeds;
  nlohmann::json curves = nlohmann::json::array();
  std::map<std::tuple<std::string, std::string, std::string>, LogLogFit> mse_fit;
  for (const double scale_value : o.favor_error.scales) {
    const std::string scale = format_number(scale_value);
    for (const auto& v : kVariants) {
      std::vector<double> ms, mses;
      nlohmann::json points = nlohmann::json::array();
      for (const auto& [key, c] : cells) {
        if (std::get<0>(key) != v.features || std::get<1>(key) != v.sampling ||
            std::get<3>(key) != scale)
          continue;
        ms.push_back(double(std::get<2>(key)));
        mses.push_back(mean(c.mse));
        points.push_back({{"m", std::get<2>(key)},
                          {"kernel_mse_mean", mean(c.mse)},
                          {"kernel_mse_std", std_dev(c.mse)},
                          {"kernel_rel_mse_mean", mean(c.rel_mse)},
                          {"attn_rel_error_mean", mean(c.attn)},
                          {"attn_rel_error_std", std_dev(c.attn)},
                          {"seeds", c.mse.size()}});
      }
      const LogLogFit fit = fit_loglog(ms, mses);
      mse_fit[{v.features, v.sampling, scale}] = fit;
      curves.push_back({{"features", v.features},
                        {"sampling", v.sampling},
                        {"scale", scale_value},
                        {"mse_slope_vs_m", fit.slope},
                        {"points", points}});
    }
  }
  outcome.summary["curves"] = curves;

  // ---- Report -------------------------------------------------------------------------------
  Section& s = outcome.section;
  s.title = "3. FAVOR+ approximation error against the number of features";
  s.figures = {{"favor_kernel_mse.png",
                "MSE of phi(q).phi(k) against exp(q.k/sqrt(d)) on sampled "
                "pairs (mean +- std over seeds), one panel per input scale"},
               {"favor_attention_error.png",
                "Relative error of the attention output against exact "
                "softmax attention (mean +- std over seeds)"}};
  s.paragraphs.push_back("L = " + std::to_string(L) + ", d = " + std::to_string(d) +
                         ", q and k entries N(0, s^2) for "
                         "each scale s, v entries N(0, 1); " +
                         std::to_string(P) + " sampled (q, k) pairs; " +
                         std::to_string(seeds.size()) +
                         " seeds (each redraws the inputs and W); m counts random "
                         "projections (trig features output 2m values).");
  const Index m_lo =
      *std::min_element(o.favor_error.features.begin(), o.favor_error.features.end());
  const Index m_hi =
      *std::max_element(o.favor_error.features.begin(), o.favor_error.features.end());
  auto cell = [&](const char* f, const char* sampling, Index m,
                  const std::string& scale) -> const Cell* {
    const auto found = cells.find({f, sampling, m, scale});
    return found == cells.end() ? nullptr : &found->second;
  };
  for (const double scale_value : o.favor_error.scales) {
    const std::string scale = format_number(scale_value);
    std::string p = "Scale s = " + scale + ". Kernel MSE from m = " + std::to_string(m_lo) +
                    " to m = " + std::to_string(m_hi) +
                    " (log-log slope against m; -1 is the "
                    "Monte Carlo rate): ";
    std::vector<std::string> parts;
    for (const auto& v : kVariants) {
      const Cell* a = cell(v.features, v.sampling, m_lo, scale);
      const Cell* b = cell(v.features, v.sampling, m_hi, scale);
      if (!a || !b) continue;
      const double slope = mse_fit[{v.features, v.sampling, scale}].slope;
      parts.push_back(std::string(v.features) + " " + v.sampling + " " + fmt(mean(a->mse), 3) +
                      " -> " + fmt(mean(b->mse), 3) + " +- " + fmt(std_dev(b->mse), 2) +
                      " (slope " + fmt(slope, 3) +
                      (slope > -0.5 ? ", not falling as 1/m over this range: the squared errors of "
                                      "a few pairs dominate, see the std"
                                    : "") +
                      ")");
    }
    for (std::size_t i = 0; i < parts.size(); ++i) p += (i ? "; " : "") + parts[i];
    p += ". At m = " + std::to_string(m_hi) + ": ";
    parts.clear();
    for (const char* f : {"positive", "trig"}) {
      const Cell* orth = cell(f, "orthogonal", m_hi, scale);
      const Cell* iid = cell(f, "iid", m_hi, scale);
      if (!orth || !iid) continue;
      const double ratio = mean(iid->mse) / mean(orth->mse);
      parts.push_back(std::string(f) + " features, orthogonal kernel MSE " +
                      (ratio >= 1 ? fmt(ratio, 3) + "x lower than iid"
                                  : fmt(1 / ratio, 3) + "x higher than iid") +
                      ", attention error " + fmt(mean(orth->attn), 3) + " (orthogonal) vs " +
                      fmt(mean(iid->attn), 3) + " (iid)");
    }
    const Cell* pos = cell("positive", "orthogonal", m_hi, scale);
    const Cell* trig = cell("trig", "orthogonal", m_hi, scale);
    if (pos && trig) {
      const bool positive_wins = mean(pos->attn) < mean(trig->attn);
      parts.push_back(
          std::string(positive_wins ? "positive" : "trig") +
          " features give the smaller attention error (orthogonal: " + fmt(mean(pos->attn), 3) +
          " positive vs " + fmt(mean(trig->attn), 3) + " trig)");
    }
    for (std::size_t i = 0; i < parts.size(); ++i) p += (i ? "; " : "") + parts[i];
    s.paragraphs.push_back(p + ".");
  }
  return outcome;
}

}  // namespace linrope::experiments
