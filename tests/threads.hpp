// Thread counts for tests: a test that exercises a split across threads, or compares results across
// thread counts, sets the count itself, so that it tests the parallel path even where the machine
// or OMP_NUM_THREADS gives one thread. Without OpenMP (LINROPE_OPENMP=OFF) everything runs in one
// thread and the guard does nothing.
#pragma once

#ifdef _OPENMP
#include <omp.h>
#endif

namespace linrope::testing {

// The thread count a split test asks for: two threads give the kernels' parallel paths (two
// segments, two slices at a time) without oversubscribing a two-core machine.
inline constexpr int kSplitThreads = 2;

// Sets the OpenMP thread count (omp_set_num_threads) for its scope and restores the previous one.
class ThreadCount {
 public:
  explicit ThreadCount([[maybe_unused]] int threads) {
#ifdef _OPENMP
    previous_ = omp_get_max_threads();
    omp_set_num_threads(threads);
#endif
  }
  ~ThreadCount() {
#ifdef _OPENMP
    omp_set_num_threads(previous_);
#endif
  }
  ThreadCount(const ThreadCount&) = delete;
  ThreadCount& operator=(const ThreadCount&) = delete;

 private:
#ifdef _OPENMP
  int previous_ = 1;
#endif
};

}  // namespace linrope::testing
