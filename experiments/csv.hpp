// A tidy CSV table: one row per measurement, named columns, the first `key_columns` of which are
// the parameters that identify a point (what --resume keys on); the rest are measured values.
#pragma once

#include <cstddef>
#include <filesystem>
#include <linrope/types.hpp>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace linrope::experiments {

// Text form of a value in a CSV cell: integers in decimal, doubles with 9 significant digits
// ("nan", "inf" and "-inf" for the non-finite ones), so that a key written once reads back the
// same.
std::string format_number(double value);
std::string format_number(Index value);

// A row under construction, by column name (order-free, so experiments cannot misplace a value).
class Row {
 public:
  Row& set(const std::string& column, std::string value);
  Row& set(const std::string& column, const char* value) { return set(column, std::string(value)); }
  Row& set(const std::string& column, double value) { return set(column, format_number(value)); }
  Row& set(const std::string& column, Index value) { return set(column, format_number(value)); }
  Row& set(const std::string& column, int value) { return set(column, Index(value)); }
  Row& set(const std::string& column, bool value) { return set(column, Index(value ? 1 : 0)); }
  const std::map<std::string, std::string>& values() const { return values_; }

 private:
  std::map<std::string, std::string> values_;
};

class CsvTable {
 public:
  // Throws std::invalid_argument on duplicate column names or key_columns > columns.size().
  CsvTable(std::vector<std::string> columns, std::size_t key_columns);

  const std::vector<std::string>& columns() const { return columns_; }
  std::size_t key_columns() const { return key_columns_; }
  std::size_t size() const { return rows_.size(); }
  const std::vector<std::string>& row(std::size_t i) const { return rows_.at(i); }

  // The key of `row`: its values of the key columns, in order. Throws std::invalid_argument naming
  // the first key column that `row` does not set.
  std::vector<std::string> key_of(const Row& row) const;
  bool contains(const std::vector<std::string>& key) const { return index_.count(key) != 0; }

  // Adds a complete row (every column set, no unknown column), replacing a row with the same key.
  void add(const Row& row);

  // Position of a column; throws std::out_of_range naming it if absent.
  std::size_t column(std::string_view name) const;
  const std::string& text(std::size_t row, std::string_view column) const;
  double number(std::size_t row, std::string_view column) const;  // NaN if the cell is not a number

  // CSV text: a header line, then one line per row, in insertion order.
  std::string to_csv() const;
  // Writes to_csv() atomically.
  void save(const std::filesystem::path& path) const;
  // Appends the rows of an existing file (for --resume). Returns how many were read; 0 if the file
  // does not exist. Throws std::runtime_error if its header differs from columns() (a file written
  // by a different version of the experiment must not be mixed with new rows) or a row is
  // malformed.
  std::size_t load(const std::filesystem::path& path);

 private:
  std::vector<std::string> columns_;
  std::size_t key_columns_;
  std::vector<std::vector<std::string>> rows_;
  std::map<std::vector<std::string>, std::size_t> index_;
};

// Splits one CSV line into fields (double quotes protect commas; "" is a literal quote).
std::vector<std::string> split_csv_line(std::string_view line);

}  // namespace linrope::experiments
