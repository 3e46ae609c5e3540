#include "atomic_file.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace linrope::experiments {

namespace fs = std::filesystem;

fs::path temporary_path_for(const fs::path& path) {
  // Appended piece by piece: GCC 12 warns falsely (-Wrestrict, PR 105651) on "." + string + ...
  std::string name = ".";
  name.append(path.filename().string()).append(".tmp-").append(std::to_string(::getpid()));
  return path.parent_path() / name;
}

namespace {

[[noreturn]] void fail(const fs::path& path, const char* what, int error) {
  throw std::runtime_error("cannot " + std::string(what) + " " + path.string() + ": " +
                           std::strerror(error));
}

}  // namespace

void write_file_atomic(const fs::path& path, std::string_view content) {
  if (!path.parent_path().empty()) fs::create_directories(path.parent_path());
  const fs::path temporary = temporary_path_for(path);
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(temporary, "create", errno);
  std::size_t written = 0;
  while (written < content.size()) {
    const ::ssize_t chunk = ::write(fd, content.data() + written, content.size() - written);
    if (chunk < 0 && errno == EINTR) continue;
    if (chunk < 0) {
      const int error = errno;
      ::close(fd);
      ::unlink(temporary.c_str());
      fail(temporary, "write", error);
    }
    written += std::size_t(chunk);
  }
  // fsync before rename: otherwise a power cut can leave the new name pointing at empty blocks.
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const int error = errno;
    ::unlink(temporary.c_str());
    fail(temporary, "flush", error);
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    const int error = errno;
    ::unlink(temporary.c_str());
    fail(path, "rename a temporary file onto", error);
  }
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path.string());
  std::ostringstream content;
  content << in.rdbuf();
  return content.str();
}

int remove_stale_temporaries(const fs::path& dir) {
  std::error_code error;
  if (!fs::is_directory(dir, error)) return 0;
  int removed = 0;
  for (const auto& entry : fs::directory_iterator(dir, error)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with('.') && name.find(".tmp-") != std::string::npos &&
        fs::remove(entry.path(), error))
      ++removed;
  }
  return removed;
}

}  // namespace linrope::experiments
