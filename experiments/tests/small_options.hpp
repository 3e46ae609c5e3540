// Tiny sizes for every experiment: a whole `all` runs in about a second, and under the sanitizers
// in a few. The row counts the tests expect follow from these sizes.
#pragma once

#include <filesystem>

#include "options.hpp"

namespace linrope::experiments::testing {

inline Options small_options(const std::filesystem::path& out) {
  Options o;
  o.out = out;
  o.quiet = true;
  o.scaling = {.lengths = {16, 32},
               .heads = 2,
               .dim = 8,
               .reps = 1,
               .naive_max = 32,
               .softmax_max = 32,
               .features = 8,
               .one_head_n = 64,
               .fit_min_n = 16,
               .causal_methods = {"scan"}};
  o.normalization = {.lengths = {8, 16}, .seeds = 2, .dim = 8, .features = 8};
  o.favor_error = {
      .length = 32, .dim = 4, .features = {4, 8}, .seeds = 2, .pairs = 64, .scales = {0.5, 1}};
  o.rope_decay = {.dim = 16, .distance = 8};
  o.rope_relative = {.positions = {10, 1000, 1000000}, .dim = 8, .samples = 16};
  resolve_presets(o);
  return o;
}

}  // namespace linrope::experiments::testing
