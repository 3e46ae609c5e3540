// Experiment 4, rope-decay: the long-term decay bound of RoPE (RoFormer sec. 3.4.3, kexue.fm/8265)
// against relative distance, for d = 128 and several bases, and under the context-extension
// scalings (linear, NTK-aware, YaRN) with factor 4.
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
  for (const auto& c : curves) {
    const std::vector<double> curve = rope_decay_curve(make_rope(dim, c), D);
    for (Index m = 0; m <= D; ++m) {
      if (!sweep.begin(key(c, m), name_of(c), 1)) continue;
      Row row = key(c, m);
      row.set("decay", curve[std::size_t(m)])
          .set("decay_relative", curve[std::size_t(m)] / curve[0]);
      sweep.record(row, 1);
    }
  }
  sweep.finish();

  Outcome outcome;
  outcome.run["yarn_original_max_position"] = kYarnOriginal;
  return outcome;
}

}  // namespace linrope::experiments
