#include "sweep.hpp"

#include "interrupt.hpp"

namespace linrope::experiments {

Sweep::Sweep(Context& context, const std::string& name, std::vector<std::string> columns,
             std::size_t key_columns, std::size_t total_points, double total_work)
    : context_(context),
      table_(std::move(columns), key_columns),
      path_(context.dir / (name + ".csv")),
      total_points_(total_points),
      measured_before_(context.measured),
      progress_(name, total_points, total_work, !context.options.quiet),
      last_save_(std::chrono::steady_clock::now()) {
  if (context.options.resume) table_.load(path_);
}

bool Sweep::begin(const Row& key_row, const std::string& label, double work) {
  const std::vector<std::string> key = table_.key_of(key_row);
  if (table_.contains(key)) {
    ++context_.resumed;
    progress_.skip(work);
    return false;
  }
  // Also checked here, not only in record(): between two points an experiment may do work of its
  // own (favor-error and normalization compute exact attention once per group of points).
  stop_if_interrupted();
  if (context_.on_measure) context_.on_measure(key);
  progress_.begin(label);
  return true;
}

void Sweep::record(const Row& row, double work) {
  table_.add(row);
  ++context_.measured;
  progress_.end(work);
  stop_if_interrupted();
  save(false);
}

void Sweep::stop_if_interrupted() {
  const int signal = interrupt_signal();
  if (signal == 0) return;
  // Only a sweep that measured something rewrites its CSV: stopped before its first point, a run
  // without --resume would otherwise replace an earlier run's results with an empty table.
  if (context_.measured > measured_before_) save(true);
  progress_.finish("interrupted");
  throw Interrupted(signal, path_, context_.measured + context_.resumed, total_points_);
}

void Sweep::save(bool force) {
  // Saving rewrites the whole file; once a second bounds its cost. Ctrl-C and SIGTERM lose nothing
  // finished (stop_if_interrupted saves at once); only SIGKILL or a crash can lose the last second.
  const auto now = std::chrono::steady_clock::now();
  if (!force && now - last_save_ < std::chrono::seconds(1)) return;
  table_.save(path_);
  last_save_ = now;
}

void Sweep::finish() {
  save(true);
  progress_.finish();
}

}  // namespace linrope::experiments
