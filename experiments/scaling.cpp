// Experiment 1, scaling: time and peak memory against sequence length for exact softmax (naive
// n x n, and the library's streaming kernel) and linear attention (elu+1, FAVOR+; every RoPE
// placement; causal and not), multi-head through the batched [1, H, n, d] entry points.
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iostream>
#include <linrope/linrope.hpp>

#include "experiment.hpp"
#include "inputs.hpp"
#include "memory.hpp"
#include "metadata.hpp"
#include "reference/softmax_reference.hpp"
#include "stats.hpp"
#include "sweep.hpp"

namespace linrope::experiments {

namespace {

constexpr RopePlacement kPlacements[] = {RopePlacement::None, RopePlacement::BeforeMap,
                                         RopePlacement::NumeratorOnly, RopePlacement::Full};

struct Point {
  std::string method;     // softmax_naive | softmax_streaming | linear
  std::string map;        // "none" for softmax, else the feature map
  std::string placement;  // "rope" for softmax (RoPE of width d on q, k), else the placement
  bool causal;
  std::string causal_method;  // causal linear: "scan" or "chunked"; otherwise "none"
  Index heads, n, d, m;       // m: feature dimension (d for softmax)
};

Row key_row(const Point& p) {
  Row row;
  row.set("method", p.method).set("map", p.map).set("placement", p.placement);
  row.set("causal", p.causal)
      .set("causal_method", p.causal_method)
      .set("heads", p.heads)
      .set("n", p.n)
      .set("d", p.d)
      .set("m", p.m);
  return row;
}

std::string label(const Point& p) {
  std::string text = p.method + " ";
  if (p.method == "linear") text += p.map + " " + p.placement + " ";
  if (p.causal) text += p.causal_method == "none" ? "causal " : "causal (" + p.causal_method + ") ";
  return text + "H=" + std::to_string(p.heads) + " n=" + std::to_string(p.n);
}

// Rough FLOPs, for the progress estimate only.
double work_of(const Point& p, Index reps) {
  const double h = double(p.heads), n = double(p.n), d = double(p.d), m = double(p.m);
  double flops;
  if (p.method == "linear")
    flops = h * n * (6 * m * d + (p.causal ? 128 * m : 0));
  else
    flops = h * n * n * d * 4 * (p.causal ? 0.5 : 1.0) * (p.method == "softmax_naive" ? 1.5 : 1.0);
  return flops * double(reps) + 1e6;
}

double mib(double bytes) { return bytes / (1024.0 * 1024.0); }

// The softmax_naive baseline: the reference's textbook softmax in float, with an explicit n x n
// score matrix per head (the library never builds one), multi-head and with RoPE (width d, by the
// library's Rope: the baseline is the algorithm with an O(n^2) matrix, not a slow rotation).
//   q [B,H,n,d], k [B,H,n_k,d], v [B,H,n_k,d_v] -> out [B,H,n,d_v]; scale 1/sqrt(d)
// Parallel over heads, one head per thread at a time, each with its own n x n_k float matrix:
// 4 n n_k bytes per thread (256 MiB at n = 8192). One parallel region per call: on a loaded
// machine finer-grained parallelism (Eigen's threaded GEMM, a parallel loop per head) waited on
// descheduled threads and ran 20-50x slower than one thread (measured at n = 512, load 5 on 2
// cores).
void naive_softmax_attention(Heads<const float> q, Heads<const float> k, Heads<const float> v,
                             Heads<float> out, bool causal, const Rope& rope) {
  using ConstMap = Eigen::Map<const MatrixF>;
  const Index n = q.n, n_k = k.n, d = q.d, d_v = v.d, slices = q.batch * q.heads;
  const double scale = 1.0 / std::sqrt(double(d));
#ifdef _OPENMP
#pragma omp parallel
#endif
  {
    MatrixF scores(n, n_k), qr(n, d), kr(n_k, d);
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
    for (Index slice = 0; slice < slices; ++slice) {
      qr = ConstMap(q.data + slice * n * d, n, d);
      kr = ConstMap(k.data + slice * n_k * d, n_k, d);
      rope.apply(qr, 0);
      rope.apply(kr, 0);
      reference::textbook_softmax_attention<float>(
          qr, kr, ConstMap(v.data + slice * n_k * d_v, n_k, d_v), scale, causal, 0, 0, scores,
          Eigen::Map<MatrixF>(out.data + slice * n * d_v, n, d_v));
    }
  }
}

// Inputs of one (heads, n): q, k, v and an output buffer, all touched so that they are resident
// before the peak-memory reset.
struct Buffers {
  std::vector<float> q, k, v, out;
  Index heads = 0, n = 0, d = 0;
};

void prepare(Buffers& b, Index heads, Index n, Index d, std::uint64_t seed) {
  if (b.heads == heads && b.n == n && b.d == d) return;
  const std::size_t count = std::size_t(heads * n * d);
  b = Buffers{};  // free the previous length first
  b.q.resize(count);
  b.k.resize(count);
  b.v.resize(count);
  b.out.assign(count, 0.0f);
  fill_uniform(b.q.data(), count, seed * 4 + 1);
  fill_uniform(b.k.data(), count, seed * 4 + 2);
  fill_uniform(b.v.data(), count, seed * 4 + 3);
  b.heads = heads;
  b.n = n;
  b.d = d;
}

struct Measurement {
  std::vector<double> times_ms;
  double peak_mib = NAN, before_mib = NAN;
};

template <class F>
Measurement measure(F&& run, Index reps, bool memory) {
  Measurement result;
  for (Index r = 0; r < reps; ++r) {
    const bool first = r == 0;
    if (first && memory) {
      malloc_trim(0);  // return freed heap pages (every arena) before taking the baseline
      // The baseline before the reset: the reset sets the high-water mark to the resident size
      // then, which is at least the baseline (reading /proc only adds pages), and VmHWM never
      // reads below it. Read after the reset, the baseline could exceed the mark by the pages
      // the read itself touched: peak 71.32 against before 71.37 MiB, seen under ASan.
      result.before_mib = current_rss_mib();
      reset_peak_rss();
    }
    const auto start = std::chrono::steady_clock::now();
    run();
    const auto stop = std::chrono::steady_clock::now();
    if (first && memory) result.peak_mib = peak_rss_mib();
    result.times_ms.push_back(std::chrono::duration<double, std::milli>(stop - start).count());
  }
  return result;
}

}  // namespace

Outcome run_scaling(Context& context) {
  const Options& o = context.options;
  const Index H = o.scaling.heads, d = o.scaling.dim, mf = o.scaling.features;
  // Large blocks always from mmap (a fixed threshold also turns off glibc's dynamic one), so that
  // freed buffers leave the resident set at once and do not hide the next point's allocations.
  mallopt(M_MMAP_THRESHOLD, 256 * 1024);
  const bool memory = hwm_reset_works();
  if (!memory)
    std::cerr << "linrope-experiments: warning: this kernel cannot reset the peak-RSS mark "
                 "(/proc/self/clear_refs); memory columns will be nan\n";

  std::vector<Index> lengths = o.scaling.lengths;
  std::sort(lengths.begin(), lengths.end());
  lengths.erase(std::unique(lengths.begin(), lengths.end()), lengths.end());

  std::vector<Point> points;
  auto add_linear = [&](Index heads, Index n) {
    for (const char* map : {"elu+1", "favor+"})
      for (const RopePlacement placement : kPlacements)
        for (const bool causal : {false, true})
          for (const std::string& method :
               causal ? o.scaling.causal_methods : std::vector<std::string>{"none"})
            points.push_back({"linear", map, to_string(placement), causal, method, heads, n, d,
                              std::string(map) == "favor+" ? mf : d});
  };
  for (const Index n : lengths) {
    for (const bool causal : {false, true}) {
      if (n <= o.scaling.naive_max)
        points.push_back({"softmax_naive", "none", "rope", causal, "none", H, n, d, d});
      if (n <= o.scaling.softmax_max)
        points.push_back({"softmax_streaming", "none", "rope", causal, "none", H, n, d, d});
    }
    add_linear(H, n);
  }
  if (o.scaling.one_head_n > 0) add_linear(1, o.scaling.one_head_n);

  double total_work = 0;
  for (const auto& p : points) total_work += work_of(p, o.scaling.reps);
  Sweep sweep(context, "scaling",
              {"method", "map", "placement", "causal", "causal_method", "heads", "n", "d", "m",
               "reps", "time_ms", "time_min_ms", "time_max_ms", "peak_rss_mib", "rss_before_mib",
               "extra_mib", "io_mib", "threads"},
              9, points.size(), total_work);

  // One feature map and rope per width, shared by all lengths (seeded: the same W every run).
  const auto elu = make_feature_map({.kind = FeatureMapKind::EluPlusOne, .input_dim = d});
  const auto favor = make_feature_map({.kind = FeatureMapKind::FavorPositive,
                                       .input_dim = d,
                                       .num_features = mf,
                                       .orthogonal = true,
                                       .seed = o.seed});
  const Rope rope_d(RopeConfig{.dim = d});
  const Rope rope_m(RopeConfig{.dim = mf});

  const double load_start = load_average();
  Buffers buffers;
  std::vector<std::string> skipped;
  const double available = available_memory_mib();
  for (const auto& p : points) {
    const double work = work_of(p, o.scaling.reps);
    if (!sweep.begin(key_row(p), label(p), work)) continue;
    const double io = mib(4.0 * double(p.heads * p.n * p.d) * sizeof(float));
    const double scores =
        p.method == "softmax_naive" ? mib(4.0 * double(p.n) * double(p.n)) * max_threads() : 0;
    const double features = p.method == "linear" ? mib(8.0 * double(p.n * p.m) * sizeof(float)) : 0;
    if (std::isfinite(available) && io + scores + features > 0.8 * available) {
      skipped.push_back(label(p));
      std::cerr << "linrope-experiments: skipping " << label(p) << ": needs about "
                << std::lround(io + scores + features) << " MiB, " << std::lround(available)
                << " MiB available\n";
      continue;
    }
    prepare(buffers, p.heads, p.n, p.d, o.seed);
    const Heads<const float> q{buffers.q.data(), 1, p.heads, p.n, p.d};
    const Heads<const float> k{buffers.k.data(), 1, p.heads, p.n, p.d};
    const Heads<const float> v{buffers.v.data(), 1, p.heads, p.n, p.d};
    const Heads<float> out{buffers.out.data(), 1, p.heads, p.n, p.d};
    Measurement result;
    if (p.method == "softmax_naive") {
      result = measure([&] { naive_softmax_attention(q, k, v, out, p.causal, rope_d); },
                       o.scaling.reps, memory);
    } else if (p.method == "softmax_streaming") {
      const SoftmaxOptions options{.causal = p.causal, .rope = &rope_d};
      result = measure([&] { softmax_attention(q, k, v, out, options); }, o.scaling.reps, memory);
    } else {
      const RopePlacement placement = rope_placement_from_string(p.placement);
      const FeatureMap& map = p.map == "favor+" ? *favor : *elu;
      const Rope* rope = placement == RopePlacement::None        ? nullptr
                         : placement == RopePlacement::BeforeMap ? &rope_d
                         : p.map == "favor+"                     ? &rope_m
                                                                 : &rope_d;
      const LinearOptions options{
          .causal = p.causal,
          .placement = placement,
          .rope = rope,
          .method = p.causal ? causal_method_from_string(p.causal_method) : CausalMethod::Scan};
      result =
          measure([&] { linear_attention(q, k, v, out, map, options); }, o.scaling.reps, memory);
    }
    Row row = key_row(p);
    row.set("reps", o.scaling.reps)
        .set("time_ms", median(result.times_ms))
        .set("time_min_ms", minimum(result.times_ms))
        .set("time_max_ms", maximum(result.times_ms))
        .set("peak_rss_mib", result.peak_mib)
        .set("rss_before_mib", result.before_mib)
        .set("extra_mib", result.peak_mib - result.before_mib)
        .set("io_mib", io)
        .set("threads", Index(max_threads()));
    sweep.record(row, work);
  }
  sweep.finish();

  Outcome outcome;
  outcome.seeds = {o.seed};
  outcome.run = {
      {"memory_measured", memory},
      {"memory_method", memory ? "clear_refs + VmHWM (per point, in process)" : "unavailable"},
      {"skipped_points", skipped},
      {"load_average_start", load_start},
      {"load_average_end", load_average()}};
  return outcome;
}

}  // namespace linrope::experiments
