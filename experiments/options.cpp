#include "options.hpp"

#include <stdexcept>

namespace linrope::experiments {

namespace {

std::vector<Index> powers_of_two(Index from, Index to) {
  std::vector<Index> values;
  for (Index v = from; v <= to; v *= 2) values.push_back(v);
  return values;
}

template <class T>
void preset(T& value, T quick, T full, bool is_full) {
  if (value == T{}) value = is_full ? std::move(full) : std::move(quick);
}

// Even widths: RoPE rotates pairs.
void require_even(const char* option, Index value) {
  if (value % 2 != 0)
    throw std::invalid_argument(std::string(option) + ": " + std::to_string(value) +
                                " is odd but RoPE needs an even width");
}

}  // namespace

void resolve_presets(Options& o) {
  const bool f = o.full;
  ScalingOptions& s = o.scaling;
  preset(s.lengths, powers_of_two(256, 16384), powers_of_two(256, Index(1) << 20), f);
  preset<Index>(s.heads, 8, 8, f);
  preset<Index>(s.dim, 64, 64, f);
  preset<Index>(s.reps, 3, 5, f);
  preset<Index>(s.naive_max, 8192, 16384, f);
  preset<Index>(s.softmax_max, 16384, 65536, f);
  preset<Index>(s.features, 256, 256, f);
  preset<Index>(s.one_head_n, 65536, Index(1) << 20, f);
  preset(s.causal_methods, {"scan"}, {"scan"}, f);
  NormalizationOptions& n = o.normalization;
  preset(n.lengths, {256, 1024, 4096}, {256, 1024, 4096, 16384}, f);
  preset<Index>(n.seeds, 3, 10, f);
  preset<Index>(n.dim, 64, 64, f);
  preset<Index>(n.features, 64, 64, f);
  FavorErrorOptions& e = o.favor_error;
  preset<Index>(e.length, 1024, 4096, f);
  preset<Index>(e.dim, 16, 16, f);
  preset(e.features, powers_of_two(16, 256), powers_of_two(16, 512), f);
  preset<Index>(e.seeds, 5, 10, f);
  preset<Index>(e.pairs, 4096, 16384, f);
  preset(e.scales, {0.5, 1.0}, {0.5, 1.0}, f);
  preset<Index>(o.rope_decay.dim, 128, 128, f);
  preset<Index>(o.rope_decay.distance, 256, 2048, f);
  RopeRelativeOptions& r = o.rope_relative;
  preset(r.positions, {10, 100, 1000, 10000, 100000, 1000000},
         {10, 100, 1000, 10000, 100000, 1000000}, f);
  preset<Index>(r.dim, 128, 128, f);
  preset<Index>(r.samples, 256, 4096, f);

  require_even("--dim", s.dim);
  require_even("--norm-dim", n.dim);
  require_even("--decay-dim", o.rope_decay.dim);
  require_even("--relative-dim", r.dim);
  if (o.out.empty()) throw std::invalid_argument("--out: must not be empty");
}

nlohmann::json to_json(const Options& o, const std::string& stem) {
  nlohmann::json json = {{"mode", o.full ? "full" : "quick"},
                         {"out", o.out.string()},
                         {"seed", o.seed},
                         {"threads", o.threads},
                         {"resume", o.resume}};
  if (stem == "scaling") {
    const ScalingOptions& s = o.scaling;
    json["scaling"] = {{"lengths", s.lengths},
                       {"heads", s.heads},
                       {"dim", s.dim},
                       {"reps", s.reps},
                       {"naive_max", s.naive_max},
                       {"softmax_max", s.softmax_max},
                       {"favor_features", s.features},
                       {"one_head_n", s.one_head_n},
                       {"fit_min_n", s.fit_min_n},
                       {"causal_methods", s.causal_methods}};
  } else if (stem == "normalization") {
    const NormalizationOptions& n = o.normalization;
    json["normalization"] = {{"lengths", n.lengths},
                             {"seeds", n.seeds},
                             {"dim", n.dim},
                             {"favor_features", n.features},
                             {"threshold", n.threshold}};
  } else if (stem == "favor_error") {
    const FavorErrorOptions& e = o.favor_error;
    json["favor_error"] = {{"length", e.length}, {"dim", e.dim},     {"features", e.features},
                           {"seeds", e.seeds},   {"pairs", e.pairs}, {"scales", e.scales}};
  } else if (stem == "rope_decay") {
    json["rope_decay"] = {{"dim", o.rope_decay.dim}, {"max_distance", o.rope_decay.distance}};
  } else if (stem == "rope_relative") {
    json["rope_relative"] = {{"max_positions", o.rope_relative.positions},
                             {"dim", o.rope_relative.dim},
                             {"samples", o.rope_relative.samples}};
  }
  return json;
}

}  // namespace linrope::experiments
