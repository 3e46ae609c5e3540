// Where and how a result was produced: commit (and whether the tree had local changes), machine,
// compiler, instruction set, OpenMP, date. Written into every JSON.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace linrope::experiments {

std::string git_commit();  // `git rev-parse HEAD` in the source tree, or "unknown"
// Whether the git work tree at `dir` (default: the source tree) has uncommitted changes to tracked
// files; nullopt if that is not a git work tree or git is missing.
std::optional<bool> git_dirty(const std::string& dir = "");
// The vector extensions this build was compiled for (its -march), e.g. {"avx512f", "avx2", "fma"},
// and those of the CPU it runs on, both by their names in /proc/cpuinfo's flags.
std::vector<std::string> compiled_isa();
std::vector<std::string> cpu_isa();
std::string cpu_model();        // first "model name" of /proc/cpuinfo, or "unknown"
std::string compiler();         // e.g. "GCC 12.2.0"
std::string utc_timestamp();    // ISO 8601, e.g. "2024-05-01T12:00:00Z"
int max_threads();              // omp_get_max_threads(), or 1 without OpenMP
void set_threads(int threads);  // omp_set_num_threads when threads > 0

// The 1-minute load average (/proc/loadavg); NaN if unreadable. Timings taken while it exceeds
// the number of cores are inflated by other processes, so it is recorded beside them.
double load_average();

// Sets the OpenMP thread count for a scope and restores the previous one. The accuracy experiments
// run many small single-head calls on one thread: their results do not depend on the thread
// count, and on a loaded machine each parallel region can wait milliseconds for a descheduled
// thread (measured: 150x slower with 2 threads than with 1 at load average 8 on 2 cores).
class ScopedThreads {
 public:
  explicit ScopedThreads(int threads);
  ~ScopedThreads();
  ScopedThreads(const ScopedThreads&) = delete;
  ScopedThreads& operator=(const ScopedThreads&) = delete;

 private:
  int previous_;
};

// {"linrope_version", "git_commit", "git_dirty", "machine": {"cpu", "cores", "isa", "threads"},
//  "compiler", "build_type", "isa", "openmp": {"enabled", "version", "threads"}, "date",
//  "load_average"}
nlohmann::json run_metadata();

// Runs a shell command and returns its standard output (and, when merge_stderr, its standard
// error); `status` receives the exit status (-1 if it could not be started).
std::string run_command(const std::string& command, int& status, bool merge_stderr = false);
std::string shell_quote(const std::string& text);

}  // namespace linrope::experiments
