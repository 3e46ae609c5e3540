#include "analysis.hpp"

#include "metadata.hpp"

#ifndef LINROPE_EXPERIMENTS_ANALYSIS_DIR
#define LINROPE_EXPERIMENTS_ANALYSIS_DIR "experiments/analysis"
#endif

namespace linrope::experiments {

namespace {

// The last non-empty line of `output` (a Python error: "ModuleNotFoundError: ...").
std::string last_line(const std::string& output) {
  std::size_t end = output.find_last_not_of("\r\n ");
  if (end == std::string::npos) return {};
  const std::size_t start = output.rfind('\n', end);
  return output.substr(start == std::string::npos ? 0 : start + 1,
                       end - (start == std::string::npos ? 0 : start + 1) + 1);
}

}  // namespace

AnalysisResult run_analysis(const Options& options, const std::string& experiment,
                            const std::filesystem::path& dir) {
  const std::filesystem::path script =
      std::filesystem::path(LINROPE_EXPERIMENTS_ANALYSIS_DIR) / "report.py";
  if (!std::filesystem::exists(script))
    return {AnalysisResult::Status::Failed, "no analysis script at " + script.string()};
  int status = 0;
  const std::string output =
      // -B: no __pycache__ in the source tree.
      run_command(shell_quote(options.python) + " -B " + shell_quote(script.string()) + " " +
                      shell_quote(experiment) + " " + shell_quote(dir.string()) +
                      (options.plots ? "" : " --no-plots"),
                  status, /*merge_stderr=*/true);
  std::string last = last_line(output);
  if (status == 0) return {AnalysisResult::Status::Done, {}};
  if (status == 3) return {AnalysisResult::Status::NoPlots, last};  // report.py's PLOTS_FAILED
  if (status == 127 && last.find("not found") != std::string::npos)
    last = options.python + " not found";
  return {AnalysisResult::Status::Failed,
          last.empty() ? "report.py exited with status " + std::to_string(status) : last};
}

}  // namespace linrope::experiments
