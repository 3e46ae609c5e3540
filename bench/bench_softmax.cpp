// Exact softmax attention, float: the streaming online-softmax kernel against the naive form that
// materialises the full n x n score matrix, and its backward beside it (one head, and 8 heads
// through the batched API: backward time / forward time is the figure to read), beside the
// machine references (peak FMA, Eigen SGEMM 1024^3) measured in the same run.
// FLOPs: 4 n n_k d (Q K^T and P V, 2 n n_k d each) non-causal, half of that causal (the useful
// work; the naive form computes the whole square either way). The backward counts
// FlashAttention-2's useful work, 2.5x the forward's (five products: S, dP, dV, dQ, dK), which is
// also what it computes (S and dP once, kept in a strip per block of queries). items = query
// tokens.
#include <cmath>
#include <cstdlib>
#include <linrope/attention.hpp>
#include <linrope/batched.hpp>
#include <vector>

#include "bench_common.hpp"
#include "reference/softmax_reference.hpp"

namespace {

using linrope::Index;
using linrope::MatrixF;

MatrixF random_matrix(Index rows, Index cols, unsigned seed) {
  std::srand(seed);
  return MatrixF::Random(rows, cols);
}

double attention_flops(Index n, Index n_k, Index d, Index d_v, bool causal) {
  const double flops = 2.0 * double(n) * double(n_k) * double(d + d_v);
  return causal ? flops / 2 : flops;
}

void BM_Naive(benchmark::State& state) {
  const Index n = state.range(0), d = state.range(1);
  const bool causal = state.range(2) != 0;
  const MatrixF q = random_matrix(n, d, 1), k = random_matrix(n, d, 2), v = random_matrix(n, d, 3);
  MatrixF s(n, n), out(n, d);
  for (auto _ : state) {
    // The reference's textbook form: S = Q K^T [n x n], mask, row-wise softmax, S V; O(n^2)
    // memory. Eigen threads the products, the rows run in parallel.
    linrope::reference::textbook_softmax_attention<float>(q, k, v, 1 / std::sqrt(double(d)), causal,
                                                          0, 0, s, out);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations() * n);
  linrope::bench::set_flops(state, attention_flops(n, n, d, d, causal));
  state.counters["threads"] = linrope::bench::threads();
}

void BM_Streaming(benchmark::State& state) {
  const Index n = state.range(0), d = state.range(1);
  const bool causal = state.range(2) != 0;
  const Index block_size = state.range(3);
  const MatrixF q = random_matrix(n, d, 1), k = random_matrix(n, d, 2), v = random_matrix(n, d, 3);
  const linrope::SoftmaxOptions options{.causal = causal, .block_size = block_size};
  for (auto _ : state) {
    MatrixF out = linrope::softmax_attention(q, k, v, options);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations() * n);
  linrope::bench::set_flops(state, attention_flops(n, n, d, d, causal));
  state.counters["threads"] = linrope::bench::threads();
}

// FlashAttention-2's count of the backward's useful work: five products where the forward has two.
double backward_flops(Index n, Index n_k, Index d, Index d_v, bool causal) {
  return 2.5 * attention_flops(n, n_k, d, d_v, causal);
}

void BM_Backward(benchmark::State& state) {
  const Index n = state.range(0), d = state.range(1);
  const bool causal = state.range(2) != 0;
  const Index block_size = state.range(3);
  const MatrixF q = random_matrix(n, d, 1), k = random_matrix(n, d, 2), v = random_matrix(n, d, 3),
                d_out = random_matrix(n, d, 4);
  const linrope::SoftmaxOptions options{.causal = causal, .block_size = block_size};
  for (auto _ : state) {
    auto g = linrope::softmax_attention_backward(q, k, v, d_out, options);
    benchmark::DoNotOptimize(g.dq.data());
  }
  state.SetItemsProcessed(state.iterations() * n);
  linrope::bench::set_flops(state, backward_flops(n, n, d, d, causal));
  state.counters["threads"] = linrope::bench::threads();
}

// 8 heads of [n x 64] through the batched API (one head per thread), forward or backward.
constexpr Index kHeads = 8;
void BM_Batched(benchmark::State& state, bool backward) {
  const Index n = state.range(0), d = state.range(1);
  const bool causal = state.range(2) != 0;
  const MatrixF q = random_matrix(kHeads * n, d, 1), k = random_matrix(kHeads * n, d, 2),
                v = random_matrix(kHeads * n, d, 3), d_out = random_matrix(kHeads * n, d, 4);
  MatrixF out(kHeads * n, d), dq(kHeads * n, d), dk(kHeads * n, d), dv(kHeads * n, d);
  const auto in = [&](const MatrixF& m) {
    return linrope::Heads<const float>{m.data(), 1, kHeads, n, d};
  };
  const auto to = [&](MatrixF& m) { return linrope::Heads<float>{m.data(), 1, kHeads, n, d}; };
  const linrope::SoftmaxOptions options{.causal = causal};
  for (auto _ : state) {
    if (backward)
      linrope::softmax_attention_backward(in(q), in(k), in(v), in(d_out), to(dq), to(dk), to(dv),
                                          options);
    else
      linrope::softmax_attention(in(q), in(k), in(v), to(out), options);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * kHeads * n);
  const double flops = kHeads * (backward ? backward_flops(n, n, d, d, causal)
                                          : attention_flops(n, n, d, d, causal));
  linrope::bench::set_flops(state, flops);
  state.counters["threads"] = linrope::bench::threads();
}

// Decoding: a few new queries against a long key cache (causal, the last query sees every key).
void BM_Decode(benchmark::State& state) {
  const Index n = state.range(0), n_k = state.range(1), d = 64;
  const MatrixF q = random_matrix(n, d, 1), k = random_matrix(n_k, d, 2),
                v = random_matrix(n_k, d, 3);
  const linrope::SoftmaxOptions options{.causal = true, .q_offset = n_k - n};
  for (auto _ : state) {
    MatrixF out = linrope::softmax_attention(q, k, v, options);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations() * n);
  linrope::bench::set_flops(state, 4.0 * double(n) * double(n_k) * double(d));
}

}  // namespace

BENCHMARK(BM_Naive)
    ->Name("softmax/naive")
    ->ArgsProduct({{1024, 4096}, {64, 128}, {0, 1}})
    ->ArgNames({"n", "d", "causal"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_Streaming)
    ->Name("softmax/streaming")
    ->ArgsProduct({{1024, 4096, 16384}, {64, 128}, {0, 1}, {0}})
    ->ArgNames({"n", "d", "causal", "block"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_Backward)
    ->Name("softmax/backward")
    ->ArgsProduct({{1024, 4096, 16384}, {64, 128}, {0, 1}, {0}})
    ->ArgNames({"n", "d", "causal", "block"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_Batched, forward, false)
    ->Name("softmax/batched_h8")
    ->ArgsProduct({{1024, 4096}, {64}, {0, 1}})
    ->ArgNames({"n", "d", "causal"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_Batched, backward, true)
    ->Name("softmax/batched_h8_backward")
    ->ArgsProduct({{1024, 4096}, {64}, {0, 1}})
    ->ArgNames({"n", "d", "causal"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
// Key block sizes around the default (0 = 256), for tuning.
BENCHMARK(BM_Streaming)
    ->Name("softmax/streaming_block")
    ->ArgsProduct({{4096}, {64}, {0}, {64, 128, 512}})
    ->ArgNames({"n", "d", "causal", "block"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_Decode)
    ->Name("softmax/decode")
    ->ArgsProduct({{1, 16}, {16384}})
    ->ArgNames({"n", "n_k"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
LINROPE_REGISTER_MACHINE_REFERENCES();
BENCHMARK_MAIN();
