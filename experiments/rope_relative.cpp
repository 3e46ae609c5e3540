// Experiment 5, rope-relative: how exactly the implementation keeps the relative-position identity
//   <R_m q, R_n k> = <q, R_(n-m) k>
// on random vectors, per precision, for positions up to 10^6.
#include <cmath>
#include <linrope/random.hpp>
#include <linrope/rope.hpp>
#include <vector>

#include "experiment.hpp"
#include "inputs.hpp"
#include "sweep.hpp"

namespace linrope::experiments {

namespace {

struct Deviation {
  double max_abs = 0, max_rel = 0, mean_rel = 0;
};

// S samples: q, k ~ N(0, I_d); m, n uniform in [0, max_position]. Rotations in precision T, dot
// products in double so that what is measured is the rotation, not the summation.
template <class T>
Deviation measure(const Rope& rope, Index dim, Index max_position, Index samples,
                  std::uint64_t seed) {
  const MatrixD qd = gaussian_matrix(samples, dim, seed * 2 + 1);
  const MatrixD kd = gaussian_matrix(samples, dim, seed * 2 + 2);
  Random random(seed * 2 + 3);
  std::vector<Index> pm(static_cast<std::size_t>(samples)), pn(pm.size()), diff(pm.size());
  for (std::size_t i = 0; i < pm.size(); ++i) {
    pm[i] = Index(random.uniform() * double(max_position + 1));
    pn[i] = Index(random.uniform() * double(max_position + 1));
    diff[i] = pn[i] - pm[i];
  }
  Matrix<T> q = qd.cast<T>(), k = kd.cast<T>(), qm = q, kn = k, kdiff = k;
  rope.apply(qm, std::span<const Index>(pm));
  rope.apply(kn, std::span<const Index>(pn));
  rope.apply(kdiff, std::span<const Index>(diff));
  Deviation d;
  for (Index i = 0; i < samples; ++i) {
    const double lhs = qm.row(i).template cast<double>().dot(kn.row(i).template cast<double>());
    const double rhs = q.row(i).template cast<double>().dot(kdiff.row(i).template cast<double>());
    const double norm =
        q.row(i).template cast<double>().norm() * k.row(i).template cast<double>().norm();
    const double dev = std::abs(lhs - rhs);
    d.max_abs = std::max(d.max_abs, dev);
    d.max_rel = std::max(d.max_rel, dev / norm);
    d.mean_rel += dev / norm / double(samples);
  }
  return d;
}

}  // namespace

Outcome run_rope_relative(Context& context) {
  const Options& o = context.options;
  const Index dim = o.rope_relative.dim, S = o.rope_relative.samples;
  const Rope rope(RopeConfig{.dim = dim});
  Sweep sweep(context, "rope_relative",
              {"precision", "dim", "max_position", "samples", "seed", "max_abs_dev", "max_rel_dev",
               "mean_rel_dev"},
              4, 2 * o.rope_relative.positions.size(),
              double(2 * o.rope_relative.positions.size()));
  Outcome outcome;
  for (std::size_t r = 0; r < o.rope_relative.positions.size(); ++r) {
    const Index max_position = o.rope_relative.positions[r];
    const std::uint64_t seed = o.seed + r;  // same vectors and positions for both precisions
    outcome.seeds.push_back(seed);
    for (const char* precision : {"float", "double"}) {
      Row key;
      key.set("precision", precision).set("dim", dim).set("max_position", max_position);
      key.set("samples", S);
      if (!sweep.begin(key,
                       std::string(precision) + " positions <= " + std::to_string(max_position), 1))
        continue;
      const Deviation d = std::string(precision) == "float"
                              ? measure<float>(rope, dim, max_position, S, seed)
                              : measure<double>(rope, dim, max_position, S, seed);
      key.set("seed", Index(seed)).set("max_abs_dev", d.max_abs).set("max_rel_dev", d.max_rel);
      sweep.record(key.set("mean_rel_dev", d.mean_rel), 1);
    }
  }
  sweep.finish();
  return outcome;
}

}  // namespace linrope::experiments
