#include "cli.hpp"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <limits>
#include <optional>
#include <ostream>
#include <string>
#include <type_traits>

#include "interrupt.hpp"
#include "progress.hpp"

namespace linrope::experiments {

namespace {

const std::string kProgram = "linrope-experiments";

std::string one_line(std::string text) {
  for (char& c : text)
    if (c == '\n' || c == '\r') c = ' ';
  while (!text.empty() && text.back() == ' ') text.pop_back();
  return text;
}

// CLI11's check with a message in words: its ranges print their bounds in full (up to 309 digits).
CLI::Validator stating(const CLI::Validator& check, const std::string& requirement) {
  return CLI::Validator(
      [check, requirement](std::string& value) {
        return check(value).empty() ? std::string() : "'" + value + "' is not " + requirement;
      },
      check.get_description());
}
const CLI::Validator kPositive = stating(CLI::PositiveNumber, "a number > 0");
const CLI::Validator kNonNegative = stating(CLI::NonNegativeNumber, "a number >= 0");

void add_global_options(CLI::App& app, Options& o, bool& quick) {
  app.add_flag("--quick", quick,
               "small sweeps; every experiment together in a few minutes (default)");
  app.add_flag("--full", o.full, "the sizes of the paper figures (long)")->excludes("--quick");
  app.add_option("--out", o.out, "output directory")->capture_default_str();
  app.add_option("--seed", o.seed, "base seed; experiments use seed, seed+1, ...")
      ->capture_default_str();
  app.add_option("--threads", o.threads,
                 "OpenMP threads (0: OpenMP's default for scaling, 1 for the accuracy experiments)")
      ->check(kNonNegative);
  app.add_flag("--resume", o.resume,
               "keep the points already in the CSV files and measure the rest (e.g. after Ctrl-C "
               "or SIGTERM, which save every finished point and exit with 130 or 143)");
  app.add_flag("--quiet", o.quiet, "no progress bar");
}

// Sizes: counts (>= 1) and lists of them.
template <class T>
void count(CLI::App& sub, const char* name, T& value, const char* help) {
  CLI::Option* option = sub.add_option(name, value, help)->check(kPositive);
  if constexpr (!std::is_arithmetic_v<T>) option->delimiter(',');
}

void add_scaling_options(CLI::App& sub, ScalingOptions& s) {
  count(sub, "--lengths", s.lengths, "sequence lengths, e.g. 256,1024,4096");
  count(sub, "--heads", s.heads, "heads (8)");
  count(sub, "--dim", s.dim, "head dimension d, even (64)");
  count(sub, "--reps", s.reps, "repetitions per point, median reported (quick 3, full 5)");
  count(sub, "--naive-max", s.naive_max, "largest n for the explicit n x n softmax");
  count(sub, "--softmax-max", s.softmax_max, "largest n for streaming softmax");
  count(sub, "--scaling-features", s.features, "FAVOR+ features m (256)");
  sub.add_option("--one-head-n", s.one_head_n, "n of the one-head memory point (-1: none)")
      ->check(
          stating(CLI::Range(Index(-1), std::numeric_limits<Index>::max()).description("INT>=-1"),
                  "an integer >= -1"));
  sub.add_option("--causal-methods", s.causal_methods,
                 "how causal linear attention is computed: scan (the default), chunked, or both")
      ->delimiter(',')
      ->check(CLI::IsMember({"scan", "chunked"}));
  sub.add_option("--fit-min-n", s.fit_min_n, "slopes fitted over n >= this")
      ->check(kPositive)
      ->capture_default_str();
}

void add_normalization_options(CLI::App& sub, NormalizationOptions& n) {
  count(sub, "--norm-lengths", n.lengths, "lengths");
  count(sub, "--norm-seeds", n.seeds, "seeds (quick 3, full 10)");
  count(sub, "--norm-dim", n.dim, "d, even (64)");
  count(sub, "--norm-features", n.features, "FAVOR+ features (64)");
  sub.add_option("--norm-threshold", n.threshold, "|den| threshold")
      ->check(kNonNegative)
      ->capture_default_str();
}

void add_favor_error_options(CLI::App& sub, FavorErrorOptions& e) {
  count(sub, "--favor-length", e.length, "L (quick 1024, full 4096)");
  count(sub, "--favor-dim", e.dim, "d (16)");
  count(sub, "--favor-features", e.features, "feature counts m");
  count(sub, "--favor-seeds", e.seeds, "seeds");
  count(sub, "--favor-pairs", e.pairs, "sampled (q, k) pairs");
  count(sub, "--favor-scales", e.scales, "std of the q, k entries (0.5,1)");
}

void add_rope_decay_options(CLI::App& sub, RopeDecayOptions& r) {
  count(sub, "--decay-dim", r.dim, "d, even (128)");
  sub.add_option("--decay-distance", r.distance, "largest distance (quick 256, full 2048)")
      ->check(kNonNegative);
}

void add_rope_relative_options(CLI::App& sub, RopeRelativeOptions& r) {
  count(sub, "--relative-positions", r.positions, "largest positions");
  count(sub, "--relative-dim", r.dim, "d, even (128)");
  count(sub, "--relative-samples", r.samples, "random pairs per range");
}

// For an option the chosen subcommand does not take: which subcommands do, in one line.
std::optional<std::string> misplaced_option(const CLI::App& app,
                                            const std::vector<std::string>& args) {
  const CLI::App* chosen = nullptr;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App* s) { return s->parsed(); }))
    chosen = sub;
  bool after_subcommand = false;  // options before the subcommand are the program's
  for (std::string arg : args) {
    after_subcommand = after_subcommand || (chosen && arg == chosen->get_name());
    if (arg.rfind("--", 0) != 0 || arg.size() == 2) continue;
    arg = arg.substr(0, arg.find('='));
    if (app.get_option_no_throw(arg) || (after_subcommand && chosen->get_option_no_throw(arg)))
      continue;
    std::string owners;
    for (const CLI::App* sub : app.get_subcommands({}))
      if (sub->get_option_no_throw(arg)) owners += (owners.empty() ? "" : ", ") + sub->get_name();
    if (owners.empty()) return "unknown option " + arg;
    if (!after_subcommand)
      return arg + " is an option of " + owners + ": put it after that subcommand";
    return arg + " is an option of " + owners + ", not of " + chosen->get_name() +
           (chosen->get_name() == "all" ? " (which runs every experiment with its defaults)" : "");
  }
  return std::nullopt;
}

}  // namespace

int run_cli(int argc, const char* const* argv, std::ostream& out, std::ostream& err,
            MeasureHook on_measure) {
  Options options;
  bool quick = false;
  CLI::App app{
      "Experiments on linear attention with RoPE. Writes the measurements, "
      "<out>/<experiment>/<experiment>.csv, and their metadata, <experiment>.json; "
      "experiments/analysis/report.py <out> then writes the plots and <out>/REPORT.md "
      "(bash scripts/experiments.sh runs both).",
      kProgram};
  app.require_subcommand(1, 1);
  add_global_options(app, options, quick);
  const std::vector<std::pair<std::string, void (*)(CLI::App&, Options&)>> adders = {
      {"scaling", [](CLI::App& s, Options& o) { add_scaling_options(s, o.scaling); }},
      {"normalization",
       [](CLI::App& s, Options& o) { add_normalization_options(s, o.normalization); }},
      {"favor-error", [](CLI::App& s, Options& o) { add_favor_error_options(s, o.favor_error); }},
      {"rope-decay", [](CLI::App& s, Options& o) { add_rope_decay_options(s, o.rope_decay); }},
      {"rope-relative",
       [](CLI::App& s, Options& o) { add_rope_relative_options(s, o.rope_relative); }}};
  std::vector<std::pair<CLI::App*, const Experiment*>> subcommands;
  for (const auto& [name, add] : adders) {
    const Experiment* e = find_experiment(name);
    CLI::App* sub = app.add_subcommand(e->name, e->description);
    add(*sub, options);
    subcommands.emplace_back(sub, e);
  }
  CLI::App* all = app.add_subcommand(
      "all", "every experiment in report order, each with its defaults (global options only)");
  for (CLI::App* sub : app.get_subcommands({})) {
    sub->fallthrough();  // global options may follow the subcommand
    sub->footer("Global options (--quick, --full, --out, ...): " + kProgram + " --help");
  }

  const std::vector<std::string> args(argv + std::min(argc, 1), argv + argc);
  try {
    app.parse(argc, argv);
    resolve_presets(options);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) {  // --help
      app.exit(e, out, err);
      return 0;
    }
    bool any_subcommand = false;
    for (const CLI::App* sub : app.get_subcommands({}))
      any_subcommand = any_subcommand || sub->parsed();
    if (!any_subcommand && !app.remaining().empty() && app.remaining().front()[0] != '-') {
      // "A subcommand is required" hides the actual mistake: a misspelt subcommand.
      std::string names;
      for (const auto& [sub, experiment] : subcommands) names += experiment->name + ", ";
      err << kProgram << ": unknown subcommand '" << app.remaining().front()
          << "'; expected one of " << names << "all (see --help)\n";
      return 2;
    }
    std::string message = one_line(e.what());
    if (dynamic_cast<const CLI::ExtrasError*>(&e))
      if (const auto better = misplaced_option(app, args)) message = *better;
    err << kProgram << ": " << message << " (see --help)\n";
    return 2;
  } catch (const std::invalid_argument& e) {
    err << kProgram << ": " << one_line(e.what()) << " (see --help)\n";
    return 2;
  }
  options.command_line = kProgram;
  for (const auto& arg : args) options.command_line += " " + arg;

  std::vector<const Experiment*> chosen;
  for (const auto& [sub, e] : subcommands)
    if (sub->parsed() || all->parsed()) chosen.push_back(e);
  return run_experiments(chosen, options, out, err, std::move(on_measure));
}

int run_experiments(const std::vector<const Experiment*>& chosen, const Options& options,
                    std::ostream& out, std::ostream& err, MeasureHook on_measure) {
  // From here on Ctrl-C and SIGTERM stop the run between two points (interrupt.hpp).
  const InterruptHandlers handlers;
  auto stop = [&](int signal, const std::string& why,
                  const std::string& advice = "run again with --resume to continue") {
    err << kProgram << ": interrupted (" << signal_name(signal) << ") " << why << "; " << advice
        << '\n';
    return 128 + signal;
  };
  auto since = [](std::chrono::steady_clock::time_point start) {
    return Progress::format_duration(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
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
          << since(begin) << " -> " << (options.out / stem_of(e->name)).string() << '\n';
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
      err << kProgram << ": " << e->name << " failed: " << one_line(ex.what()) << '\n';
      status = 1;
      failed = true;
    }
    // A signal after the last point of `e` (while its metadata was written): `e` is complete (or
    // failed on its own); stop before the next experiment.
    if (interrupted()) {
      std::string rest;
      for (std::size_t j = i + 1; j < chosen.size(); ++j)
        rest += (rest.empty() ? "" : ", ") + chosen[j]->name;
      return stop(interrupt_signal(),
                  "after " + e->name + (failed ? " failed; " : " completed; ") +
                      (rest.empty() ? "nothing left to run" : "not run: " + rest),
                  rest.empty() ? "every point is saved" : "run again with --resume to continue");
    }
  }
  out << "total " << since(start) << "; measurements in " << options.out.string()
      << "/ (experiments/analysis/report.py " << options.out.string()
      << " writes the plots and REPORT.md)\n";
  return status;
}

}  // namespace linrope::experiments
