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

  // Summary per precision from the table (resumed rows included).
  const CsvTable& t = sweep.table();
  Section& s = outcome.section;
  s.title = "5. RoPE relative-position identity";
  s.figures = {{"rope_relative.png",
                "Largest deviation |<R_m q, R_n k> - <q, R_(n-m) k>| / "
                "(|q||k|) over random pairs, against the largest position"}};
  std::string p = "Over " + std::to_string(S) +
                  " random pairs per range (d = " + std::to_string(dim) +
                  ", positions uniform up to the largest), the identity held "
                  "to (largest deviation relative to |q||k|): ";
  std::vector<std::string> parts;
  for (const char* precision : {"float", "double"}) {
    // Deviation at the smallest and at the largest position range, and the worst overall.
    double worst = -1, worst_abs = 0, first_rel = NAN, last_rel = NAN;
    Index worst_at = 0, first = 0, last = 0;
    for (std::size_t r = 0; r < t.size(); ++r) {
      if (t.text(r, "precision") != precision || t.number(r, "dim") != double(dim)) continue;
      const double rel = t.number(r, "max_rel_dev");
      const Index range = Index(t.number(r, "max_position"));
      if (rel > worst) worst = rel, worst_at = range;
      worst_abs = std::max(worst_abs, t.number(r, "max_abs_dev"));
      if (first == 0 || range < first) first = range, first_rel = rel;
      if (range > last) last = range, last_rel = rel;
    }
    if (worst < 0) continue;
    outcome.summary[precision] = {{"max_rel_dev", worst},
                                  {"max_abs_dev", worst_abs},
                                  {"at_max_position", worst_at},
                                  {"rel_dev_smallest_range", first_rel},
                                  {"rel_dev_largest_range", last_rel}};
    const double growth = last_rel / first_rel;
    std::string trend = !(std::isfinite(growth) && first_rel > 0) ? ""
                        : growth > 10
                            ? ", growing " + fmt(growth, 2) + "x from the smallest range"
                            : ", within a factor " + fmt(std::max(growth, 1 / growth), 2) +
                                  " of the smallest range";
    parts.push_back(std::string(precision) + ": " + fmt(first_rel, 3) + " for positions up to " +
                    std::to_string(first) + " and " + fmt(last_rel, 3) + " up to " +
                    std::to_string(last) + trend + " (worst " + fmt(worst, 3) + ", absolute " +
                    fmt(worst_abs, 3) + ")");
  }
  for (std::size_t i = 0; i < parts.size(); ++i) p += (i ? "; " : "") + parts[i];
  s.paragraphs.push_back(p +
                         ". For scale, one rounding is 2^-24 = 6.0e-8 in float and 2^-53 = "
                         "1.1e-16 in double.");
  return outcome;
}

}  // namespace linrope::experiments
