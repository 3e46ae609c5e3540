// Experiment 4, rope-decay: the long-term decay bound of RoPE (RoFormer sec. 3.4.3, kexue.fm/8265)
// against relative distance, for d = 128 and several bases, and under the context-extension
// scalings (linear, NTK-aware, YaRN) with factor 4.
#include <cmath>
#include <linrope/rope.hpp>

#include "experiment.hpp"
#include "sweep.hpp"

namespace linrope::experiments {

namespace {

struct DecayCurve {
  double base;
  RopeScalingKind kind;
  double factor;
  const char* scaling;  // CSV name
};

// YaRN needs the context length the model was trained on; 4096 (LLaMA 2's) here.
constexpr Index kYarnOriginal = 4096;

Rope make_rope(Index dim, const DecayCurve& c) {
  RopeConfig config{.dim = dim, .base = c.base};
  config.scaling = {.kind = c.kind, .factor = c.factor, .original_max_position = kYarnOriginal};
  return Rope(config);
}

std::string name_of(const DecayCurve& c) {
  std::string name = "base " + std::string(format_number(c.base));
  if (c.kind != RopeScalingKind::None)
    name += ", " + std::string(c.scaling) + " x" + format_number(c.factor);
  return name;
}

}  // namespace

Outcome run_rope_decay(Context& context) {
  const Options& o = context.options;
  const Index dim = o.rope_decay.dim, D = o.rope_decay.distance;
  const std::vector<DecayCurve> curves = {
      {500, RopeScalingKind::None, 1, "none"},    {10000, RopeScalingKind::None, 1, "none"},
      {500000, RopeScalingKind::None, 1, "none"}, {10000, RopeScalingKind::Linear, 4, "linear"},
      {10000, RopeScalingKind::Ntk, 4, "ntk"},    {10000, RopeScalingKind::Yarn, 4, "yarn"}};
  Sweep sweep(context, "rope_decay",
              {"dim", "base", "scaling", "factor", "distance", "decay", "decay_relative"}, 5,
              curves.size() * std::size_t(D + 1), double(curves.size()) * double(D + 1));
  auto key = [&](const DecayCurve& c, Index m) {
    Row row;
    row.set("dim", dim).set("base", c.base).set("scaling", c.scaling).set("factor", c.factor);
    return row.set("distance", m);
  };
  nlohmann::json summary_curves = nlohmann::json::array();
  std::vector<std::string> facts;
  std::vector<std::vector<double>> values;
  for (const auto& c : curves) {
    const std::vector<double> curve = rope_decay_curve(make_rope(dim, c), D);
    values.push_back(curve);
    for (Index m = 0; m <= D; ++m) {
      if (!sweep.begin(key(c, m), name_of(c), 1)) continue;
      Row row = key(c, m);
      row.set("decay", curve[std::size_t(m)])
          .set("decay_relative", curve[std::size_t(m)] / curve[0]);
      sweep.record(row, 1);
    }
    // First distance where the bound is at most half of its value at 0.
    Index half = -1;
    for (Index m = 0; m <= D && half < 0; ++m)
      if (curve[std::size_t(m)] <= 0.5 * curve[0]) half = m;
    const double last = curve.back() / curve[0];
    // The bound oscillates, so one end point can rank the bases by accident: compare the mean
    // over the far three quarters of the distances instead.
    double far_sum = 0;
    for (Index m = D / 4; m <= D; ++m) far_sum += curve[std::size_t(m)] / curve[0];
    const double far_mean = far_sum / double(D - D / 4 + 1);
    summary_curves.push_back({{"name", name_of(c)},
                              {"base", c.base},
                              {"scaling", c.scaling},
                              {"factor", c.factor},
                              {"decay_at_0", curve[0]},
                              {"decay_at_max", curve.back()},
                              {"relative_at_max", last},
                              {"mean_relative_far", far_mean},
                              {"first_distance_at_half", half}});
    facts.push_back(name_of(c) + ": " + fmt(curve[0], 4) + " -> " + fmt(curve.back(), 3) + " (" +
                    percent(last) + ")" +
                    (half >= 0 ? ", half reached at distance " + std::to_string(half)
                               : ", never below half within " + std::to_string(D)));
  }
  sweep.finish();

  Outcome outcome;
  outcome.summary["curves"] = summary_curves;
  outcome.summary["yarn_original_max_position"] = kYarnOriginal;
  Section& s = outcome.section;
  s.title = "4. RoPE long-term decay";
  s.figures = {{"rope_decay.png",
                "Upper bound of |sum_i h_i e^{i m theta_i}| / (d/2) against "
                "relative distance m, d = " +
                    std::to_string(dim) + ": bases (left) and scalings with factor 4 (right)"}};
  std::string p =
      "The bound (1/(d/2)) sum_j |sum_{i<j} e^{i m theta_i}| for d = " + std::to_string(dim) +
      ", from distance 0 to " + std::to_string(D) +
      " (start -> end, end as a share of the start): ";
  for (std::size_t i = 0; i < facts.size(); ++i) p += (i ? "; " : "") + facts[i];
  s.paragraphs.push_back(p + ".");
  // Which base decays fastest, from the numbers.
  std::size_t fastest = 0, slowest = 0;
  for (std::size_t i = 0; i < 3; ++i) {
    if (summary_curves[i]["mean_relative_far"] < summary_curves[fastest]["mean_relative_far"])
      fastest = i;
    if (summary_curves[i]["mean_relative_far"] > summary_curves[slowest]["mean_relative_far"])
      slowest = i;
  }
  s.paragraphs.push_back(
      "Among the unscaled bases, " + summary_curves[fastest]["name"].get<std::string>() +
      " is lowest on average over distances " + std::to_string(D / 4) + " to " + std::to_string(D) +
      " and " + summary_curves[slowest]["name"].get<std::string>() +
      " highest: a larger base slows the rotation of every pair, so the decay stretches over "
      "longer distances. NTK-aware scaling raises the base (to " +
      fmt(10000 * std::pow(4.0, double(dim) / double(dim - 2)), 4) +
      "), and YaRN (original context " + std::to_string(kYarnOriginal) +
      ") interpolates only the slow pairs, keeping the fast ones.");
  // Linear interpolation divides every frequency by 4: its curve at 4m is the unscaled one at m.
  if (D >= 4) {
    const Index m = D / 4;
    s.paragraphs.push_back(
        "Check of linear interpolation (frequencies divided by 4): its bound at "
        "distance " +
        std::to_string(4 * m) + " is " + fmt(values[3][std::size_t(4 * m)], 6) +
        ", and the unscaled base-10000 "
        "bound at distance " +
        std::to_string(m) + " is " + fmt(values[1][std::size_t(m)], 6) + ".");
  }
  return outcome;
}

}  // namespace linrope::experiments
