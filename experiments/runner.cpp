// Runs one experiment end to end: CSV (written by the experiment as it goes), JSON metadata,
// plots, its report section, and REPORT.md.
#include <chrono>
#include <iostream>

#include "atomic_file.hpp"
#include "experiment.hpp"
#include "memory.hpp"
#include "metadata.hpp"
#include "plot.hpp"
#include "progress.hpp"

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
  Outcome outcome = experiment.run(context);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  nlohmann::json meta = run_metadata();
  meta["experiment"] = experiment.name;
  meta["command_line"] = options.command_line;
  meta["seeds"] = outcome.seeds;
  meta["options"] = to_json(options);
  meta["duration_s"] = seconds;
  meta["load_average_before"] = load_before;
  meta["points_measured"] = context.measured;
  meta["points_resumed"] = context.resumed;
  meta["csv"] = stem + ".csv";
  meta["summary"] = outcome.summary;
  write_file_atomic(dir / (stem + ".json"), meta.dump(2) + "\n");

  std::string plot_note = "run with --no-plots";
  if (options.plots) {
    const PlotResult plot = run_plot(options, stem, dir);
    plot_note = plot.message;
    if (!plot.ok)
      std::cerr << "linrope-experiments: plots for " << experiment.name
                << " not generated: " << plot.message << '\n';
  }
  const std::string commit = meta["git_commit"].get<std::string>();
  const std::string provenance =
      "Run " + meta["date"].get<std::string>() + ", " + (options.full ? "--full" : "--quick") +
      " mode, commit " + commit.substr(0, 12) + ", " + cpu_model() + " (" +
      std::to_string(meta["machine"]["cores"].get<unsigned>()) + " cores, " +
      std::to_string(max_threads()) + " threads, load average " + fmt(load_before, 3) +
      " before the run), " + Progress::format_duration(seconds) + "; " +
      std::to_string(context.measured) + " points measured, " + std::to_string(context.resumed) +
      " resumed.";
  write_file_atomic(dir / "report_section.md",
                    render_section(outcome.section, stem, dir, provenance, plot_note));
  std::vector<std::string> stems;
  for (const auto& e : all_experiments()) stems.push_back(stem_of(e.name));
  assemble_report(options.out, stems);
  return context;
}

}  // namespace linrope::experiments
