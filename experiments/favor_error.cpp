// Experiment 3, favor-error: how well FAVOR+ random features approximate the softmax kernel
// exp(<q, k> / sqrt(d)) as the number of features m grows, for iid and orthogonal projections,
// positive and trigonometric features (the setting of Performer's Fig. 4: L tokens, d = 16):
// the MSE of phi(q).phi(k) on sampled pairs, and the relative error of the attention output
// against exact softmax attention (no RoPE, placement None, non-causal). The input scale is swept
// too: it decides which features win (the estimators' variances grow like exp(|q'|^2 + |k'|^2)).
#include <cmath>
#include <linrope/linrope.hpp>
#include <linrope/random.hpp>

#include "experiment.hpp"
#include "inputs.hpp"
#include "metadata.hpp"
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
  Outcome outcome;
  outcome.seeds = seeds;
  return outcome;
}

}  // namespace linrope::experiments
