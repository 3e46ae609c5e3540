#include "threads.hpp"

#include <cstdlib>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include "arrays.hpp"
#include "bindings.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace linrope::python {
namespace {

// `import torch` sets libgomp's thread count to 1 on a 2-core machine, and torch and linrope share
// libgomp: left alone, linrope would run on one thread after it. So the count is ours: the
// machine's cores (OMP_NUM_THREADS if set) until set_num_threads changes it, imposed on the
// calling thread for the duration of each kernel and restored after, so that torch keeps its own.
int default_threads() {
#ifdef _OPENMP
  if (const char* env = std::getenv("OMP_NUM_THREADS")) {
    const int n = std::atoi(env);  // "4" or "4,2": the first level
    if (n > 0) return n;
  }
  return omp_get_num_procs();
#else
  return 1;
#endif
}

// How many kernel calls hold each feature map now; a map held by none has no entry. A mutex, not
// the GIL, guards it, so the count stays right whatever thread state a caller is in.
struct MapsInUse {
  std::mutex mutex;
  std::unordered_map<const FeatureMap*, int> calls;
};

MapsInUse& maps_in_use() {
  static MapsInUse maps;
  return maps;
}

}  // namespace

std::atomic<int>& thread_count() {
  static std::atomic<int> count{default_threads()};
  return count;
}

std::atomic<std::int64_t>& kernel_nanoseconds() {
  static std::atomic<std::int64_t> total{0};
  return total;
}

MapInUse::MapInUse(const FeatureMap* map) : map_(map) {
  if (!map_) return;
  MapsInUse& maps = maps_in_use();
  const std::lock_guard lock(maps.mutex);
  ++maps.calls[map_];
}

MapInUse::~MapInUse() {
  if (!map_) return;
  MapsInUse& maps = maps_in_use();
  const std::lock_guard lock(maps.mutex);
  if (--maps.calls[map_] == 0) maps.calls.erase(map_);
}

void redraw_unless_in_use(FeatureMap& map, std::uint64_t seed) {
  MapsInUse& maps = maps_in_use();
  // Held through the redraw, so that no kernel can take the map halfway through it.
  const std::lock_guard lock(maps.mutex);
  if (const auto it = maps.calls.find(&map); it != maps.calls.end()) {
    std::ostringstream message;
    message << "FeatureMap.redraw: the map is in use by " << it->second
            << " kernel call(s) running in other threads (they read W without the GIL); redraw "
               "after they return, or draw a new FeatureMap with the new seed";
    throw std::runtime_error(message.str());
  }
  map.redraw(seed);
}

KernelScope::KernelScope(const FeatureMap* map) : in_use_(map) {
#ifdef _OPENMP
  previous_ = omp_get_max_threads();
  omp_set_num_threads(thread_count().load());
#endif
}

KernelScope::~KernelScope() {
#ifdef _OPENMP
  omp_set_num_threads(previous_);
#endif
  kernel_nanoseconds() += std::chrono::duration_cast<std::chrono::nanoseconds>(
                              std::chrono::steady_clock::now() - start_)
                              .count();
}

void bind_threads(py::module_& m) {
  using namespace pybind11::literals;
#ifdef _OPENMP
  m.attr("openmp") = true;
#else
  m.attr("openmp") = false;
#endif
  m.def(
      "set_num_threads",
      [](int n) {
        if (n < 1) fail("set_num_threads", "n is ", n, " but expected n >= 1");
#ifdef _OPENMP
        thread_count() = n;
#endif
      },
      "n"_a,
      "Threads every linrope kernel runs on (default: the machine's cores, or OMP_NUM_THREADS). "
      "Independent of torch.set_num_threads. A no-op without OpenMP.");
  m.def(
      "get_num_threads", [] { return thread_count().load(); },
      "Threads every linrope kernel runs on.");
  // For the tests: the team size an OpenMP region opened by a kernel would get.
  m.def("_kernel_threads", [] {
    int threads = 1;
    KernelScope scope;
#ifdef _OPENMP
#pragma omp parallel
#pragma omp single
    threads = omp_get_num_threads();
#endif
    return threads;
  });
  // For the benchmarks: seconds spent in the C++ kernels since import (GIL released, threads set).
  m.def("_kernel_seconds", [] { return double(kernel_nanoseconds().load()) * 1e-9; });
}

}  // namespace linrope::python
