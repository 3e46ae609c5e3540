// A CSV-backed sweep, the loop every experiment runs: with --resume it loads the earlier CSV and
// skips every point whose key (parameter columns) is already there; each new row is saved
// atomically (at most once per second, and at the end), and the progress bar follows along.
//
//   Sweep sweep(context, columns, key_columns, points, work);
//   for (each point) {
//     if (!sweep.begin(key_row, "n=4096", work)) continue;   // resumed
//     ... measure ...
//     sweep.record(full_row, work);
//   }
//   sweep.finish();
//
// Ctrl-C or SIGTERM (see interrupt.hpp): the point being measured finishes; then record() (or the
// next begin() of a point to measure) saves the CSV at once and throws Interrupted, so an
// interrupted run keeps every finished point and `--resume` measures only the rest.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "csv.hpp"
#include "experiment.hpp"
#include "progress.hpp"

namespace linrope::experiments {

class Sweep {
 public:
  Sweep(Context& context, const std::string& name, std::vector<std::string> columns,
        std::size_t key_columns, std::size_t total_points, double total_work);

  // False (and the point counts as done) when the row for `key` is already in the table.
  // Throws Interrupted, after saving, instead of starting a point once a signal has come.
  bool begin(const Row& key, const std::string& label, double work);
  // Throws Interrupted, after saving (this row included), once a signal has come.
  void record(const Row& row, double work);
  void finish();  // saves the CSV (always, so that a run with no new point still writes it)

  const CsvTable& table() const { return table_; }
  std::filesystem::path csv_path() const { return path_; }

 private:
  void save(bool force);
  void stop_if_interrupted();
  Context& context_;
  CsvTable table_;
  std::filesystem::path path_;
  std::size_t total_points_;
  std::size_t measured_before_;  // context.measured when the sweep began
  Progress progress_;
  std::chrono::steady_clock::time_point last_save_;
};

}  // namespace linrope::experiments
