// Runs one experiment: the CSV (written by the experiment as it goes) and the JSON metadata, which
// says whether the sweep completed or a signal stopped it. Nothing else: the analysis
// (experiments/analysis/report.py) reads these two files and alone writes what is derived from
// them (summary.json, plots, REPORT.md), so the data flow one way, from here to it.
#include <chrono>

#include "atomic_file.hpp"
#include "experiment.hpp"
#include "interrupt.hpp"
#include "metadata.hpp"

namespace linrope::experiments {

namespace fs = std::filesystem;

const std::vector<Experiment>& all_experiments() {
  static const std::vector<Experiment> list = {
      {"scaling",
       "time and peak memory against sequence length: softmax (naive, streaming) vs linear",
       &run_scaling},
      {"normalization", "RoPE numerator-only (eq. 19) vs full normalisation, before-map and none",
       &run_normalization},
      {"favor-error", "FAVOR+ approximation error against the number of features",
       &run_favor_error},
      {"rope-decay", "RoPE long-term decay bound against relative distance (bases, scalings)",
       &run_rope_decay},
      {"rope-relative", "measured <R_m q, R_n k> = <q, R_(n-m) k> deviation, float and double",
       &run_rope_relative},
  };
  return list;
}

const Experiment* find_experiment(const std::string& name) {
  for (const auto& e : all_experiments())
    if (e.name == name) return &e;
  return nullptr;
}

std::string stem_of(const std::string& name) {
  std::string stem = name;
  for (char& c : stem)
    if (c == '-') c = '_';
  return stem;
}

Context run_experiment(const Experiment& experiment, const Options& options,
                       std::function<void(const std::vector<std::string>&)> on_measure) {
  const std::string stem = stem_of(experiment.name);
  const fs::path dir = options.out / stem;
  fs::create_directories(dir);
  remove_stale_temporaries(dir);
  remove_stale_temporaries(options.out);
  set_threads(options.threads);

  Context context{options, dir, 0, 0, std::move(on_measure)};
  const double load_before = load_average();
  const auto start = std::chrono::steady_clock::now();
  // Written once the experiment has stopped, either way.
  auto metadata = [&](const char* status) {
    nlohmann::json meta = run_metadata();
    meta["experiment"] = experiment.name;
    meta["status"] = status;  // "complete", or "interrupted": the CSV holds only part of the sweep
    meta["command_line"] = options.command_line;
    meta["options"] = to_json(options, stem);
    meta["duration_s"] =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    meta["load_average_before"] = load_before;
    meta["points_measured"] = context.measured;
    meta["points_resumed"] = context.resumed;
    meta["csv"] = stem + ".csv";
    return meta;
  };

  Outcome outcome;
  try {
    outcome = experiment.run(context);
  } catch (const Interrupted& stop) {
    // No point of this run finished: the CSV (not rewritten, see Sweep) and metadata of any
    // earlier run still describe each other; leave them as they were.
    if (context.measured == 0) throw;
    // The CSV holds the finished points (the sweep saved it); the metadata says the sweep is
    // incomplete, and the analysis then makes no figures or findings from it.
    nlohmann::json meta = metadata("interrupted");
    meta["signal"] = signal_name(stop.signal());
    meta["points_saved"] = stop.saved();
    meta["points_total"] = stop.total();
    write_file_atomic(dir / (stem + ".json"), meta.dump(2) + "\n");
    throw;
  }
  nlohmann::json meta = metadata("complete");
  meta["seeds"] = outcome.seeds;
  meta["run"] = outcome.run;
  write_file_atomic(dir / (stem + ".json"), meta.dump(2) + "\n");
  return context;
}

}  // namespace linrope::experiments
