// Experiment 1, scaling: time and peak memory against sequence length for exact softmax (naive
// n x n, and the library's streaming kernel) and linear attention (elu+1, FAVOR+; every RoPE
// placement; causal and not), multi-head through the batched [1, H, n, d] entry points.
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <linrope/linrope.hpp>
#include <map>
#include <set>
#include <thread>

#include "experiment.hpp"
#include "fit.hpp"
#include "inputs.hpp"
#include "memory.hpp"
#include "metadata.hpp"
#include "naive_softmax.hpp"
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
      reset_peak_rss();
      result.before_mib = current_rss_mib();
    }
    const auto start = std::chrono::steady_clock::now();
    run();
    const auto stop = std::chrono::steady_clock::now();
    if (first && memory) result.peak_mib = peak_rss_mib();
    result.times_ms.push_back(std::chrono::duration<double, std::milli>(stop - start).count());
  }
  return result;
}

struct Curve {
  std::vector<double> n, time_ms, extra_mib;
};
// method, map, placement, causal, causal method, heads
using CurveKey = std::tuple<std::string, std::string, std::string, bool, std::string, Index>;

std::string curve_name(const CurveKey& key) {
  const auto& [method, map, placement, causal, causal_method, heads] = key;
  std::string name = method == "linear" ? "linear " + map + " " + placement : method;
  if (!causal) return name;
  return name + (causal_method == "none" ? " (causal)" : " (causal, " + causal_method + ")");
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
      result = measure([&] { naive_softmax_attention(q, k, v, out, p.causal, &rope_d); },
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
          .method = p.causal_method == "chunked" ? CausalMethod::Chunked : CausalMethod::Scan};
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
  const double load_end = load_average();

  // Curves (heads = H) from the whole table, resumed rows included.
  const CsvTable& table = sweep.table();
  std::map<CurveKey, Curve> curves;
  std::vector<std::size_t> one_head_rows;
  for (std::size_t r = 0; r < table.size(); ++r) {
    if (table.number(r, "d") != double(d)) continue;
    if (Index(table.number(r, "heads")) != H) {
      if (Index(table.number(r, "heads")) == 1) one_head_rows.push_back(r);
      continue;
    }
    Curve& c = curves[{table.text(r, "method"), table.text(r, "map"), table.text(r, "placement"),
                       table.text(r, "causal") == "1", table.text(r, "causal_method"), H}];
    c.n.push_back(table.number(r, "n"));
    c.time_ms.push_back(table.number(r, "time_ms"));
    c.extra_mib.push_back(table.number(r, "extra_mib"));
  }
  for (auto& [key, c] : curves) {  // ascending n
    std::vector<std::size_t> order(c.n.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    // Capture c.n by name: clang 14 cannot capture a structured binding (C++20, clang >= 16).
    const std::vector<double>& n = c.n;
    std::sort(order.begin(), order.end(), [&n](auto a, auto b) { return n[a] < n[b]; });
    Curve sorted;
    for (const auto i : order) {
      sorted.n.push_back(c.n[i]);
      sorted.time_ms.push_back(c.time_ms[i]);
      sorted.extra_mib.push_back(c.extra_mib[i]);
    }
    c = std::move(sorted);
  }

  Outcome outcome;
  outcome.seeds = {o.seed};
  nlohmann::json& summary = outcome.summary;
  summary["memory_method"] = memory ? "clear_refs + VmHWM (per point, in process)" : "unavailable";
  summary["fit_min_n"] = o.scaling.fit_min_n;
  summary["skipped_points"] = skipped;
  summary["load_average_start"] = load_start;
  summary["load_average_end"] = load_end;
  nlohmann::json fits = nlohmann::json::array();
  std::map<CurveKey, LogLogFit> fit_of;
  for (const auto& [key, c] : curves) {
    const LogLogFit fit = fit_loglog(c.n, c.time_ms, o.scaling.fit_min_n);
    fit_of[key] = fit;
    const auto& [method, map, placement, causal, causal_method, heads] = key;
    fits.push_back({{"method", method},
                    {"map", map},
                    {"placement", placement},
                    {"causal", causal},
                    {"causal_method", causal_method},
                    {"heads", heads},
                    {"slope", fit.slope},
                    {"intercept", fit.intercept},
                    {"r2", fit.r2},
                    {"points", fit.points},
                    {"largest_n", c.n.back()},
                    {"time_ms_at_largest_n", c.time_ms.back()},
                    {"extra_mib_at_largest_n", c.extra_mib.back()}});
  }
  summary["fits"] = fits;

  // Crossovers: each linear curve against the streaming (and naive) softmax of the same causality,
  // over the lengths both measured.
  nlohmann::json crossings = nlohmann::json::array();
  struct Cross {
    CurveKey linear;
    std::string against;
    Crossover c;
  };
  std::vector<Cross> cross_list;
  for (const auto& [key, c] : curves) {
    if (std::get<0>(key) != "linear") continue;
    for (const char* baseline : {"softmax_streaming", "softmax_naive"}) {
      const CurveKey other{baseline, "none", "rope", std::get<3>(key), "none", H};
      const auto found = curves.find(other);
      if (found == curves.end()) continue;
      std::vector<double> n, tl, ts;
      for (std::size_t i = 0; i < c.n.size(); ++i)
        for (std::size_t j = 0; j < found->second.n.size(); ++j)
          if (c.n[i] == found->second.n[j]) {
            n.push_back(c.n[i]);
            tl.push_back(c.time_ms[i]);
            ts.push_back(found->second.time_ms[j]);
          }
      if (n.empty()) continue;
      const Crossover x = crossover(n, tl, ts, o.scaling.fit_min_n);
      cross_list.push_back({key, baseline, x});
      crossings.push_back(
          {{"map", std::get<1>(key)},
           {"placement", std::get<2>(key)},
           {"causal", std::get<3>(key)},
           {"causal_method", std::get<4>(key)},
           {"against", baseline},
           {"kind", x.kind == Crossover::Kind::Interpolated       ? "interpolated"
                    : x.kind == Crossover::Kind::FasterThroughout ? "faster_throughout"
                                                                  : "not_reached"},
           {"n", x.n},
           {"text", describe(x)}});
    }
  }
  summary["crossovers"] = crossings;

  nlohmann::json one_head = nlohmann::json::array();
  for (const auto r : one_head_rows)
    one_head.push_back({{"map", table.text(r, "map")},
                        {"placement", table.text(r, "placement")},
                        {"causal", table.text(r, "causal") == "1"},
                        {"causal_method", table.text(r, "causal_method")},
                        {"n", table.number(r, "n")},
                        {"time_ms", table.number(r, "time_ms")},
                        {"peak_rss_mib", table.number(r, "peak_rss_mib")},
                        {"extra_mib", table.number(r, "extra_mib")},
                        {"io_mib", table.number(r, "io_mib")}});
  summary["one_head"] = one_head;

  // ---- Report -------------------------------------------------------------------------------
  Section& s = outcome.section;
  s.title = "1. Scaling: time and peak memory against sequence length";
  s.figures = {{"scaling_time.png",
                "Median time per call against n (log-log), H = " + std::to_string(H) +
                    ", d = " + std::to_string(d) + "; the legend gives each curve's fitted slope"},
               {"scaling_memory.png", "Peak resident memory beyond the inputs and outputs"}};
  // The report quotes the first causal method asked for.
  auto linear_method = [&](bool causal) {
    return causal ? o.scaling.causal_methods.front() : std::string("none");
  };
  auto slope_text = [&](const CurveKey& key) {
    const auto found = fit_of.find(key);
    return found == fit_of.end() ? std::string("n/a") : fmt(found->second.slope, 3);
  };
  std::string p1 = "Setup: " + std::to_string(H) + " heads, d = " + std::to_string(d) +
                   ", batch 1, float, median of " + std::to_string(o.scaling.reps) +
                   " repetitions on " + std::to_string(max_threads()) +
                   " threads; FAVOR+ with m = " + std::to_string(mf) +
                   " orthogonal features; softmax with RoPE of width d. "
                   "Log-log slopes fitted over n >= " +
                   fmt(o.scaling.fit_min_n, 6) + ": ";
  std::vector<std::string> parts;
  for (const bool causal : {false, true}) {
    for (const char* method : {"softmax_naive", "softmax_streaming"}) {
      const CurveKey key{method, "none", "rope", causal, "none", H};
      if (curves.count(key)) parts.push_back(curve_name(key) + " " + slope_text(key));
    }
    for (const char* map : {"elu+1", "favor+"}) {
      const CurveKey key{"linear", map, "numerator_only", causal, linear_method(causal), H};
      if (curves.count(key)) parts.push_back(curve_name(key) + " " + slope_text(key));
    }
  }
  for (std::size_t i = 0; i < parts.size(); ++i) p1 += (i ? "; " : "") + parts[i];
  // Range of the linear slopes over every placement.
  double lo = INFINITY, hi = -INFINITY;
  for (const auto& [key, fit] : fit_of)
    if (std::get<0>(key) == "linear" && std::isfinite(fit.slope)) {
      lo = std::min(lo, fit.slope);
      hi = std::max(hi, fit.slope);
    }
  if (std::isfinite(lo))
    p1 += ". Over all linear curves (both maps, four placements, causal or not) the slopes span " +
          fmt(lo, 3) + " to " + fmt(hi, 3) + " (1 is linear, 2 quadratic).";
  s.paragraphs.push_back(p1);
  const double cores = double(std::thread::hardware_concurrency());
  if (std::max(load_start, load_end) > cores)
    s.paragraphs.push_back(
        "The machine was shared during this run: load average " + fmt(load_start, 3) +
        " at the start and " + fmt(load_end, 3) + " at the end, on " + fmt(cores, 3) +
        " cores. Absolute times include waiting for other processes; compare curves within "
        "this run rather than across machines.");

  std::string p2 =
      "Crossover (where linear attention becomes faster than streaming softmax, "
      "log-log interpolation between measured lengths): ";
  parts.clear();
  for (const auto& x : cross_list)
    if (x.against == "softmax_streaming" && std::get<2>(x.linear) == "numerator_only")
      parts.push_back(curve_name(x.linear) + ": " + describe(x.c));
  for (std::size_t i = 0; i < parts.size(); ++i) p2 += (i ? "; " : "") + parts[i];
  double earliest = INFINITY, latest = 0;
  for (const auto& x : cross_list)
    if (x.against == "softmax_streaming" && x.c.kind == Crossover::Kind::Interpolated) {
      earliest = std::min(earliest, x.c.n);
      latest = std::max(latest, x.c.n);
    }
  if (std::isfinite(earliest))
    p2 += ". Over every placement the interpolated crossovers lie between n ~ " + fmt(earliest, 3) +
          " and n ~ " + fmt(latest, 3) + ".";
  if (!parts.empty()) s.paragraphs.push_back(p2);

  if (memory) {
    std::string p3 = "Memory beyond inputs and outputs at the largest measured n: ";
    parts.clear();
    for (const bool causal : {false, true}) {
      for (const char* method : {"softmax_naive", "softmax_streaming"}) {
        const CurveKey key{method, "none", "rope", causal, "none", H};
        if (const auto c = curves.find(key); c != curves.end())
          parts.push_back(curve_name(key) + " " + fmt(c->second.extra_mib.back(), 3) +
                          " MiB at n = " + fmt(c->second.n.back(), 7));
      }
      for (const char* map : {"elu+1", "favor+"}) {
        const CurveKey key{"linear", map, "numerator_only", causal, linear_method(causal), H};
        if (const auto c = curves.find(key); c != curves.end())
          parts.push_back(curve_name(key) + " " + fmt(c->second.extra_mib.back(), 3) +
                          " MiB at n = " + fmt(c->second.n.back(), 7));
      }
    }
    for (std::size_t i = 0; i < parts.size(); ++i) p3 += (i ? "; " : "") + parts[i];
    const Index naive_n = std::min(o.scaling.naive_max, lengths.back());
    const int threads = std::min<int>(max_threads(), int(H));
    p3 += ". (The naive kernel holds one n x n float matrix per thread: " +
          fmt(mib(4.0 * double(naive_n) * double(naive_n)), 4) +
          " MiB each at n = " + std::to_string(naive_n) + ", " + std::to_string(threads) +
          " threads.)";
    s.paragraphs.push_back(p3);
    if (!one_head_rows.empty()) {
      std::string p4 = "One head, n = " + fmt(table.number(one_head_rows.front(), "n"), 8) +
                       ", d = " + std::to_string(d) + " (inputs and output " +
                       fmt(table.number(one_head_rows.front(), "io_mib"), 4) +
                       " MiB): peak RSS of the process / memory beyond inputs and outputs: ";
      parts.clear();
      for (const auto r : one_head_rows)
        if (table.text(r, "placement") == "numerator_only" || table.text(r, "placement") == "full")
          parts.push_back(table.text(r, "map") + " " + table.text(r, "placement") +
                          (table.text(r, "causal") == "1"
                               ? " causal (" + table.text(r, "causal_method") + ") "
                               : " ") +
                          fmt(table.number(r, "peak_rss_mib"), 4) + " / " +
                          fmt(table.number(r, "extra_mib"), 3) + " MiB");
      for (std::size_t i = 0; i < parts.size(); ++i) p4 += (i ? "; " : "") + parts[i];
      s.paragraphs.push_back(p4 + ".");
    }
  } else {
    s.paragraphs.push_back(
        "Peak memory was not measured: this kernel does not support resetting "
        "the high-water mark through /proc/self/clear_refs.");
  }
  if (!skipped.empty())
    s.paragraphs.push_back(std::to_string(skipped.size()) +
                           " points were skipped for lack of memory (listed in scaling.json).");
  return outcome;
}

}  // namespace linrope::experiments
