// Private: OpenMP queries that also compile without OpenMP.
#pragma once

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

}  // namespace linrope::detail
