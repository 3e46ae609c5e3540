#include "progress.hpp"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace linrope::experiments {

Progress::Progress(std::string name, std::size_t total_points, double total_work, bool enabled)
    : name_(std::move(name)),
      total_points_(total_points),
      total_work_(total_work),
      enabled_(enabled),
      tty_(::isatty(STDERR_FILENO) == 1),
      start_(Clock::now()),
      last_draw_(start_) {}

Progress::~Progress() { finish(); }

std::string Progress::format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const long total = std::lround(seconds);
  char buffer[32];
  if (total >= 3600)
    std::snprintf(buffer, sizeof buffer, "%ldh%02ldm", total / 3600, (total / 60) % 60);
  else if (total >= 60)
    std::snprintf(buffer, sizeof buffer, "%ldm%02lds", total / 60, total % 60);
  else
    std::snprintf(buffer, sizeof buffer, "%lds", total);
  return buffer;
}

void Progress::skip(double work) {
  skipped_work_ += work;
  ++done_points_;
}

void Progress::begin(const std::string& label) {
  label_ = label;
  draw(false);
}

void Progress::end(double work) {
  measured_work_ += work;
  ++done_points_;
  draw(done_points_ == total_points_);
}

void Progress::draw(bool force) {
  if (!enabled_ || finished_) return;
  const auto now = Clock::now();
  // A terminal redraws cheaply; a log file gets a line every 5 s at most.
  const double interval = tty_ ? 0.1 : 5.0;
  if (!force && std::chrono::duration<double>(now - last_draw_).count() < interval &&
      done_points_ != 0)
    return;
  last_draw_ = now;
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const double remaining_work = std::max(0.0, total_work_ - measured_work_ - skipped_work_);
  const double eta = measured_work_ > 0 ? elapsed * remaining_work / measured_work_ : NAN;
  const double fraction =
      total_work_ > 0 ? std::min(1.0, (measured_work_ + skipped_work_) / total_work_) : 1.0;
  constexpr int kBar = 24;
  const int filled = int(fraction * kBar);
  std::string bar(std::size_t(filled), '#');
  bar.resize(kBar, '.');
  char line[512];
  std::snprintf(line, sizeof line, "[%s] %zu/%zu |%s| %3.0f%% %s, left %s  %s", name_.c_str(),
                done_points_, total_points_, bar.c_str(), 100 * fraction,
                format_duration(elapsed).c_str(), format_duration(eta).c_str(), label_.c_str());
  std::string text = line;
  if (tty_) {
    const std::size_t width = text.size();
    if (width < last_width_) text.append(last_width_ - width, ' ');
    last_width_ = width;
    std::fprintf(stderr, "\r%s", text.c_str());
  } else {
    std::fprintf(stderr, "%s\n", text.c_str());
  }
  std::fflush(stderr);
}

void Progress::finish(const std::string& label) {
  if (!enabled_ || finished_) return;
  label_ = label;
  draw(true);
  if (tty_) std::fputc('\n', stderr);
  finished_ = true;
}

}  // namespace linrope::experiments
