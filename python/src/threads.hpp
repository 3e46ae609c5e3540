// The thread policy of linrope._core: how many OpenMP threads a kernel runs on, and the GIL
// released around every kernel.
#pragma once

#include <pybind11/pybind11.h>

#include <atomic>
#include <chrono>
#include <cstdint>

namespace linrope::python {

namespace py = pybind11;

// Threads every linrope kernel runs on; see threads.cpp for why the count is linrope's own.
std::atomic<int>& thread_count();

// Seconds spent inside KernelScopes since import, summed over threads: what the benchmark of the
// binding's overhead subtracts from the time of a whole call (bench/bench_torch_layer.py).
std::atomic<std::int64_t>& kernel_nanoseconds();

// One kernel call: releases the GIL and sets linrope's thread count on this thread, restoring
// both on exit.
class KernelScope {
 public:
  KernelScope();
  ~KernelScope();
  KernelScope(const KernelScope&) = delete;
  KernelScope& operator=(const KernelScope&) = delete;

 private:
  py::gil_scoped_release release_;
  int previous_ = 1;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

}  // namespace linrope::python
