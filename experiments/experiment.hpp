// The experiments and what they share: a Context in, the CSV of measurements and an Outcome (what
// the run used that the CSV does not say) out. The runner (runner.cpp) adds the JSON metadata.
// What is derived from the two (summary.json, plots, REPORT.md) is experiments/analysis/report.py's
// alone: it reads them, and nothing here reads what it writes.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "options.hpp"

namespace linrope::experiments {

struct Context {
  const Options& options;
  std::filesystem::path dir;  // <out>/<experiment>, created by the runner
  std::size_t measured = 0;   // points computed in this run
  std::size_t resumed = 0;    // points kept from an existing CSV (--resume)
  // Called with the key of each point just before it is measured (tests count re-measurements).
  std::function<void(const std::vector<std::string>& key)> on_measure;
};

struct Outcome {
  std::vector<std::uint64_t> seeds;               // every seed the run used
  nlohmann::json run = nlohmann::json::object();  // facts of the run, e.g. points skipped
};

struct Experiment {
  std::string name;         // subcommand, directory, CSV and JSON stem
  std::string description;  // one line for --help
  Outcome (*run)(Context&);
};

Outcome run_scaling(Context& context);
Outcome run_normalization(Context& context);
Outcome run_favor_error(Context& context);
Outcome run_rope_decay(Context& context);
Outcome run_rope_relative(Context& context);

// "favor-error" -> "favor_error": the directory, CSV and JSON stem of an experiment.
std::string stem_of(const std::string& name);

// In report order.
const std::vector<Experiment>& all_experiments();
const Experiment* find_experiment(const std::string& name);

// Runs one experiment into options.out/<name>: CSV (by the experiment), then <name>.json. Returns
// the context (counters) for tests. Throws on failure (std::runtime_error, std::invalid_argument).
// After SIGINT or SIGTERM (see interrupt.hpp) throws Interrupted once the sweep has saved its CSV,
// having written <name>.json with "status": "interrupted" (the analysis then says the sweep is
// incomplete and draws nothing from it); before the first point finished, writes nothing.
Context run_experiment(const Experiment& experiment, const Options& options,
                       std::function<void(const std::vector<std::string>&)> on_measure = {});

}  // namespace linrope::experiments
