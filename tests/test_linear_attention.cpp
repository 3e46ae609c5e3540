// Single-head linear attention (include/linrope/attention.hpp) against the naive double-precision
// reference in tests/reference/linear_reference.hpp (explicit rotation matrices, explicit n x n_k
// weights), plus the properties the research relies on and the argument checks.
//
// Tolerances (used by every comparison below). A kernel in precision T with unit roundoff u
// (2^-24 float, 2^-53 double) evaluates num_i = sum_j A_ij v_j and den_i = sum_j B_ij from rounded
// features. Every term it adds is bounded by M_ij |v_j|_inf (M = the reference's `magnitude`, which
// bounds the rotated and the unrotated inner products and the rotation's own rounding), and:
//   - each inner product has m terms, each sum over keys at most n_k terms: any summation order
//     errs by at most (m + n_k) u times the sum of |terms| (Higham, Accuracy and Stability, 4.2);
//   - an exp-based feature exp(z) carries the error of z: |dz| <= (d + 2) u |w| |x'| (+ |x'|^2 u)
//     for Favor maps (= z_size below); stabilising shifts of that size add the same again;
//   - rotations, casts and rescalings add a handful of u each (the "+ 16").
// So |num error| <= gamma N_i and |den error| <= gamma D_i with N_i = sum_j M_ij |v_j|_inf,
// D_i = sum_j M_ij and gamma = (u + u_double) (m + d + n_k + 2 z_size + 16), times a margin of 8
// (the bounds are first order, and FavorTrig's sin/cos err relative to their envelope rather than
// to |sin|, which the margin covers on average over the features). Dividing,
//   |o_i error| <= gamma (N_i + |o_i|_inf (D_i + eps)) / (|den_i + eps| - gamma (D_i + eps)),
// which is relative to the magnitude of the terms of num and den and grows with the conditioning
// D_i / |den_i + eps|. Rows where |den_i + eps| <= 2 gamma (D_i + eps) are ill-conditioned (at
// precision u not even the sign of den + eps is determined, which happens for Full, whose
// denominator can cross zero, and for signed FavorTrig features); they are skipped, counted, and
// the inputs are chosen so that they stay rare (checked). Everywhere else this bound is ~1e-4
// relative in float at n_k = 1000 and ~1e-12 in double, while a wrong sign, pair, position or mask
// changes outputs at O(1).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <linrope/linrope.hpp>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "check_close.hpp"
#include "linear_cases.hpp"
#include "map_cases.hpp"
#include "reference/linear_reference.hpp"
#include "reference/random.hpp"
#include "threads.hpp"

namespace {

using namespace linrope;
namespace ref = linrope::reference;
using namespace linrope::testing;  // the shared cases, maps, comparison, inputs and threads
using ref::VectorD;

// Few random features so that m (f, or 2f for Trig and Hyperbolic) stays small: f = d + 4 is not a
// multiple of d, so the last orthogonal block is cut, and d = 5 gives odd m for FavorPositive.
// FAVOR+ maps draw `features` random features (default d + 4).
std::unique_ptr<FeatureMap> small_map(FeatureMapKind kind, Index d, std::uint64_t seed = 7,
                                      Index features = -1) {
  return linrope::testing::make_map(kind, d, favor_features(kind, features > 0 ? features : d + 4),
                                    seed);
}

// The reference's per-row bounds for a kernel in precision T (see the header comment).
template <class T>
VectorD tolerances(const ref::LinearResult& want, double gamma, double eps) {
  return ref::row_tolerances(want, gamma, eps, double(std::numeric_limits<T>::min()));
}

// DenominatorStats against the reference's den: each kernel den_i is within gamma D_i of the exact
// one. Rows with no admissible key have no denominator: they are counted in no_keys only.
void check_stats(const DenominatorStats& got, const ref::LinearResult& want, double gamma,
                 double threshold) {
  VectorD t(want.den.size());
  for (Index i = 0; i < t.size(); ++i) t(i) = gamma * want.den_magnitude(i);
  check_denominator_stats(got, want.den, t, want.admissible, threshold);
}

// A threshold that splits the |den_i| in two (their median), so below_threshold is not trivially
// 0 or n.
double median_abs(const VectorD& den) {
  if (den.size() == 0) return 1e-3;
  std::vector<double> a(std::size_t(den.size()));
  for (Index i = 0; i < den.size(); ++i) a[std::size_t(i)] = std::abs(den(i));
  std::nth_element(a.begin(), a.begin() + std::ptrdiff_t(a.size() / 2), a.end());
  return std::max(a[a.size() / 2], 1e-300);
}

struct RopeChoice {
  RopeLayout layout = RopeLayout::Interleaved;
  bool partial = false;  // leave a pass-through pair
  double base = 10000.0;
};

// One problem: everything a comparison needs.
struct Problem {
  FeatureMapKind kind = FeatureMapKind::EluPlusOne;
  RopePlacement placement = RopePlacement::None;
  bool causal = false;
  Index n = 1, n_k = -1 /* -1: = n */, d = 6, d_v = 3;
  Index features = -1;  // FAVOR+'s random features; -1: d + 4
  Index q_offset = 0, k_offset = 0;
  double eps = 1e-6;
  CausalMethod method = CausalMethod::Chunked;
  Index chunk_size = 64;
  RopeChoice rope;
  double scale = 0.7;  // standard deviation of the inputs (|x'| ~ 1, well inside exp's range)
  std::uint64_t seed = 1;
};

// Derives the sweep's secondary choices (d, d_v, layout, partial width, base) from a counter, so
// that a sweep over maps, placements and lengths also covers them all.
void vary(Problem& p, int counter) {
  p.d = counter % 2 == 0 ? 6 : 5;
  p.d_v = counter % 3 == 0 ? 1 : (counter % 3 == 1 ? 3 : 4);
  p.rope.layout = (counter / 2) % 2 == 0 ? RopeLayout::Interleaved : RopeLayout::Half;
  p.rope.partial = (counter / 4) % 2 == 1;
  p.rope.base = (counter / 8) % 2 == 0 ? 10000.0 : 100.0;
  p.seed = std::uint64_t(1000 + counter);
}

// The map, the rope the placement needs (width d before the map, m on the features; rotary width
// the largest even number <= width, two less when partial), inputs rounded to T, the options, and
// the reference on exactly those rounded inputs.
template <class T>
struct Fixture {
  explicit Fixture(const Problem& p) : problem(p) {
    map = small_map(p.kind, p.d, 7, p.features);
    m = map->output_dim();
    const Index n_k = p.n_k < 0 ? p.n : p.n_k;
    if (p.placement != RopePlacement::None) {
      RopeConfig config = placement_rope(p.placement, p.d, m, p.rope.partial);
      config.base = p.rope.base;
      config.layout = p.rope.layout;
      rope.emplace(config);
      spec = ref::rope_spec(config);
    }
    q = gaussian(p.n, p.d, p.seed, p.scale).cast<T>();
    k = gaussian(n_k, p.d, p.seed + 1, p.scale).cast<T>();
    v = gaussian(n_k, p.d_v, p.seed + 2).cast<T>();
    options = linear_options(p.causal, p.placement, rope ? &*rope : nullptr, p.eps, p.q_offset,
                             p.k_offset);
    options.method = p.method;
    options.chunk_size = p.chunk_size;
  }
  Fixture(const Fixture&) = delete;  // options.rope points into this object

  ref::LinearResult reference() const {
    return ref::linear_attention(q.template cast<double>(), k.template cast<double>(),
                                 v.template cast<double>(), ref::feature_formula(*map),
                                 reference_spec(options, spec));
  }
  double gamma() const {
    const double z = std::max(ref::exponent_size(*map, q.template cast<double>()),
                              ref::exponent_size(*map, k.template cast<double>()));
    return ref::rounding_gamma<T>(m, problem.d, k.rows(), z);
  }
  Matrix<T> run(DenominatorStats* stats = nullptr) const {
    return linear_attention(q, k, v, *map, options, stats);
  }

  Problem problem;
  std::unique_ptr<FeatureMap> map;
  Index m = 0;
  std::optional<Rope> rope;
  std::optional<ref::RopeSpec> spec;
  Matrix<T> q, k, v;
  LinearOptions options;
};

// Runs the kernel on one problem and checks outputs and statistics against the reference.
template <class T>
void check_problem(const Problem& p) {
  const std::string map_name = to_string(p.kind), placement = to_string(p.placement);
  const std::string type = sizeof(T) == 4 ? "float" : "double";
  CAPTURE(map_name);
  CAPTURE(placement);
  CAPTURE(type);
  CAPTURE(p.causal);
  CAPTURE(p.n);
  CAPTURE(p.n_k);
  CAPTURE(p.d);
  CAPTURE(p.d_v);
  CAPTURE(p.q_offset);
  CAPTURE(p.k_offset);
  CAPTURE(p.eps);
  CAPTURE(p.chunk_size);
  CAPTURE(int(p.method));
  CAPTURE(int(p.rope.layout));
  CAPTURE(p.rope.partial);
  CAPTURE(p.rope.base);
  Fixture<T> f(p);
  const ref::LinearResult want = f.reference();
  const double gamma = f.gamma();
  DenominatorStats stats;
  stats.threshold = median_abs(want.den);
  const Matrix<T> got = f.run(&stats);
  check_close(got, want.out, tolerances<T>(want, gamma, p.eps), "output vs reference");
  check_stats(stats, want, gamma, stats.threshold);
}

template <class T>
Matrix<T> with_row_norm(const MatrixD& x, double norm) {
  MatrixD y = x;
  for (Index i = 0; i < y.rows(); ++i) y.row(i) *= norm / y.row(i).norm();
  return y.cast<T>();
}

}  // namespace

// ---------------------------------------------------------------------------------------------

TEST_CASE("FeatureMap::apply agrees with the reference feature formulas") {
  // The reference computes phi from its own formulas (feature_map_reference.hpp) with the map's W,
  // never through apply; test_feature_maps.cpp checks apply against them in depth. Here once more
  // on the inputs of this file, feature order included (the feature placements' rotation pairs
  // depend on it). Inputs of norm ~1-3: double features err by ~(d + |z|) 2^-53 relative,
  // 1e-12 relative to the row's largest feature is a wide margin.
  for (const auto kind : kMaps)
    for (const Index d : {5, 6}) {
      const std::string map_name = to_string(kind);
      CAPTURE(map_name);
      CAPTURE(d);
      const auto map = small_map(kind, d);
      MatrixD x = gaussian(9, d, 42, 0.8);
      x.row(3).setZero();  // 1+cos maps 0 to [0, ..., 0, 1]
      const MatrixD by_formula = ref::feature_formula(*map)(x);
      MatrixD by_apply(x.rows(), map->output_dim());
      map->apply(x, by_apply);
      REQUIRE(by_formula.cols() == by_apply.cols());
      for (Index i = 0; i < x.rows(); ++i) {
        CAPTURE(i);
        const double scale = std::max(by_formula.row(i).cwiseAbs().maxCoeff(), 1e-300);
        CHECK((by_formula.row(i) - by_apply.row(i)).cwiseAbs().maxCoeff() <= 1e-12 * scale);
      }
    }
}

TEST_CASE("reference self-checks: rotation pairs and FAVOR+ against softmax") {
  SUBCASE("rotate_rows is the element-wise RoPE of docs/DESIGN.md, section RoPE") {
    // Pair i = (2i, 2i+1) interleaved or (i, i + r/2) half, angle p * base^(-2i/r), dims >= r
    // fixed.
    for (const auto layout : {RopeLayout::Interleaved, RopeLayout::Half}) {
      CAPTURE(int(layout));
      const ref::RopeSpec spec{.dim = 7, .rotary_dim = 4, .base = 100.0, .layout = layout};
      const MatrixD x = gaussian(5, 7, 5);
      const MatrixD got = ref::rotate_rows(spec, x, 3);
      MatrixD want = x;
      for (Index i = 0; i < 5; ++i)
        for (Index p = 0; p < 2; ++p) {
          const double angle = double(3 + i) * std::pow(100.0, -2.0 * double(p) / 4.0);
          const Index a = layout == RopeLayout::Interleaved ? 2 * p : p;
          const Index b = layout == RopeLayout::Interleaved ? 2 * p + 1 : p + 2;
          want(i, a) = x(i, a) * std::cos(angle) - x(i, b) * std::sin(angle);
          want(i, b) = x(i, a) * std::sin(angle) + x(i, b) * std::cos(angle);
        }
      CHECK((got - want).cwiseAbs().maxCoeff() <= 1e-14);
    }
  }
  SUBCASE("FAVOR+ with many features approaches softmax attention") {
    // Each positive random feature estimates exp(<q', k'>) with relative standard deviation
    // sqrt(exp(|q' + k'|^2) - 1) ~ 1.05 at these norms (|x'| ~ 0.6), so with f features the kernel
    // values err by ~1.05 / sqrt(f) relative and the outputs (averages of unit-variance values) by
    // about as much; 2x that bounds the rms error. W iid Gaussian, drawn here, not by the library.
    const Index d = 6, f = 16384;
    const MatrixD q = gaussian(17, d, 1, 0.4), k = gaussian(23, d, 2, 0.4), v = gaussian(23, 3, 3);
    const MatrixD w = gaussian(f, d, 7);
    ref::LinearSpec spec;
    spec.eps = 0;
    const auto phi = [&](const MatrixD& x) {
      return ref::features(FeatureMapKind::FavorPositive, w, x);
    };
    const MatrixD approx = ref::linear_attention(q, k, v, phi, spec).out;
    const MatrixD exact = ref::softmax_attention(q, k, v, 1 / std::sqrt(double(d)));
    const double rms = (approx - exact).norm() / std::sqrt(double(approx.size()));
    CHECK(rms <= 2 * 1.05 / std::sqrt(double(f)));
  }
}

TEST_CASE(
    "linear_attention matches the reference: every map x placement x causal x method x length") {
  // Lengths around the default chunk of 64 and Scan's block of 64; causal problems run every
  // causal method (Scan, the default, and Chunked) on the same inputs. n = 1000 is sampled (once
  // per map, placements and types rotating) to keep the suite fast, also under the sanitizers.
  int counter = 0;
  for (const auto kind : kMaps)
    for (const auto placement : kPlacements)
      for (const bool causal : {false, true})
        for (const Index n : {1, 2, 63, 64, 65}) {
          Problem p;
          vary(p, counter++);
          p.kind = kind;
          p.placement = placement;
          p.causal = causal;
          p.n = n;
          for (const auto method : kCausalMethods) {
            if (!causal && method != kCausalMethods[0]) continue;
            p.method = method;
            check_problem<float>(p);
            check_problem<double>(p);
          }
        }
  int which = 0;
  for (const auto kind : kMaps) {
    Problem p;
    vary(p, which);
    p.kind = kind;
    p.placement = kPlacements[which % 4];
    p.causal = which % 3 != 2;
    p.n = 1000;
    for (const auto method : kCausalMethods) {
      if (!p.causal && method != kCausalMethods[0]) continue;
      p.method = method;
      if (which % 2 == 0) {
        check_problem<float>(p);
      } else {
        check_problem<double>(p);
      }
    }
    ++which;
  }
}

TEST_CASE("offsets and cross attention: a block of new queries against a longer key cache") {
  struct Layout {
    bool causal;
    Index n, n_k, q_offset, k_offset;
  };
  // (a) decoding a block: 37 new queries at positions 64..100 against 101 cached keys 0..100;
  // (b) queries 0..19 against keys 10..24: rows 0..9 have no admissible key (zero rows);
  // (c) non-causal cross attention with unrelated offsets;
  // (d) keys later than most queries, n < n_k;
  // (e)-(g) at most 3 queries and 3 keys, which run the scan even when Chunked is asked for
  // (linear_causal), with unrelated offsets: one query after its keys, a first query that sees
  // no key, and keys at the queries' own positions.
  const Layout layouts[] = {{true, 37, 101, 64, 0}, {true, 20, 15, 0, 10}, {false, 13, 50, 7, 300},
                            {true, 9, 40, 30, 5},   {true, 1, 3, 5, 3},    {true, 3, 2, 0, 1},
                            {true, 2, 3, 10, 9}};
  int counter = 0;
  for (const auto& layout : layouts)
    for (const auto kind : kMaps)
      for (const auto placement : kPlacements) {
        Problem p;
        vary(p, counter);
        p.kind = kind;
        p.placement = placement;
        p.causal = layout.causal;
        p.n = layout.n;
        p.n_k = layout.n_k;
        p.q_offset = layout.q_offset;
        p.k_offset = layout.k_offset;
        p.method = counter % 2 == 0 ? CausalMethod::Chunked : CausalMethod::Scan;
        p.chunk_size = counter % 4 == 0 ? 7 : 16;
        ++counter;
        check_problem<float>(p);
        check_problem<double>(p);
      }
}

TEST_CASE("chunked causal skips the blocks above the diagonal: any shift, any chunk, any n_k") {
  // causal_chunked computes a chunk's masked products a block of 32 keys at a time, from the first
  // query that sees the block. Shifts q_offset - k_offset of both signs and not multiples of 8 or
  // 32, chunks of 50, 64 and 100 (blocks cut short), n_k shorter and longer than n.
  int counter = 0;
  for (const auto kind : {FeatureMapKind::EluPlusOne, FeatureMapKind::FavorPositive})
    for (const Index chunk : {Index(50), Index(64), Index(100)})
      for (const Index shift : {Index(-37), Index(0), Index(17), Index(40), Index(130)})
        for (const Index n_k : {Index(30), Index(150)}) {
          Problem p;
          vary(p, counter);
          p.kind = kind;
          p.placement = counter % 2 == 0 ? RopePlacement::NumeratorOnly : RopePlacement::None;
          p.causal = true;
          p.n = 150;
          p.n_k = n_k;
          p.q_offset = 100 + shift;
          p.k_offset = 100;
          p.chunk_size = chunk;
          ++counter;
          check_problem<float>(p);
          check_problem<double>(p);
        }
}

TEST_CASE("rows with no admissible key are zero rows, for eps = 0 as well") {
  // Expectation: num_i = 0 and den_i = 0 for a query before every key; its output is exactly 0
  // (not 0/0), and den_i = 0 enters the statistics (nonpositive, below_threshold, min <= 0).
  // Every causal method.
  for (const auto kind : kMaps)
    for (const auto placement : kPlacements)
      for (const double eps : {0.0, 1e-6})
        for (const auto method : kCausalMethods) {
          Problem p;
          p.kind = kind;
          p.placement = placement;
          p.causal = true;
          p.method = method;
          p.n = 12;
          p.n_k = 8;
          p.q_offset = 3;
          p.k_offset = 10;  // rows 0..6 (positions 3..9) come before the first key
          p.eps = eps;
          const std::string map_name = to_string(kind), placement_name = to_string(placement);
          CAPTURE(map_name);
          CAPTURE(placement_name);
          CAPTURE(eps);
          CAPTURE(int(method));
          Fixture<float> f(p);
          DenominatorStats stats;
          const MatrixF out = f.run(&stats);
          REQUIRE(out.rows() == 12);
          CHECK(out.topRows(7).cwiseAbs().maxCoeff() == 0.0f);
          CHECK(out.allFinite());
          // The 7 rows have no denominator: counted apart, not as den = 0.
          CHECK(stats.count == 12);
          CHECK(stats.no_keys == 7);
          CHECK(stats.nonpositive <= 5);
          CHECK(stats.below_threshold <= 5);
        }
}

TEST_CASE("no keys at all (n_k = 0): every row is a zero row") {
  for (const bool causal : {false, true})
    for (const double eps : {0.0, 1e-6}) {
      CAPTURE(causal);
      CAPTURE(eps);
      const auto map = small_map(FeatureMapKind::FavorPositive, 6);
      const Rope rope(RopeConfig{.dim = map->output_dim()});
      LinearOptions options;
      options.causal = causal;
      options.rope = &rope;
      options.eps = eps;
      const MatrixD q = gaussian(5, 6, 3), k(0, 6), v(0, 2);
      DenominatorStats stats;
      const MatrixD out = linear_attention(q, k, v, *map, options, &stats);
      REQUIRE(out.rows() == 5);
      REQUIRE(out.cols() == 2);
      CHECK(out.cwiseAbs().maxCoeff() == 0.0);
      CHECK(stats.count == 5);
      CHECK(stats.no_keys == 5);
      CHECK(stats.nonpositive == 0);
    }
}

TEST_CASE("causal methods agree: Chunked (chunk 1, 7, 64, 1000, 2^40) == Scan == reference") {
  int counter = 0;
  for (const auto kind : kMaps)
    for (const auto placement : kPlacements) {
      Problem p;
      vary(p, counter);
      p.kind = kind;
      p.placement = placement;
      p.causal = true;
      // Self-attention at a shared offset, and every fourth time a block against a longer cache.
      p.n = 65;
      p.q_offset = p.k_offset = 3;
      if (counter % 4 == 3) {
        p.n = 37;
        p.n_k = 101;
        p.q_offset = 64;
        p.k_offset = 0;
      }
      ++counter;
      const std::string map_name = to_string(kind), placement_name = to_string(placement);
      CAPTURE(map_name);
      CAPTURE(placement_name);
      CAPTURE(p.n);
      auto run_type = [&](auto zero) {
        using T = decltype(zero);
        CAPTURE(sizeof(T));
        Fixture<T> f(p);
        const ref::LinearResult want = f.reference();
        const VectorD tol = tolerances<T>(want, f.gamma(), p.eps);
        f.options.method = CausalMethod::Scan;
        const Matrix<T> scan = f.run();
        check_close(scan, want.out, tol, "Scan vs reference");
        // A chunk far longer than any sequence is one chunk (it must not allocate chunk_size rows).
        for (const Index chunk : {Index(1), Index(7), Index(64), Index(1000), Index(1) << 40}) {
          CAPTURE(chunk);
          f.options.method = CausalMethod::Chunked;
          f.options.chunk_size = chunk;
          const Matrix<T> chunked = f.run();
          check_close(chunked, want.out, tol, "Chunked vs reference");
          check_close(chunked, scan.template cast<double>(), tol, "Chunked vs Scan", 2.0);
        }
      };
      run_type(0.0f);
      run_type(0.0);
    }
}

TEST_CASE("Scan by strips of the state: wide d_v and m, queries in groups, rising scales") {
  // causal_scan runs the state S [m x d_v] in strips of 4, 2 or 1 vectors (64 bytes) of columns,
  // as m is at most 128, 256 or more (float: 64, 32, 16 columns; double: 32, 16, 8), with the last
  // strip narrower when d_v is not a multiple; and it runs queries whose own key needs no rescaling
  // in groups of 8 / (vectors per strip). The inputs' scale 1.5 makes FAVOR+'s key scales c_j
  // vary, so the running maximum rises now and then inside a block (a rescaled step between
  // grouped ones). Shifts of both signs: keys absorbed before a block, queries without a key.
  struct Shape {
    FeatureMapKind kind;
    Index d, features;  // m: d for elu+1, `features` for FAVOR+
  };
  const Shape shapes[] = {{FeatureMapKind::EluPlusOne, 64, 0},
                          {FeatureMapKind::FavorPositive, 12, 200},
                          {FeatureMapKind::FavorPositive, 8, 300}};
  int counter = 0;
  for (const auto& shape : shapes)
    for (const Index d_v : {Index(8), Index(16), Index(17), Index(32), Index(64), Index(100)})
      for (const Index shift : {Index(0), Index(-21), Index(45)}) {
        Problem p;
        vary(p, counter);
        p.kind = shape.kind;
        p.d = shape.d;
        p.features = shape.features;
        p.d_v = d_v;
        p.placement = kPlacements[std::size_t(counter) % std::size(kPlacements)];
        p.causal = true;
        p.method = CausalMethod::Scan;
        p.n = 150;  // not a multiple of the block (64) nor of any group
        p.n_k = counter % 2 == 0 ? 150 : 131;
        p.q_offset = 50 + shift;
        p.k_offset = 50;
        p.scale = 1.5;
        ++counter;
        check_problem<float>(p);
        check_problem<double>(p);
      }
}

TEST_CASE("a long causal call split across threads: Chunked and Scan against the reference") {
  // n = 700 runs as two segments with 2 threads (linear_causal: at least 256 queries each), each
  // from the prefix state of the keys before it, whichever the method; with a shift, the segments'
  // first keys are not their first queries' positions. The test sets the thread count itself, so
  // that the split runs even where the machine or OMP_NUM_THREADS gives one thread.
  const ThreadCount threads(kSplitThreads);
  int counter = 0;
  for (const auto kind : {FeatureMapKind::EluPlusOne, FeatureMapKind::FavorPositive})
    for (const auto method : {CausalMethod::Chunked, CausalMethod::Scan})
      for (const Index shift : {Index(0), Index(-40), Index(90)}) {
        Problem p;
        vary(p, counter);
        p.kind = kind;
        p.placement = counter % 2 == 0 ? RopePlacement::NumeratorOnly : RopePlacement::Full;
        p.causal = true;
        p.method = method;
        p.n = 700;
        p.n_k = 720;
        p.d_v = 20;
        p.q_offset = 100 + shift;
        p.k_offset = 100;
        ++counter;
        check_problem<float>(p);
        check_problem<double>(p);
      }
}

TEST_CASE("LinearAttentionStream == one causal call: one token at a time and blocks of 5") {
  int counter = 0;
  for (const auto kind : kMaps)
    for (const auto placement : kPlacements) {
      Problem p;
      vary(p, counter++);
      p.kind = kind;
      p.placement = placement;
      p.causal = true;
      p.n = 23;  // 4 blocks of 5 and a last block of 3
      p.q_offset = p.k_offset = 5;
      const std::string map_name = to_string(kind), placement_name = to_string(placement);
      CAPTURE(map_name);
      CAPTURE(placement_name);
      auto run_type = [&](auto zero) {
        using T = decltype(zero);
        CAPTURE(sizeof(T));
        Fixture<T> f(p);
        const ref::LinearResult want = f.reference();
        const double gamma = f.gamma();
        const VectorD tol = tolerances<T>(want, gamma, p.eps);
        const Matrix<T> whole = f.run();
        for (const Index block : {1, 5}) {
          CAPTURE(block);
          LinearOptions options = f.options;
          options.causal = false;  // ignored by the stream: it is always causal
          LinearAttentionStream<T> stream(*f.map, p.d_v, options);
          CHECK(stream.position() == 5);
          Matrix<T> out(p.n, p.d_v);
          for (Index start = 0; start < p.n; start += block) {
            const Index t = std::min(block, p.n - start);
            DenominatorStats stats;
            const Matrix<T> o = stream.step(f.q.middleRows(start, t), f.k.middleRows(start, t),
                                            f.v.middleRows(start, t), &stats);
            REQUIRE(o.rows() == t);
            REQUIRE(o.cols() == p.d_v);
            out.middleRows(start, t) = o;
            CHECK(stats.count == t);
            CHECK(std::abs(stats.min - want.den.segment(start, t).minCoeff()) <=
                  gamma * want.den_magnitude.segment(start, t).maxCoeff());
            CHECK(stream.position() == 5 + start + t);
          }
          check_close(out, want.out, tol, "stream vs reference");
          check_close(out, whole.template cast<double>(), tol, "stream vs linear_attention", 2.0);
          // reset() returns to an empty state at q_offset: the replay gives the same outputs.
          stream.reset();
          CHECK(stream.position() == 5);
          const Matrix<T> first = stream.step(f.q.topRows(3), f.k.topRows(3), f.v.topRows(3));
          check_close(first, want.out.topRows(3), tol.head(3), "stream after reset");
        }
        // A moved-from-into stream carries on where the original was.
        LinearAttentionStream<T> a(*f.map, p.d_v, f.options);
        Matrix<T> out(p.n, p.d_v);
        out.topRows(10) = a.step(f.q.topRows(10), f.k.topRows(10), f.v.topRows(10));
        LinearAttentionStream<T> b(std::move(a));
        out.bottomRows(p.n - 10) =
            b.step(f.q.bottomRows(p.n - 10), f.k.bottomRows(p.n - 10), f.v.bottomRows(p.n - 10));
        check_close(out, want.out, tol, "moved stream vs reference");
      };
      run_type(0.0f);
      run_type(0.0);
    }
}

TEST_CASE("eps: o = num / (den + eps) exactly as the reference, for eps = 0 and eps = 10") {
  // eps = 10 is comparable to the denominators here (den ~ n_k), so a kernel that drops eps, adds
  // it on the stabilised scale, or adds it to the numerator is off at O(1). eps = 0 only where
  // den > 0: maps with positive features and placements whose den is an unrotated or a
  // non-negative kernel (with relu, den = 0 but num != 0 is possible for NumeratorOnly, and Full
  // can cross zero: o = num / 0 is not finite by definition).
  int counter = 0;
  for (const auto kind : kMaps)
    for (const auto placement : kPlacements)
      for (const double eps : {0.0, 10.0}) {
        const bool positive_den =
            kind != FeatureMapKind::Relu && kind != FeatureMapKind::FavorTrig &&
            (placement != RopePlacement::Full || kind == FeatureMapKind::OnePlusCosine);
        if (eps == 0 && !positive_den) continue;
        Problem p;
        vary(p, counter++);
        p.kind = kind;
        p.placement = placement;
        p.causal = counter % 2 == 0;
        p.n = 31;
        p.eps = eps;
        for (const auto method : kCausalMethods) {  // causal: every method
          if (!p.causal && method != kCausalMethods[0]) continue;
          p.method = method;
          check_problem<float>(p);
          check_problem<double>(p);
          if (eps == 0) {
            Fixture<float> f(p);
            CHECK(f.run().allFinite());
          }
        }
      }
  SUBCASE("eps changes the output") {
    Problem p;
    p.kind = FeatureMapKind::EluPlusOne;
    p.placement = RopePlacement::NumeratorOnly;
    p.n = 17;
    Fixture<double> f(p);
    const MatrixD small = f.run();
    f.options.eps = 10;
    const MatrixD large = f.run();
    // den_i ~ 17 * <phi, psi> ~ 17 * 6: eps = 10 shrinks outputs by ~10%.
    CHECK((small - large).cwiseAbs().maxCoeff() > 1e-3 * small.cwiseAbs().maxCoeff());
  }
}

TEST_CASE("DenominatorStats: min, nonpositive and below_threshold with a custom threshold") {
  // The sweeps above check statistics on every run; here a case where all three are non-trivial:
  // Full with FavorTrig has negative denominators, and the threshold is chosen between the
  // smallest and largest |den|.
  Problem p;
  p.kind = FeatureMapKind::FavorTrig;
  p.placement = RopePlacement::Full;
  p.causal = true;
  p.n = 200;
  p.rope.base = 100;
  for (const bool causal : {false, true}) {
    CAPTURE(causal);
    p.causal = causal;
    Fixture<double> f(p);
    const ref::LinearResult want = f.reference();
    const double gamma = f.gamma();
    DenominatorStats stats;
    stats.threshold = median_abs(want.den);
    f.run(&stats);
    check_stats(stats, want, gamma, stats.threshold);
    CHECK(stats.nonpositive > 0);
    CHECK(stats.below_threshold > 0);
    CHECK(stats.below_threshold < p.n);
    CHECK(stats.min < 0);
    // Statistics are computed afresh by each call (not accumulated into the caller's object).
    f.run(&stats);
    CHECK(stats.count == p.n);
  }
}

TEST_CASE("NumeratorOnly keeps denominators positive for non-negative maps") {
  // den_i = sum_j <phi_i, psi_j> with phi, psi >= 0 and (for these maps) > 0 somewhere in every
  // row: positive whatever the rope does. Relu features can be all zero (den = 0, never < 0).
  for (const auto kind : kMaps) {
    if (kind == FeatureMapKind::FavorTrig) continue;
    for (const bool causal : {false, true}) {
      const std::string map_name = to_string(kind);
      CAPTURE(map_name);
      CAPTURE(causal);
      Problem p;
      p.kind = kind;
      p.placement = RopePlacement::NumeratorOnly;
      p.causal = causal;
      p.n = 300;
      p.rope.base = 100;
      Fixture<float> f(p);
      CHECK(f.map->nonnegative());
      DenominatorStats stats;
      f.run(&stats);
      CHECK(stats.count == 300);
      if (kind == FeatureMapKind::Relu) {
        CHECK(stats.min >= 0);
      } else {
        CHECK(stats.nonpositive == 0);
        CHECK(stats.min > 0);
      }
    }
  }
}

TEST_CASE("Full reaches smaller denominators than NumeratorOnly on the same inputs") {
  // Rotated features decorrelate across distance, so sum_j <R_i phi_i, R_j psi_j> falls well
  // below the unrotated sum (in the reference: ~10x for n = 512, and negative when causal).
  for (const auto kind : {FeatureMapKind::EluPlusOne, FeatureMapKind::FavorPositive})
    for (const bool causal : {false, true}) {
      const std::string map_name = to_string(kind);
      CAPTURE(map_name);
      CAPTURE(causal);
      Problem p;
      p.kind = kind;
      p.causal = causal;
      p.n = 512;
      p.placement = RopePlacement::NumeratorOnly;
      Fixture<float> numerator_only(p);
      p.placement = RopePlacement::Full;
      Fixture<float> full(p);
      DenominatorStats a, b;
      numerator_only.run(&a);
      full.run(&b);
      CHECK(a.count == 512);
      CHECK(b.count == 512);
      CHECK(b.min < 0.5 * a.min);
      if (causal) CHECK(b.nonpositive > 0);
    }
}

TEST_CASE("relative positions only: shifting q_offset and k_offset together changes nothing") {
  // <R_i x, R_j y> depends on i - j only, so NumeratorOnly and Full are shift-invariant for every
  // map. BeforeMap is only for maps whose kernel is rotation-invariant: phi(R q) . phi(R k) =
  // 1 + cos(q, k) for 1+cos, whereas element-wise or random-projection maps see absolute
  // positions; so BeforeMap is checked with 1+cos. Every causal method, on the same inputs.
  struct Case {
    FeatureMapKind kind;
    RopePlacement placement;
  };
  std::vector<Case> cases;
  for (const auto kind : kMaps) {
    cases.push_back({kind, RopePlacement::NumeratorOnly});
    cases.push_back({kind, RopePlacement::Full});
  }
  cases.push_back({FeatureMapKind::OnePlusCosine, RopePlacement::BeforeMap});
  int counter = 0;
  for (const auto& c : cases)
    for (const Index shift : {17, 1000, 4099})
      for (const auto method : kCausalMethods) {
        const std::string map_name = to_string(c.kind), placement_name = to_string(c.placement);
        CAPTURE(map_name);
        CAPTURE(placement_name);
        CAPTURE(shift);
        CAPTURE(int(method));
        Problem p;
        vary(p, counter / int(std::size(kCausalMethods)));  // the same inputs for every method
        ++counter;
        p.kind = c.kind;
        p.placement = c.placement;
        p.causal = true;
        p.method = method;
        p.n = 40;
        p.n_k = 60;
        p.q_offset = 20;
        p.k_offset = 0;
        p.rope.base = 100;  // fast enough rotation that a wrong position shows at these widths
        Fixture<float> f(p);
        const ref::LinearResult want = f.reference();
        const VectorD tol = tolerances<float>(want, f.gamma(), p.eps);
        const MatrixF before = f.run();
        f.options.q_offset += shift;
        f.options.k_offset += shift;
        const MatrixF after = f.run();
        check_close(before, want.out, tol, "at the original offsets");
        check_close(after, before.cast<double>(), tol, "shifted vs original", 2.0);
      }
}

TEST_CASE("causal outputs never depend on later keys, even with large norms (float)") {
  // Rows of norm 20: exp-based features span e^(+-80) and more, so the kernel must stabilise;
  // a stabiliser that looks at later keys (a global key maximum) changes earlier outputs, which is
  // what replacing the keys after position i catches - by fresh keys, by a key with a huge norm,
  // and by the key that maximises the features (x' = the longest projection row: for FavorPositive
  // and FavorHyperbolic its largest feature is ~e^70 above the others' here).
  // At these norms the exact den_i is ~e^-100 on the unstabilised scale, so the default eps = 1e-6
  // would swamp it (outputs ~1e-50, below float's range, and nothing to compare). So eps is 0
  // (where den > 0) or the median |den_i|, where eps matters at O(1): a kernel that adds eps on the
  // wrong scale, or on a scale set by later keys, is off at O(1).
  int counter = 0;
  for (const auto kind :
       {FeatureMapKind::FavorPositive, FeatureMapKind::FavorHyperbolic, FeatureMapKind::FavorTrig})
    for (const auto placement : kPlacements)
      for (const auto method : {CausalMethod::Chunked, CausalMethod::Scan})
        for (const bool zero_eps : {false, true}) {
          const bool positive_den =
              kind != FeatureMapKind::FavorTrig && placement != RopePlacement::Full;
          if (zero_eps && !positive_den) continue;
          const std::string map_name = to_string(kind), placement_name = to_string(placement);
          CAPTURE(map_name);
          CAPTURE(placement_name);
          CAPTURE(int(method));
          Problem p;
          vary(p, counter++);
          p.kind = kind;
          p.placement = placement;
          p.causal = true;
          p.n = 65;
          p.method = method;
          p.chunk_size = 16;
          Fixture<float> f(p);
          f.q = with_row_norm<float>(gaussian(p.n, p.d, p.seed), 20);
          f.k = with_row_norm<float>(gaussian(p.n, p.d, p.seed + 1), 20);
          f.options.eps = 0;
          f.options.eps = zero_eps ? 0.0 : median_abs(f.reference().den);
          CAPTURE(f.options.eps);
          const ref::LinearResult want = f.reference();
          const VectorD tol = tolerances<float>(want, f.gamma(), f.options.eps);
          const MatrixF base = f.run();
          REQUIRE(base.allFinite());
          // Signed FavorTrig features at |x'|^2/2 ~ 80 cancel badly: fewer rows are conditioned
          // (at least 87% of them in every case here), so up to half may be skipped.
          const int max_skipped = kind != FeatureMapKind::FavorTrig ? 10 : 50;
          check_close(base, want.out, tol, "large norms vs reference", 1, -1, max_skipped);

          // The longest projection row, as an input: x = w d^(1/4), so that x' = w.
          const MatrixD& w = f.map->projection();
          Index longest = 0;
          w.rowwise().norm().maxCoeff(&longest);
          const MatrixD best_key = w.row(longest) * std::pow(double(p.d), 0.25);

          for (const Index i : {0, 13, 15, 16, 40, 63}) {
            CAPTURE(i);
            for (int variant = 0; variant < 3; ++variant) {
              CAPTURE(variant);
              const Index later = p.n - 1 - i;
              MatrixF k2 = f.k, v2 = f.v;
              k2.bottomRows(later) = with_row_norm<float>(gaussian(later, p.d, 99 + i), 20);
              v2.bottomRows(later) = gaussian(later, p.d_v, 98 + i, 50.0).cast<float>();
              if (variant == 1) k2.row(i + 1) = with_row_norm<float>(gaussian(1, p.d, 97), 300);
              if (variant == 2) k2.row(i + 1) = best_key.cast<float>();
              const MatrixF changed = linear_attention(f.q, k2, v2, *f.map, f.options);
              CHECK(changed.allFinite());
              check_close(changed, base.cast<double>(), tol, "prefix after changing later keys",
                          2.0, i + 1, max_skipped);
            }
          }
        }
}

TEST_CASE("large norms give finite outputs (float, non-causal), matching the reference") {
  // eps as in the previous test: 0 where den > 0, otherwise the median |den_i|.
  int counter = 0;
  for (const auto kind : kMaps)
    for (const auto placement : kPlacements) {
      const std::string map_name = to_string(kind), placement_name = to_string(placement);
      CAPTURE(map_name);
      CAPTURE(placement_name);
      Problem p;
      vary(p, counter++);
      p.kind = kind;
      p.placement = placement;
      p.n = 65;
      Fixture<float> f(p);
      f.q = with_row_norm<float>(gaussian(p.n, p.d, p.seed), 20);
      f.k = with_row_norm<float>(gaussian(p.n, p.d, p.seed + 1), 20);
      const bool positive_den =
          kind != FeatureMapKind::Relu && kind != FeatureMapKind::FavorTrig &&
          (placement != RopePlacement::Full || kind == FeatureMapKind::OnePlusCosine);
      f.options.eps = 0;
      f.options.eps = positive_den ? 0.0 : median_abs(f.reference().den);
      CAPTURE(f.options.eps);
      DenominatorStats stats;
      const MatrixF out = f.run(&stats);
      CHECK(out.allFinite());
      CHECK(std::isfinite(stats.min));
      const ref::LinearResult want = f.reference();
      const int max_skipped = kind != FeatureMapKind::FavorTrig ? 10 : 50;  // as above
      check_close(out, want.out, tolerances<float>(want, f.gamma(), f.options.eps), "large norms",
                  1, -1, max_skipped);
      check_stats(stats, want, f.gamma(), stats.threshold);
    }
}

// ---------------------------------------------------------------------------------------------
// Bad input: std::invalid_argument naming the argument.

TEST_CASE("LinearAttentionStream: a first step long enough to be split across threads") {
  // A step of 600 tokens runs linear_causal's split (two segments with the 2 threads set here),
  // whose last segment must leave every key in the stream's state (FinalState::EveryKey): the
  // one-token steps after it read that state. Both methods.
  const ThreadCount threads(kSplitThreads);
#ifndef _OPENMP
  MESSAGE("built without OpenMP: the long step is not split, only its result is checked");
#endif
  int counter = 0;
  for (const auto kind : {FeatureMapKind::EluPlusOne, FeatureMapKind::FavorPositive})
    for (const auto method : {CausalMethod::Chunked, CausalMethod::Scan}) {
      Problem p;
      vary(p, counter++);
      p.kind = kind;
      p.placement = RopePlacement::NumeratorOnly;
      p.causal = true;
      p.method = method;
      p.n = 606;
      p.q_offset = p.k_offset = 3;
      const std::string map_name = to_string(kind);
      CAPTURE(map_name);
      CAPTURE(int(method));
      auto run_type = [&](auto zero) {
        using T = decltype(zero);
        CAPTURE(sizeof(T));
        Fixture<T> f(p);
        const ref::LinearResult want = f.reference();
        const VectorD tol = tolerances<T>(want, f.gamma(), p.eps);
        LinearAttentionStream<T> stream(*f.map, p.d_v, f.options);
        Matrix<T> out(p.n, p.d_v);
        out.topRows(600) = stream.step(f.q.topRows(600), f.k.topRows(600), f.v.topRows(600));
        for (Index t = 600; t < p.n; ++t)
          out.row(t) = stream.step(f.q.row(t), f.k.row(t), f.v.row(t));
        check_close(out, want.out, tol, "stream (600, then 1 x 6) vs reference");
      };
      run_type(0.0f);
      run_type(0.0);
    }
}

TEST_CASE("bad input throws std::invalid_argument naming the argument") {
  const Index d = 6;
  const auto map = small_map(FeatureMapKind::FavorPositive, d);
  const Index m = map->output_dim();
  const Rope feature_rope(RopeConfig{.dim = m});
  const Rope input_rope(RopeConfig{.dim = d});
  const MatrixF q = gaussian(7, d, 1).cast<float>(), k = gaussian(9, d, 2).cast<float>(),
                v = gaussian(9, 3, 3).cast<float>();
  LinearOptions ok;
  ok.rope = &feature_rope;
  REQUIRE_NOTHROW(linear_attention(q, k, v, *map, ok));

  SUBCASE("shapes") {
    CHECK_THROWS_WITH_AS(
        linear_attention(q, MatrixF(gaussian(9, d + 1, 2).cast<float>()), v, *map, ok),
        doctest::Contains("k is ["), std::invalid_argument);
    CHECK_THROWS_WITH_AS(linear_attention(q, k, MatrixF(v.topRows(8)), *map, ok),
                         doctest::Contains("v is ["), std::invalid_argument);
    const MatrixF q_wide = gaussian(7, d + 2, 1).cast<float>();
    const MatrixF k_wide = gaussian(9, d + 2, 2).cast<float>();
    CHECK_THROWS_WITH_AS(linear_attention(q_wide, k_wide, v, *map, ok),
                         doctest::Contains("q has d = 8"), std::invalid_argument);
    const MatrixD qd = q.cast<double>(), kd = k.cast<double>(), vd = v.cast<double>();
    CHECK_THROWS_WITH_AS(linear_attention(qd, MatrixD(kd.leftCols(d - 1)), vd, *map, ok),
                         doctest::Contains("k is ["), std::invalid_argument);
  }
  SUBCASE("rope missing or of the wrong width for the placement") {
    for (const auto placement :
         {RopePlacement::BeforeMap, RopePlacement::NumeratorOnly, RopePlacement::Full}) {
      const std::string placement_name = to_string(placement);
      CAPTURE(placement_name);
      LinearOptions o;
      o.placement = placement;
      o.rope = nullptr;
      CHECK_THROWS_WITH_AS(linear_attention(q, k, v, *map, o), doctest::Contains("rope"),
                           std::invalid_argument);
      // BeforeMap needs width d, the feature placements width m (here m = 10 != d = 6).
      o.rope = placement == RopePlacement::BeforeMap ? &feature_rope : &input_rope;
      CHECK_THROWS_WITH_AS(linear_attention(q, k, v, *map, o), doctest::Contains("rope"),
                           std::invalid_argument);
      o.causal = true;
      CHECK_THROWS_WITH_AS(linear_attention(q, k, v, *map, o), doctest::Contains("rope"),
                           std::invalid_argument);
    }
    LinearOptions none;
    none.placement = RopePlacement::None;
    none.rope = nullptr;
    CHECK_NOTHROW(linear_attention(q, k, v, *map, none));
  }
  SUBCASE("positions beyond 2^53, where RoPE angles are no longer exact") {
    LinearOptions far = ok;
    far.q_offset = (Index(1) << 53) - 3;  // 7 query rows run past 2^53
    CHECK_THROWS_WITH_AS(linear_attention(q, k, v, *map, far),
                         doctest::Contains("options.q_offset is 9007199254740989 with 7 rows"),
                         std::invalid_argument);
    far = ok;
    far.k_offset = -(Index(1) << 53) - 1;
    CHECK_THROWS_WITH_AS(linear_attention(q, k, v, *map, far),
                         doctest::Contains("options.k_offset"), std::invalid_argument);
  }
  SUBCASE("non-finite inputs") {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const float inf = std::numeric_limits<float>::infinity();
    MatrixF bad_q = q, bad_k = k, bad_v = v;
    bad_q(2, 3) = nan;
    bad_k(8, 0) = inf;
    bad_v(4, 2) = -inf;
    CHECK_THROWS_WITH_AS(linear_attention(bad_q, k, v, *map, ok),
                         doctest::Contains("q has the non-finite value"), std::invalid_argument);
    CHECK_THROWS_WITH_AS(linear_attention(q, bad_k, v, *map, ok),
                         doctest::Contains("k has the non-finite value"), std::invalid_argument);
    CHECK_THROWS_WITH_AS(linear_attention(q, k, bad_v, *map, ok),
                         doctest::Contains("v has the non-finite value"), std::invalid_argument);
    LinearOptions causal = ok;
    causal.causal = true;
    CHECK_THROWS_WITH_AS(linear_attention(q, bad_k, v, *map, causal),
                         doctest::Contains("non-finite"), std::invalid_argument);
  }
  SUBCASE("eps and chunk_size") {
    for (const double eps : {-1e-9, std::numeric_limits<double>::quiet_NaN(),
                             std::numeric_limits<double>::infinity()}) {
      CAPTURE(eps);
      LinearOptions o = ok;
      o.eps = eps;
      CHECK_THROWS_WITH_AS(linear_attention(q, k, v, *map, o), doctest::Contains("eps"),
                           std::invalid_argument);
    }
    for (const Index chunk : {0, -3}) {
      CAPTURE(chunk);
      LinearOptions o = ok;
      o.causal = true;
      o.chunk_size = chunk;
      CHECK_THROWS_WITH_AS(linear_attention(q, k, v, *map, o), doctest::Contains("chunk_size"),
                           std::invalid_argument);
    }
  }
  SUBCASE("stream") {
    LinearOptions o = ok;
    o.q_offset = 3;
    o.k_offset = 4;
    CHECK_THROWS_WITH_AS(LinearAttentionStreamF(*map, 3, o), doctest::Contains("q_offset"),
                         std::invalid_argument);
    LinearOptions no_rope = ok;
    no_rope.rope = nullptr;
    CHECK_THROWS_WITH_AS(LinearAttentionStreamF(*map, 3, no_rope), doctest::Contains("rope"),
                         std::invalid_argument);
    LinearOptions bad_eps = ok;
    bad_eps.eps = -1;
    CHECK_THROWS_WITH_AS(LinearAttentionStreamF(*map, 3, bad_eps), doctest::Contains("eps"),
                         std::invalid_argument);
    LinearAttentionStreamF stream(*map, 3, ok);
    CHECK_THROWS_WITH_AS(stream.step(q.topRows(2), k.topRows(3), v.topRows(3)),
                         doctest::Contains("k is ["), std::invalid_argument);
    CHECK_THROWS_WITH_AS(stream.step(q.topRows(2), k.topRows(2), v.topRows(3)),
                         doctest::Contains("v is ["), std::invalid_argument);
    CHECK_THROWS_WITH_AS(stream.step(q.topRows(2), k.topRows(2), MatrixF(v.topRows(2).leftCols(2))),
                         doctest::Contains("v is ["), std::invalid_argument);
    CHECK_THROWS_WITH_AS(stream.step(MatrixF(q.topRows(2).leftCols(5)), k.topRows(2), v.topRows(2)),
                         doctest::Contains("q is ["), std::invalid_argument);
    MatrixF bad = k.topRows(2);
    bad(1, 1) = std::numeric_limits<float>::quiet_NaN();
    CHECK_THROWS_WITH_AS(stream.step(q.topRows(2), bad, v.topRows(2)),
                         doctest::Contains("non-finite"), std::invalid_argument);
    // A rejected step leaves the stream as it was.
    CHECK(stream.position() == 0);
    const MatrixF o1 = stream.step(q.topRows(1), k.topRows(1), v.topRows(1));
    CHECK(o1.allFinite());
    CHECK(stream.position() == 1);
  }
}

TEST_CASE("a non-finite value is found wherever it is: every method, parallel split, unread keys") {
  // The kernels check q, k and v block by block as they read them, not in a scan before. Each
  // position below is read by a different part of them: the first and last blocks, the keys of
  // the parallel split's first pass, the last chunk's keys (causal: read, never absorbed), and
  // (causal) keys past the last query, which no query sees and the kernels never read. The message
  // must still name the first bad value of q, k, then v. The thread count is set here, so that
  // n = 700 (causal) is split into two segments whatever the machine gives.
  const ThreadCount threads(kSplitThreads);
  const Index d = 6, d_v = 3;
  const auto elu = small_map(FeatureMapKind::EluPlusOne, d);
  const auto favor = small_map(FeatureMapKind::FavorPositive, d);
  const Rope feature_rope(RopeConfig{.dim = favor->output_dim()});
  const float inf = std::numeric_limits<float>::infinity();
  struct Method {
    const char* name;
    bool causal;
    CausalMethod method;
  };
  for (const Method method :
       {Method{"noncausal", false, CausalMethod::Chunked},
        Method{"chunked", true, CausalMethod::Chunked}, Method{"scan", true, CausalMethod::Scan}})
    for (const Index n : {Index(0), Index(7), Index(700)}) {  // 700: split across threads
      const Index n_k = n + 40;  // causal: keys from n (n - 4 for FAVOR+) on lie past every query
      const MatrixF q = gaussian(n, d, 11).cast<float>(), k = gaussian(n_k, d, 12).cast<float>(),
                    v = gaussian(n_k, d_v, 13).cast<float>();
      for (const bool use_favor : {false, true}) {
        LinearOptions options;
        options.q_offset = use_favor ? 3 : 0;  // FAVOR+: queries 4 positions behind the keys
        options.k_offset = use_favor ? 7 : 0;
        options.causal = method.causal;
        options.method = method.method;
        options.placement = use_favor ? RopePlacement::NumeratorOnly : RopePlacement::None;
        options.rope = use_favor ? &feature_rope : nullptr;
        const FeatureMap& map = use_favor ? *favor : *elu;
        struct Bad {
          char tensor;
          Index row, col;
        };
        std::vector<Bad> cases = {{'k', 0, 1}, {'k', n_k - 1, 4}, {'k', n_k / 2, 0},
                                  {'v', 0, 2}, {'v', n_k - 1, 0}, {'v', n_k / 2 + 3, 1}};
        // v's row n - 1 (causal, elu+1): the last chunk's keys, which are never absorbed.
        if (n > 0)
          cases.insert(cases.end(),
                       {{'q', 0, 0}, {'q', n - 1, 3}, {'q', n / 2, 2}, {'v', n - 1, 1}});
        for (const Bad& bad : cases) {
          CAPTURE(method.name);
          CAPTURE(n);
          CAPTURE(use_favor);
          CAPTURE(bad.tensor);
          CAPTURE(bad.row);
          MatrixF bq = q, bk = k, bv = v;
          MatrixF& target = bad.tensor == 'q' ? bq : bad.tensor == 'k' ? bk : bv;
          target(bad.row, bad.col) = -inf;
          const std::string want = std::string(1, bad.tensor) +
                                   " has the non-finite value -inf at row " +
                                   std::to_string(bad.row) + ", column " + std::to_string(bad.col);
          CHECK_THROWS_WITH_AS(linear_attention(bq, bk, bv, map, options),
                               doctest::Contains(want.c_str()), std::invalid_argument);
        }
        // Two bad values: q's is named, whichever the kernel reads first.
        if (n > 0) {
          MatrixF bq = q, bv = v;
          bq(n - 1, 0) = inf;
          bv(0, 0) = inf;
          CHECK_THROWS_WITH_AS(linear_attention(bq, k, bv, map, options),
                               doctest::Contains("q has the non-finite value"),
                               std::invalid_argument);
        }
      }
    }
}

TEST_CASE("placement names round-trip") {
  for (const auto placement : kPlacements)
    CHECK(rope_placement_from_string(to_string(placement)) == placement);
  CHECK(std::string(to_string(RopePlacement::NumeratorOnly)) == "numerator_only");
  CHECK_THROWS_WITH_AS(rope_placement_from_string("sideways"),
                       doctest::Contains("placement is \"sideways\" but expected one of none, "
                                         "before_map, numerator_only, full"),
                       std::invalid_argument);
}

TEST_CASE("causal method names round-trip") {
  for (const auto method : {CausalMethod::Chunked, CausalMethod::Scan})
    CHECK(causal_method_from_string(to_string(method)) == method);
  CHECK(std::string(to_string(CausalMethod::Scan)) == "scan");
  CHECK_THROWS_WITH_AS(causal_method_from_string("cumsum"),
                       doctest::Contains("method is \"cumsum\" but expected one of chunked, scan"),
                       std::invalid_argument);
  CHECK_THROWS_AS(to_string(static_cast<CausalMethod>(7)), std::invalid_argument);
}

TEST_CASE("a subnormal denominator with eps = 0 still gives the exact weighted average") {
  // relu features of q = k = [1e-160, 0] are [1e-160, 0]: den = 1e-320 (subnormal) and
  // num = 1e-320 v. 1 / den overflows to inf, so the output must be num / den, not num * (1 / den):
  // exactly v (one key), where the product would give inf and, for v_c = 0, NaN.
  const auto map = make_feature_map({.kind = FeatureMapKind::Relu, .input_dim = 2});
  MatrixD q(1, 2), k(1, 2), v(1, 2);
  q << 1e-160, 0;
  k << 1e-160, 0;
  v << 0, 3;
  for (const bool causal : {false, true}) {
    CAPTURE(causal);
    const MatrixD out = linear_attention(
        q, k, v, *map, {.causal = causal, .placement = RopePlacement::None, .eps = 0});
    CHECK(out(0, 0) == 0.0);
    CHECK(out(0, 1) == doctest::Approx(3.0).epsilon(1e-12));
  }
}

// ---------------------------------------------------------------------------------------------
// The comparison helper itself (tests/check_close.hpp).

TEST_CASE("check_close's minimum: a comparison that skipped every row, or had none, fails") {
  // check_close skips rows whose tolerance is +inf (ill-conditioned). Without a minimum on the
  // rows compared, a case whose rows were all skipped passed having compared nothing: the
  // earlier rule (skipped * 10 <= rows + 9) accepted 1 skipped row out of 1. The output here is
  // wrong at O(1000), so any comparison that looked at it would fail.
  using linrope::testing::compare_rows;
  using linrope::testing::enough_rows_compared;
  const double inf = std::numeric_limits<double>::infinity();
  const MatrixD want = MatrixD::Zero(1, 2);
  const MatrixF wrong = MatrixF::Constant(1, 2, 1000.0f);
  const auto all_skipped = compare_rows(wrong, want, VectorD::Constant(1, inf), 1, 1);
  CHECK(all_skipped.compared == 0);
  CHECK(all_skipped.failed == 0);                       // nothing compared, nothing failed...
  CHECK_FALSE(enough_rows_compared(all_skipped, 10));   // ...and check_close fails it
  CHECK_FALSE(enough_rows_compared(all_skipped, 100));  // whatever share a caller allows
  // No rows at all.
  const auto none = compare_rows(MatrixF(0, 2), MatrixD(0, 2), VectorD(0), 1, 0);
  CHECK(none.compared == 0);
  CHECK_FALSE(enough_rows_compared(none, 10));
  // Compared, the wrong row is caught.
  const auto compared = compare_rows(wrong, want, VectorD::Constant(1, 1.0), 1, 1);
  CHECK(compared.compared == 1);
  CHECK(compared.failed == 1);
  CHECK(compared.worst == 0);
  CHECK(enough_rows_compared(compared, 10));

  // The share, on 10 rows within tolerance: at 10%, 1 skipped row passes and 2 do not; at 50%
  // (the signed FavorTrig cases at large norms), 5 pass and 6 do not.
  const MatrixF ten = MatrixF::Zero(10, 2);
  const MatrixD want_ten = MatrixD::Zero(10, 2);
  const auto skipping = [&](Index skipped) {
    VectorD tol = VectorD::Constant(10, 1.0);
    tol.head(skipped).setConstant(inf);
    const auto r = compare_rows(ten, want_ten, tol, 1, 10);
    CHECK(r.compared == 10 - skipped);
    CHECK(r.failed == 0);
    return r;
  };
  CHECK(enough_rows_compared(skipping(1), 10));
  CHECK_FALSE(enough_rows_compared(skipping(2), 10));
  CHECK(enough_rows_compared(skipping(5), 50));
  CHECK_FALSE(enough_rows_compared(skipping(6), 50));
  CHECK_FALSE(enough_rows_compared(skipping(10), 100));
}
