#include "csv.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <set>
#include <sstream>
#include <stdexcept>

#include "atomic_file.hpp"

namespace linrope::experiments {

std::string format_number(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%.9g", value);
  return buffer;
}

std::string format_number(Index value) { return std::to_string(value); }

Row& Row::set(const std::string& column, std::string value) {
  values_[column] = std::move(value);
  return *this;
}

CsvTable::CsvTable(std::vector<std::string> columns, std::size_t key_columns)
    : columns_(std::move(columns)), key_columns_(key_columns) {
  if (key_columns_ > columns_.size())
    throw std::invalid_argument("CsvTable: key_columns is " + std::to_string(key_columns_) +
                                " but there are only " + std::to_string(columns_.size()) +
                                " columns");
  std::set<std::string> seen;
  for (const auto& name : columns_)
    if (!seen.insert(name).second)
      throw std::invalid_argument("CsvTable: column '" + name + "' appears twice");
}

std::vector<std::string> CsvTable::key_of(const Row& row) const {
  std::vector<std::string> key;
  key.reserve(key_columns_);
  for (std::size_t c = 0; c < key_columns_; ++c) {
    const auto found = row.values().find(columns_[c]);
    if (found == row.values().end())
      throw std::invalid_argument("CsvTable: the row does not set the key column '" + columns_[c] +
                                  "'");
    key.push_back(found->second);
  }
  return key;
}

void CsvTable::add(const Row& row) {
  std::vector<std::string> cells;
  cells.reserve(columns_.size());
  for (const auto& name : columns_) {
    const auto found = row.values().find(name);
    if (found == row.values().end())
      throw std::invalid_argument("CsvTable: the row does not set the column '" + name + "'");
    cells.push_back(found->second);
  }
  if (row.values().size() != columns_.size())
    for (const auto& [name, value] : row.values())
      if (std::find(columns_.begin(), columns_.end(), name) == columns_.end())
        throw std::invalid_argument("CsvTable: the row sets '" + name + "', which is not a column");
  std::vector<std::string> key(cells.begin(), cells.begin() + std::ptrdiff_t(key_columns_));
  if (const auto found = index_.find(key); found != index_.end()) {
    rows_[found->second] = std::move(cells);
    return;
  }
  index_.emplace(std::move(key), rows_.size());
  rows_.push_back(std::move(cells));
}

std::size_t CsvTable::column(std::string_view name) const {
  for (std::size_t c = 0; c < columns_.size(); ++c)
    if (columns_[c] == name) return c;
  throw std::out_of_range("CsvTable: no column '" + std::string(name) + "'");
}

const std::string& CsvTable::text(std::size_t row, std::string_view name) const {
  return rows_.at(row).at(column(name));
}

double CsvTable::number(std::size_t row, std::string_view name) const {
  const std::string& cell = text(row, name);
  char* end = nullptr;
  const double value = std::strtod(cell.c_str(), &end);
  if (cell.empty() || end != cell.c_str() + cell.size())
    return std::numeric_limits<double>::quiet_NaN();
  return value;
}

namespace {

std::string quote(const std::string& cell) {
  if (cell.find_first_of(",\"\n\r") == std::string::npos) return cell;
  std::string quoted = "\"";
  for (const char c : cell) {
    if (c == '"') quoted += '"';
    quoted += c;
  }
  return quoted + '"';
}

void append_line(std::string& out, const std::vector<std::string>& cells) {
  for (std::size_t c = 0; c < cells.size(); ++c) {
    if (c) out += ',';
    out += quote(cells[c]);
  }
  out += '\n';
}

}  // namespace

std::string CsvTable::to_csv() const {
  std::string out;
  append_line(out, columns_);
  for (const auto& row : rows_) append_line(out, row);
  return out;
}

void CsvTable::save(const std::filesystem::path& path) const { write_file_atomic(path, to_csv()); }

std::vector<std::string> split_csv_line(std::string_view line) {
  std::vector<std::string> fields(1);
  bool quoted = false;
  for (std::size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quoted) {
      if (c == '"' && i + 1 < line.size() && line[i + 1] == '"') {
        fields.back() += '"';
        ++i;
      } else if (c == '"') {
        quoted = false;
      } else {
        fields.back() += c;
      }
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      fields.emplace_back();
    } else if (c != '\r') {
      fields.back() += c;
    }
  }
  return fields;
}

std::size_t CsvTable::load(const std::filesystem::path& path) {
  if (!std::filesystem::exists(path)) return 0;
  std::istringstream in(read_file(path));
  std::string line;
  if (!std::getline(in, line)) return 0;
  if (split_csv_line(line) != columns_)
    throw std::runtime_error(path.string() + " has the header '" + line + "' but expected '" +
                             to_csv().substr(0, to_csv().find('\n')) +
                             "'; remove it or run without --resume");
  std::size_t count = 0, line_number = 1;
  while (std::getline(in, line)) {
    ++line_number;
    if (line.empty()) continue;
    std::vector<std::string> cells = split_csv_line(line);
    if (cells.size() != columns_.size())
      throw std::runtime_error(path.string() + ":" + std::to_string(line_number) + " has " +
                               std::to_string(cells.size()) + " fields but expected " +
                               std::to_string(columns_.size()));
    Row row;
    for (std::size_t c = 0; c < cells.size(); ++c) row.set(columns_[c], std::move(cells[c]));
    add(row);
    ++count;
  }
  return count;
}

}  // namespace linrope::experiments
