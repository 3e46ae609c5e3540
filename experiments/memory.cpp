#include "memory.hpp"

#include <sys/mman.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

namespace linrope::experiments {

namespace {

// A "Key:   1234 kB" line of a /proc file, in MiB.
double read_kib_field(const char* file, const char* key) {
  std::ifstream in(file);
  std::string line;
  const std::size_t length = std::strlen(key);
  while (std::getline(in, line))
    if (line.compare(0, length, key) == 0) return std::stod(line.substr(length)) / 1024.0;
  return NAN;
}

}  // namespace

double current_rss_mib() { return read_kib_field("/proc/self/status", "VmRSS:"); }
double peak_rss_mib() { return read_kib_field("/proc/self/status", "VmHWM:"); }
double available_memory_mib() { return read_kib_field("/proc/meminfo", "MemAvailable:"); }

bool reset_peak_rss() {
  std::FILE* f = std::fopen("/proc/self/clear_refs", "w");
  if (!f) return false;
  const bool written = std::fputs("5", f) >= 0;
  return std::fclose(f) == 0 && written;
}

bool hwm_reset_works() {
  static const bool works = [] {
    // mmap, not malloc: the allocator might keep freed memory resident and hide the drop.
    constexpr std::size_t kBytes = std::size_t(64) << 20;
    void* block =
        ::mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (block == MAP_FAILED) return false;
    std::memset(block, 1, kBytes);
    const double high = peak_rss_mib();
    ::munmap(block, kBytes);
    if (!reset_peak_rss()) return false;
    const double after = peak_rss_mib();
    return std::isfinite(high) && std::isfinite(after) && high - after > 48.0;
  }();
  return works;
}

}  // namespace linrope::experiments
