// Runs experiments/plot.py (matplotlib, under /usr/bin/python3) on an experiment's directory.
#pragma once

#include <filesystem>
#include <string>

#include "options.hpp"

namespace linrope::experiments {

struct PlotResult {
  bool ok = false;
  std::string message;  // one line: why plotting failed
};

// `<python> <plot.py> <experiment> <dir>`; the script writes PNGs atomically into dir.
PlotResult run_plot(const Options& options, const std::string& experiment,
                    const std::filesystem::path& dir);

std::filesystem::path default_plot_script();

}  // namespace linrope::experiments
