// What a run of linrope-experiments depends on: the global options, which every subcommand and
// `all` take, and one struct per experiment holding the options of that subcommand only (`all`
// leaves them at their defaults). Sizes left at 0 / empty take the preset of the mode (--quick,
// the default, or --full) when resolve_presets() is called.
#pragma once

#include <cstdint>
#include <filesystem>
#include <linrope/types.hpp>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace linrope::experiments {

struct ScalingOptions {
  std::vector<Index> lengths;               // quick 256..16384, full 256..2^20 (powers of 2)
  Index heads = 0;                          // 8
  Index dim = 0;                            // 64
  Index reps = 0;                           // quick 3, full 5
  Index naive_max = 0;                      // explicit n x n scores only up to here: 8192 / 16384
  Index softmax_max = 0;                    // streaming softmax up to here: quick 16384, full 65536
  Index features = 0;                       // FAVOR+ m: 256
  Index one_head_n = 0;                     // one-head linear memory point: 65536 / 2^20; -1 skips
  double fit_min_n = 2048;                  // slopes fitted over n >= this
  std::vector<std::string> causal_methods;  // of causal linear attention: "scan", "chunked"
};

struct NormalizationOptions {
  std::vector<Index> lengths;  // quick 256, 1024, 4096; full adds 16384
  Index seeds = 0;             // quick 3, full 10
  Index dim = 0;               // 64
  Index features = 0;          // FAVOR+ features: 64
  double threshold = 1e-3;     // DenominatorStats::threshold
};

struct FavorErrorOptions {
  Index length = 0;             // quick 1024, full 4096
  Index dim = 0;                // 16
  std::vector<Index> features;  // quick 16..256, full 16..512 (powers of 2)
  Index seeds = 0;              // quick 5, full 10
  Index pairs = 0;              // sampled (q, k) pairs for the kernel MSE: 4096 / 16384
  std::vector<double> scales;   // std of the q, k entries: 0.5 and 1
};

struct RopeDecayOptions {
  Index dim = 0;       // 128
  Index distance = 0;  // quick 256, full 2048
};

struct RopeRelativeOptions {
  std::vector<Index> positions;  // largest positions: 10, 100, ..., 10^6
  Index dim = 0;                 // 128
  Index samples = 0;             // quick 256, full 4096
};

struct Options {
  // Global.
  bool full = false;
  std::filesystem::path out = "results";
  std::uint64_t seed = 1;
  int threads = 0;  // 0: leave OpenMP's default
  bool resume = false;
  bool quiet = false;        // no progress bar
  std::string command_line;  // recorded in the metadata

  // Per experiment.
  ScalingOptions scaling;
  NormalizationOptions normalization;
  FavorErrorOptions favor_error;
  RopeDecayOptions rope_decay;
  RopeRelativeOptions rope_relative;
};

// Fills every unset size from the preset of options.full. Throws std::invalid_argument with a
// one-line message naming the option for what the command line cannot check (an odd RoPE width).
void resolve_presets(Options& options);

// The global options and those of experiment `stem` ("favor_error"), for its metadata.
nlohmann::json to_json(const Options& options, const std::string& stem);

}  // namespace linrope::experiments
