// Private: the one place that runs work on OpenMP threads, and the OpenMP queries, all of which
// also compile without OpenMP (one thread).
//
// Every parallel loop of the library goes through parallel_for: its partition of the work is the
// caller's (it depends on the shapes only, see "Reproducibility" in attention.hpp), and an
// exception thrown by a task (std::bad_alloc, the only one possible after the argument checks)
// is caught inside the region and rethrown after it: an exception leaving an OpenMP region
// terminates the program.
#pragma once

#include <atomic>
#include <exception>
#include <linrope/types.hpp>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace linrope::detail {

inline int max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

inline int thread_id() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

inline bool in_parallel() {
#ifdef _OPENMP
  return omp_in_parallel();
#else
  return false;
#endif
}

// Static: task i runs on thread i * threads / count (equal shares). Dynamic: each thread takes the
// next task when it is free (uneven tasks, e.g. the causal triangle's blocks, largest first).
enum class Schedule { Static, Dynamic };

// body(i) for i in [0, count), on up to `threads` OpenMP threads; in this thread, without
// entering a parallel region, when threads <= 1 or count <= 1 (a region, even a team of one,
// costs a wake-up of the idle pool at its end: ~15% of a stream's one-token step with elu+1).
// After a task throws, the tasks not yet started are skipped, and the first exception is
// rethrown once every thread has left the region.
template <class Body>
void parallel_for(Index count, int threads, Schedule schedule, Body body) {
  if (threads <= 1 || count <= 1) {
    for (Index i = 0; i < count; ++i) body(i);
    return;
  }
#ifdef _OPENMP
  std::exception_ptr failure;
  std::atomic<bool> failed{false};
  const auto guarded = [&](Index i) {
    if (failed.load(std::memory_order_relaxed)) return;
    try {
      body(i);
    } catch (...) {
#pragma omp critical(linrope_parallel_failure)
      if (!failure) failure = std::current_exception();
      failed.store(true, std::memory_order_relaxed);
    }
  };
  if (schedule == Schedule::Dynamic) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (Index i = 0; i < count; ++i) guarded(i);
  } else {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (Index i = 0; i < count; ++i) guarded(i);
  }
  if (failure) std::rethrow_exception(failure);
#else
  (void)schedule;
  for (Index i = 0; i < count; ++i) body(i);
#endif
}

// Whether a call may spread its work over the OpenMP threads (Parallel) or must stay on the
// calling thread (Serial: it already runs inside a parallel region, e.g. one head per thread).
enum class Threads { Serial, Parallel };

// How many threads a call may use: every thread for Parallel outside a parallel region, else one.
inline int usable_threads(Threads threads) {
  return threads == Threads::Parallel && !in_parallel() ? max_threads() : 1;
}

// body(i) for i in [0, count), on usable_threads(threads) threads. Static shares.
template <class Body>
void for_each_index(Index count, Threads threads, Body body) {
  parallel_for(count, usable_threads(threads), Schedule::Static, body);
}

}  // namespace linrope::detail
