// Linear attention without a denominator (LinearOptions::denominator = false; attention.hpp): o_i =
// num_i, the form most linear models in use now compute (they normalise the output instead).
// Against the naive reference (tests/reference/linear_reference.hpp, out = num), the gradients
// against its finite differences, and the other entry points (stream, batched, state in/out) on the
// same function; Full refused.
//
// Tolerances: the outputs' are the reference's row bound without a denominator, gamma N_i (N_i the
// sum of the absolute terms of num_i; row_tolerances), the gradients' those of
// linear_gradient_cases.hpp with D_i = 1 and no term through den.
#include <doctest/doctest.h>

#include <limits>
#include <linrope/linrope.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "check_close.hpp"
#include "linear_cases.hpp"
#include "linear_gradient_cases.hpp"
#include "map_cases.hpp"
#include "reference/linear_reference.hpp"

namespace {

using namespace linrope;
using namespace linrope::testing;

// The placements that remain without a denominator (Full is NumeratorOnly then).
constexpr RopePlacement kKept[] = {RopePlacement::None, RopePlacement::BeforeMap,
                                   RopePlacement::NumeratorOnly};

Problem problem(FeatureMapKind kind, RopePlacement placement, bool causal, Index n, Index n_k) {
  Problem p;
  p.kind = kind;
  p.placement = placement;
  p.causal = causal;
  p.n = n;
  p.n_k = n_k;
  p.q_offset = 3;
  p.k_offset = causal ? 5 : 0;  // two queries with no key: zero rows
  p.denominator = false;
  return p;
}

template <class T>
Matrix<T> run_forward(const Setup& s, CausalMethod method, DenominatorStats* stats = nullptr) {
  LinearOptions o = s.options;
  o.method = method;
  o.chunk_size = 3;
  return linear_attention(Matrix<T>(s.q.cast<T>()), Matrix<T>(s.k.cast<T>()),
                          Matrix<T>(s.v.cast<T>()), *s.map, o, stats);
}

}  // namespace

TEST_CASE("no denominator: o = num against the reference, every map and kept placement") {
  int cases = 0;
  for (const FeatureMapKind kind : kMaps)
    for (const RopePlacement placement : kKept)
      for (const bool causal : {false, true})
        for (const Index n : {Index(1), Index(9), Index(70)}) {
          const Problem p = problem(kind, placement, causal, n, n + 2);
          const std::string name = describe(p);
          CAPTURE(name);
          const Setup s(p);
          const ref::LinearResult want = s.reference();
          const double gamma_f = rounding_gamma_of<float>(s),
                       gamma_d = rounding_gamma_of<double>(s);
          for (const CausalMethod method : {CausalMethod::Scan, CausalMethod::Chunked}) {
            if (!causal && method == CausalMethod::Chunked) continue;
            DenominatorStats stats;
            check_close(run_forward<double>(s, method, &stats), want.out,
                        ref::row_tolerances(want, gamma_d, p.eps), "double");
            check_close(
                run_forward<float>(s, method), want.out,
                ref::row_tolerances(want, gamma_f, p.eps, std::numeric_limits<float>::min()),
                "float");
            // No denominator, no statistics of it: rows counted, those without keys apart.
            Index no_keys = 0;
            for (const Index a : want.admissible) no_keys += a == 0;
            CHECK(stats.count == n);
            CHECK(stats.no_keys == no_keys);
            CHECK(stats.nonpositive == 0);
            CHECK(stats.below_threshold == 0);
            CHECK(stats.zero_divisor == 0);
            ++cases;
          }
        }
  CHECK(cases == 6 * 3 * 3 * 3);
}

TEST_CASE("no denominator: gradients against finite differences of the reference") {
  Tally tally;
  for (const FeatureMapKind kind : kMaps)
    for (const RopePlacement placement : kKept)
      for (const bool causal : {false, true})
        check_problem(problem(kind, placement, causal, 7, 9), tally);
  // No denominator, no ill-conditioned row: every comparison runs.
  const int methods = 1 + int(kGradientMethods.size());  // non-causal, then each causal one
  CHECK(tally.run_double == 6 * 3 * methods);
  CHECK(tally.run_float == 6 * 3 * methods);
}

TEST_CASE("no denominator: the stream, batched calls and state in/out compute the same function") {
  const Problem p =
      problem(FeatureMapKind::FavorPositive, RopePlacement::NumeratorOnly, true, 11, 11);
  Problem same = p;
  same.k_offset = same.q_offset;
  const Setup s(same);
  const ref::LinearResult want = s.reference();
  const VectorD tol = ref::row_tolerances(want, rounding_gamma_of<double>(s), p.eps);
  const MatrixD whole = run_forward<double>(s, CausalMethod::Scan);
  check_close(whole, want.out, tol, "single call");
  // The stream, one token at a time.
  LinearAttentionStreamD stream(*s.map, p.d_v, s.options);
  MatrixD streamed(p.n, p.d_v);
  for (Index i = 0; i < p.n; ++i)
    streamed.row(i) = stream.step(s.q.middleRows(i, 1), s.k.middleRows(i, 1), s.v.middleRows(i, 1));
  check_close(streamed, want.out, tol, "stream");
  // Cut at 4, the second part from the first's state.
  LinearAttentionStateD state;
  LinearOptions second = s.options;
  second.q_offset = second.k_offset = s.options.q_offset + 4;
  MatrixD cut(p.n, p.d_v);
  cut << linear_attention(MatrixD(s.q.topRows(4)), MatrixD(s.k.topRows(4)), MatrixD(s.v.topRows(4)),
                          *s.map, s.options, state),
      linear_attention(MatrixD(s.q.bottomRows(7)), MatrixD(s.k.bottomRows(7)),
                       MatrixD(s.v.bottomRows(7)), *s.map, second, state);
  check_close(cut, want.out, tol, "cut at 4");
  // Batched, one slice: the single call's bits.
  MatrixD out(p.n, p.d_v);
  linear_attention(Heads<const double>{s.q.data(), 1, 1, p.n, p.d},
                   Heads<const double>{s.k.data(), 1, 1, p.n, p.d},
                   Heads<const double>{s.v.data(), 1, 1, p.n, p.d_v},
                   Heads<double>{out.data(), 1, 1, p.n, p.d_v}, *s.map, s.options);
  CHECK(out == whole);
}

TEST_CASE("no denominator: full is refused, naming numerator_only") {
  Problem p = problem(FeatureMapKind::EluPlusOne, RopePlacement::Full, false, 4, 4);
  const Setup s(p);
  try {
    run_forward<double>(s, CausalMethod::Scan);
    FAIL("expected std::invalid_argument");
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    CHECK(what.find("full and numerator_only are one function") != std::string::npos);
  }
}
