// The machine's own references, registered in every benchmark binary so that each figure can be
// read as a fraction of what this machine can do, measured in the same run:
//   machine/peak_fma   register-resident FMA loop on every thread: the fp32 arithmetic peak
//   machine/sgemm_1024 Eigen SGEMM 1024^3: what a good GEMM reaches here
//   machine/copy       memcpy of a float buffer: the bandwidth of a plain copy
#pragma once

#include <benchmark/benchmark.h>

#include <cstring>
#include <linrope/types.hpp>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace linrope::bench {

inline int threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// FLOP counter reported as GFLOP/s (per second of real time).
inline void set_flops(benchmark::State& state, double flops_per_iteration) {
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops_per_iteration * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}
inline void set_bytes(benchmark::State& state, double bytes_per_iteration) {
  state.counters["GB/s"] =
      benchmark::Counter(bytes_per_iteration * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// The widest float vector this build has, so that the peak is the machine's own (and the asm
// constraint "x" names a register that exists: a 64-byte vector fits one only with AVX-512).
#if defined(__AVX512F__)
inline constexpr int kPeakLanes = 16;
#elif defined(__AVX__)
inline constexpr int kPeakLanes = 8;
#else
inline constexpr int kPeakLanes = 4;
#endif

// 16 independent accumulators of kPeakLanes floats hide the FMA latency (4 cycles x up to 2
// pipes); 2 FLOP per lane per FMA.
inline float peak_fma_kernel(long iterations, float seed) {
  typedef float vec __attribute__((vector_size(4 * kPeakLanes)));
  constexpr int kAcc = 16;
  vec acc[kAcc];
  const vec a = {}, b = {};
  vec mul = a + 0.999999f, add = b + 1e-7f;
  for (int i = 0; i < kAcc; ++i) acc[i] = a + seed + float(i);
  for (long it = 0; it < iterations; ++it) {
    for (int i = 0; i < kAcc; ++i) acc[i] = acc[i] * mul + add;
    asm volatile("" : "+x"(mul), "+x"(add));
  }
  vec total = a;
  for (int i = 0; i < kAcc; ++i) total += acc[i];
  float s = 0;
  for (int i = 0; i < kPeakLanes; ++i) s += total[i];
  return s;
}

inline void BM_PeakFma(benchmark::State& state) {
  constexpr long kIterations = 1 << 20;
  const int n_threads = threads();
  for (auto _ : state) {
    float sink = 0;
#pragma omp parallel for reduction(+ : sink) num_threads(n_threads)
    for (int t = 0; t < n_threads; ++t) sink += peak_fma_kernel(kIterations, float(t));
    benchmark::DoNotOptimize(sink);
  }
  set_flops(state, double(kIterations) * 16 * kPeakLanes * 2 * n_threads);
  state.counters["threads"] = n_threads;
}

inline void BM_EigenSgemm1024(benchmark::State& state) {
  const Index n = 1024;
  MatrixF a = MatrixF::Random(n, n), b = MatrixF::Random(n, n), c(n, n);
  for (auto _ : state) {
    c.noalias() = a * b;
    benchmark::DoNotOptimize(c.data());
  }
  set_flops(state, 2.0 * n * n * n);
}

inline void BM_Copy(benchmark::State& state) {
  const std::size_t count = std::size_t(state.range(0));
  std::vector<float> from(count, 1.0f), to(count);
  for (auto _ : state) {
    std::memcpy(to.data(), from.data(), count * sizeof(float));
    benchmark::DoNotOptimize(to.data());
    benchmark::ClobberMemory();
  }
  set_bytes(state, 2.0 * double(count) * sizeof(float));  // read + write
}

}  // namespace linrope::bench

// Registers the machine references in a benchmark binary (once per binary).
#define LINROPE_REGISTER_MACHINE_REFERENCES()                                              \
  BENCHMARK(linrope::bench::BM_PeakFma)->Name("machine/peak_fma")->UseRealTime();          \
  BENCHMARK(linrope::bench::BM_EigenSgemm1024)->Name("machine/sgemm_1024")->UseRealTime(); \
  BENCHMARK(linrope::bench::BM_Copy)                                                       \
      ->Name("machine/copy")                                                               \
      ->Arg(1 << 20)                                                                       \
      ->Arg(1 << 24)                                                                       \
      ->UseRealTime()
