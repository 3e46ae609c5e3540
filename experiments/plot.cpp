#include "plot.hpp"

#include "metadata.hpp"

#ifndef LINROPE_EXPERIMENTS_PLOT_SCRIPT
#define LINROPE_EXPERIMENTS_PLOT_SCRIPT "experiments/plot.py"
#endif

namespace linrope::experiments {

std::filesystem::path default_plot_script() { return LINROPE_EXPERIMENTS_PLOT_SCRIPT; }

PlotResult run_plot(const Options& options, const std::string& experiment,
                    const std::filesystem::path& dir) {
  const std::filesystem::path script =
      options.plot_script.empty() ? default_plot_script() : options.plot_script;
  if (!std::filesystem::exists(script)) return {false, "no plot script at " + script.string()};
  int status = 0;
  const std::string output =
      run_command(shell_quote(options.python) + " " + shell_quote(script.string()) + " " +
                      shell_quote(experiment) + " " + shell_quote(dir.string()),
                  status, /*merge_stderr=*/true);
  if (status == 0) return {true, {}};
  // The last non-empty line of the output is the Python error ("ModuleNotFoundError: ...").
  std::string last;
  std::size_t end = output.size();
  while (end > 0) {
    const std::size_t start = output.rfind('\n', end - 1);
    const std::size_t from = start == std::string::npos ? 0 : start + 1;
    last = output.substr(from, end - from);
    if (!last.empty()) break;
    if (start == std::string::npos) break;
    end = start;
  }
  if (status == 127 && last.empty()) last = options.python + " not found";
  return {false, last.empty() ? "plot.py exited with status " + std::to_string(status) : last};
}

}  // namespace linrope::experiments
