// Runs one experiment end to end: CSV (written by the experiment as it goes), JSON metadata,
// plots, its report section, and REPORT.md; or, when a signal stopped the sweep, metadata and a
// report section that say so.
#include <chrono>
#include <iostream>

#include "atomic_file.hpp"
#include "experiment.hpp"
#include "interrupt.hpp"
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

namespace {

// Removes the plots (PNG and SVG) in an experiment's directory: an earlier run's, once the CSV
// they were drawn from has been replaced.
void remove_figures(const fs::path& dir) {
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(dir, error)) {
    const auto extension = entry.path().extension();
    if (extension == ".png" || extension == ".svg") fs::remove(entry.path(), error);
  }
}

}  // namespace

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
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  nlohmann::json meta;  // filled once the experiment has stopped, either way
  auto fill_metadata = [&](const char* status, double seconds) {
    meta = run_metadata();
    meta["experiment"] = experiment.name;
    meta["status"] = status;  // "complete", or "interrupted": the CSV holds only part of the sweep
    meta["command_line"] = options.command_line;
    meta["options"] = to_json(options, stem);
    meta["duration_s"] = seconds;
    meta["load_average_before"] = load_before;
    meta["points_measured"] = context.measured;
    meta["points_resumed"] = context.resumed;
    meta["csv"] = stem + ".csv";
  };
  auto provenance = [&](double seconds) {
    const std::string commit = meta["git_commit"].get<std::string>();
    return "Run " + meta["date"].get<std::string>() + ", " + (options.full ? "--full" : "--quick") +
           " mode, commit " + commit.substr(0, 12) +
           (meta["git_dirty"] == true ? " with local changes" : "") + ", " + cpu_model() + " (" +
           std::to_string(meta["machine"]["cores"].get<unsigned>()) + " cores, " +
           std::to_string(max_threads()) + " threads, built for " +
           (meta["isa"].empty() ? std::string("baseline") : meta["isa"][0].get<std::string>()) +
           ", load average " + fmt(load_before, 3) + " before the run), " +
           Progress::format_duration(seconds) + "; " + std::to_string(context.measured) +
           " points measured, " + std::to_string(context.resumed) + " resumed.";
  };
  std::vector<std::string> stems;
  for (const auto& e : all_experiments()) stems.push_back(stem_of(e.name));

  Outcome outcome;
  try {
    outcome = experiment.run(context);
  } catch (const Interrupted& stop) {
    // No point of this run finished: the CSV (not rewritten, see Sweep), metadata and report
    // section of any earlier run still describe each other; leave them as they were.
    if (context.measured == 0) throw;
    // The CSV holds the finished points (the sweep saved it). Figures and findings drawn from part
    // of a sweep would read as results, so none are made: no plots, and a report section that
    // says what is missing and how to finish it. It replaces the section of any earlier run,
    // which no longer describes the CSV, as its figures no longer do: they are removed. The
    // metadata records the interruption.
    remove_figures(dir);
    const double seconds = elapsed();
    fill_metadata("interrupted", seconds);
    meta["signal"] = signal_name(stop.signal());
    meta["points_total"] = stop.total();
    write_file_atomic(dir / (stem + ".json"), meta.dump(2) + "\n");
    Section section;
    section.title = experiment.name + ": interrupted, incomplete";
    section.paragraphs.push_back(
        "Interrupted by " + signal_name(stop.signal()) + " after " + std::to_string(stop.saved()) +
        " of " + std::to_string(stop.total()) +
        " points; the CSV holds those points only, so this section has no figures or findings. "
        "Run `linrope-experiments " +
        experiment.name + " --resume` with the same options to measure the rest and write it.");
    write_file_atomic(dir / "report_section.md",
                      render_section(section, stem, dir, provenance(seconds), ""));
    assemble_report(options.out, stems);
    throw;
  }
  const double seconds = elapsed();
  fill_metadata("complete", seconds);
  meta["seeds"] = outcome.seeds;
  meta["summary"] = outcome.summary;
  write_file_atomic(dir / (stem + ".json"), meta.dump(2) + "\n");

  std::string plot_note = "run with --no-plots";
  if (options.plots) {
    const PlotResult plot = run_plot(options, stem, dir);
    plot_note = plot.message;
    if (!plot.ok && interrupted())  // the signal reached plot.py too
      plot_note = "plots not made: interrupted by " + signal_name(interrupt_signal()) +
                  "; run again with --resume to make them";
    if (!plot.ok)
      std::cerr << "linrope-experiments: plots for " << experiment.name
                << " not generated: " << plot.message << '\n';
  }
  write_file_atomic(dir / "report_section.md",
                    render_section(outcome.section, stem, dir, provenance(seconds), plot_note));
  assemble_report(options.out, stems);
  return context;
}

}  // namespace linrope::experiments
