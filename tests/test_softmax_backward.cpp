// The softmax attention backward: every gradient against central finite differences of the naive
// double reference forward (never of the library's own forward) over swept shapes, ropes, offsets
// and cross attention; the forward's log-sum-exp; the dense gradient where parts are added; float
// against double at large norms; the batched form against the single-head one with padding;
// determinism; bad input.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <linrope/attention.hpp>
#include <linrope/batched.hpp>
#include <string>
#include <vector>

#include "reference/finite_difference.hpp"
#include "reference/softmax_reference.hpp"
#include "softmax/softmax_backward.hpp"  // the per-head kernel that the batched form calls
#include "softmax/softmax_kernel.hpp"    // the forward kernel, for its log-sum-exp
#include "softmax_cases.hpp"
#include "threads.hpp"

namespace {

using linrope::Heads;
using linrope::Index;
using linrope::MatrixD;
using linrope::MatrixF;
using linrope::Rope;
using linrope::RopeConfig;
using linrope::SoftmaxOptions;
using namespace linrope::testing;  // inputs, ropes and bounds shared with the forward's tests
namespace ref = linrope::reference;

struct Gradients {
  MatrixD dq, dk, dv;
};

// The yardstick: central differences of sum(d_out .* reference forward), in double.
Gradients finite_differences(const MatrixD& q, const MatrixD& k, const MatrixD& v,
                             const MatrixD& d_out, const ref::SoftmaxReferenceOptions& options) {
  const auto loss = [&](const MatrixD& qq, const MatrixD& kk, const MatrixD& vv) {
    return ref::weighted_sum(d_out, ref::softmax_attention(qq, kk, vv, options));
  };
  return {ref::central_difference(q, [&](const MatrixD& x) { return loss(x, k, v); }),
          ref::central_difference(k, [&](const MatrixD& x) { return loss(q, x, v); }),
          ref::central_difference(v, [&](const MatrixD& x) { return loss(q, k, x); })};
}

template <class T>
Gradients backward(const MatrixD& q, const MatrixD& k, const MatrixD& v, const MatrixD& d_out,
                   const SoftmaxOptions& options) {
  using M = linrope::Matrix<T>;
  const auto g = linrope::softmax_attention_backward(M(q.cast<T>()), M(k.cast<T>()), M(v.cast<T>()),
                                                     M(d_out.cast<T>()), options);
  return {g.dq.template cast<double>(), g.dk.template cast<double>(), g.dv.template cast<double>()};
}

// Bound on |kernel - exact| for each gradient, from the rounding of T (unit roundoff u), first
// order. Q, K, V, G: the largest row norms of q, k, v, d_out; N = n (queries), n_k keys.
//  - every score is off by <= e_s (score_error); lse = max + log(sum) adds (|s|max + n_k + 8) u
//    (its own rounding, the sum over n_k terms, log and exp), so each P_ij = exp(s - lse) is off
//    by the relative eps_p = 2 e_s + (scale Q K + n_k + 8) u;
//  - |dP_ij| = |<d_out_i, v_j>| <= G V, off by d_v u G V; |D_i| = |<d_out_i, o_i>| <= G V, off
//    by G times the forward's error eps_o V, eps_o = 2 e_s + (2 n_k + 8) u; so dS_ij =
//    P_ij (dP_ij - D_i) is off by P_ij G V eps_s, eps_s = 2 eps_p + d_v u + eps_o;
//  - each gradient is a sum of such terms times a d-wide factor, rounding (terms + d + 8) u
//    relative to the sum of |terms| (the +8 covers the scale and R^T):
//      dq_i = scale R^T sum_j dS_ij R k_j: sum_j P_ij = 1, |dS_ij| <= 2 P_ij G V ->
//             scale K G V (eps_s + 2 (n_k + d + 8) u)
//      dk_j = R^T sum_i dS_ij scale R q_i: at most N rows -> N scale Q G V (eps_s + 2 (N + d + 8)
//      u) dv_j = sum_i P_ij d_out_i: at most N rows -> N G (eps_p + (N + 8) u)
// Each times 4 (first-order bounds, and the reference rounds too). The finite differences add
// their own error, a few 1e-11 (reference/finite_difference.hpp): 3e-8 max(1, max|g|) allows it.
template <class T>
Gradients tolerances(const MatrixD& q, const MatrixD& k, const MatrixD& v, const MatrixD& d_out,
                     double scale, Index max_position) {
  const double u = std::numeric_limits<T>::epsilon() / 2;
  const double n = double(q.rows()), n_k = double(k.rows()), d = double(q.cols()),
               d_v = double(v.cols());
  const double Q = max_row_norm(q), K = max_row_norm(k), V = max_row_norm(v),
               G = max_row_norm(d_out);
  const double e_s = score_error<T>(q, k, scale, max_position);
  const double eps_p = 2 * e_s + (scale * Q * K + n_k + 8) * u;
  const double eps_o = 2 * e_s + (2 * n_k + 8) * u;
  const double eps_s = 2 * eps_p + d_v * u + eps_o;
  const auto filled = [](const MatrixD& like, double value) {
    return MatrixD::Constant(like.rows(), like.cols(), value);
  };
  return {filled(q, 4 * scale * K * G * V * (eps_s + 2 * (n_k + d + 8) * u)),
          filled(k, 4 * n * scale * Q * G * V * (eps_s + 2 * (n + d + 8) * u)),
          filled(v, 4 * n * G * (eps_p + (n + 8) * u))};
}

// A gradient against its central differences: the largest error within the kernel's derived
// tolerance plus the differences' own (whole-matrix, unlike check_close.hpp's row-wise check).
void check_against_differences(const char* name, const MatrixD& got, const MatrixD& expected,
                               const MatrixD& kernel_tolerance) {
  CAPTURE(name);
  REQUIRE(got.rows() == expected.rows());
  REQUIRE(got.cols() == expected.cols());
  if (expected.size() == 0) return;
  const double fd_tolerance = 3e-8 * std::max(1.0, expected.cwiseAbs().maxCoeff());
  const double err = (got - expected).cwiseAbs().maxCoeff();
  const double tol = kernel_tolerance(0, 0) + fd_tolerance;
  CAPTURE(err);
  CAPTURE(tol);
  CHECK(err <= tol);
}

// The float and double kernels against the finite differences `expected`, at the tolerances
// derived above.
void check_gradients(const MatrixD& q, const MatrixD& k, const MatrixD& v, const MatrixD& d_out,
                     const SoftmaxOptions& options, const Gradients& expected) {
  const double scale = options.scale != 0 ? options.scale : default_scale(q.cols());
  const Index max_position = options.rope == nullptr
                                 ? 0
                                 : std::max({std::abs(options.q_offset) + q.rows(),
                                             std::abs(options.k_offset) + k.rows()});
  for (const bool is_float : {false, true}) {
    CAPTURE(is_float);
    const Gradients got = is_float ? backward<float>(q, k, v, d_out, options)
                                   : backward<double>(q, k, v, d_out, options);
    const Gradients tol = is_float ? tolerances<float>(q, k, v, d_out, scale, max_position)
                                   : tolerances<double>(q, k, v, d_out, scale, max_position);
    check_against_differences("dq", got.dq, expected.dq, tol.dq);
    check_against_differences("dk", got.dk, expected.dk, tol.dk);
    check_against_differences("dv", got.dv, expected.dv, tol.dv);
  }
}

}  // namespace

TEST_CASE("softmax_attention_backward matches finite differences: self-attention sweep") {
  // n = 40 with blocks of 7 keys: several blocks of queries (16 rows each) and of keys in both
  // passes, and masks that cut blocks anywhere. Odd widths take the partial half-layout rope.
  std::uint64_t seed = 100;
  for (const bool causal : {false, true})
    for (const Index n : {1, 3, 17, 40})
      for (const Index d : {1, 7, 8}) {
        std::vector<RopeCase> rope_cases{kNoRope};
        if (d % 2 == 0) rope_cases.push_back(kRopeCases[0]);
        if (d > 2) rope_cases.push_back(kRopeCases[1]);
        const Index d_v = d + 3;  // d_v != d: catches a swapped width
        const MatrixD q = input(n, d, ++seed), k = input(n, d, ++seed), v = input(n, d_v, ++seed),
                      d_out = input(n, d_v, ++seed);
        for (const RopeCase& rope_case : rope_cases) {
          const Ropes ropes(rope_case, d);
          const Gradients expected =
              finite_differences(q, k, v, d_out, {.causal = causal, .rope = ropes.reference()});
          for (const Index block_size : {0, 7}) {
            CAPTURE(causal);
            CAPTURE(n);
            CAPTURE(d);
            CAPTURE(rope_case.name);
            CAPTURE(block_size);
            check_gradients(q, k, v, d_out,
                            {.causal = causal, .rope = ropes.fast(), .block_size = block_size},
                            expected);
          }
        }
      }
}

TEST_CASE("softmax_attention_backward matches finite differences: cross attention and offsets") {
  const PositionCase cases[] = {
      {5, 23, 18, 0, true},   // decoding against a cache: the last query sees all 23 keys
      {5, 23, 10, 0, true},   // keys 15..22 come after every query: zero dk, dv rows
      {12, 8, 0, 6, true},    // queries 0..5 precede every key: zero dq rows
      {9, 4, 0, 0, false},    // fewer keys than queries
      {4, 30, 0, 0, false},   // more keys than queries
      {10, 15, 3, -4, true},  // negative key positions
      {33, 20, 5, 17, true},  // offsets that align with no block
  };
  const Index d = 8, d_v = 5;
  std::uint64_t seed = 500;
  for (const PositionCase& c : cases) {
    const MatrixD q = input(c.n, d, ++seed), k = input(c.n_k, d, ++seed),
                  v = input(c.n_k, d_v, ++seed), d_out = input(c.n, d_v, ++seed);
    for (const RopeCase& rope_case : {kNoRope, kRopeCases[0], kRopeCases[1]}) {
      const Ropes ropes(rope_case, d);
      const Gradients expected = finite_differences(q, k, v, d_out, reference_options(c, ropes));
      for (const Index block_size : {0, 7}) {
        const std::string where = describe(c, rope_case, block_size);
        CAPTURE(where);
        const SoftmaxOptions options = kernel_options(c, ropes, block_size);
        check_gradients(q, k, v, d_out, options, expected);
        if (!c.causal) continue;
        // Exact zeros, not merely small: a query before every key, a key after every query.
        const Gradients got = backward<float>(q, k, v, d_out, options);
        const Index empty_queries = std::clamp(c.k_offset - c.q_offset, Index(0), c.n);
        const Index first_unseen = std::clamp(c.q_offset + c.n - c.k_offset, Index(0), c.n_k);
        CHECK(got.dq.topRows(empty_queries).cwiseAbs().sum() == 0.0);
        CHECK(got.dk.bottomRows(c.n_k - first_unseen).cwiseAbs().sum() == 0.0);
        CHECK(got.dv.bottomRows(c.n_k - first_unseen).cwiseAbs().sum() == 0.0);
      }
    }
  }
}

TEST_CASE("softmax_attention_backward: an explicit scale, and a key cache cut into slices") {
  SUBCASE("scale 0.37 and 2.5") {
    const Index n = 19, d = 6, d_v = 4;
    const MatrixD q = input(n, d, 1), k = input(n, d, 2), v = input(n, d_v, 3),
                  d_out = input(n, d_v, 4);
    const Ropes ropes(kRopeCases[0], d);
    for (const double scale : {0.37, 2.5})
      for (const bool causal : {false, true}) {
        CAPTURE(scale);
        CAPTURE(causal);
        const Gradients expected = finite_differences(
            q, k, v, d_out, {.causal = causal, .scale = scale, .rope = ropes.reference()});
        check_gradients(q, k, v, d_out,
                        {.causal = causal, .scale = scale, .rope = ropes.fast(), .block_size = 5},
                        expected);
      }
  }
  SUBCASE("3 queries against 2100 keys: a long strip of keys per block of queries") {
    const Index n = 3, n_k = 2100, d = 2, d_v = 2;  // narrow: 8406 finite differences
    const MatrixD q = input(n, d, 5), k = input(n_k, d, 6), v = input(n_k, d_v, 7),
                  d_out = input(n, d_v, 8);
    for (const bool causal : {false, true}) {
      CAPTURE(causal);
      const Index q_offset = causal ? n_k - n : 0;
      const Gradients expected =
          finite_differences(q, k, v, d_out, {.causal = causal, .q_offset = q_offset});
      check_gradients(q, k, v, d_out, {.causal = causal, .q_offset = q_offset}, expected);
    }
  }
}

// The exact gradient in double through the n x n matrices (no rope): the yardstick where finite
// differences would take too long.
Gradients dense_gradients(const MatrixD& q, const MatrixD& k, const MatrixD& v,
                          const MatrixD& d_out, bool causal) {
  const double scale = default_scale(q.cols());
  MatrixD p = scale * q * k.transpose();
  for (Index i = 0; i < p.rows(); ++i) {
    const Index len = causal ? std::min(i + 1, p.cols()) : p.cols();
    const double max = p.row(i).head(len).maxCoeff();
    p.row(i).head(len) = (p.row(i).head(len).array() - max).exp().matrix();
    p.row(i).head(len) /= p.row(i).head(len).sum();
    p.row(i).tail(p.cols() - len).setZero();
  }
  const MatrixD dp = d_out * v.transpose();
  const Eigen::VectorXd delta = p.cwiseProduct(dp).rowwise().sum();
  const MatrixD ds = p.cwiseProduct(dp.colwise() - delta);
  return {scale * ds * k, scale * ds.transpose() * q, p.transpose() * d_out};
}

// Self-attention without a rope, causal and not, in float and double, against dense_gradients.
void check_against_dense(const MatrixD& q, const MatrixD& k, const MatrixD& v, const MatrixD& d_out,
                         Index block_size) {
  for (const bool causal : {false, true}) {
    CAPTURE(causal);
    const Gradients expected = dense_gradients(q, k, v, d_out, causal);
    const SoftmaxOptions options{.causal = causal, .block_size = block_size};
    for (const bool is_float : {false, true}) {
      CAPTURE(is_float);
      const Gradients got = is_float ? backward<float>(q, k, v, d_out, options)
                                     : backward<double>(q, k, v, d_out, options);
      const double scale = default_scale(q.cols());
      const Gradients tol = is_float ? tolerances<float>(q, k, v, d_out, scale, q.rows())
                                     : tolerances<double>(q, k, v, d_out, scale, q.rows());
      check_against_differences("dq", got.dq, expected.dq, tol.dq);
      check_against_differences("dk", got.dk, expected.dk, tol.dk);
      check_against_differences("dv", got.dv, expected.dv, tol.dv);
    }
  }
}

TEST_CASE("softmax_attention_backward: 1600 queries, three parts whose dk and dv are added") {
  // Parts of >= 512 queries each sum their own dk and dv; three here, cut unevenly when causal.
  const Index n = 1600, d = 8, d_v = 5;
  check_against_dense(input(n, d, 41), input(n, d, 42), input(n, d_v, 43), input(n, d_v, 44), 0);
}

TEST_CASE("softmax_attention_backward: key blocks of the packed keys, and ones that cannot be") {
  // With AVX-512 the float backward packs the keys and values once and multiplies blocks of
  // them (PackedRight::block). 96-key blocks: at d = 40 every block is taken from the packed
  // form, the one at 480 across its 512-column edge; at d = 288 (deeper than a packed cache
  // block) only blocks at multiples of 512 keys can be, so one call mixes both paths. This is the
  // plumbing, end to end (and, in the sanitizers' pass, no read outside the packed form): the
  // derived float tolerances are worst-case bounds, too loose to see one wrong panel, so the
  // panels' addressing is proven bitwise in test_gemm.cpp ("a block of a PackedRight ...").
  const Index n = 700;
  for (const Index d : {40, 288}) {
    CAPTURE(d);
    check_against_dense(input(n, d, 45), input(n, d, 46), input(n, 24, 47), input(n, 24, 48), 96);
  }
}

TEST_CASE("softmax_attention_backward: empty sequences and zero widths") {
  const MatrixD q = input(6, 4, 1), k = input(9, 4, 2), v = input(9, 3, 3), d_out = input(6, 3, 4);
  const auto all_zero = [](const Gradients& g) {
    return g.dq.cwiseAbs().sum() == 0 && g.dk.cwiseAbs().sum() == 0 && g.dv.cwiseAbs().sum() == 0;
  };
  SUBCASE("n = 0: nothing is attended, zero dk and dv") {
    const Gradients g = backward<float>(MatrixD(0, 4), k, v, MatrixD(0, 3), {.causal = true});
    CHECK(g.dq.rows() == 0);
    CHECK(g.dk.rows() == 9);
    CHECK(g.dv.rows() == 9);
    CHECK(all_zero(g));
  }
  SUBCASE("n_k = 0: zero outputs, zero dq") {
    const Gradients g = backward<double>(q, MatrixD(0, 4), MatrixD(0, 3), d_out, {});
    CHECK(g.dq.rows() == 6);
    CHECK(g.dq.cols() == 4);
    CHECK(all_zero(g));
  }
  SUBCASE("d_v = 0: no output at all") {
    const Gradients g = backward<float>(q, k, MatrixD(9, 0), MatrixD(6, 0), {.causal = true});
    CHECK(g.dq.rows() == 6);
    CHECK(g.dk.rows() == 9);
    CHECK(g.dv.cols() == 0);
    CHECK(all_zero(g));
  }
  SUBCASE("d = 0: uniform weights, dv_j = the sum of d_out over the queries that see key j") {
    for (const bool causal : {false, true}) {
      CAPTURE(causal);
      const MatrixD q0(6, 0), k0(9, 0);
      const ref::SoftmaxReferenceOptions reference{.causal = causal, .q_offset = 3};
      check_gradients(q0, k0, v, d_out, {.causal = causal, .q_offset = 3},
                      finite_differences(q0, k0, v, d_out, reference));
    }
  }
  SUBCASE("n = 1, n_k = 1: the one weight is 1 whatever the score, so dq = dk = 0") {
    const Gradients g =
        backward<double>(q.topRows(1), k.topRows(1), v.topRows(1), d_out.topRows(1), {});
    CHECK(g.dq.cwiseAbs().maxCoeff() < 1e-15);
    CHECK(g.dk.cwiseAbs().maxCoeff() < 1e-15);
    CHECK((g.dv - d_out.topRows(1)).cwiseAbs().maxCoeff() < 1e-15);
  }
}

TEST_CASE("softmax_head: the log-sum-exp it can keep") {
  // Against max + log(sum(exp(s - max))) over the admissible keys in double; -inf (exactly) for a
  // query with no admissible key. |lse| error: the scores' (e_s, twice over: max and terms) plus
  // the sum over n_k terms and the log (n_k + 8) u relative to the larger of |lse| and 1; times 4.
  struct Case {
    Index n, n_k, q_offset, k_offset;
    bool causal;
  };
  const Case cases[] = {{40, 40, 0, 0, true},
                        {12, 30, 0, 6, true},  // queries 0..5 see no key
                        {3, 2100, 0, 0, false},
                        {3, 2100, 2097, 0, true},  // key slices merged
                        {3, 2100, 500, 0, true}};  // a slice past every query
  const Index d = 8, d_v = 3;
  for (const Case& c : cases) {
    const MatrixD q = input(c.n, d, 11), k = input(c.n_k, d, 12), v = input(c.n_k, d_v, 13);
    const double scale = default_scale(d);
    std::vector<double> expected(std::size_t(c.n));
    for (Index i = 0; i < c.n; ++i) {
      std::vector<double> s;
      for (Index j = 0; j < c.n_k; ++j)
        if (!c.causal || c.k_offset + j <= c.q_offset + i)
          s.push_back(scale * q.row(i).dot(k.row(j)));
      double lse = -std::numeric_limits<double>::infinity();
      if (!s.empty()) {
        const double m = *std::max_element(s.begin(), s.end());
        double sum = 0;
        for (const double x : s) sum += std::exp(x - m);
        lse = m + std::log(sum);
      }
      expected[std::size_t(i)] = lse;
    }
    const auto check_lse = [&]<class T>(T) {
      using M = linrope::Matrix<T>;
      const M qt = q.cast<T>(), kt = k.cast<T>(), vt = v.cast<T>();
      M out(c.n, d_v);
      std::vector<T> lse(std::size_t(c.n));
      const SoftmaxOptions options{
          .causal = c.causal, .q_offset = c.q_offset, .k_offset = c.k_offset};
      linrope::detail::softmax_head<T>(
          {qt.data(), kt.data(), vt.data(), out.data(), c.n, c.n_k, d, d_v, lse.data()}, options,
          linrope::detail::Threads::Parallel);
      const double u = std::numeric_limits<T>::epsilon() / 2;
      const double e_s = score_error<T>(q, k, scale, 0);
      for (Index i = 0; i < c.n; ++i) {
        CAPTURE(i);
        const double want = expected[std::size_t(i)];
        if (std::isinf(want)) {
          CHECK(double(lse[std::size_t(i)]) == want);
          continue;
        }
        const double tol = 4 * (2 * e_s + (double(c.n_k) + 8) * u * std::max(1.0, std::abs(want)));
        CHECK(std::abs(double(lse[std::size_t(i)]) - want) <= tol);
      }
    };
    CAPTURE(c.n);
    CAPTURE(c.n_k);
    CAPTURE(c.causal);
    const ThreadCount threads(kSplitThreads);
    check_lse(float{});
    check_lse(double{});
  }
}

TEST_CASE("softmax_attention_backward: large-norm float inputs give finite gradients") {
  // Row norms ~100 and ~1000: scores up to ~1e4 and ~1e6 (times 1/sqrt(d)), far beyond exp's range
  // (float overflows at 88.7), so only P = exp(s - lse) <= ~1 keeps the gradients finite. Float is
  // ill-conditioned here, which the derived tolerance states (against the double kernel, whose
  // own error is far below float's).
  const Index n = 150, d_v = 6;
  const MatrixD d_out = input(n, d_v, 34);
  for_each_large_norm_case(n, d_v,
                           [&](const MatrixD& q, const MatrixD& k, const MatrixD& v, const Ropes&,
                               const SoftmaxOptions& options) {
                             const Gradients got_f = backward<float>(q, k, v, d_out, options);
                             const Gradients got_d = backward<double>(q, k, v, d_out, options);
                             CHECK(got_f.dq.allFinite());
                             CHECK(got_f.dk.allFinite());
                             CHECK(got_f.dv.allFinite());
                             const Gradients tol =
                                 tolerances<float>(q, k, v, d_out, default_scale(kLargeNormD), n);
                             check_against_differences("dq", got_f.dq, got_d.dq, tol.dq);
                             check_against_differences("dk", got_f.dk, got_d.dk, tol.dk);
                             check_against_differences("dv", got_f.dv, got_d.dv, tol.dv);
                           });
}

TEST_CASE("softmax_attention_backward leaves its inputs alone and is deterministic") {
  const Index n = 200, d = 32, d_v = 16;
  const MatrixF q = input(n, d, 41).cast<float>(), k = input(n, d, 42).cast<float>(),
                v = input(n, d_v, 43).cast<float>(), d_out = input(n, d_v, 44).cast<float>();
  const MatrixF q0 = q, k0 = k, v0 = v, d_out0 = d_out;
  const Ropes ropes(kRopeCases[0], d);
  const ThreadCount threads(kSplitThreads);
  for (const bool causal : {false, true}) {
    CAPTURE(causal);
    const SoftmaxOptions options{.causal = causal, .rope = ropes.fast(), .q_offset = 7};
    const auto first = linrope::softmax_attention_backward(q, k, v, d_out, options);
    CHECK((q == q0));
    CHECK((k == k0));
    CHECK((v == v0));
    CHECK((d_out == d_out0));
    const auto again = linrope::softmax_attention_backward(q, k, v, d_out, options);
    CHECK((again.dq == first.dq));
    CHECK((again.dk == first.dk));
    CHECK((again.dv == first.dv));
    // Without its own parallel region (as the batched form calls it from inside one).
    MatrixF dq(n, d), dk(n, d), dv(n, d_v);
    linrope::detail::softmax_head_backward<float>(
        {q.data(), k.data(), v.data(), d_out.data(), dq.data(), dk.data(), dv.data(), n, n, d, d_v},
        options, linrope::detail::Threads::Serial);
    CHECK((dq == first.dq));
    CHECK((dk == first.dk));
    CHECK((dv == first.dv));
    const ThreadCount one(1);
    const auto one_thread = linrope::softmax_attention_backward(q, k, v, d_out, options);
    CHECK((one_thread.dq == first.dq));
    CHECK((one_thread.dk == first.dk));
    CHECK((one_thread.dv == first.dv));
  }
}

namespace {

// [B,H,rows,width] buffers as MatrixD of B*H*rows rows (slice s = b * H + h at rows s * rows).
struct Batch {
  Index B, H, n, n_k, d, d_v;
  MatrixD q, k, v, d_out;
  MatrixD slice(const MatrixD& m, Index s, Index rows, Index valid) const {
    return m.middleRows(s * rows, valid);
  }
};

template <class T>
Gradients batched_backward(const Batch& b, const Index* q_lengths, const Index* k_lengths,
                           const SoftmaxOptions& options) {
  using M = linrope::Matrix<T>;
  const M q = b.q.cast<T>(), k = b.k.cast<T>(), v = b.v.cast<T>(), d_out = b.d_out.cast<T>();
  // Garbage in the outputs: the padding rows must be overwritten with zeros.
  M dq = M::Constant(q.rows(), q.cols(), T(7)), dk = M::Constant(k.rows(), k.cols(), T(7)),
    dv = M::Constant(v.rows(), v.cols(), T(7));
  linrope::softmax_attention_backward(Heads<const T>{q.data(), b.B, b.H, b.n, b.d, q_lengths},
                                      Heads<const T>{k.data(), b.B, b.H, b.n_k, b.d, k_lengths},
                                      Heads<const T>{v.data(), b.B, b.H, b.n_k, b.d_v, k_lengths},
                                      Heads<const T>{d_out.data(), b.B, b.H, b.n, b.d_v},
                                      Heads<T>{dq.data(), b.B, b.H, b.n, b.d},
                                      Heads<T>{dk.data(), b.B, b.H, b.n_k, b.d},
                                      Heads<T>{dv.data(), b.B, b.H, b.n_k, b.d_v}, options);
  return {dq.template cast<double>(), dk.template cast<double>(), dv.template cast<double>()};
}

}  // namespace

TEST_CASE_TEMPLATE(
    "batched softmax_attention_backward: each slice is the single-head call, bit "
    "for bit, and padding gets zeros",
    T, float, double) {
  // B * H = 6 slices: with 2 threads each slice runs serially on one thread; B = H = 1 below
  // runs one slice with the whole team. Both must give the single-head bits.
  const Index B = 2, H = 3, n = 21, n_k = 25, d = 8, d_v = 5;
  Batch b{B,
          H,
          n,
          n_k,
          d,
          d_v,
          input(B * H * n, d, 61),
          input(B * H * n_k, d, 62),
          input(B * H * n_k, d_v, 63),
          input(B * H * n, d_v, 64)};
  const Index q_lengths[] = {21, 9}, k_lengths[] = {25, 16};
  // d_out past the lengths is never read: NaN there must not matter.
  for (Index s = H; s < 2 * H; ++s)
    b.d_out.middleRows(s * n + q_lengths[1], n - q_lengths[1]).setConstant(std::nan(""));
  const Ropes ropes(kRopeCases[1], d);
  const ThreadCount threads(kSplitThreads);
  for (const bool causal : {false, true}) {
    CAPTURE(causal);
    const SoftmaxOptions options{
        .causal = causal, .rope = ropes.fast(), .q_offset = 4, .block_size = 6};
    const Gradients got = batched_backward<T>(b, q_lengths, k_lengths, options);
    for (Index s = 0; s < B * H; ++s) {
      CAPTURE(s);
      const Index lq = q_lengths[s / H], lk = k_lengths[s / H];
      const Gradients want =
          backward<T>(b.slice(b.q, s, n, lq), b.slice(b.k, s, n_k, lk), b.slice(b.v, s, n_k, lk),
                      b.slice(b.d_out, s, n, lq), options);
      CHECK((b.slice(got.dq, s, n, lq) == want.dq));
      CHECK((b.slice(got.dk, s, n_k, lk) == want.dk));
      CHECK((b.slice(got.dv, s, n_k, lk) == want.dv));
      CHECK(got.dq.middleRows(s * n + lq, n - lq).cwiseAbs().sum() == 0);
      CHECK(got.dk.middleRows(s * n_k + lk, n_k - lk).cwiseAbs().sum() == 0);
      CHECK(got.dv.middleRows(s * n_k + lk, n_k - lk).cwiseAbs().sum() == 0);
    }
    // One slice: the kernel runs with the whole team.
    Batch one{1,
              1,
              n,
              n_k,
              d,
              d_v,
              b.q.topRows(n),
              b.k.topRows(n_k),
              b.v.topRows(n_k),
              b.d_out.topRows(n)};
    const Gradients single = batched_backward<T>(one, nullptr, nullptr, options);
    const Gradients want = backward<T>(one.q, one.k, one.v, one.d_out, options);
    CHECK((single.dq == want.dq));
    CHECK((single.dk == want.dk));
    CHECK((single.dv == want.dv));
  }
}

TEST_CASE_TEMPLATE("softmax_attention_backward rejects bad input", T, float, double) {
  using M = linrope::Matrix<T>;
  const M q = M::Ones(3, 16), k = M::Ones(7, 16), v = M::Ones(7, 5), d_out = M::Ones(3, 5);
  const auto call = [](const M& a, const M& b, const M& c, const M& g,
                       const SoftmaxOptions& o = {}) {
    return linrope::softmax_attention_backward(a, b, c, g, o);
  };
  CHECK_THROWS_WITH_AS(
      call(q, k, v, M::Ones(3, 4)),
      doctest::Contains("softmax_attention_backward: d_out is [3 x 4] but expected [3 x 5]"),
      std::invalid_argument);
  CHECK_THROWS_WITH_AS(call(q, k, v, M::Ones(2, 5)), doctest::Contains("d_out is [2 x 5]"),
                       std::invalid_argument);
  M bad = d_out;
  bad(1, 2) = std::numeric_limits<T>::quiet_NaN();
  CHECK_THROWS_WITH_AS(call(q, k, v, bad),
                       doctest::Contains("softmax_attention_backward: d_out has the non-finite "
                                         "value nan at row 1, column 2"),
                       std::invalid_argument);
  bad(1, 2) = -std::numeric_limits<T>::infinity();
  CHECK_THROWS_WITH_AS(call(q, k, v, bad), doctest::Contains("d_out has the non-finite value -inf"),
                       std::invalid_argument);
  // The forward's checks, under the backward's name.
  CHECK_THROWS_WITH_AS(
      call(q, M::Ones(7, 8), v, d_out),
      doctest::Contains("softmax_attention_backward: k is [7 x 8] but q has d = 16"),
      std::invalid_argument);
  CHECK_THROWS_WITH_AS(call(q, k, M::Ones(6, 5), d_out),
                       doctest::Contains("v is [6 x 5] but k has n_k = 7 rows"),
                       std::invalid_argument);
  bad = q;
  bad(2, 3) = std::numeric_limits<T>::quiet_NaN();
  CHECK_THROWS_WITH_AS(call(bad, k, v, d_out),
                       doctest::Contains("q has the non-finite value nan at row 2, column 3"),
                       std::invalid_argument);
  const Rope narrow(RopeConfig{.dim = 8});
  CHECK_THROWS_WITH_AS(call(q, k, v, d_out, {.rope = &narrow}),
                       doctest::Contains("options.rope has dim = 8 but q has d = 16"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(call(q, k, v, d_out, {.scale = -1}), doctest::Contains("options.scale is"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(call(q, k, v, d_out, {.block_size = -1}),
                       doctest::Contains("options.block_size is -1"), std::invalid_argument);
}

TEST_CASE_TEMPLATE("batched softmax_attention_backward rejects bad input", T, float, double) {
  using M = linrope::Matrix<T>;
  const Index B = 1, H = 2, n = 3, d = 4, d_v = 5;
  const M q = M::Ones(B * H * n, d), v = M::Ones(B * H * n, d_v);
  M d_out = M::Ones(B * H * n, d_v), dq(B * H * n, d), dk(B * H * n, d), dv(B * H * n, d_v);
  struct Views {
    Heads<const T> q, k, v, d_out;
    Heads<T> dq, dk, dv;
  };
  const Views good{{q.data(), B, H, n, d},       {q.data(), B, H, n, d},  {v.data(), B, H, n, d_v},
                   {d_out.data(), B, H, n, d_v}, {dq.data(), B, H, n, d}, {dk.data(), B, H, n, d},
                   {dv.data(), B, H, n, d_v}};
  const auto call = [](const Views& x) {
    linrope::softmax_attention_backward(x.q, x.k, x.v, x.d_out, x.dq, x.dk, x.dv);
  };
  CHECK_NOTHROW(call(good));
  struct Bad {
    const char* what;
    void (*spoil)(Views&);
  };
  const Bad cases[] = {
      {"softmax_attention_backward: d_out is [1, 2, 3, 4] but expected [1, 2, 3, 5]",
       [](Views& x) { x.d_out.d = 4; }},
      {"d_out is [1, 1, 3, 5] but expected [1, 2, 3, 5]", [](Views& x) { x.d_out.heads = 1; }},
      {"dq is [1, 2, 3, 5] but expected [1, 2, 3, 4]", [](Views& x) { x.dq.d = 5; }},
      {"dk is [1, 2, 2, 4] but expected [1, 2, 3, 4]", [](Views& x) { x.dk.n = 2; }},
      {"dv is [2, 2, 3, 5] but expected [1, 2, 3, 5]", [](Views& x) { x.dv.batch = 2; }},
      {"dq.data is null", [](Views& x) { x.dq.data = nullptr; }},
      {"d_out.data is null", [](Views& x) { x.d_out.data = nullptr; }},
      {"k is [1, 2, 3, 3] but q has d = 4", [](Views& x) { x.k.d = 3; }},
  };
  for (const Bad& c : cases) {
    CAPTURE(c.what);
    Views x = good;
    c.spoil(x);
    CHECK_THROWS_WITH_AS(call(x), doctest::Contains(c.what), std::invalid_argument);
  }
  d_out(n + 2, 1) = std::numeric_limits<T>::quiet_NaN();  // slice [0, 1], row 2
  CHECK_THROWS_WITH_AS(call(good),
                       doctest::Contains("softmax_attention_backward: d_out[0, 1] has the "
                                         "non-finite value nan at row 2, column 1"),
                       std::invalid_argument);
  // Past the lengths it is padding, never read.
  const Index lengths[] = {2};
  Views padded = good;
  padded.q.lengths = lengths;
  CHECK_NOTHROW(call(padded));
}
