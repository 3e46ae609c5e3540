// The command line of linrope-experiments: one subcommand per experiment, and `all`.
#pragma once

#include <iosfwd>

namespace linrope::experiments {

// Parses, runs, and returns the exit status: 0 on success (and for --help), 1 if an experiment
// failed, 2 for a bad command line (one line on `err`).
int run_cli(int argc, const char* const* argv, std::ostream& out, std::ostream& err);

}  // namespace linrope::experiments
