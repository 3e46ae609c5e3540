// The thread policy of linrope._core: how many OpenMP threads a kernel runs on, the GIL released
// around every kernel, and the feature maps a running kernel holds (so that FeatureMap.redraw from
// another Python thread is refused instead of racing with it).
#pragma once

#include <pybind11/pybind11.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <linrope/linrope.hpp>

namespace linrope::python {

namespace py = pybind11;

// Threads every linrope kernel runs on; see threads.cpp for why the count is linrope's own.
std::atomic<int>& thread_count();

// Seconds spent inside KernelScopes since import, summed over threads: what the benchmark of the
// binding's overhead subtracts from the time of a whole call (bench/bench_torch_layer.py).
std::atomic<std::int64_t>& kernel_nanoseconds();

// Marks `map` (if not null) as read by a kernel for its lifetime. Kernels read W while the GIL is
// released, so another Python thread may call FeatureMap.redraw meanwhile; redraw_unless_in_use
// refuses while any MapInUse holds the map. Taken while the GIL is held, before it is released:
// taken after, a redraw could slip in between the release and the count.
class MapInUse {
 public:
  explicit MapInUse(const FeatureMap* map);
  ~MapInUse();
  MapInUse(const MapInUse&) = delete;
  MapInUse& operator=(const MapInUse&) = delete;

 private:
  const FeatureMap* map_;
};

// map.redraw(seed), or std::runtime_error (RuntimeError) if a kernel holds the map.
void redraw_unless_in_use(FeatureMap& map, std::uint64_t seed);

// One kernel call: holds `map` (if any), releases the GIL and sets linrope's thread count on this
// thread, restoring all three on exit. The members are declared in that order, so the map is
// held before the GIL is released and let go only after it is re-acquired.
class KernelScope {
 public:
  explicit KernelScope(const FeatureMap* map = nullptr);
  ~KernelScope();
  KernelScope(const KernelScope&) = delete;
  KernelScope& operator=(const KernelScope&) = delete;

 private:
  MapInUse in_use_;
  py::gil_scoped_release release_;
  int previous_ = 1;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

}  // namespace linrope::python
