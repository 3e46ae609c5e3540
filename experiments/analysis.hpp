// Runs experiments/analysis/report.py (Python; matplotlib for the plots) on an experiment's
// directory: derived numbers, plots and the report section, all from the CSV and JSON.
#pragma once

#include <filesystem>
#include <string>

#include "options.hpp"

namespace linrope::experiments {

struct AnalysisResult {
  enum class Status { Done, NoPlots, Failed } status = Status::Failed;
  std::string message;  // one line: why the plots (NoPlots) or the whole analysis (Failed) failed
};

// `<python> report.py <experiment> <dir> [--no-plots]`.
AnalysisResult run_analysis(const Options& options, const std::string& experiment,
                            const std::filesystem::path& dir);

}  // namespace linrope::experiments
