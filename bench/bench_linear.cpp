// Linear attention through the public batched API, float32, beside exact softmax attention (same
// API family, same sizes) and the machine references, all measured in one run.
//
// Shapes: q, k, v [B = 1, H = 8, n, d = 64] (PyTorch's layout; d = 32 and 128 in the d:<d>
// family), d_v = d. Feature maps: favor+ (FavorPositive, f = 256 orthogonal random features,
// m = 256; 64-192 in the m:<m> family) and elu+1 (m = d). RoPE width:
// d for before_map, m for numerator_only and full (none has no rope).
//
// Names ("favor" and "elu" rather than "favor+" and "elu+1", so that --benchmark_filter needs no
// regex escapes):
//   linear/<map>/<placement>/<noncausal|chunked|scan>/n:<n>  batched linear_attention
//   linear/favor/numerator_only/<chunked|scan>/m:<m>/n:<n>  the same with f = m = 64, 128, 192
//   linear/<map>/numerator_only/<noncausal|chunked|scan>/d:<d>/n:<n>  head width d = d_v = 32, 128
//   linear_backward/<map>/<placement>/<noncausal|causal>/n:<n>  batched linear_attention_backward
//                                       (dq, dk, dv from d_out; the causal backward has one form)
//   linear_saving/<map>/<numerator_only|full>/<noncausal|causal>/n:<n>  the forward keeping its
//                                       features (LinearSaved; causal: the scan; saved_MiB)
//   linear_backward_saved/<map>/<numerator_only|full>/<noncausal|causal>/n:<n>  the backward
//                                       reading them (the saving forward run once, untimed)
//   linear_stream/<map>/<placement>     LinearAttentionStream<float>, 1 head, 1 token per step
//   linear_decay/<map>/<none|0.97|retnet>/<scan|backward>/n:<n>  eq. 19, causal, forward (the
//                                       scan) and backward without a decay, with g = 0.97 on every
//                                       head and with RetNet's g_h = 1 - 2^(-5-h): the decay's
//                                       cost is each one's time over none's
//   softmax/<noncausal|causal>/n:<n>    batched softmax_attention
//   softmax_backward/<noncausal|causal>/n:<n>  batched softmax_attention_backward (no FLOP
//                                       model either: read it against the forward)
//   machine/peak_fma, machine/sgemm_1024, machine/copy   what this machine can do
//
// FLOP model (per (batch, head) slice, times B * H; n = n_k here). exp, elu, the RoPE rotations,
// the row norms of FAVOR+ and the key sums z += psi_j (n_k m additions) are not counted:
//   feature GEMMs   2 n d f (q) + 2 n_k d f (k)    f = 256 for favor+; 0 for elu+1 (no GEMM)
//   state           2 n_k m d_v                    S = sum_j psi_j v_j^T
//   read-out        2 n m d_v                      phi_i S
//   denominators    2 n m                          phi_i . z
//   causal chunked  + 2 n C m + 2 n C d_v          scores and their product with V inside each
//                                                  chunk, the masked C x C blocks counted whole
//                                                  (C = chunk_size = 64); the scan has no such term
//   softmax          2 n n_k (d + d_v), halved when causal (the useful work)
//   stream           the linear model per token with n = n_k = 1, one head
// fraction_of_peak (GFLOP/s / machine/peak_fma) is computed offline by bench/compare_pytorch.py.
// items = tokens: B * n per call (each token through every head), 1 per stream step.
#include <cmath>
#include <linrope/attention.hpp>
#include <linrope/batched.hpp>
#include <linrope/feature_maps.hpp>
#include <linrope/rope.hpp>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "bench_common.hpp"

namespace {

using linrope::FeatureMapKind;
using linrope::Index;
using linrope::MatrixF;
using linrope::RopePlacement;

constexpr Index kBatch = 1, kHeads = 8, kDim = 64, kFavorFeatures = 256, kChunk = 64;

enum class Mode { NonCausal, Chunked, Scan };

const char* mode_name(Mode mode) {
  switch (mode) {
    case Mode::NonCausal:
      return "noncausal";
    case Mode::Chunked:
      return "chunked";
    case Mode::Scan:
      return "scan";
  }
  return "?";
}

const char* map_name(FeatureMapKind kind) {
  return kind == FeatureMapKind::FavorPositive ? "favor" : "elu";
}

// N(0, 1) entries: the scale of q and k after a LayerNorm-ed projection. The timings do not depend
// on the values (every path computes the same exp and GEMMs), so any fixed seed will do.
std::vector<float> gaussian_buffer(Index count, unsigned seed) {
  std::mt19937 engine(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(count));
  for (float& value : x) value = normal(engine);
  return x;
}

// features: FAVOR+'s f (0 for elu+1, which has none).
std::unique_ptr<linrope::FeatureMap> make_map(FeatureMapKind kind, Index features, Index d = kDim) {
  return linrope::make_feature_map(
      {.kind = kind, .input_dim = d, .num_features = features, .orthogonal = true, .seed = 7});
}

Index default_features(FeatureMapKind kind) {
  return kind == FeatureMapKind::FavorPositive ? kFavorFeatures : 0;
}

// The rope each placement needs: width d before the map, width m on the features.
std::optional<linrope::Rope> make_rope(RopePlacement placement, Index m, Index d = kDim) {
  if (placement == RopePlacement::None) return std::nullopt;
  return linrope::Rope({.dim = placement == RopePlacement::BeforeMap ? d : m});
}

// What decays a benchmark's heads: nothing, g = 0.97 on every head, or RetNet's per-head
// g_h = 1 - 2^(-5-h) (0.969 .. 0.99976 for 8 heads).
enum class Decay { None, Uniform, RetNet };

const char* decay_name(Decay decay) {
  constexpr const char* kNames[] = {"none", "0.97", "retnet"};
  return kNames[int(decay)];
}

// `options` with `decay`; RetNet's values live in `storage`, which must outlive the calls.
linrope::LinearOptions with_decay(linrope::LinearOptions options, Decay decay,
                                  std::vector<double>& storage) {
  if (decay == Decay::Uniform) options.decay = 0.97;
  if (decay == Decay::RetNet) {
    storage.clear();
    for (Index h = 0; h < kHeads; ++h) storage.push_back(1 - std::ldexp(1.0, -5 - int(h)));
    options.head_decays = storage;
  }
  return options;
}

// FLOPs of one (batch, head) slice, by the model in the header comment.
double linear_flops(Index n, Index n_k, Index d, Index d_v, Index f, Index m, Mode mode) {
  double flops = 2.0 * double(n + n_k) * double(d) * double(f)  // feature GEMMs
                 + 2.0 * double(n_k) * double(m) * double(d_v)  // state
                 + 2.0 * double(n) * double(m) * double(d_v)    // read-out
                 + 2.0 * double(n) * double(m);                 // denominators
  if (mode == Mode::Chunked)
    flops += 2.0 * double(n) * double(kChunk) * double(m + d_v);  // intra-chunk blocks
  return flops;
}

// Owns [B, H, n, d] buffers for q, k, v and out (d_v = d), and hands out the views.
struct Problem {
  explicit Problem(Index n, Index d = kDim)
      : n(n),
        d(d),
        q(gaussian_buffer(kBatch * kHeads * n * d, 1)),
        k(gaussian_buffer(kBatch * kHeads * n * d, 2)),
        v(gaussian_buffer(kBatch * kHeads * n * d, 3)),
        out(static_cast<std::size_t>(kBatch * kHeads * n * d)) {}
  linrope::Heads<const float> in(const std::vector<float>& x) const {
    return {.data = x.data(), .batch = kBatch, .heads = kHeads, .n = n, .d = d};
  }
  linrope::Heads<float> output() {
    return {.data = out.data(), .batch = kBatch, .heads = kHeads, .n = n, .d = d};
  }
  Index n, d;
  std::vector<float> q, k, v, out;
};

// saving: the forward that keeps its features for the backward (attention.hpp, LinearSaved).
void time_linear(benchmark::State& state, FeatureMapKind kind, Index f, RopePlacement placement,
                 Mode mode, Index n, Index d = kDim, Decay decay = Decay::None,
                 bool saving = false) {
  Problem problem(n, d);
  const auto map = make_map(kind, f, d);
  const Index m = map->output_dim();
  const std::optional<linrope::Rope> rope = make_rope(placement, m, d);
  std::vector<double> decays;
  const linrope::LinearOptions options = with_decay(
      {.causal = mode != Mode::NonCausal,
       .placement = placement,
       .rope = rope ? &*rope : nullptr,
       .method = mode == Mode::Scan ? linrope::CausalMethod::Scan : linrope::CausalMethod::Chunked,
       .chunk_size = kChunk},
      decay, decays);
  linrope::LinearSavedF saved;
  for (auto _ : state) {
    if (saving)
      linrope::linear_attention(problem.in(problem.q), problem.in(problem.k), problem.in(problem.v),
                                problem.output(), *map, options, saved);
    else
      linrope::linear_attention(problem.in(problem.q), problem.in(problem.k), problem.in(problem.v),
                                problem.output(), *map, options);
    benchmark::DoNotOptimize(problem.out.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * kBatch * n);
  linrope::bench::set_flops(state, double(kBatch * kHeads) * linear_flops(n, n, d, d, f, m, mode));
  state.counters["threads"] = linrope::bench::threads();
  if (saving) state.counters["saved_MiB"] = double(saved.bytes()) / double(1 << 20);
}

void BM_LinearSaving(benchmark::State& state, FeatureMapKind kind, RopePlacement placement,
                     Mode mode) {
  time_linear(state, kind, default_features(kind), placement, mode, state.range(0), kDim,
              Decay::None, true);
}

void BM_Linear(benchmark::State& state, FeatureMapKind kind, RopePlacement placement, Mode mode) {
  time_linear(state, kind, default_features(kind), placement, mode, state.range(0));
}

// The backward of the same problem (d_out ~ N(0, 1)). No FLOP model: compare its time with the
// forward's of the same name (bench/RESULTS.md). saved: from the features a saving forward kept
// (run once, before the timed loop; compare with linear_saving/...).
void BM_LinearBackward(benchmark::State& state, FeatureMapKind kind, RopePlacement placement,
                       bool causal, Decay decay, bool saved) {
  const Index n = state.range(0);
  Problem problem(n);
  const std::vector<float> d_out = gaussian_buffer(kBatch * kHeads * n * kDim, 4);
  std::vector<float> dq(d_out.size()), dk(d_out.size()), dv(d_out.size());
  const auto map = make_map(kind, default_features(kind));
  const std::optional<linrope::Rope> rope = make_rope(placement, map->output_dim());
  std::vector<double> decays;
  const linrope::LinearOptions options = with_decay(
      {.causal = causal, .placement = placement, .rope = rope ? &*rope : nullptr}, decay, decays);
  const auto out = [&](std::vector<float>& x) {
    return linrope::Heads<float>{
        .data = x.data(), .batch = kBatch, .heads = kHeads, .n = n, .d = kDim};
  };
  linrope::LinearSavedF kept;
  if (saved)
    linrope::linear_attention(problem.in(problem.q), problem.in(problem.k), problem.in(problem.v),
                              problem.output(), *map, options, kept);
  for (auto _ : state) {
    if (saved)
      linrope::linear_attention_backward(problem.in(problem.q), problem.in(problem.k),
                                         problem.in(problem.v), problem.in(d_out), out(dq), out(dk),
                                         out(dv), *map, options, kept);
    else
      linrope::linear_attention_backward(problem.in(problem.q), problem.in(problem.k),
                                         problem.in(problem.v), problem.in(d_out), out(dq), out(dk),
                                         out(dv), *map, options);
    benchmark::DoNotOptimize(dq.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * kBatch * n);
  state.counters["threads"] = linrope::bench::threads();
}

// FAVOR+ eq. 19, causal, with f = m features other than 256: where it overtakes causal softmax
// as m varies. The scan does 8 m d FLOPs a token (d = d_v = 64), softmax 2 n d at the same
// rate it would cross at n = 4 m; the chunked form adds its masked blocks (RESULTS.md's count of
// the useful FLOPs puts it near n = 4.75 m + 48; this file's model, whole blocks, near 5 m + 64).
void BM_FavorFeatures(benchmark::State& state, Mode mode) {
  time_linear(state, FeatureMapKind::FavorPositive, state.range(0), RopePlacement::NumeratorOnly,
              mode, state.range(1));
}

// Eq. 19, causal, the scan, with a decay (or none, the baseline of the same family).
void BM_DecayForward(benchmark::State& state, FeatureMapKind kind, Decay decay) {
  time_linear(state, kind, default_features(kind), RopePlacement::NumeratorOnly, Mode::Scan,
              state.range(0), kDim, decay);
}

// Eq. 19 at head widths d = d_v other than 64 (elu+1: m = d; FAVOR+: m = 256).
void BM_HeadWidth(benchmark::State& state, FeatureMapKind kind, Mode mode) {
  time_linear(state, kind, default_features(kind), RopePlacement::NumeratorOnly, mode,
              state.range(1), state.range(0));
}

void BM_Softmax(benchmark::State& state, bool causal) {
  const Index n = state.range(0);
  Problem problem(n);
  const linrope::SoftmaxOptions options{.causal = causal};
  for (auto _ : state) {
    linrope::softmax_attention(problem.in(problem.q), problem.in(problem.k), problem.in(problem.v),
                               problem.output(), options);
    benchmark::DoNotOptimize(problem.out.data());
    benchmark::ClobberMemory();
  }
  const double per_head = 2.0 * double(n) * double(n) * double(2 * kDim);
  state.SetItemsProcessed(state.iterations() * kBatch * n);
  linrope::bench::set_flops(state, double(kBatch * kHeads) * (causal ? per_head / 2 : per_head));
  state.counters["threads"] = linrope::bench::threads();
}

// The backward of BM_Softmax's problem (d_out ~ N(0, 1)), here beside the linear backward so that
// compare_pytorch.py takes every forward and backward time from one run. bench_softmax times it
// too (softmax/batched_h8_backward, uniform inputs, n <= 4096), with a FLOP model.
void BM_SoftmaxBackward(benchmark::State& state, bool causal) {
  const Index n = state.range(0);
  Problem problem(n);
  const std::vector<float> d_out = gaussian_buffer(kBatch * kHeads * n * kDim, 4);
  std::vector<float> dq(d_out.size()), dk(d_out.size()), dv(d_out.size());
  const auto out = [&](std::vector<float>& x) {
    return linrope::Heads<float>{
        .data = x.data(), .batch = kBatch, .heads = kHeads, .n = n, .d = kDim};
  };
  const linrope::SoftmaxOptions options{.causal = causal};
  for (auto _ : state) {
    linrope::softmax_attention_backward(problem.in(problem.q), problem.in(problem.k),
                                        problem.in(problem.v), problem.in(d_out), out(dq), out(dk),
                                        out(dv), options);
    benchmark::DoNotOptimize(dq.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * kBatch * n);
  state.counters["threads"] = linrope::bench::threads();
}

// Decoding: one head, one token per step, the state carried across steps (positions keep growing,
// which costs nothing extra: memory and work per step are O(m d_v) whatever the position).
void BM_Stream(benchmark::State& state, FeatureMapKind kind, RopePlacement placement) {
  constexpr Index kTokens = 256;  // distinct input rows, cycled
  const auto map = make_map(kind, default_features(kind));
  const Index m = map->output_dim();
  const std::optional<linrope::Rope> rope = make_rope(placement, m);
  const linrope::LinearOptions options{.placement = placement, .rope = rope ? &*rope : nullptr};
  const std::vector<float> q = gaussian_buffer(kTokens * kDim, 1),
                           k = gaussian_buffer(kTokens * kDim, 2),
                           v = gaussian_buffer(kTokens * kDim, 3);
  std::vector<MatrixF> q_rows, k_rows, v_rows;
  for (Index t = 0; t < kTokens; ++t) {
    q_rows.push_back(Eigen::Map<const MatrixF>(q.data() + t * kDim, 1, kDim));
    k_rows.push_back(Eigen::Map<const MatrixF>(k.data() + t * kDim, 1, kDim));
    v_rows.push_back(Eigen::Map<const MatrixF>(v.data() + t * kDim, 1, kDim));
  }
  linrope::LinearAttentionStream<float> stream(*map, kDim, options);
  Index t = 0;
  for (auto _ : state) {
    MatrixF out = stream.step(q_rows[t], k_rows[t], v_rows[t]);
    benchmark::DoNotOptimize(out.data());
    t = (t + 1) % kTokens;
  }
  const Index f = default_features(kind);
  state.SetItemsProcessed(state.iterations());
  linrope::bench::set_flops(state, linear_flops(1, 1, kDim, kDim, f, m, Mode::Scan));
  state.counters["position"] = double(stream.position());
}

bool register_all() {
  const FeatureMapKind maps[] = {FeatureMapKind::EluPlusOne, FeatureMapKind::FavorPositive};
  const RopePlacement placements[] = {RopePlacement::None, RopePlacement::NumeratorOnly,
                                      RopePlacement::Full, RopePlacement::BeforeMap};
  const std::vector<std::int64_t> sizes = {1024, 4096, 16384};
  for (const FeatureMapKind kind : maps)
    for (const RopePlacement placement : placements)
      for (const Mode mode : {Mode::NonCausal, Mode::Chunked, Mode::Scan}) {
        const std::string name = std::string("linear/") + map_name(kind) + "/" +
                                 linrope::to_string(placement) + "/" + mode_name(mode);
        std::vector<std::int64_t> ns = sizes;
        // On the flagship configuration (FAVOR+, eq. 19): the log-log slope of time against n
        // (2k .. 32k) is fitted on the non-causal form, and every form is timed at short n, to
        // find where it overtakes exact softmax (timed at the same short n below).
        if (kind == FeatureMapKind::FavorPositive && placement == RopePlacement::NumeratorOnly) {
          if (mode == Mode::NonCausal)
            ns = {256, 512, 1024, 2048, 4096, 8192, 16384, 32768};
          else
            ns = {256, 512, 1024, 2048, 4096, 16384};
        }
        benchmark::RegisterBenchmark(name.c_str(), BM_Linear, kind, placement, mode)
            ->ArgsProduct({ns})
            ->ArgNames({"n"})
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
      }
  for (const FeatureMapKind kind : maps)
    for (const RopePlacement placement : placements)
      for (const bool causal : {false, true}) {
        const std::string name = std::string("linear_backward/") + map_name(kind) + "/" +
                                 linrope::to_string(placement) + "/" +
                                 (causal ? "causal" : "noncausal");
        // The backward's log-log slope (2k .. 32k), on the flagship configuration.
        std::vector<std::int64_t> ns = sizes;
        if (kind == FeatureMapKind::FavorPositive && placement == RopePlacement::NumeratorOnly)
          ns = {1024, 2048, 4096, 8192, 16384, 32768};
        benchmark::RegisterBenchmark(name.c_str(), BM_LinearBackward, kind, placement, causal,
                                     Decay::None, false)
            ->ArgsProduct({ns})
            ->ArgNames({"n"})
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
      }
  // The forward that keeps its features and the backward that reads them, beside linear/ and
  // linear_backward/ of the same names.
  for (const FeatureMapKind kind : maps)
    for (const RopePlacement placement : {RopePlacement::NumeratorOnly, RopePlacement::Full})
      for (const bool causal : {false, true}) {
        const std::string tail = std::string(map_name(kind)) + "/" + linrope::to_string(placement) +
                                 "/" + (causal ? "causal" : "noncausal");
        const Mode mode = causal ? Mode::Scan : Mode::NonCausal;
        benchmark::RegisterBenchmark(("linear_saving/" + tail).c_str(), BM_LinearSaving, kind,
                                     placement, mode)
            ->ArgsProduct({{4096, 16384}})
            ->ArgNames({"n"})
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
        benchmark::RegisterBenchmark(("linear_backward_saved/" + tail).c_str(), BM_LinearBackward,
                                     kind, placement, causal, Decay::None, true)
            ->ArgsProduct({{4096, 16384}})
            ->ArgNames({"n"})
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
      }
  for (const FeatureMapKind kind : maps)
    for (const Mode mode : {Mode::NonCausal, Mode::Chunked, Mode::Scan}) {
      const std::string name =
          std::string("linear/") + map_name(kind) + "/numerator_only/" + mode_name(mode);
      benchmark::RegisterBenchmark(name.c_str(), BM_HeadWidth, kind, mode)
          ->ArgsProduct({{32, 128}, {4096}})
          ->ArgNames({"d", "n"})
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  for (const Mode mode : {Mode::Chunked, Mode::Scan})
    benchmark::RegisterBenchmark(
        (std::string("linear/favor/numerator_only/") + mode_name(mode)).c_str(), BM_FavorFeatures,
        mode)
        ->ArgsProduct({{64, 128, 192}, {256, 512, 1024, 2048}})
        ->ArgNames({"m", "n"})
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  for (const bool causal : {false, true})
    benchmark::RegisterBenchmark(causal ? "softmax/causal" : "softmax/noncausal", BM_Softmax,
                                 causal)
        ->ArgsProduct({{256, 512, 1024, 2048, 4096, 16384}})
        ->ArgNames({"n"})
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  for (const bool causal : {false, true})
    benchmark::RegisterBenchmark(causal ? "softmax_backward/causal" : "softmax_backward/noncausal",
                                 BM_SoftmaxBackward, causal)
        ->ArgsProduct({sizes})
        ->ArgNames({"n"})
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  // Run with --benchmark_enable_random_interleaving=true and repetitions, so that with and
  // without a decay alternate on a shared machine.
  for (const FeatureMapKind kind : maps)
    for (const Decay decay : {Decay::None, Decay::Uniform, Decay::RetNet})
      for (const bool backward : {false, true}) {
        const std::string name = std::string("linear_decay/") + map_name(kind) + "/" +
                                 decay_name(decay) + (backward ? "/backward" : "/scan");
        (backward ? benchmark::RegisterBenchmark(name.c_str(), BM_LinearBackward, kind,
                                                 RopePlacement::NumeratorOnly, true, decay, false)
                  : benchmark::RegisterBenchmark(name.c_str(), BM_DecayForward, kind, decay))
            ->ArgsProduct({{4096, 16384}})
            ->ArgNames({"n"})
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
      }
  for (const FeatureMapKind kind : maps)
    for (const RopePlacement placement : {RopePlacement::None, RopePlacement::NumeratorOnly}) {
      const std::string name =
          std::string("linear_stream/") + map_name(kind) + "/" + linrope::to_string(placement);
      benchmark::RegisterBenchmark(name.c_str(), BM_Stream, kind, placement)
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime();
    }
  return true;
}

// Before main: BENCHMARK_MAIN parses the flags and runs whatever has been registered by then.
const bool registered = register_all();

}  // namespace

LINROPE_REGISTER_MACHINE_REFERENCES();
BENCHMARK_MAIN();
