#include "cli.hpp"

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <ostream>
#include <string>

#include "csv.hpp"
#include "experiment.hpp"
#include "interrupt.hpp"
#include "memory.hpp"
#include "progress.hpp"

namespace linrope::experiments {

namespace {

std::string one_line(std::string text) {
  for (char& c : text)
    if (c == '\n' || c == '\r') c = ' ';
  while (!text.empty() && text.back() == ' ') text.pop_back();
  return text;
}

// Validators with one-line messages in our words ("--heads: '0' is not an integer >= 1"); CLI11's
// own PositiveNumber prints the whole double range.
CLI::Validator integer_at_least(long long lowest) {
  return CLI::Validator(
      [lowest](std::string& text) -> std::string {
        std::size_t used = 0;
        long long value = 0;
        try {
          value = std::stoll(text, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used != text.size() || text.empty() || value < lowest)
          return "'" + text + "' is not an integer >= " + std::to_string(lowest);
        return {};
      },
      "INT>=" + std::to_string(lowest), "integer_at_least");
}

CLI::Validator real_above(double lowest, bool inclusive) {
  return CLI::Validator(
      [lowest, inclusive](std::string& text) -> std::string {
        std::size_t used = 0;
        double value = 0;
        try {
          value = std::stod(text, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used != text.size() || text.empty() || !std::isfinite(value) ||
            (inclusive ? value < lowest : value <= lowest))
          return "'" + text + "' is not a number " + (inclusive ? ">= " : "> ") +
                 format_number(lowest);
        return {};
      },
      std::string("NUMBER") + (inclusive ? ">=" : ">") + "0", "real_above");
}

void add_options(CLI::App& app, Options& o, bool& quick, bool& no_plots) {
  app.add_flag("--quick", quick,
               "small sweeps; every experiment together in a few minutes (default)");
  app.add_flag("--full", o.full, "the sizes of the paper figures (long)")->excludes("--quick");
  app.add_option("--out", o.out, "output directory")->capture_default_str();
  app.add_option("--seed", o.seed, "base seed; experiments use seed, seed+1, ...")
      ->capture_default_str();
  app.add_option("--threads", o.threads,
                 "OpenMP threads (0: OpenMP's default for scaling, 1 for the accuracy experiments)")
      ->check(integer_at_least(0));
  app.add_flag("--resume", o.resume,
               "keep the points already in the CSV files and measure the rest (e.g. after Ctrl-C "
               "or SIGTERM, which save every finished point and exit with 130 or 143)");
  app.add_flag("--no-plots", no_plots, "write CSV, JSON and REPORT.md but no PNG");
  app.add_flag("--quiet", o.quiet, "no progress bar");
  app.add_option("--python", o.python, "Python interpreter with matplotlib")->capture_default_str();
  app.add_option("--plot-script", o.plot_script, "path of plot.py");

  auto list = [&](const char* name, std::vector<Index>& values, const char* help) {
    app.add_option(name, values, help)->delimiter(',')->check(integer_at_least(1))->group("Sizes");
  };
  auto number = [&](const char* name, Index& value, const char* help) {
    app.add_option(name, value, help)->check(integer_at_least(1))->group("Sizes");
  };
  list("--lengths", o.lengths, "scaling: sequence lengths, e.g. 256,1024,4096");
  number("--heads", o.heads, "scaling: heads (8)");
  number("--dim", o.dim, "scaling: head dimension d (64)");
  number("--reps", o.reps, "scaling: repetitions per point, median reported (quick 3, full 5)");
  number("--naive-max", o.naive_max, "scaling: largest n for the explicit n x n softmax");
  number("--softmax-max", o.softmax_max, "scaling: largest n for streaming softmax");
  number("--scaling-features", o.scaling_features, "scaling: FAVOR+ features m (256)");
  app.add_option("--one-head-n", o.one_head_n, "scaling: n of the one-head memory point (-1: none)")
      ->check(integer_at_least(-1))
      ->group("Sizes");
  app.add_option("--fit-min-n", o.fit_min_n, "scaling: slopes fitted over n >= this")
      ->check(real_above(0, false))
      ->group("Sizes");
  list("--norm-lengths", o.norm_lengths, "normalization: lengths");
  number("--norm-seeds", o.norm_seeds, "normalization: seeds (quick 3)");
  number("--norm-dim", o.norm_dim, "normalization: d (64)");
  number("--norm-features", o.norm_features, "normalization: FAVOR+ features (64)");
  app.add_option("--norm-threshold", o.norm_threshold, "normalization: |den| threshold")
      ->check(real_above(0, true))
      ->group("Sizes");
  number("--favor-length", o.favor_length, "favor-error: L (quick 1024, full 4096)");
  number("--favor-dim", o.favor_dim, "favor-error: d (16)");
  list("--favor-features", o.favor_features, "favor-error: feature counts m");
  number("--favor-seeds", o.favor_seeds, "favor-error: seeds");
  number("--favor-pairs", o.favor_pairs, "favor-error: sampled (q, k) pairs");
  app.add_option("--favor-scales", o.favor_scales, "favor-error: std of the q, k entries (0.5,1)")
      ->delimiter(',')
      ->check(real_above(0, false))
      ->group("Sizes");
  number("--decay-dim", o.decay_dim, "rope-decay: d (128)");
  app.add_option("--decay-distance", o.decay_distance, "rope-decay: largest distance")
      ->check(integer_at_least(0))
      ->group("Sizes");
  list("--relative-positions", o.relative_positions, "rope-relative: largest positions");
  number("--relative-dim", o.relative_dim, "rope-relative: d (128)");
  number("--relative-samples", o.relative_samples, "rope-relative: random pairs per range");
}

}  // namespace

int run_cli(int argc, const char* const* argv, std::ostream& out, std::ostream& err,
            std::function<void(const std::vector<std::string>&)> on_measure) {
  const std::string program = "linrope-experiments";
  Options options;
  bool quick = false, no_plots = false;
  CLI::App app{
      "Experiments on linear attention with RoPE. Writes <out>/<experiment>/ (CSV, JSON, "
      "PNG) and <out>/REPORT.md.",
      program};
  app.fallthrough();  // global options may follow the subcommand
  app.require_subcommand(1, 1);
  add_options(app, options, quick, no_plots);
  std::vector<std::pair<CLI::App*, const Experiment*>> subcommands;
  for (const auto& e : all_experiments())
    subcommands.emplace_back(app.add_subcommand(e.name, e.description), &e);
  CLI::App* all = app.add_subcommand("all", "every experiment, in report order");

  try {
    app.parse(argc, argv);
    options.plots = !no_plots;
    resolve_presets(options);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) {  // --help
      app.exit(e, out, err);
      return 0;
    }
    bool any_subcommand = all->parsed();
    for (const auto& [sub, experiment] : subcommands)
      any_subcommand = any_subcommand || sub->parsed();
    if (!any_subcommand && !app.remaining().empty()) {
      // "A subcommand is required" hides the actual mistake: a misspelt subcommand.
      std::string names;
      for (const auto& [sub, experiment] : subcommands) names += experiment->name + ", ";
      err << program << ": unknown subcommand '" << app.remaining().front() << "'; expected one of "
          << names << "all (see --help)\n";
      return 2;
    }
    err << program << ": " << one_line(e.what()) << " (see --help)\n";
    return 2;
  } catch (const std::invalid_argument& e) {
    err << program << ": " << one_line(e.what()) << " (see --help)\n";
    return 2;
  }
  for (int i = 0; i < argc; ++i) options.command_line += (i ? " " : "") + std::string(argv[i]);

  std::vector<const Experiment*> chosen;
  for (const auto& [sub, e] : subcommands)
    if (sub->parsed() || all->parsed()) chosen.push_back(e);

  // From here on Ctrl-C and SIGTERM stop the run between two points (interrupt.hpp).
  const InterruptHandlers handlers;
  auto stop = [&](int signal, const std::string& why,
                  const std::string& advice = "run again with --resume to continue") {
    err << program << ": interrupted (" << signal_name(signal) << ") " << why << "; " << advice
        << '\n';
    return 128 + signal;
  };
  int status = 0;
  const auto start = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < chosen.size(); ++i) {
    const Experiment* e = chosen[i];
    bool failed = false;
    try {
      const auto begin = std::chrono::steady_clock::now();
      const Context c = run_experiment(*e, options, on_measure);
      out << e->name << ": " << c.measured << " points measured, " << c.resumed << " resumed, "
          << Progress::format_duration(
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count())
          << " -> " << (options.out / stem_of(e->name)).string() << '\n';
    } catch (const Interrupted& ex) {
      if (ex.saved() == 0)
        return stop(ex.signal(),
                    "during " + e->name +
                        " before its first point finished; nothing saved, earlier results left "
                        "as they were",
                    "run it again to measure it");
      return stop(ex.signal(), "during " + e->name + "; " + std::to_string(ex.saved()) + " of " +
                                   std::to_string(ex.total()) + " points saved to " +
                                   ex.csv().string());
    } catch (const std::exception& ex) {
      err << program << ": " << e->name << " failed: " << one_line(ex.what()) << '\n';
      status = 1;
      failed = true;
    }
    // A signal after the last point of `e` (while it was summarised, plotted or reported): `e` is
    // complete (or failed on its own); stop before the next experiment.
    if (interrupted()) {
      std::string rest;
      for (std::size_t j = i + 1; j < chosen.size(); ++j)
        rest += (rest.empty() ? "" : ", ") + chosen[j]->name;
      // Nothing left to run: --resume then only remakes plots the signal may have cut short.
      return stop(interrupt_signal(),
                  "after " + e->name + (failed ? " failed; " : " completed; ") +
                      (rest.empty() ? "nothing left to run" : "not run: " + rest),
                  rest.empty() ? "if its plots were cut short, run again with --resume to make them"
                               : "run again with --resume to continue");
    }
  }
  out << "total "
      << Progress::format_duration(
             std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count())
      << "; report: " << (options.out / "REPORT.md").string() << '\n';
  return status;
}

}  // namespace linrope::experiments
