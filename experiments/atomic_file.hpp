// Files that are either complete or absent: every output is written to a temporary name beside its
// destination, flushed to disk, then renamed over it (rename is atomic within a directory), so an
// interrupted run never leaves a truncated CSV, JSON or report behind.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>

namespace linrope::experiments {

// The temporary name used for `path`: ".<filename>.tmp-<pid>" in the same directory. Stale ones
// (from a killed run) all contain ".tmp-" and are removed by remove_stale_temporaries.
std::filesystem::path temporary_path_for(const std::filesystem::path& path);

// Writes `content` to `path` atomically (temporary file, fsync, rename). Creates missing parent
// directories. Throws std::runtime_error naming the path and the system error on failure, and
// leaves no temporary file behind.
void write_file_atomic(const std::filesystem::path& path, std::string_view content);

// Reads a whole file; throws std::runtime_error if it cannot be opened.
std::string read_file(const std::filesystem::path& path);

// Deletes leftovers of interrupted writes (names starting with '.' and containing ".tmp-") in
// `dir`. Returns how many were removed.
int remove_stale_temporaries(const std::filesystem::path& dir);

}  // namespace linrope::experiments
