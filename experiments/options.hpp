// Everything a run of linrope-experiments depends on. Sizes left at 0 / empty take the preset of
// the mode (--quick, the default, or --full) when resolve_presets() is called.
#pragma once

#include <cstdint>
#include <filesystem>
#include <linrope/types.hpp>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace linrope::experiments {

struct Options {
  bool full = false;
  std::filesystem::path out = "results";
  std::uint64_t seed = 1;
  int threads = 0;  // 0: leave OpenMP's default
  bool resume = false;
  bool plots = true;
  bool quiet = false;  // no progress bar
  std::string python = "/usr/bin/python3";
  std::filesystem::path plot_script;  // empty: the plot.py beside the sources
  std::string command_line;           // recorded in the metadata

  // scaling
  std::vector<Index> lengths;  // quick 256..16384, full 256..2^20 (powers of 2)
  Index heads = 0;             // 8
  Index dim = 0;               // 64
  Index reps = 0;              // quick 3, full 5
  Index naive_max = 0;         // explicit n x n scores only up to here: quick 8192, full 16384
  Index softmax_max = 0;       // streaming softmax up to here: quick 16384, full 65536
  Index scaling_features = 0;  // FAVOR+ m: 256
  Index one_head_n = 0;        // one-head linear memory point: quick 65536, full 2^20; -1 skips
  double fit_min_n = 2048;     // slopes fitted over n >= this

  // normalization
  std::vector<Index> norm_lengths;  // quick 256, 1024, 4096; full adds 16384
  Index norm_seeds = 0;             // quick 3, full 10
  Index norm_dim = 0;               // 64
  Index norm_features = 0;          // FAVOR+ features: 64
  double norm_threshold = 1e-3;     // DenominatorStats::threshold

  // favor-error
  Index favor_length = 0;             // quick 1024, full 4096
  Index favor_dim = 0;                // 16
  std::vector<Index> favor_features;  // quick 16..256, full 16..512 (powers of 2)
  Index favor_seeds = 0;              // quick 5, full 10
  Index favor_pairs = 0;              // sampled (q, k) pairs for the kernel MSE: 4096 / 16384
  std::vector<double> favor_scales;   // std of the q, k entries: 0.5 and 1

  // rope-decay
  Index decay_dim = 0;       // 128
  Index decay_distance = 0;  // quick 256, full 2048

  // rope-relative
  std::vector<Index> relative_positions;  // largest positions: 10, 100, ..., 10^6
  Index relative_dim = 0;                 // 128
  Index relative_samples = 0;             // quick 256, full 4096
};

// Fills every unset size from the preset of options.full. Throws std::invalid_argument with a
// one-line message naming the option if a value is out of range (e.g. "--lengths: 0 is not >= 1").
void resolve_presets(Options& options);

nlohmann::json to_json(const Options& options);

}  // namespace linrope::experiments
