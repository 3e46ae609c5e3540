// Ctrl-C (SIGINT) and SIGTERM during a sweep. The signal handler only records which signal came;
// everything else happens in ordinary code: between two points the sweep (sweep.cpp) sees the
// flag, saves its CSV at once and throws Interrupted; the runner marks the experiment as
// interrupted; the command line prints one line and exits with 128 + signal (130, 143).
//
//   const InterruptHandlers handlers;   // for the length of the run
//   ... if (interrupted()) { save; throw Interrupted(...); } ...
#pragma once

#include <signal.h>

#include <cstddef>
#include <filesystem>
#include <stdexcept>
#include <string>

namespace linrope::experiments {

// Installs handlers for SIGINT and SIGTERM for its lifetime; at scope exit restores the actions
// that were there before (doctest's, in the tests) and clears the flag, so that nothing leaks
// into later runs. The handlers are one-shot (SA_RESETHAND): the first signal sets the flag and
// the kernel restores the default action, so a second Ctrl-C while the run is saving and
// stopping kills the program at once (force quit; every file is still whole, see atomic_file.hpp).
class InterruptHandlers {
 public:
  InterruptHandlers();  // also clears the flag
  ~InterruptHandlers();
  InterruptHandlers(const InterruptHandlers&) = delete;
  InterruptHandlers& operator=(const InterruptHandlers&) = delete;

 private:
  struct sigaction previous_int_ {};
  struct sigaction previous_term_ {};
};

// The signal received while handlers were installed (SIGINT or SIGTERM), or 0.
int interrupt_signal();
inline bool interrupted() { return interrupt_signal() != 0; }

// "SIGINT", "SIGTERM", or "signal <n>".
std::string signal_name(int signal);

// Thrown by a sweep between two points once a signal was received, after its CSV was saved:
// `saved` of the sweep's `total` points (this run's and resumed ones) are in `csv`.
class Interrupted : public std::runtime_error {
 public:
  Interrupted(int signal, std::filesystem::path csv, std::size_t saved, std::size_t total);
  int signal() const { return signal_; }
  const std::filesystem::path& csv() const { return csv_; }
  std::size_t saved() const { return saved_; }
  std::size_t total() const { return total_; }
  int exit_status() const { return 128 + signal_; }  // what a shell reports for a killed program

 private:
  int signal_;
  std::filesystem::path csv_;
  std::size_t saved_, total_;
};

}  // namespace linrope::experiments
