// Feature maps, float, d = 64, output width 256 (favor+: f = 256; favor-trig / favor-hyp: f = 128,
// two halves): the cost of a map beside the Eigen GEMM of exactly its shape, [n x d] * [d x f], in
// the same run. GFLOP/s counts that GEMM only (2 n d f), not the element-wise pass, so
//   map time / GEMM time = (GEMM GFLOP/s) / (map GFLOP/s).
// elu+1, relu and 1+cos have no GEMM: they report items (rows) and bytes moved (read x, write out).
#include <linrope/feature_maps.hpp>
#include <vector>

#include "bench_common.hpp"

namespace {

using namespace linrope;

constexpr Index kDim = 64;

Index projection_rows(FeatureMapKind kind) {
  switch (kind) {
    case FeatureMapKind::FavorPositive:
      return 256;
    case FeatureMapKind::FavorTrig:
    case FeatureMapKind::FavorHyperbolic:
      return 128;
    default:
      return 0;
  }
}

void BM_FeatureMap(benchmark::State& state, FeatureMapKind kind, bool stabilized) {
  const Index n = state.range(0), f = projection_rows(kind);
  FeatureMapConfig config;
  config.kind = kind;
  config.input_dim = kDim;
  config.num_features = f;
  config.seed = 42;
  const auto map = make_feature_map(config);
  const MatrixF x = MatrixF::Random(n, kDim);  // |x| ~ 4.6: ordinary attention magnitudes
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
  state.SetItemsProcessed(state.iterations() * n);
  if (f > 0)
    bench::set_flops(state, 2.0 * double(n) * double(kDim) * double(f));
  else
    bench::set_bytes(state, double(n) * double(kDim + map->output_dim()) * sizeof(float));
  state.counters["threads"] = bench::threads();
}

// The peer: the GEMM the Favor maps run, same shapes and layouts (x row-major [n x d], the scaled
// W^T row-major [d x f]), Eigen's own OpenMP parallelisation.
void BM_EigenGemm(benchmark::State& state) {
  const Index n = state.range(0), f = state.range(1);
  const MatrixF x = MatrixF::Random(n, kDim);
  const MatrixF wt = MatrixF::Random(kDim, f);
  MatrixF out(n, f);
  for (auto _ : state) {
    out.noalias() = x * wt;
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * n);
  bench::set_flops(state, 2.0 * double(n) * double(kDim) * double(f));
  state.counters["threads"] = bench::threads();
}

}  // namespace

#define LINROPE_MAP_BENCHMARK(label, kind, stabilized)                      \
  BENCHMARK_CAPTURE(BM_FeatureMap, label, FeatureMapKind::kind, stabilized) \
      ->ArgsProduct({{4096, 16384}})                                        \
      ->ArgNames({"n"})                                                     \
      ->UseRealTime()

LINROPE_MAP_BENCHMARK(favor_pos, FavorPositive, false);
LINROPE_MAP_BENCHMARK(favor_pos_stabilized, FavorPositive, true);
LINROPE_MAP_BENCHMARK(favor_trig, FavorTrig, false);
LINROPE_MAP_BENCHMARK(favor_trig_stabilized, FavorTrig, true);
LINROPE_MAP_BENCHMARK(favor_hyp, FavorHyperbolic, false);
LINROPE_MAP_BENCHMARK(favor_hyp_stabilized, FavorHyperbolic, true);
LINROPE_MAP_BENCHMARK(elu_plus_one, EluPlusOne, false);
LINROPE_MAP_BENCHMARK(relu, Relu, false);
LINROPE_MAP_BENCHMARK(one_plus_cos, OnePlusCosine, false);
BENCHMARK(BM_EigenGemm)
    ->ArgsProduct({{4096, 16384}, {128, 256}})
    ->ArgNames({"n", "f"})
    ->UseRealTime();

LINROPE_REGISTER_MACHINE_REFERENCES();

BENCHMARK_MAIN();
