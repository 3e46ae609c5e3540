// RoPE apply on an [n x d] float matrix, in place, against two yardsticks measured in the same run:
//   rope/apply        Rope::apply (element-wise form, angles reduced in double), both layouts
//   rope/apply_transpose  Rope::apply_transpose (R^T, the gradient of apply), both layouts
//   rope/naive_matrix the naive form: for every row, a dense (d x d) rotation matrix R(p) is built
//                     (cos/sin of p theta_i in double, stored as float) and the row is replaced by
//                     R(p) x with Eigen's GEMV. This is what "never build the rotation matrix in a
//                     kernel" rules out; O(d^2) per row instead of O(d), so only n = 4096.
//   rope/copy         memcpy of the same n x d floats into another buffer: the bandwidth ceiling
// Every figure's GB/s counts the matrix read once and written once (2 n d 4 bytes), so the three
// are directly comparable. All single-threaded (Rope::apply has no OpenMP inside).
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstring>
#include <linrope/rope.hpp>
#include <vector>

#include "bench_common.hpp"

namespace {

using linrope::Index;
using linrope::MatrixF;

linrope::RopeLayout layout_of(const benchmark::State& state) {
  return state.range(2) == 0 ? linrope::RopeLayout::Interleaved : linrope::RopeLayout::Half;
}

// Rope::apply, or (transpose) Rope::apply_transpose: R^T, the gradient of apply, the same kernel
// turning the other way.
void BM_RopeApply(benchmark::State& state, bool transpose) {
  const Index n = state.range(0), d = state.range(1);
  const linrope::Rope rope({.dim = d, .layout = layout_of(state)});
  MatrixF x = MatrixF::Random(n, d);
  for (auto _ : state) {
    // Rotating the same buffer again and again is fine: rotations keep the values bounded.
    if (transpose)
      rope.apply_transpose(x, 0);
    else
      rope.apply(x, 0);
    benchmark::DoNotOptimize(x.data());
    benchmark::ClobberMemory();
  }
  linrope::bench::set_bytes(state, 2.0 * double(n) * double(d) * sizeof(float));
  state.SetItemsProcessed(state.iterations() * n);  // tokens/s
}

void BM_RopeNaiveMatrix(benchmark::State& state) {
  const Index n = state.range(0), d = state.range(1);
  const bool interleaved = layout_of(state) == linrope::RopeLayout::Interleaved;
  const std::vector<double> theta = linrope::Rope({.dim = d}).frequencies();
  MatrixF x = MatrixF::Random(n, d);
  Eigen::MatrixXf R(d, d);
  Eigen::VectorXf y(d);
  for (auto _ : state) {
    for (Index i = 0; i < n; ++i) {
      R.setZero();
      for (Index k = 0; k < d / 2; ++k) {
        const Index a = interleaved ? 2 * k : k, b = interleaved ? 2 * k + 1 : k + d / 2;
        const double angle = double(i) * theta[k];
        const float c = float(std::cos(angle)), s = float(std::sin(angle));
        R(a, a) = c;
        R(a, b) = -s;
        R(b, a) = s;
        R(b, b) = c;
      }
      y.noalias() = R * x.row(i).transpose();
      x.row(i) = y.transpose();
    }
    benchmark::DoNotOptimize(x.data());
    benchmark::ClobberMemory();
  }
  linrope::bench::set_bytes(state, 2.0 * double(n) * double(d) * sizeof(float));
  state.SetItemsProcessed(state.iterations() * n);
}

void BM_CopySameBytes(benchmark::State& state) {
  const Index n = state.range(0), d = state.range(1);
  const MatrixF x = MatrixF::Random(n, d);
  MatrixF y(n, d);
  for (auto _ : state) {
    std::memcpy(y.data(), x.data(), std::size_t(n * d) * sizeof(float));
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  linrope::bench::set_bytes(state, 2.0 * double(n) * double(d) * sizeof(float));
  state.SetItemsProcessed(state.iterations() * n);
}

}  // namespace

BENCHMARK_CAPTURE(BM_RopeApply, apply, false)
    ->Name("rope/apply")
    ->ArgsProduct({{4096, 16384, 65536}, {64, 128}, {0, 1}})
    ->ArgNames({"n", "d", "half"});
BENCHMARK_CAPTURE(BM_RopeApply, transpose, true)
    ->Name("rope/apply_transpose")
    ->ArgsProduct({{4096, 16384, 65536}, {64, 128}, {0, 1}})
    ->ArgNames({"n", "d", "half"});
BENCHMARK(BM_RopeNaiveMatrix)
    ->Name("rope/naive_matrix")
    ->ArgsProduct({{4096}, {64, 128}, {0, 1}})
    ->ArgNames({"n", "d", "half"});
BENCHMARK(BM_CopySameBytes)
    ->Name("rope/copy")
    ->ArgsProduct({{4096, 16384, 65536}, {64, 128}})
    ->ArgNames({"n", "d"});

LINROPE_REGISTER_MACHINE_REFERENCES();

BENCHMARK_MAIN();
