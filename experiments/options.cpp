#include "options.hpp"

#include <cmath>
#include <stdexcept>

namespace linrope::experiments {

namespace {

std::vector<Index> powers_of_two(Index from, Index to) {
  std::vector<Index> values;
  for (Index v = from; v <= to; v *= 2) values.push_back(v);
  return values;
}

void preset(Index& value, Index quick, Index full, bool is_full) {
  if (value == 0) value = is_full ? full : quick;
}

void preset(std::vector<Index>& values, std::vector<Index> quick, std::vector<Index> full,
            bool is_full) {
  if (values.empty()) values = is_full ? std::move(full) : std::move(quick);
}

void require_at_least(const char* option, Index value, Index lowest) {
  if (value < lowest)
    throw std::invalid_argument(std::string(option) + ": " + std::to_string(value) +
                                " is not >= " + std::to_string(lowest));
}

void require_at_least(const char* option, const std::vector<Index>& values, Index lowest) {
  for (const Index v : values) require_at_least(option, v, lowest);
}

}  // namespace

void resolve_presets(Options& o) {
  const bool f = o.full;
  preset(o.lengths, powers_of_two(256, 16384), powers_of_two(256, Index(1) << 20), f);
  preset(o.heads, 8, 8, f);
  preset(o.dim, 64, 64, f);
  preset(o.reps, 3, 5, f);
  preset(o.naive_max, 8192, 16384, f);
  preset(o.softmax_max, 16384, 65536, f);
  preset(o.scaling_features, 256, 256, f);
  preset(o.one_head_n, 65536, Index(1) << 20, f);
  preset(o.norm_lengths, {256, 1024, 4096}, {256, 1024, 4096, 16384}, f);
  preset(o.norm_seeds, 3, 10, f);
  preset(o.norm_dim, 64, 64, f);
  preset(o.norm_features, 64, 64, f);
  preset(o.favor_length, 1024, 4096, f);
  preset(o.favor_dim, 16, 16, f);
  preset(o.favor_features, powers_of_two(16, 256), powers_of_two(16, 512), f);
  preset(o.favor_seeds, 5, 10, f);
  preset(o.favor_pairs, 4096, 16384, f);
  preset(o.decay_dim, 128, 128, f);
  preset(o.decay_distance, 256, 2048, f);
  preset(o.relative_positions, {10, 100, 1000, 10000, 100000, 1000000},
         {10, 100, 1000, 10000, 100000, 1000000}, f);
  preset(o.relative_dim, 128, 128, f);
  preset(o.relative_samples, 256, 4096, f);

  require_at_least("--lengths", o.lengths, 1);
  require_at_least("--heads", o.heads, 1);
  require_at_least("--dim", o.dim, 2);
  require_at_least("--reps", o.reps, 1);
  require_at_least("--scaling-features", o.scaling_features, 1);
  require_at_least("--norm-lengths", o.norm_lengths, 1);
  require_at_least("--norm-seeds", o.norm_seeds, 1);
  require_at_least("--norm-dim", o.norm_dim, 2);
  require_at_least("--norm-features", o.norm_features, 1);
  require_at_least("--favor-length", o.favor_length, 1);
  require_at_least("--favor-dim", o.favor_dim, 1);
  require_at_least("--favor-features", o.favor_features, 1);
  require_at_least("--favor-seeds", o.favor_seeds, 1);
  require_at_least("--favor-pairs", o.favor_pairs, 1);
  require_at_least("--decay-dim", o.decay_dim, 2);
  require_at_least("--decay-distance", o.decay_distance, 0);
  require_at_least("--relative-positions", o.relative_positions, 1);
  require_at_least("--relative-dim", o.relative_dim, 2);
  require_at_least("--relative-samples", o.relative_samples, 1);
  require_at_least("--threads", o.threads, 0);
  // Even widths: RoPE rotates pairs.
  for (const auto& [option, value] : {std::pair{"--dim", o.dim},
                                      {"--norm-dim", o.norm_dim},
                                      {"--decay-dim", o.decay_dim},
                                      {"--relative-dim", o.relative_dim}})
    if (value % 2 != 0)
      throw std::invalid_argument(std::string(option) + ": " + std::to_string(value) +
                                  " is odd but RoPE needs an even width");
  if (!(o.norm_threshold >= 0)) throw std::invalid_argument("--norm-threshold: must be >= 0");
  if (o.favor_scales.empty()) o.favor_scales = {0.5, 1.0};
  for (const double scale : o.favor_scales)
    if (!(scale > 0) || !std::isfinite(scale))
      throw std::invalid_argument("--favor-scales: " + std::to_string(scale) + " is not > 0");
  if (o.out.empty()) throw std::invalid_argument("--out: must not be empty");
}

nlohmann::json to_json(const Options& o) {
  return {
      {"mode", o.full ? "full" : "quick"},
      {"out", o.out.string()},
      {"seed", o.seed},
      {"threads", o.threads},
      {"resume", o.resume},
      {"plots", o.plots},
      {"scaling",
       {{"lengths", o.lengths},
        {"heads", o.heads},
        {"dim", o.dim},
        {"reps", o.reps},
        {"naive_max", o.naive_max},
        {"softmax_max", o.softmax_max},
        {"favor_features", o.scaling_features},
        {"one_head_n", o.one_head_n},
        {"fit_min_n", o.fit_min_n}}},
      {"normalization",
       {{"lengths", o.norm_lengths},
        {"seeds", o.norm_seeds},
        {"dim", o.norm_dim},
        {"favor_features", o.norm_features},
        {"threshold", o.norm_threshold}}},
      {"favor_error",
       {{"length", o.favor_length},
        {"dim", o.favor_dim},
        {"features", o.favor_features},
        {"seeds", o.favor_seeds},
        {"pairs", o.favor_pairs},
        {"scales", o.favor_scales}}},
      {"rope_decay", {{"dim", o.decay_dim}, {"max_distance", o.decay_distance}}},
      {"rope_relative",
       {{"max_positions", o.relative_positions},
        {"dim", o.relative_dim},
        {"samples", o.relative_samples}}},
  };
}

}  // namespace linrope::experiments
