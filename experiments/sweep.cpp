#include "sweep.hpp"

namespace linrope::experiments {

Sweep::Sweep(Context& context, const std::string& name, std::vector<std::string> columns,
             std::size_t key_columns, std::size_t total_points, double total_work)
    : context_(context),
      table_(std::move(columns), key_columns),
      path_(context.dir / (name + ".csv")),
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
  if (context_.on_measure) context_.on_measure(key);
  progress_.begin(label);
  return true;
}

void Sweep::record(const Row& row, double work) {
  table_.add(row);
  ++context_.measured;
  save(false);
  progress_.end(work);
}

void Sweep::save(bool force) {
  // Saving rewrites the whole file; once a second bounds both the cost and what a kill can lose.
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
