// Multi-head attention over [batch, heads, n, d] buffers (include/linrope/batched.hpp): every
// (b, h) slice must give what the single-head call gives on that slice (to rounding: the batched
// path may split the sequence differently), `lengths` must mask keys and leave padded output rows
// untouched, statistics accumulate over slices, and bad views throw.
//
// Tolerances. Linear attention: the single-head call and the batched slice are both within the
// reference's bound tol_i of the exact output (tests/reference/linear_reference.hpp, derivation in
// tests/test_linear_attention.cpp), so they differ by at most 2 tol_i. Softmax attention:
// o_i = sum_j p_ij v_j with p = softmax(s); each logit s_ij = scale <R q_i, R k_j> errs by at most
// (d + 4) u scale |q_i| |k_j| (dot product plus rotation), which moves every weight by at most
// twice that relatively, and normalising adds (n_k + 4) u; a convex combination of v then errs by
// at most (2 max|ds| + (n_k + 4) u) max|v|. Twice that (two results) with a margin of 8 is `tol`.
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
using linrope::testing::check_close;
using linrope::testing::gaussian;
using linrope::testing::kSplitThreads;
using linrope::testing::ThreadCount;
using ref::VectorD;

constexpr double kSentinel = 12345;

// A contiguous [batch, heads, rows, cols] buffer of N(0, scale^2), one seed per slice.
template <class T>
struct Buffer {
  Buffer(Index batch_, Index heads_, Index rows_, Index cols_, std::uint64_t seed, double scale)
      : batch(batch_),
        heads(heads_),
        rows(rows_),
        cols(cols_),
        data(std::size_t(batch_ * heads_ * rows_ * cols_)) {
    for (Index b = 0; b < batch; ++b)
      for (Index h = 0; h < heads; ++h) {
        const Matrix<T> x =
            gaussian(rows, cols, seed + std::uint64_t(100 * b + h), scale).template cast<T>();
        slice(b, h) = x;
      }
  }
  Eigen::Map<Matrix<T>> slice(Index b, Index h) {
    return {data.data() + ((b * heads + h) * rows) * cols, rows, cols};
  }
  Matrix<T> slice(Index b, Index h) const {
    return Eigen::Map<const Matrix<T>>(data.data() + ((b * heads + h) * rows) * cols, rows, cols);
  }
  Heads<const T> view(const Index* lengths = nullptr) const {
    return {data.data(), batch, heads, rows, cols, lengths};
  }
  Heads<T> out_view(const Index* lengths = nullptr) {
    return {data.data(), batch, heads, rows, cols, lengths};
  }
  Index batch, heads, rows, cols;
  std::vector<T> data;
};

// Rows at or past `length` must still hold the sentinel.
template <class T>
void check_untouched(const Matrix<T>& got, Index length) {
  Index touched = 0;
  for (Index i = length; i < got.rows(); ++i)
    for (Index c = 0; c < got.cols(); ++c) touched += got(i, c) != T(kSentinel);
  CHECK(touched == 0);
}

struct LinearCase {
  FeatureMapKind kind;
  RopePlacement placement;
  bool causal;
};

// The maps here: 10 random features for FAVOR+ maps, seed 11.
std::unique_ptr<FeatureMap> batch_map(FeatureMapKind kind, Index d) {
  return linrope::testing::make_map(kind, d, linrope::testing::favor_features(kind, 10), 11);
}

// Batched linear attention against single-head calls on every slice (truncated to lengths[b] when
// lengths are given), with statistics accumulated over the slices.
template <class T>
void check_linear_method(const LinearCase& c, CausalMethod method, Index batch, Index heads,
                         Index n, Index n_k, const std::vector<Index>& lengths) {
  const std::string map_name = to_string(c.kind), placement = to_string(c.placement);
  CAPTURE(int(method));
  const std::string type = sizeof(T) == 4 ? "float" : "double";
  CAPTURE(map_name);
  CAPTURE(placement);
  CAPTURE(c.causal);
  CAPTURE(type);
  CAPTURE(batch);
  CAPTURE(heads);
  CAPTURE(n);
  CAPTURE(n_k);
  CAPTURE(lengths.size());
  const Index d = 6, d_v = 5;
  const auto map = batch_map(c.kind, d);
  const Index m = map->output_dim();
  std::optional<Rope> rope;
  std::optional<ref::RopeSpec> spec;
  if (c.placement != RopePlacement::None) {
    RopeConfig config;
    config.dim = c.placement == RopePlacement::BeforeMap ? d : m;
    config.base = 100;
    config.layout = RopeLayout::Half;
    rope.emplace(config);
    spec = ref::rope_spec(config);
  }
  LinearOptions options;
  options.causal = c.causal;
  options.placement = c.placement;
  options.rope = rope ? &*rope : nullptr;
  options.q_offset = n_k - n + 2;  // queries are the last n positions of the keys
  options.k_offset = 2;
  options.method = method;
  options.chunk_size = 8;

  const Buffer<T> q(batch, heads, n, d, 1, 0.7), k(batch, heads, n_k, d, 2, 0.7),
      v(batch, heads, n_k, d_v, 3, 1.0);
  Buffer<T> out(batch, heads, n, d_v, 4, 1.0);
  std::fill(out.data.begin(), out.data.end(), T(kSentinel));
  const Index* len = lengths.empty() ? nullptr : lengths.data();
  DenominatorStats stats;
  stats.threshold = 5.0;
  linear_attention(q.view(len), k.view(len), v.view(len), out.out_view(len), *map, options, &stats);

  // Expected statistics: the reference's den over every (b, h) slice's valid rows.
  ref::LinearResult all;
  std::vector<double> den, den_mag;
  std::vector<Index> admissible;
  double gamma_max = 0;
  for (Index b = 0; b < batch; ++b)
    for (Index h = 0; h < heads; ++h) {
      CAPTURE(b);
      CAPTURE(h);
      const Index rows = len ? len[b] : n, keys = len ? len[b] : n_k;
      const Matrix<T> qs = q.slice(b, h).topRows(rows), ks = k.slice(b, h).topRows(keys),
                      vs = v.slice(b, h).topRows(keys);
      const Matrix<T> single = linear_attention(qs, ks, vs, *map, options);
      const Matrix<T> got = out.slice(b, h);
      const ref::LinearResult want = ref::linear_attention(
          qs.template cast<double>(), ks.template cast<double>(), vs.template cast<double>(),
          ref::feature_formula(*map), linrope::testing::reference_spec(options, spec));
      const double z = std::max(ref::exponent_size(*map, qs.template cast<double>()),
                                ref::exponent_size(*map, ks.template cast<double>()));
      const double gamma = ref::rounding_gamma<T>(m, d, keys, z);
      gamma_max = std::max(gamma_max, gamma);
      const VectorD tol = ref::row_tolerances(want, gamma, options.eps);
      // A slice of length 0 has no row to compare (check_close would fail it): check_untouched
      // below shows that its output was left alone.
      if (rows > 0) {
        check_close<T>(got, want.out, tol, "batched slice vs reference", 1, rows);
        check_close<T>(got, single.template cast<double>(), 2 * tol,
                       "batched slice vs single-head call", 1, rows);
      }
      check_untouched(got, rows);
      for (Index i = 0; i < rows; ++i) {
        den.push_back(want.den(i));
        den_mag.push_back(gamma * want.den_magnitude(i));
        admissible.push_back(want.admissible[std::size_t(i)]);
      }
    }
  // Accumulated statistics: every (b, h) slice's valid rows, each den_i within gamma D_i.
  linrope::testing::check_denominator_stats(
      stats, Eigen::Map<const VectorD>(den.data(), Index(den.size())),
      Eigen::Map<const VectorD>(den_mag.data(), Index(den_mag.size())), admissible, 5.0);
}

// Causal cases run both methods (Chunked with chunks of 8, and Scan).
template <class T>
void check_linear(const LinearCase& c, Index batch, Index heads, Index n, Index n_k,
                  const std::vector<Index>& lengths) {
  check_linear_method<T>(c, CausalMethod::Chunked, batch, heads, n, n_k, lengths);
  if (c.causal) check_linear_method<T>(c, CausalMethod::Scan, batch, heads, n, n_k, lengths);
}

// Batched softmax attention against single-head softmax_attention on every slice.
template <class T>
void check_softmax(bool causal, bool with_rope, Index batch, Index heads, Index n, Index n_k,
                   const std::vector<Index>& lengths) {
  const std::string type = sizeof(T) == 4 ? "float" : "double";
  CAPTURE(causal);
  CAPTURE(with_rope);
  CAPTURE(type);
  CAPTURE(batch);
  CAPTURE(heads);
  CAPTURE(n);
  CAPTURE(n_k);
  CAPTURE(lengths.size());
  const Index d = 6, d_v = 5;
  std::optional<Rope> rope;
  if (with_rope) rope.emplace(RopeConfig{.dim = d, .base = 100});
  SoftmaxOptions options;
  options.causal = causal;
  options.rope = rope ? &*rope : nullptr;
  options.q_offset = n_k - n;
  options.k_offset = 0;
  options.block_size = 8;
  const Buffer<T> q(batch, heads, n, d, 5, 1.0), k(batch, heads, n_k, d, 6, 1.0),
      v(batch, heads, n_k, d_v, 7, 1.0);
  Buffer<T> out(batch, heads, n, d_v, 8, 1.0);
  std::fill(out.data.begin(), out.data.end(), T(kSentinel));
  const Index* len = lengths.empty() ? nullptr : lengths.data();
  softmax_attention(q.view(len), k.view(len), v.view(len), out.out_view(len), options);
  const double u = std::numeric_limits<T>::epsilon() / 2, scale = 1 / std::sqrt(double(d));
  for (Index b = 0; b < batch; ++b)
    for (Index h = 0; h < heads; ++h) {
      CAPTURE(b);
      CAPTURE(h);
      const Index rows = len ? len[b] : n, keys = len ? len[b] : n_k;
      const Matrix<T> qs = q.slice(b, h).topRows(rows), ks = k.slice(b, h).topRows(keys),
                      vs = v.slice(b, h).topRows(keys);
      const Matrix<T> single = softmax_attention(qs, ks, vs, options);
      const Matrix<T> got = out.slice(b, h);
      double qn = 0, kn = 0, vmax = 0;
      if (rows > 0) qn = qs.template cast<double>().rowwise().norm().maxCoeff();
      if (keys > 0) {
        kn = ks.template cast<double>().rowwise().norm().maxCoeff();
        vmax = vs.template cast<double>().cwiseAbs().maxCoeff();
      }
      const double ds = double(d + 4) * u * scale * qn * kn;
      const double tol = 8 * 2 * (2 * ds + double(keys + 4) * u) * vmax;
      if (rows > 0)  // as in check_linear_method
        check_close<T>(got, single.template cast<double>(), VectorD::Constant(rows, tol),
                       "batched slice vs single-head call", 1, rows);
      check_untouched(got, rows);
    }
}

}  // namespace

TEST_CASE("batched linear attention equals the single-head call on every slice") {
  const LinearCase cases[] = {
      {FeatureMapKind::EluPlusOne, RopePlacement::NumeratorOnly, true},
      {FeatureMapKind::EluPlusOne, RopePlacement::None, false},
      {FeatureMapKind::FavorPositive, RopePlacement::Full, true},
      {FeatureMapKind::FavorPositive, RopePlacement::BeforeMap, false},
      {FeatureMapKind::FavorTrig, RopePlacement::NumeratorOnly, false},
      {FeatureMapKind::OnePlusCosine, RopePlacement::BeforeMap, true},
      {FeatureMapKind::FavorHyperbolic, RopePlacement::Full, false},
      {FeatureMapKind::Relu, RopePlacement::NumeratorOnly, true},
  };
  for (const auto& c : cases) {
    // batch 2, heads 3, odd n; self-attention and a block of queries against a longer cache.
    check_linear<float>(c, 2, 3, 37, 37, {});
    check_linear<double>(c, 2, 3, 37, 37, {});
    check_linear<float>(c, 2, 3, 13, 41, {});
    check_linear<double>(c, 2, 3, 13, 41, {});
  }
}

TEST_CASE("batched linear attention: lengths mask padded keys and leave padded rows untouched") {
  const LinearCase cases[] = {
      {FeatureMapKind::EluPlusOne, RopePlacement::NumeratorOnly, true},
      {FeatureMapKind::EluPlusOne, RopePlacement::NumeratorOnly, false},
      {FeatureMapKind::FavorPositive, RopePlacement::Full, true},
      {FeatureMapKind::FavorPositive, RopePlacement::Full, false},
      {FeatureMapKind::OnePlusCosine, RopePlacement::BeforeMap, false},
  };
  for (const auto& c : cases) {
    check_linear<float>(c, 2, 3, 37, 37, {31, 17});
    check_linear<double>(c, 2, 3, 37, 37, {37, 0});
    check_linear<float>(c, 3, 2, 37, 37, {1, 36, 37});
  }
}

TEST_CASE("batched linear attention: one long head is split along the sequence") {
  // Fewer slices than threads (one slice, 2 threads set here whatever the machine gives): the
  // batched path runs the slice with the whole team, which splits it along the sequence when it
  // is long enough: causal into segments of at least 256 queries (n = 600: two), non-causal into
  // parts of 512 keys and queries (n = 1100: two). With lengths, the split follows the valid rows.
  const ThreadCount threads(kSplitThreads);
  for (const bool causal : {false, true}) {
    const LinearCase c{FeatureMapKind::FavorPositive, RopePlacement::NumeratorOnly, causal};
    const Index n = causal ? 600 : 1100;
    check_linear<float>(c, 1, 1, n, n, {});
    check_linear<double>(c, 1, 1, n, n, {});
    check_linear<float>(c, 1, 1, n, n, {n - 51});
  }
}

TEST_CASE("batched softmax attention equals the single-head call on every slice") {
  for (const bool causal : {false, true})
    for (const bool with_rope : {false, true}) {
      check_softmax<float>(causal, with_rope, 2, 3, 37, 37, {});
      check_softmax<double>(causal, with_rope, 2, 3, 37, 37, {});
      check_softmax<float>(causal, with_rope, 2, 3, 13, 41, {});
      check_softmax<float>(causal, with_rope, 2, 3, 37, 37, {31, 17});
      check_softmax<double>(causal, with_rope, 2, 3, 37, 37, {37, 0});
      check_softmax<float>(causal, with_rope, 1, 1, 301, 301, {});
      check_softmax<float>(causal, with_rope, 1, 1, 301, 301, {250});
    }
}

TEST_CASE("batched: padding may hold anything, even NaN") {
  // Non-finite values are only rejected within the lengths: padding is never read as data.
  const Index n = 21, d = 6;
  const auto map = batch_map(FeatureMapKind::EluPlusOne, d);
  const Rope rope(RopeConfig{.dim = d});
  LinearOptions options;
  options.rope = &rope;
  Buffer<float> q(2, 3, n, d, 1, 0.7), k(2, 3, n, d, 2, 0.7), v(2, 3, n, 4, 3, 1.0);
  Buffer<float> out(2, 3, n, 4, 4, 1.0);
  const std::vector<Index> lengths = {15, 21};
  for (Index h = 0; h < 3; ++h) {
    q.slice(0, h).bottomRows(n - 15).setConstant(std::numeric_limits<float>::quiet_NaN());
    k.slice(0, h).bottomRows(n - 15).setConstant(std::numeric_limits<float>::infinity());
    v.slice(0, h).bottomRows(n - 15).setConstant(std::numeric_limits<float>::quiet_NaN());
  }
  // Non-causal, so that a kernel reading padded keys would be caught (causally, the valid queries
  // of a self-attention never reach them).
  for (const bool causal : {false, true})
    for (const bool softmax : {false, true}) {
      CAPTURE(causal);
      CAPTURE(softmax);
      std::fill(out.data.begin(), out.data.end(), float(kSentinel));
      options.causal = causal;
      if (softmax) {
        softmax_attention(q.view(lengths.data()), k.view(lengths.data()), v.view(lengths.data()),
                          out.out_view(lengths.data()), {.causal = causal, .rope = &rope});
      } else {
        linear_attention(q.view(lengths.data()), k.view(lengths.data()), v.view(lengths.data()),
                         out.out_view(lengths.data()), *map, options);
      }
      for (Index b = 0; b < 2; ++b)
        for (Index h = 0; h < 3; ++h) {
          CAPTURE(b);
          CAPTURE(h);
          const MatrixF got = out.slice(b, h);
          CHECK(got.topRows(lengths[std::size_t(b)]).allFinite());
          check_untouched(got, lengths[std::size_t(b)]);
        }
    }
}

TEST_CASE("batched: bad views throw std::invalid_argument naming the argument") {
  const Index d = 6;
  const auto map = batch_map(FeatureMapKind::EluPlusOne, d);
  const Rope rope(RopeConfig{.dim = d});
  LinearOptions lo;
  lo.rope = &rope;
  const SoftmaxOptions so;
  const Buffer<float> q(2, 3, 7, d, 1, 1.0), k(2, 3, 9, d, 2, 1.0), v(2, 3, 9, 4, 3, 1.0);
  Buffer<float> out(2, 3, 7, 4, 4, 1.0);
  REQUIRE_NOTHROW(linear_attention(q.view(), k.view(), v.view(), out.out_view(), *map, lo));
  REQUIRE_NOTHROW(softmax_attention(q.view(), k.view(), v.view(), out.out_view(), so));

  // Each entry: a broken copy of the four views and the text the message must contain.
  struct Bad {
    const char* what;
    Heads<const float> q, k, v;
    Heads<float> out;
  };
  std::vector<Bad> bad;
  auto add = [&](const char* what, auto edit) {
    Bad b{what, q.view(), k.view(), v.view(), out.out_view()};
    edit(b);
    bad.push_back(b);
  };
  add("q.data", [](Bad& b) { b.q.data = nullptr; });
  add("k.data", [](Bad& b) { b.k.data = nullptr; });
  add("v.data", [](Bad& b) { b.v.data = nullptr; });
  add("out.data", [](Bad& b) { b.out.data = nullptr; });
  add("k is [", [](Bad& b) { b.k.heads = 2; });
  add("out is [", [](Bad& b) { b.out.heads = 1; });
  add("v is [", [](Bad& b) { b.v.batch = 1; });
  add("batch", [](Bad& b) { b.q.batch = 1; });
  add("k is [", [](Bad& b) { b.k.d = d - 1; });
  add("v is [", [](Bad& b) { b.v.n = 8; });
  add("out is [", [](Bad& b) { b.out.n = 6; });
  add("out is [", [](Bad& b) { b.out.d = 3; });
  static const Index too_long[] = {7, 10}, negative[] = {-1, 3};
  add("lengths",
      [](Bad& b) { b.q.lengths = b.k.lengths = b.v.lengths = b.out.lengths = too_long; });
  add("lengths",
      [](Bad& b) { b.q.lengths = b.k.lengths = b.v.lengths = b.out.lengths = negative; });
  for (const auto& b : bad) {
    CAPTURE(b.what);
    CHECK_THROWS_WITH_AS(linear_attention(b.q, b.k, b.v, b.out, *map, lo),
                         doctest::Contains(b.what), std::invalid_argument);
    CHECK_THROWS_WITH_AS(softmax_attention(b.q, b.k, b.v, b.out, so), doctest::Contains(b.what),
                         std::invalid_argument);
  }

  // Non-finite values within the lengths, a missing rope.
  Buffer<float> nan_q(2, 3, 7, d, 1, 1.0);
  nan_q.slice(1, 2)(3, 1) = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_WITH_AS(linear_attention(nan_q.view(), k.view(), v.view(), out.out_view(), *map, lo),
                       doctest::Contains("non-finite"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(softmax_attention(nan_q.view(), k.view(), v.view(), out.out_view(), so),
                       doctest::Contains("non-finite"), std::invalid_argument);
  // Two bad slices: the first in (b, h) order is named, whichever thread reaches its own first.
  // (The linear kernels find non-finite values as they read them, each slice on its own thread:
  // 2 threads set here, whatever the machine gives.)
  const ThreadCount threads(kSplitThreads);
  Buffer<float> bad_k(2, 3, 9, d, 2, 1.0), bad_v(2, 3, 9, 4, 3, 1.0);
  bad_k.slice(1, 0)(8, 5) = -std::numeric_limits<float>::infinity();
  bad_v.slice(0, 2)(0, 3) = std::numeric_limits<float>::quiet_NaN();
  for (const bool causal : {false, true}) {
    CAPTURE(causal);
    LinearOptions o = lo;
    o.causal = causal;
    CHECK_THROWS_WITH_AS(
        linear_attention(q.view(), bad_k.view(), bad_v.view(), out.out_view(), *map, o),
        doctest::Contains("v[0, 2] has the non-finite value nan at row 0, column 3"),
        std::invalid_argument);
    CHECK_THROWS_WITH_AS(
        linear_attention(q.view(), bad_k.view(), v.view(), out.out_view(), *map, o),
        doctest::Contains("k[1, 0] has the non-finite value -inf at row 8, column 5"),
        std::invalid_argument);
  }
  CHECK_THROWS_WITH_AS(softmax_attention(q.view(), bad_k.view(), bad_v.view(), out.out_view(), so),
                       doctest::Contains("v[0, 2] has the non-finite value nan"),
                       std::invalid_argument);
  LinearOptions no_rope = lo;
  no_rope.rope = nullptr;
  CHECK_THROWS_WITH_AS(
      linear_attention(q.view(), k.view(), v.view(), out.out_view(), *map, no_rope),
      doctest::Contains("rope"), std::invalid_argument);
}
