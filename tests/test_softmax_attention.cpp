// Exact softmax attention: the streaming kernel against the naive n x n reference (explicit
// rotation matrices) over swept shapes, block sizes, offsets and cross attention; properties
// (relative position invariance, causality, large norms, determinism); and every bad input.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <linrope/attention.hpp>
#include <memory>
#include <string>
#include <vector>

#include "reference/softmax_reference.hpp"
#include "softmax/softmax_kernel.hpp"  // the per-head kernel that batched.cpp calls
#include "softmax_cases.hpp"
#include "threads.hpp"

namespace {

using linrope::Index;
using linrope::MatrixD;
using linrope::MatrixF;
using linrope::Rope;
using linrope::RopeConfig;
using linrope::RopeLayout;
using linrope::SoftmaxOptions;
using linrope::testing::default_scale;
using linrope::testing::describe;
using linrope::testing::for_each_large_norm_case;
using linrope::testing::input;
using linrope::testing::kernel_options;
using linrope::testing::kNoRope;
using linrope::testing::kRopeCases;
using linrope::testing::kSplitThreads;
using linrope::testing::max_row_norm;
using linrope::testing::PositionCase;
using linrope::testing::reference_options;
using linrope::testing::RopeCase;
using linrope::testing::Ropes;
using linrope::testing::score_error;
using linrope::testing::ThreadCount;
namespace ref = linrope::reference;

template <class T>
MatrixD run(const MatrixD& q, const MatrixD& k, const MatrixD& v, const SoftmaxOptions& options) {
  using M = linrope::Matrix<T>;
  const M qt = q.cast<T>(), kt = k.cast<T>(), vt = v.cast<T>();
  return linrope::softmax_attention(qt, kt, vt, options).template cast<double>();
}

// Bound on |fast - reference| for every output, from the rounding of T (unit roundoff u):
//  - every score is off by <= e_s (score_error, softmax_cases.hpp);
//  - moving every score by <= e_s moves a softmax average of v by <= 2 e_s max|v|;
//  - the exp (a few ulp: 4u), the running sum and the P V accumulation over n_k terms
//    (<= n_k u each) and the division (u): <= (2 n_k + 8) u max|v|.
// Total max|v| (2 e_s + (2 n_k + 8) u), times 4: the bound is first-order, and the double
// reference rounds too (for T = double its errors are of the same size as the kernel's).
template <class T>
double tolerance(const MatrixD& q, const MatrixD& k, const MatrixD& v, double scale,
                 Index max_position) {
  const double u = std::numeric_limits<T>::epsilon() / 2;
  const double n_k = double(k.rows());
  const double e_s = score_error<T>(q, k, scale, max_position);
  const double v_max = v.size() == 0 ? 0.0 : v.cwiseAbs().maxCoeff();
  return 4 * v_max * (2 * e_s + (2 * n_k + 8) * u);
}

// Compares float and double runs of `options` (rope, block size and scale set by the caller) with
// the reference, at the tolerance derived above.
void check_against_reference(const MatrixD& q, const MatrixD& k, const MatrixD& v,
                             const SoftmaxOptions& options, const ref::PlainRope* plain,
                             const MatrixD& expected) {
  const double scale = options.scale != 0 ? options.scale : default_scale(q.cols());
  const Index max_position =
      std::max({std::abs(options.q_offset) + q.rows(), std::abs(options.k_offset) + k.rows()});
  const Index p_max = plain != nullptr ? max_position : 0;
  const MatrixD got_d = run<double>(q, k, v, options);
  const MatrixD got_f = run<float>(q, k, v, options);
  REQUIRE(got_d.rows() == expected.rows());
  REQUIRE(got_d.cols() == expected.cols());
  REQUIRE(got_f.rows() == expected.rows());
  REQUIRE(got_f.cols() == expected.cols());
  if (expected.size() == 0) return;
  const double tol_d = tolerance<double>(q, k, v, scale, p_max);
  const double tol_f = tolerance<float>(q, k, v, scale, p_max);
  const double err_d = (got_d - expected).cwiseAbs().maxCoeff();
  const double err_f = (got_f - expected).cwiseAbs().maxCoeff();
  CAPTURE(tol_d);
  CAPTURE(tol_f);
  CHECK(err_d <= tol_d);
  CHECK(err_f <= tol_f);
}

}  // namespace

TEST_CASE("softmax_attention matches the naive reference: self-attention sweep") {
  const Index lengths[] = {1, 2, 63, 64, 65, 1000};
  const Index widths[] = {1, 8, 33, 64};
  const Index block_sizes[] = {0, 1, 7, 64};
  std::uint64_t seed = 100;
  for (const bool causal : {false, true})
    for (const Index n : lengths)
      for (const Index d : widths) {
        // n = 1000 only at d = 8, with one rope and the default block (256, which does not divide
        // 1000 either): each such run is ~30 MFLOP of GEMM, slow in an unoptimised sanitizer build.
        const bool long_case = n == 1000;
        if (long_case && d != 8) continue;
        std::vector<RopeCase> rope_cases{kNoRope};
        if (d % 2 == 0) rope_cases.push_back(kRopeCases[0]);
        if (d % 2 == 0 && !long_case) rope_cases.push_back(kRopeCases[1]);
        const Index d_v = d + 3;  // d_v != d: catches a swapped width
        const MatrixD q = input(n, d, ++seed), k = input(n, d, ++seed), v = input(n, d_v, ++seed);
        for (const RopeCase& rope_case : rope_cases) {
          const Ropes ropes(rope_case, d);
          const MatrixD expected =
              ref::softmax_attention(q, k, v, {.causal = causal, .rope = ropes.reference()});
          for (const Index block_size : block_sizes) {
            if (long_case && block_size != 0) continue;
            CAPTURE(causal);
            CAPTURE(n);
            CAPTURE(d);
            CAPTURE(d_v);
            CAPTURE(rope_case.name);
            CAPTURE(block_size);
            const SoftmaxOptions options{
                .causal = causal, .rope = ropes.fast(), .block_size = block_size};
            check_against_reference(q, k, v, options, ropes.reference(), expected);
          }
        }
      }
}

TEST_CASE("softmax_attention matches the reference: cross attention, offsets, key caches") {
  const PositionCase cases[] = {
      {5, 70, 65, 0, true},      // decoding against a cache: the last query sees all 70 keys
      {65, 130, 65, 0, true},    // second half of a sequence; the last block sees the whole cache
      {1, 1000, 999, 0, true},   // one new token against a long cache
      {40, 20, 0, 10, true},     // queries 0..9 precede every key: zero rows
      {33, 7, 0, 0, false},      // cross attention, fewer keys than queries
      {7, 200, 0, 0, false},     // cross attention, more keys than queries
      {50, 90, 3, -4, true},     // negative key positions
      {64, 129, 100, 36, true},  // offsets that do not align with any block
      // Few queries, many keys: the keys are cut into slices whose states are merged.
      {5, 3000, 2995, 0, true},
      {20, 2500, 0, 0, false},
      {3, 2100, 500, 0, true},  // a slice past every query: an empty state in the merge
  };
  const Index d = 16, d_v = 9;
  std::uint64_t seed = 500;
  for (const PositionCase& c : cases) {
    const MatrixD q = input(c.n, d, ++seed), k = input(c.n_k, d, ++seed),
                  v = input(c.n_k, d_v, ++seed);
    for (const RopeCase& rope_case : {kNoRope, kRopeCases[0], kRopeCases[1]}) {
      const Ropes ropes(rope_case, d);
      const MatrixD expected = ref::softmax_attention(q, k, v, reference_options(c, ropes));
      for (const Index block_size : {0, 7, 64}) {
        const std::string where = describe(c, rope_case, block_size);
        CAPTURE(where);
        const SoftmaxOptions options = kernel_options(c, ropes, block_size);
        check_against_reference(q, k, v, options, ropes.reference(), expected);
        if (c.causal && c.k_offset > c.q_offset) {
          // Queries before the first key have no admissible key: exactly zero, not NaN.
          const Index empty_rows = std::min(c.n, c.k_offset - c.q_offset);
          const MatrixD got = run<float>(q, k, v, options);
          CHECK(got.topRows(empty_rows).cwiseAbs().maxCoeff() == 0.0);
          CHECK(got.bottomRows(c.n - empty_rows).cwiseAbs().maxCoeff() > 0.0);
        }
      }
    }
  }
}

TEST_CASE("softmax_attention: an explicit scale replaces 1/sqrt(d)") {
  const Index n = 70, d = 12, d_v = 5;
  const MatrixD q = input(n, d, 1), k = input(n, d, 2), v = input(n, d_v, 3);
  const Ropes ropes(kRopeCases[0], d);
  for (const double scale : {0.37, 2.5})
    for (const bool causal : {false, true}) {
      CAPTURE(scale);
      CAPTURE(causal);
      const MatrixD expected = ref::softmax_attention(
          q, k, v, {.causal = causal, .scale = scale, .rope = ropes.reference()});
      check_against_reference(q, k, v, {.causal = causal, .scale = scale, .rope = ropes.fast()},
                              ropes.reference(), expected);
      // And it really is a different function from the default scale.
      const MatrixD unscaled = run<double>(q, k, v, {.causal = causal, .rope = ropes.fast()});
      CHECK((unscaled - expected).cwiseAbs().maxCoeff() > 1e-3);
    }
}

TEST_CASE("softmax_attention: empty sequences and zero widths") {
  const MatrixD q = input(6, 4, 1), k = input(9, 4, 2), v = input(9, 3, 3);
  SUBCASE("n = 0 gives [0 x d_v]") {
    const MatrixD got = run<float>(MatrixD(0, 4), k, v, {.causal = true});
    CHECK(got.rows() == 0);
    CHECK(got.cols() == 3);
  }
  SUBCASE("n_k = 0 gives zero rows") {
    for (const bool causal : {false, true}) {
      const MatrixD got = run<double>(q, MatrixD(0, 4), MatrixD(0, 3), {.causal = causal});
      CHECK(got.rows() == 6);
      CHECK(got.cols() == 3);
      CHECK(got.cwiseAbs().maxCoeff() == 0.0);
    }
  }
  SUBCASE("d_v = 0 gives [n x 0]") {
    const MatrixD got = run<float>(q, k, MatrixD(9, 0), {});
    CHECK(got.rows() == 6);
    CHECK(got.cols() == 0);
  }
  SUBCASE("d = 0: every score is the empty dot product 0, so each row is the mean of v") {
    const MatrixD got = run<double>(MatrixD(6, 0), MatrixD(9, 0), v, {});
    const MatrixD mean = v.colwise().mean();
    for (Index i = 0; i < 6; ++i) CHECK((got.row(i) - mean).cwiseAbs().maxCoeff() < 1e-15);
  }
}

TEST_CASE("softmax_attention with RoPE depends on relative positions only") {
  // Shifting both offsets by delta changes every angle but no difference of angles. The tolerance
  // is the reference bound for each run, with positions up to delta + n.
  const Index n = 80, n_k = 100, d = 32, d_v = 8;
  const MatrixD q = input(n, d, 11), k = input(n_k, d, 12), v = input(n_k, d_v, 13);
  for (const RopeCase& rope_case : kRopeCases)
    for (const bool causal : {false, true})
      for (const Index delta : {Index(1), Index(1000), Index(-250), Index(54321)}) {
        CAPTURE(rope_case.name);
        CAPTURE(causal);
        CAPTURE(delta);
        const Ropes ropes(rope_case, d);
        const SoftmaxOptions base{
            .causal = causal, .rope = ropes.fast(), .q_offset = 20, .block_size = 32};
        SoftmaxOptions shifted = base;
        shifted.q_offset += delta;
        shifted.k_offset += delta;
        const Index p_max = std::abs(delta) + 20 + n_k;
        const double scale = default_scale(d);
        const double tol_d = 2 * tolerance<double>(q, k, v, scale, p_max);
        const double tol_f = 2 * tolerance<float>(q, k, v, scale, p_max);
        CHECK((run<double>(q, k, v, base) - run<double>(q, k, v, shifted)).cwiseAbs().maxCoeff() <=
              tol_d);
        CHECK((run<float>(q, k, v, base) - run<float>(q, k, v, shifted)).cwiseAbs().maxCoeff() <=
              tol_f);
        // Not vacuous: shifting only the queries does change the output.
        SoftmaxOptions q_only = base;
        q_only.q_offset += delta;
        if (!causal)
          CHECK((run<double>(q, k, v, base) - run<double>(q, k, v, q_only)).cwiseAbs().maxCoeff() >
                1e-6);
      }
}

TEST_CASE("causal softmax_attention: later keys and values leave earlier outputs bit-unchanged") {
  // Exact, not to rounding: score (i, j) is its own dot product in the GEMM, whatever the other
  // keys; the running max of row i only ever sees admissible scores; inadmissible weights are exact
  // zeros, so a later v_j enters row i only as 0 * v_j = 0; key slices with nothing admissible
  // merge in with weight exactly 0; and which blocks and slices exist depends on positions and
  // lengths only. (Compared with ==, so +0 and -0 would count as equal.)
  struct Case {
    Index n, n_k, q_offset;  // k_offset = 0
  };
  const Case cases[] = {{130, 130, 0}, {20, 2100, 2080}};  // self-attention; a sliced key cache
  const Index d = 16, d_v = 7;
  const Ropes ropes(kRopeCases[0], d);
  for (const Case& c : cases) {
    const MatrixD q = input(c.n, d, 21), k = input(c.n_k, d, 22), v = input(c.n_k, d_v, 23);
    for (const Index block_size : {0, 7})
      for (const Index cut : {Index(0), Index(5), Index(c.n / 2), c.n - 2}) {
        CAPTURE(c.n);
        CAPTURE(c.n_k);
        CAPTURE(block_size);
        CAPTURE(cut);
        // Replace every key and value after the position of query `cut`.
        const Index first_later = c.q_offset + cut + 1, later = c.n_k - first_later;
        MatrixD k2 = k, v2 = v;
        k2.bottomRows(later) = input(later, d, 1000 + cut, 3.0);
        v2.bottomRows(later) = input(later, d_v, 2000 + cut, 3.0);
        const SoftmaxOptions options{
            .causal = true, .rope = ropes.fast(), .q_offset = c.q_offset, .block_size = block_size};
        for (const bool is_float : {false, true}) {
          CAPTURE(is_float);
          const MatrixD before =
              is_float ? run<float>(q, k, v, options) : run<double>(q, k, v, options);
          const MatrixD after =
              is_float ? run<float>(q, k2, v2, options) : run<double>(q, k2, v2, options);
          CHECK((before.topRows(cut + 1) == after.topRows(cut + 1)));
          // Not vacuous: the later rows do see the change.
          CHECK((before.bottomRows(c.n - cut - 1) != after.bottomRows(c.n - cut - 1)));
        }
      }
  }
}

TEST_CASE("softmax_attention: large-norm queries and keys give finite outputs (online max)") {
  // Row norms ~100 and ~1000: scores up to ~1e4 / sqrt(d) and ~1e6 / sqrt(d), far beyond exp's
  // range (float overflows at 88.7), so only the running max keeps the weights finite. Float is
  // ill-conditioned here (a score error of d u |q| |k| scale ~ 1e-2 at norm 100), which the
  // derived tolerance states; the double comparison is tight.
  const Index n = 150, d_v = 6;
  for_each_large_norm_case(
      n, d_v,
      [&](const MatrixD& q, const MatrixD& k, const MatrixD& v, const Ropes& ropes,
          const SoftmaxOptions& options) {
        const MatrixD got_f = run<float>(q, k, v, options);
        CHECK(got_f.allFinite());
        // Every output is a convex combination of the rows of v.
        for (Index c = 0; c < d_v; ++c) {
          CHECK(got_f.col(c).maxCoeff() <= v.col(c).maxCoeff() * (1 + 1e-6) + 1e-6);
          CHECK(got_f.col(c).minCoeff() >= v.col(c).minCoeff() * (1 + 1e-6) - 1e-6);
        }
        const MatrixD expected =
            ref::softmax_attention(q, k, v, {.causal = options.causal, .rope = ropes.reference()});
        check_against_reference(q, k, v, options, ropes.reference(), expected);
      });
}

TEST_CASE("softmax_attention leaves its inputs alone and is deterministic") {
  const Index n = 200, d = 32, d_v = 16;
  const MatrixF q = input(n, d, 41).cast<float>(), k = input(n, d, 42).cast<float>(),
                v = input(n, d_v, 43).cast<float>();
  const MatrixF q0 = q, k0 = k, v0 = v;
  const Ropes ropes(kRopeCases[0], d);
  // Several threads whatever the machine gives, against one thread below.
  const ThreadCount threads(kSplitThreads);
  for (const bool causal : {false, true}) {
    CAPTURE(causal);
    const SoftmaxOptions options{.causal = causal, .rope = ropes.fast(), .q_offset = 7};
    const MatrixF first = linrope::softmax_attention(q, k, v, options);
    CHECK((q == q0));  // RoPE went to copies
    CHECK((k == k0));
    CHECK((v == v0));
    CHECK((linrope::softmax_attention(q, k, v, options) == first));
    // The per-head kernel without its own parallel region (as batched.cpp calls it from inside
    // one) gives the same bits.
    MatrixF serial(n, d_v);
    linrope::detail::softmax_head<float>(
        {q.data(), k.data(), v.data(), serial.data(), n, n, d, d_v}, options,
        linrope::detail::Threads::Serial);
    CHECK((serial == first));
    // And so does a single-thread run: the blocking depends on n, never on the thread count.
    const ThreadCount one(1);
    const MatrixF one_thread = linrope::softmax_attention(q, k, v, options);
    CHECK((one_thread == first));
  }
}

TEST_CASE("softmax_attention with sliced keys is bitwise independent of the threads") {
  // 3 queries against 5000 keys: one block of queries, so the keys are cut into slices whose merge
  // order is fixed. Several threads whatever the machine gives, against one thread below.
  const ThreadCount threads(kSplitThreads);
  const Index n = 3, n_k = 5000, d = 8, d_v = 4;
  const MatrixF q = input(n, d, 51).cast<float>(), k = input(n_k, d, 52).cast<float>(),
                v = input(n_k, d_v, 53).cast<float>();
  for (const bool causal : {false, true}) {
    CAPTURE(causal);
    const SoftmaxOptions options{.causal = causal, .q_offset = n_k - n};
    const MatrixF first = linrope::softmax_attention(q, k, v, options);
    MatrixF serial(n, d_v);
    linrope::detail::softmax_head<float>(
        {q.data(), k.data(), v.data(), serial.data(), n, n_k, d, d_v}, options,
        linrope::detail::Threads::Serial);
    CHECK((serial == first));
    const ThreadCount one(1);
    const MatrixF one_thread = linrope::softmax_attention(q, k, v, options);
    CHECK((one_thread == first));
  }
}

TEST_CASE_TEMPLATE("softmax_attention rejects bad input", T, float, double) {
  using M = linrope::Matrix<T>;
  const M q = M::Ones(5, 16), k = M::Ones(7, 16), v = M::Ones(7, 4);
  const auto call = [](const M& a, const M& b, const M& c, const SoftmaxOptions& o = {}) {
    return linrope::softmax_attention(a, b, c, o);
  };
  CHECK_THROWS_WITH_AS(call(q, M::Ones(7, 8), M::Ones(7, 4)),
                       doctest::Contains("softmax_attention: k is [7 x 8] but q has d = 16"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(call(q, k, M::Ones(6, 4)),
                       doctest::Contains("softmax_attention: v is [6 x 4] but k has n_k = 7 rows"),
                       std::invalid_argument);

  M bad = q;
  bad(2, 3) = std::numeric_limits<T>::quiet_NaN();
  CHECK_THROWS_WITH_AS(call(bad, k, v),
                       doctest::Contains("q has the non-finite value nan at row 2, column 3"),
                       std::invalid_argument);
  bad = k;
  bad(6, 15) = std::numeric_limits<T>::infinity();
  CHECK_THROWS_WITH_AS(call(q, bad, v),
                       doctest::Contains("k has the non-finite value inf at row 6"),
                       std::invalid_argument);
  bad = v;
  bad(0, 0) = -std::numeric_limits<T>::infinity();
  CHECK_THROWS_WITH_AS(call(q, k, bad),
                       doctest::Contains("v has the non-finite value -inf at row 0"),
                       std::invalid_argument);

  const Rope narrow(RopeConfig{.dim = 8});
  CHECK_THROWS_WITH_AS(call(q, k, v, {.rope = &narrow}),
                       doctest::Contains("options.rope has dim = 8 but q has d = 16"),
                       std::invalid_argument);
  for (const double scale :
       {-1.0, std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
    CAPTURE(scale);
    CHECK_THROWS_WITH_AS(call(q, k, v, {.scale = scale}), doctest::Contains("options.scale is "),
                         std::invalid_argument);
  }
  CHECK_THROWS_WITH_AS(call(q, k, v, {.block_size = -1}),
                       doctest::Contains("options.block_size is -1 but expected block_size >= 0"),
                       std::invalid_argument);
  // Shape errors are reported even when n = 0.
  CHECK_THROWS_WITH_AS(call(M(0, 16), M::Ones(7, 8), v), doctest::Contains("k is [7 x 8]"),
                       std::invalid_argument);
}
