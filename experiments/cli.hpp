// The command line of linrope-experiments: one subcommand per experiment, each with its own
// options, and `all`, which runs every experiment with its defaults; global options (--quick,
// --full, --out, --seed, --threads, --resume, --quiet) go before or after the subcommand. It writes
// CSV and JSON only; experiments/analysis/report.py makes the plots and REPORT.md from them.
#pragma once

#include <functional>
#include <iosfwd>
#include <string>
#include <vector>

#include "experiment.hpp"

namespace linrope::experiments {

using MeasureHook = std::function<void(const std::vector<std::string>&)>;

// Parses, runs, and returns the exit status: 0 on success (and for --help), 1 if an experiment
// failed, 2 for a bad command line (one line on `err`; an option of another subcommand is one),
// or what run_experiments returns. `on_measure` is passed to run_experiment (the tests use it to
// interrupt a run at a chosen point).
int run_cli(int argc, const char* const* argv, std::ostream& out, std::ostream& err,
            MeasureHook on_measure = {});

// Runs `chosen` in order with `options` (presets resolved), one line per experiment on `out`.
// Returns 0, 1 if an experiment failed, or 128 + the signal (130 for Ctrl-C, 143 for SIGTERM) if
// interrupted: the finished points are saved, the run stops, and one line on `err` says how many
// and that --resume continues.
int run_experiments(const std::vector<const Experiment*>& chosen, const Options& options,
                    std::ostream& out, std::ostream& err, MeasureHook on_measure = {});

}  // namespace linrope::experiments
