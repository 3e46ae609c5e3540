// Feature maps, float, over n, the input width d = 32, 64, 128 and (FAVOR maps) the projection
// count f = 128, 256 (favor+: m = f; favor-trig / favor-hyp: m = 2f, two halves): the cost of a
// map beside the Eigen GEMM of exactly its shape, [n x d] * [d x f], in the same run. GFLOP/s
// counts that GEMM only (2 n d f), not the element-wise pass, so
//   map time / GEMM time = (GEMM GFLOP/s) / (map GFLOP/s).
// elu+1, relu and 1+cos have no GEMM: they report items (rows) and bytes moved (read x, write out).
// Names: BM_FeatureMap/<map>/n:<n>/d:<d>/f:<f> (<map> such as favor_pos or relu; f:0 for the
// element-wise maps), BM_FeatureMapBackward/<map>/n:<n>/d:<d>/f:<f> (FeatureMap::backward, which
// maps x again and then does one more GEMM, [n x f] * [f x d], for the Favor maps: compare with
// the forward of the same name), BM_EigenGemm/n:<n>/d:<d>/f:<f>.
#include <cstdint>
#include <linrope/feature_maps.hpp>
#include <memory>
#include <vector>

#include "bench_common.hpp"

namespace {

using namespace linrope;

const std::vector<std::int64_t> kRows = {4096, 16384}, kDims = {32, 64, 128},
                                kProjections = {128, 256};

// The map of the benchmark's shape (n, d, f from its arguments).
std::unique_ptr<FeatureMap> map_of(const benchmark::State& state, FeatureMapKind kind) {
  FeatureMapConfig config;
  config.kind = kind;
  config.input_dim = state.range(1);
  config.num_features = state.range(2);
  config.seed = 42;
  return make_feature_map(config);
}

// Items (rows), and the FLOP model (the GEMM, 2 n d f) or, for maps without one, bytes.
void report(benchmark::State& state, const FeatureMap& map) {
  const Index n = state.range(0), d = state.range(1), f = state.range(2);
  state.SetItemsProcessed(state.iterations() * n);
  if (f > 0)
    bench::set_flops(state, 2.0 * double(n) * double(d) * double(f));
  else
    bench::set_bytes(state, double(n) * double(d + map.output_dim()) * sizeof(float));
  state.counters["threads"] = bench::threads();
}

void BM_FeatureMap(benchmark::State& state, FeatureMapKind kind, bool stabilized) {
  const auto map = map_of(state, kind);
  const Index n = state.range(0);
  // |x| ~ 0.58 sqrt(d): ordinary attention magnitudes.
  const MatrixF x = MatrixF::Random(n, map->input_dim());
  MatrixF out(n, map->output_dim());
  std::vector<double> log_scale(static_cast<std::size_t>(n));
  for (auto _ : state) {
    if (stabilized)
      map->apply_stabilized(x, out, log_scale);
    else
      map->apply(x, out);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  report(state, *map);
}

// dx = J^T d_out over the same shapes (d_out ~ U(-1, 1)); the same FLOP and byte model as the
// forward, so that the two GFLOP/s figures compare the times directly.
void BM_FeatureMapBackward(benchmark::State& state, FeatureMapKind kind) {
  const auto map = map_of(state, kind);
  const Index n = state.range(0);
  const MatrixF x = MatrixF::Random(n, map->input_dim());
  const MatrixF d_out = MatrixF::Random(n, map->output_dim());
  MatrixF dx(n, map->input_dim());
  for (auto _ : state) {
    map->backward(x, d_out, dx);
    benchmark::DoNotOptimize(dx.data());
    benchmark::ClobberMemory();
  }
  report(state, *map);
}

// The peer: the GEMM the Favor maps run, same shapes and layouts (x row-major [n x d], the scaled
// W^T row-major [d x f]), Eigen's own OpenMP parallelisation.
void BM_EigenGemm(benchmark::State& state) {
  const Index n = state.range(0), d = state.range(1), f = state.range(2);
  const MatrixF x = MatrixF::Random(n, d);
  const MatrixF wt = MatrixF::Random(d, f);
  MatrixF out(n, f);
  for (auto _ : state) {
    out.noalias() = x * wt;
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * n);
  bench::set_flops(state, 2.0 * double(n) * double(d) * double(f));
  state.counters["threads"] = bench::threads();
}

}  // namespace

#define LINROPE_MAP_BENCHMARK(label, kind, stabilized, projections)         \
  BENCHMARK_CAPTURE(BM_FeatureMap, label, FeatureMapKind::kind, stabilized) \
      ->ArgsProduct({kRows, kDims, projections})                            \
      ->ArgNames({"n", "d", "f"})                                           \
      ->UseRealTime()

LINROPE_MAP_BENCHMARK(favor_pos, FavorPositive, false, kProjections);
LINROPE_MAP_BENCHMARK(favor_pos_stabilized, FavorPositive, true, kProjections);
LINROPE_MAP_BENCHMARK(favor_trig, FavorTrig, false, kProjections);
LINROPE_MAP_BENCHMARK(favor_trig_stabilized, FavorTrig, true, kProjections);
LINROPE_MAP_BENCHMARK(favor_hyp, FavorHyperbolic, false, kProjections);
LINROPE_MAP_BENCHMARK(favor_hyp_stabilized, FavorHyperbolic, true, kProjections);
LINROPE_MAP_BENCHMARK(elu_plus_one, EluPlusOne, false, {0});
LINROPE_MAP_BENCHMARK(relu, Relu, false, {0});
LINROPE_MAP_BENCHMARK(one_plus_cos, OnePlusCosine, false, {0});

#define LINROPE_MAP_BACKWARD_BENCHMARK(label, kind, projections)        \
  BENCHMARK_CAPTURE(BM_FeatureMapBackward, label, FeatureMapKind::kind) \
      ->ArgsProduct({kRows, kDims, projections})                        \
      ->ArgNames({"n", "d", "f"})                                       \
      ->UseRealTime()

LINROPE_MAP_BACKWARD_BENCHMARK(favor_pos, FavorPositive, kProjections);
LINROPE_MAP_BACKWARD_BENCHMARK(favor_trig, FavorTrig, kProjections);
LINROPE_MAP_BACKWARD_BENCHMARK(favor_hyp, FavorHyperbolic, kProjections);
LINROPE_MAP_BACKWARD_BENCHMARK(elu_plus_one, EluPlusOne, {0});
LINROPE_MAP_BACKWARD_BENCHMARK(relu, Relu, {0});
LINROPE_MAP_BACKWARD_BENCHMARK(one_plus_cos, OnePlusCosine, {0});
BENCHMARK(BM_EigenGemm)
    ->ArgsProduct({kRows, kDims, kProjections})
    ->ArgNames({"n", "d", "f"})
    ->UseRealTime();

LINROPE_REGISTER_MACHINE_REFERENCES();

BENCHMARK_MAIN();
