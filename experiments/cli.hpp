// The command line of linrope-experiments: one subcommand per experiment, and `all`.
#pragma once

#include <functional>
#include <iosfwd>
#include <string>
#include <vector>

namespace linrope::experiments {

// Parses, runs, and returns the exit status: 0 on success (and for --help), 1 if an experiment
// failed, 2 for a bad command line (one line on `err`), 128 + the signal (130 for Ctrl-C, 143 for
// SIGTERM) if interrupted: the finished points are saved, the run stops, and one line on `err`
// says how many and that --resume continues. `on_measure` is passed to run_experiment (the tests
// use it to interrupt a run at a chosen point).
int run_cli(int argc, const char* const* argv, std::ostream& out, std::ostream& err,
            std::function<void(const std::vector<std::string>&)> on_measure = {});

}  // namespace linrope::experiments
