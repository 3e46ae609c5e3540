// State in, state out (include/linrope/attention.hpp and batched.hpp; docs/DESIGN.md, "State in,
// state out"): a causal sequence cut at any point and run in two calls, the second from the state
// the first left, against the naive reference on the whole sequence (explicit n x n weights,
// explicit rotations): the outputs, the state itself (the explicit sums of features times values),
// and the gradients (against finite differences of the reference on the whole, the gradient of
// the first part's final state coming from the second part's d_initial), including cuts where the
// second part's keys are larger and the stabiliser rescales the state. Then batched against single
// head, the split across threads, and bad input.
//
// Tolerances are those of the whole-sequence tests, derived there: outputs within the reference's
// row bounds (tests/test_linear_attention.cpp), gradients within gamma G plus the finite
// differences' own error (linear_gradient_cases.hpp). A cut adds a handful of roundings (the
// state's rescaling by exp(c - M) <= 1 and one merge) to sums of m + d + n_k terms, within the
// bounds' margin of 8. The state's entries are sums over keys of products of a feature and a value:
// each within gamma times the sum of their absolute values.
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <linrope/linrope.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "check_close.hpp"
#include "linear_cases.hpp"
#include "linear_gradient_cases.hpp"
#include "linear_state_cases.hpp"
#include "map_cases.hpp"
#include "reference/linear_reference.hpp"
#include "reference/random.hpp"
#include "threads.hpp"

using namespace linrope;
using namespace linrope::testing;

TEST_CASE("a causal sequence cut anywhere and run in two calls equals the reference on the whole") {
  // n = 23 (odd): cuts at 0 (an empty first part), 1, 11 (inside the scan block and across the
  // chunks of 3), 22 and 23 (an empty second part).
  int cases = 0;
  for (const FeatureMapKind kind : kMaps)
    for (const RopePlacement placement : kPlacements) {
      const std::string kind_name = to_string(kind);
      CAPTURE(kind_name);
      const std::string placement_name = to_string(placement);
      CAPTURE(placement_name);
      Setup s(cut_problem(kind, placement, 23));
      check_forward_cuts(s, {0, 1, 11, 22, 23});
      ++cases;
    }
  CHECK(cases == 24);
}

TEST_CASE("the stabiliser: a second part with larger keys rescales the first part's state") {
  // Keys after the cut 2.5x larger: their features' shift exceeds every earlier one, so the
  // second call raises the state's scale (checked), and the reverse: the second part's keys 5x
  // smaller, so the second call reads a state whose scale exceeds its own keys' (checked; for
  // favor-hyp a larger x does not always give a larger shift, |x|^2 / 2 being subtracted).
  for (const FeatureMapKind kind : kFavorMaps)
    for (const RopePlacement placement : kPlacements)
      for (const bool later_larger : {true, false}) {
        const std::string kind_name = to_string(kind);
        CAPTURE(kind_name);
        const std::string placement_name = to_string(placement);
        CAPTURE(placement_name);
        CAPTURE(later_larger);
        const Index n = 23, cut = 9;
        Setup s(cut_problem(kind, placement, n));
        if (later_larger)
          scale_keys(s, cut, n, 2.5);
        else
          scale_keys(s, cut, n, 0.2);
        const CutRun<double> r = run_cut<double>(s, cut, s.options);
        if (later_larger)
          CHECK(r.final_state.log_scale > r.first_state.log_scale);
        else
          CHECK(r.final_state.log_scale == r.first_state.log_scale);
        check_forward_cuts(s, {cut});
      }
}

TEST_CASE("the gradients of a cut sequence, through d_initial and d_final, equal the whole's") {
  // Against central differences of the reference on the whole sequence: the first part's keys
  // get their gradient from the second part's queries only through the state between them.
  int run = 0, skipped = 0;
  for (const FeatureMapKind kind : kMaps)
    for (const RopePlacement placement : kPlacements)
      for (const bool larger : {false, true}) {
        if (larger && !is_favor(kind)) continue;
        const std::string kind_name = to_string(kind);
        CAPTURE(kind_name);
        const std::string placement_name = to_string(placement);
        CAPTURE(placement_name);
        CAPTURE(larger);
        const Index n = 13;
        Setup s(cut_problem(kind, placement, n));
        if (larger) scale_keys(s, 6, n, 2.0);
        const int ran = check_cut_gradients(s);
        run += ran;
        skipped += ran == 0;
      }
  INFO("ran ", run, ", skipped ", skipped, " ill-conditioned problems");
  CHECK(run >= 250);
  CHECK(skipped <= 3);
}

TEST_CASE("d_initial and d_final at the state's own scale: the state's gradient by differences") {
  check_state_gradient_by_differences(1.0);
}

TEST_CASE("batched state in, state out equals the single-head calls, padded rows left out") {
  check_batched_states({});
}

TEST_CASE("a long head split across threads continues from a state and leaves the same state") {
  // n = 1100 per part: each call splits into segments (two threads), the first from the given
  // state; against one call on the whole 2200 tokens on one thread (both within the reference's
  // bounds of the exact result: compared with slack 2).
  const ThreadCount threads(kSplitThreads);
  const Index n = 2200, cut = 1100;
  Setup s(cut_problem(FeatureMapKind::EluPlusOne, RopePlacement::NumeratorOnly, n));
  const ref::LinearResult want = s.reference();
  const double z = ref::exponent_size(*s.map, s.k);
  const double gamma = ref::rounding_gamma<float>(s.m, s.p.d, n, z);
  const CutRun<float> r = run_cut<float>(s, cut, s.options);
  check_close(r.out, want.out,
              ref::row_tolerances(want, gamma, s.p.eps, std::numeric_limits<float>::min()),
              "float, split across threads, cut at 1100");
  check_state(r.final_state, s, gamma);
  // Gradients: the cut against the whole's double backward on one thread.
  check_against_one_thread(run_cut_backward<float>(s, cut, s.options), s, want);
}

TEST_CASE("state in, state out: bad input throws std::invalid_argument naming the argument") {
  Setup s(cut_problem(FeatureMapKind::EluPlusOne, RopePlacement::None, 5));
  const Index m = s.m, d_v = s.p.d_v;
  const LinearOptions o = s.options;
  LinearAttentionStateD good{MatrixD::Zero(m, d_v), MatrixD::Zero(m, 1), 0.0};
  {
    LinearOptions noncausal = o;
    noncausal.causal = false;
    LinearAttentionStateD state = good;
    check_invalid([&] { linear_attention(s.q, s.k, s.v, *s.map, noncausal, state); },
                  {"linear_attention", "options.causal is false"});
  }
  {
    LinearAttentionStateD state{MatrixD::Zero(m + 1, d_v), MatrixD::Zero(m, 1), 0.0};
    check_invalid([&] { linear_attention(s.q, s.k, s.v, *s.map, o, state); },
                  {"state.S is [", "expected [5 x 3]"});
    CHECK(state.S.rows() == m + 1);  // unchanged
  }
  for (const double bad : {std::nan(""), std::numeric_limits<double>::infinity()}) {
    LinearAttentionStateD state = good;
    state.log_scale = bad;
    check_invalid([&] { linear_attention(s.q, s.k, s.v, *s.map, o, state); },
                  {"initial_state.log_scale[0, 0]", "expected a finite value or -inf"});
  }
  {
    LinearAttentionStateD state = good;
    state.z(2) = std::nan("");
    check_invalid([&] { linear_attention(s.q, s.k, s.v, *s.map, o, state); }, {"initial_state.z"});
  }
  {
    LinearStateGradient<double> wrong{MatrixD::Zero(m, d_v + 1), MatrixD::Zero(m, 1)};
    check_invalid(
        [&] { linear_attention_backward(s.q, s.k, s.v, s.d_out, *s.map, o, good, wrong); },
        {"linear_attention_backward", "d_final.dS is [5 x 4]"});
  }
  {  // batched: z missing, a final state over an input, a wrong head count
    std::vector<double> S(m * d_v), z(m), l(1), out(5 * d_v);
    const Heads<const double> q{s.q.data(), 1, 1, 5, s.p.d}, k{s.k.data(), 1, 1, 5, s.p.d},
        v{s.v.data(), 1, 1, 5, d_v};
    const Heads<double> out_view{out.data(), 1, 1, 5, d_v};
    check_invalid(
        [&] {
          linear_attention(q, k, v, out_view, *s.map, o, {},
                           HeadStates<double>{S.data(), nullptr, l.data(), 1, 1, m, d_v});
        },
        {"final_state.z is null"});
    check_invalid(
        [&] {
          linear_attention(q, k, v, out_view, *s.map, o, {},
                           HeadStates<double>{out.data(), z.data(), l.data(), 1, 1, m, d_v});
        },
        {"final_state.S overlaps out"});
    check_invalid(
        [&] {
          linear_attention(q, k, v, out_view, *s.map, o, {},
                           HeadStates<double>{S.data(), z.data(), l.data(), 1, 2, m, d_v});
        },
        {"final_state is [batch 1, heads 2", "expected [1, 1, 5, 3]"});
  }
}
