#include "metadata.hpp"

#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iterator>
#include <linrope/version.hpp>
#include <set>
#include <sstream>
#include <thread>

#ifdef _OPENMP
#include <omp.h>
#endif

#ifndef LINROPE_SOURCE_DIR
#define LINROPE_SOURCE_DIR "."
#endif
#ifndef LINROPE_BUILD_TYPE
#define LINROPE_BUILD_TYPE "unknown"
#endif

namespace linrope::experiments {

std::string shell_quote(const std::string& text) {
  std::string quoted = "'";
  for (const char c : text) {
    if (c == '\'')
      quoted += "'\\''";
    else
      quoted += c;
  }
  return quoted + "'";
}

std::string run_command(const std::string& command, int& status, bool merge_stderr) {
  const std::string full = command + (merge_stderr ? " 2>&1" : " 2>/dev/null");
  std::FILE* pipe = ::popen(full.c_str(), "r");
  if (!pipe) {
    status = -1;
    return {};
  }
  std::string output;
  char buffer[4096];
  std::size_t count;
  while ((count = std::fread(buffer, 1, sizeof buffer, pipe)) > 0) output.append(buffer, count);
  const int raw = ::pclose(pipe);
  status = raw == -1 ? -1 : (WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw));
  return output;
}

std::string git_commit() {
  int status = 0;
  std::string out =
      run_command("git -C " + shell_quote(LINROPE_SOURCE_DIR) + " rev-parse HEAD", status);
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  if (status != 0 || out.size() != 40) return "unknown";
  return out;
}

std::optional<bool> git_dirty(const std::string& dir) {
  int status = 0;
  const std::string out =
      run_command("git -C " + shell_quote(dir.empty() ? LINROPE_SOURCE_DIR : dir) +
                      " status --porcelain --untracked-files=no",
                  status);
  if (status != 0) return std::nullopt;
  return !out.empty();
}

std::vector<std::string> compiled_isa() {
  std::vector<std::string> isa;
#ifdef __AVX512F__
  isa.push_back("avx512f");
#endif
#ifdef __AVX512BW__
  isa.push_back("avx512bw");
#endif
#ifdef __AVX512DQ__
  isa.push_back("avx512dq");
#endif
#ifdef __AVX512VL__
  isa.push_back("avx512vl");
#endif
#ifdef __AVX2__
  isa.push_back("avx2");
#endif
#ifdef __FMA__
  isa.push_back("fma");
#endif
#ifdef __AVX__
  isa.push_back("avx");
#endif
#ifdef __SSE4_2__
  isa.push_back("sse4_2");
#endif
#ifdef __SSE2__
  isa.push_back("sse2");
#endif
#ifdef __ARM_NEON
  isa.push_back("asimd");
#endif
  return isa;
}

std::vector<std::string> cpu_isa() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("flags", 0) == 0 || line.rfind("Features", 0) == 0) {
      std::istringstream words(line.substr(line.find(':') + 1));
      const std::set<std::string> flags(std::istream_iterator<std::string>(words), {});
      std::vector<std::string> isa;
      for (const char* name : {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma", "avx",
                               "sse4_2", "sse2", "asimd"})
        if (flags.count(name)) isa.push_back(name);
      return isa;
    }
  return {};
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  return "unknown";
}

std::string compiler() {
#if defined(__clang__)
  return std::string("Clang ") + __clang_version__;
#elif defined(__GNUC__)
  return std::string("GCC ") + __VERSION__;
#else
  return __VERSION__;
#endif
}

std::string utc_timestamp() {
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  ::gmtime_r(&now, &utc);
  char buffer[32];
  std::strftime(buffer, sizeof buffer, "%Y-%m-%dT%H:%M:%SZ", &utc);
  return buffer;
}

int max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

void set_threads(int threads) {
#ifdef _OPENMP
  if (threads > 0) omp_set_num_threads(threads);
#else
  (void)threads;
#endif
}

double load_average() {
  std::ifstream in("/proc/loadavg");
  double one_minute = NAN;
  if (!(in >> one_minute)) return NAN;
  return one_minute;
}

ScopedThreads::ScopedThreads(int threads) : previous_(max_threads()) { set_threads(threads); }
ScopedThreads::~ScopedThreads() { set_threads(previous_); }

nlohmann::json run_metadata() {
  const std::optional<bool> dirty = git_dirty();
#ifdef _OPENMP
  const nlohmann::json openmp = {
      {"enabled", true}, {"version", _OPENMP}, {"threads", max_threads()}};
#else
  const nlohmann::json openmp = {{"enabled", false}, {"version", nullptr}, {"threads", 1}};
#endif
  return {{"linrope_version", linrope::version},
          {"git_commit", git_commit()},
          {"git_dirty", dirty ? nlohmann::json(*dirty) : nlohmann::json(nullptr)},
          {"machine",
           {{"cpu", cpu_model()},
            {"cores", std::thread::hardware_concurrency()},
            {"isa", cpu_isa()},
            {"threads", max_threads()}}},
          {"compiler", compiler()},
          {"build_type", LINROPE_BUILD_TYPE},
          {"isa", compiled_isa()},
          {"openmp", openmp},
          {"date", utc_timestamp()},
          {"load_average", load_average()}};
}

}  // namespace linrope::experiments
