// A progress bar on stderr for long sweeps: the point being measured, how far along, and the time
// left, estimated from the work (e.g. FLOPs) done so far in this run. On a terminal it redraws one
// line; otherwise (logs, CTest) it prints a line at most every few seconds.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>

namespace linrope::experiments {

class Progress {
 public:
  Progress(std::string name, std::size_t total_points, double total_work, bool enabled);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void skip(double work);                          // a point taken from an earlier run (--resume)
  void begin(const std::string& label);            // shows the point about to be measured
  void end(double work);                           // that point is done
  void finish(const std::string& label = "done");  // final line; idempotent

  // "1h02m", "3m05s", "12s"
  static std::string format_duration(double seconds);

 private:
  void draw(bool force);
  using Clock = std::chrono::steady_clock;
  std::string name_, label_;
  std::size_t total_points_, done_points_ = 0;
  double total_work_, measured_work_ = 0, skipped_work_ = 0;
  bool enabled_, tty_, finished_ = false;
  Clock::time_point start_, last_draw_;
  std::size_t last_width_ = 0;
};

}  // namespace linrope::experiments
