// Decay (LinearOptions::decay and head_decays; docs/DESIGN.md, "Decay"): causal linear attention
//   o_i = sum_{j<=i} w_ij <num_i, num_j> v_j / (sum_{j<=i} w_ij <den_i, den_j> + eps),
//   w_ij = g^(p_i - p_j),
// on every path of the causal core, against the naive reference with an explicit n x n decay
// matrix (tests/reference/linear_reference.hpp): every map, placement (and no denominator),
// method and g, odd shapes and q_offset != k_offset; the backward against finite differences of
// the reference forward; a sequence cut anywhere; the stream; batched per-head decays with padding
// and states in place; the split across threads; causality; sequences of 65536 tokens; and every
// refused call.
//
// Tolerances are the derived ones of the tests without a decay (test_linear_attention.cpp for the
// outputs, linear_gradient_cases.hpp for the gradients, test_linear_state.cpp for the states), with
// the decay's own part added: decay_gamma, the rounding of the log scales' shifts, which are
// doubles of size |log g| P (P the span of positions) whatever the kernel's precision.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
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

namespace {

using namespace linrope;
using namespace linrope::testing;

// g = 1 (none), one near 1 (a rescale every ~364 positions), 1/2 (every 16) and one so small that
// every key's scale passes the headroom (log g = -6.9: a rescale at nearly every key).
constexpr double kDecays[] = {1.0, 0.97, 0.5, 1e-3};
constexpr double kDecaysBelowOne[] = {0.97, 0.5, 1e-3};

// A method and its chunk: the scan, and the chunked form with odd chunks.
struct MethodChoice {
  CausalMethod method;
  Index chunk;
};
constexpr MethodChoice kMethods[] = {
    {CausalMethod::Scan, 64}, {CausalMethod::Chunked, 3}, {CausalMethod::Chunked, 7}};

LinearOptions with_method(LinearOptions o, MethodChoice m) {
  o.method = m.method;
  o.chunk_size = m.chunk;
  return o;
}

// The forward's gamma for a kernel in precision T (test_linear_attention.cpp), plus the decay's.
template <class T>
double forward_gamma(const Setup& s) {
  const double z = std::max(ref::exponent_size(*s.map, s.q), ref::exponent_size(*s.map, s.k));
  return ref::rounding_gamma<T>(s.m, s.p.d, s.k.rows(), z) +
         ref::decay_gamma(reference_spec(s.options, s.spec), s.q.rows(), s.k.rows());
}

template <class T>
Matrix<T> cast(const MatrixD& x) {
  return x.cast<T>();
}

template <class T>
Matrix<T> forward(const Setup& s, const LinearOptions& o, DenominatorStats* stats = nullptr) {
  return linear_attention(cast<T>(s.q), cast<T>(s.k), cast<T>(s.v), *s.map, o, stats);
}

// The outputs and DenominatorStats of one call against the reference on the same inputs.
template <class T>
void check_forward(const Setup& s, const LinearOptions& o, const ref::LinearResult& want) {
  const double gamma = forward_gamma<T>(s);
  DenominatorStats stats;
  stats.threshold = 1.0;
  const Matrix<T> got = forward<T>(s, o, &stats);
  check_close(got, want.out,
              ref::row_tolerances(want, gamma, s.p.eps, double(std::numeric_limits<T>::min())),
              sizeof(T) == 4 ? "float vs reference" : "double vs reference");
  if (!s.p.denominator) return;
  VectorD t(want.den.size());
  for (Index i = 0; i < t.size(); ++i) t(i) = gamma * want.den_magnitude(i);
  check_denominator_stats(stats, want.den, t, want.admissible, stats.threshold);
}

// A causal problem: odd d = 5, d_v = 3, FAVOR+ f = 7 (Problem's defaults).
Problem decay_problem(FeatureMapKind kind, RopePlacement placement, double decay, Index n,
                      Index n_k, Index q_offset, Index k_offset) {
  return {.kind = kind,
          .placement = placement,
          .causal = true,
          .n = n,
          .n_k = n_k,
          .q_offset = q_offset,
          .k_offset = k_offset,
          .decay = decay};
}

// The placements, and whether with a denominator: Full has none without (it is numerator_only).
struct Form {
  RopePlacement placement;
  bool denominator;
};
std::vector<Form> forms() {
  std::vector<Form> all;
  for (const RopePlacement placement : kPlacements)
    for (const bool denominator : {true, false})
      if (denominator || placement != RopePlacement::Full) all.push_back({placement, denominator});
  return all;
}

std::string name_of(FeatureMapKind kind, const Form& form, double decay) {
  return std::string(to_string(kind)) + " " + to_string(form.placement) +
         (form.denominator ? "" : " no-denominator") + " g=" + std::to_string(decay);
}

}  // namespace

TEST_CASE("every map, placement, method and decay against the reference's decay matrix") {
  // Shapes: 13 tokens at a shared offset; 9 queries against 14 keys with q_offset > k_offset (the
  // queries see a prefix of keys before their own); one token; 70 tokens (past the scan's block of
  // 64, and g = 0.5's headroom of 16 positions four times over).
  struct Shape {
    Index n, n_k, q_offset, k_offset;
  };
  const Shape shapes[] = {{13, 13, 4, 4}, {9, 14, 10, 5}, {1, 1, 0, 0}, {70, 70, 3, 3}};
  int cases = 0;
  for (const FeatureMapKind kind : kMaps)
    for (const Form& form : forms())
      for (const double decay : kDecays)
        for (const Shape& shape : shapes) {
          const std::string name = name_of(kind, form, decay);
          CAPTURE(name);
          CAPTURE(shape.n);
          CAPTURE(shape.n_k);
          Problem p = decay_problem(kind, form.placement, decay, shape.n, shape.n_k, shape.q_offset,
                                    shape.k_offset);
          p.denominator = form.denominator;
          p.seed = std::uint64_t(100 + cases);
          const Setup s(p);
          const ref::LinearResult want = s.reference();
          for (const MethodChoice& method : kMethods) {
            const std::string method_name = to_string(method.method);
            CAPTURE(method_name);
            CAPTURE(method.chunk);
            const LinearOptions o = with_method(s.options, method);
            check_forward<float>(s, o, want);
            check_forward<double>(s, o, want);
          }
          ++cases;
        }
  CHECK(cases == 6 * 7 * 4 * 4);
}

TEST_CASE("decay 1 is the call without a decay, bit for bit, however it is given") {
  // decay = 1 explicitly, and head_decays of ones (one value for a single head, H for batched):
  // the same bits as the default options, forward and backward, both methods.
  const Index B = 2, H = 3, n = 37, d = 5, d_v = 3;
  for (const FeatureMapKind kind : {FeatureMapKind::FavorPositive, FeatureMapKind::EluPlusOne})
    for (const MethodChoice& method : kMethods) {
      const std::string kind_name = to_string(kind);
      CAPTURE(kind_name);
      CAPTURE(method.chunk);
      Setup s(decay_problem(kind, RopePlacement::NumeratorOnly, 1.0, n, n, 2, 2));
      const LinearOptions plain = with_method(s.options, method);
      const std::vector<double> one = {1.0}, ones(H, 1.0);
      LinearOptions explicit_one = plain, single = plain, batched = plain;
      explicit_one.decay = 1.0;
      single.head_decays = one;
      batched.head_decays = ones;
      const MatrixD want = forward<double>(s, plain);
      CHECK(forward<double>(s, explicit_one) == want);
      CHECK(forward<double>(s, single) == want);
      const AttentionGradients<double> g =
          linear_attention_backward(s.q, s.k, s.v, s.d_out, *s.map, plain);
      const AttentionGradients<double> g1 =
          linear_attention_backward(s.q, s.k, s.v, s.d_out, *s.map, single);
      CHECK(g1.dq == g.dq);
      CHECK(g1.dk == g.dk);
      CHECK(g1.dv == g.dv);
      // Batched: every slice is the same problem here.
      std::vector<double> q, k, v, out_plain(B * H * n * d_v), out_ones(B * H * n * d_v);
      for (Index s_ = 0; s_ < B * H; ++s_) {
        q.insert(q.end(), s.q.data(), s.q.data() + n * d);
        k.insert(k.end(), s.k.data(), s.k.data() + n * d);
        v.insert(v.end(), s.v.data(), s.v.data() + n * d_v);
      }
      const auto in = [&](const std::vector<double>& x, Index width) {
        return Heads<const double>{x.data(), B, H, n, width};
      };
      linear_attention(in(q, d), in(k, d), in(v, d_v),
                       Heads<double>{out_plain.data(), B, H, n, d_v}, *s.map, plain);
      linear_attention(in(q, d), in(k, d), in(v, d_v), Heads<double>{out_ones.data(), B, H, n, d_v},
                       *s.map, batched);
      CHECK(out_plain == out_ones);
    }
}

TEST_CASE("the backward with a decay against finite differences of the reference forward") {
  // Every map and placement, with and without a denominator, each g < 1, at a shared offset and
  // with q_offset > k_offset; every causal method (linear_gradient_cases.hpp: the scan and chunks
  // of 1, 2, 3 and 1000), float and double.
  Tally tally;
  for (const FeatureMapKind kind : kMaps)
    for (const Form& form : forms())
      for (const double decay : kDecaysBelowOne)
        for (const bool shifted : {false, true}) {
          Problem p = shifted ? decay_problem(kind, form.placement, decay, 6, 9, 8, 4)
                              : decay_problem(kind, form.placement, decay, 7, 7, 3, 3);
          p.denominator = form.denominator;
          // eps = 1 for full: its signed denominator near 0 would make the differences meaningless.
          if (form.placement == RopePlacement::Full) p.eps = 1.0;
          check_problem(p, tally);
        }
  INFO("float: ran ", tally.run_float, ", skipped ", tally.skipped_float, "; double: ran ",
       tally.run_double, ", skipped ", tally.skipped_double);
  CHECK(tally.run_double == 6 * 7 * 3 * 2 * 5);
  CHECK(tally.skipped_float <= 10);
}

TEST_CASE("a sequence with a decay cut anywhere equals one call: outputs, states, gradients") {
  // n = 23 cut at 0, 1, 11, 22 and 23 (outputs and the final state, as explicit decayed sums,
  // against the reference on the whole); n = 13 cut at 0, 1, 6, 12, 13 (gradients against finite
  // differences of the whole: the first part's keys reach the second part's queries only through
  // the state between, decayed).
  int run = 0, skipped = 0;
  for (const FeatureMapKind kind : kMaps)
    for (const RopePlacement placement : kPlacements)
      for (const double decay : kDecaysBelowOne) {
        const std::string name = name_of(kind, {placement, true}, decay);
        CAPTURE(name);
        Problem forward_problem = cut_problem(kind, placement, 23);
        forward_problem.decay = decay;
        Setup whole(forward_problem);
        check_forward_cuts(whole, {0, 1, 11, 22, 23});

        Problem p = cut_problem(kind, placement, 13);
        p.decay = decay;
        if (placement == RopePlacement::Full) p.eps = 1.0;
        const int ran = check_cut_gradients(Setup(p));
        run += ran;
        skipped += ran == 0;
      }
  INFO("ran ", run, ", skipped ", skipped, " ill-conditioned problems");
  CHECK(run >= 6 * 4 * 3 * 2 * 5 - 30);
  CHECK(skipped <= 3);
}

TEST_CASE("the state's gradient with a decay: d_initial and d_final by differences") {
  // check_state_gradient_by_differences's explicit formula, whose g^(p_i - (k_offset - 1)) on
  // the initial state and g^(t - p_j) in the final one are the decay's frame at the boundaries.
  for (const double decay : kDecaysBelowOne) {
    CAPTURE(decay);
    check_state_gradient_by_differences(decay);
  }
}

TEST_CASE(
    "LinearAttentionStream with a decay equals one call: one token at a time and blocks of 5") {
  // Against the reference (and the one call, both within its bound: slack 2). The stream keeps its
  // decay as a number: one given through a head_decays span that dies before the first step.
  for (const FeatureMapKind kind : kMaps)
    for (const RopePlacement placement : kPlacements)
      for (const double decay : kDecaysBelowOne) {
        const std::string name = name_of(kind, {placement, true}, decay);
        CAPTURE(name);
        Setup s(decay_problem(kind, placement, decay, 23, 23, 5, 5));
        const ref::LinearResult want = s.reference();
        const auto run_type = [&](auto zero) {
          using T = decltype(zero);
          CAPTURE(sizeof(T));
          const VectorD tol = ref::row_tolerances(want, forward_gamma<T>(s), s.p.eps,
                                                  double(std::numeric_limits<T>::min()));
          const Matrix<T> whole = forward<T>(s, s.options);
          for (const Index block : {1, 5}) {
            CAPTURE(block);
            std::unique_ptr<LinearAttentionStream<T>> stream;
            {
              LinearOptions o = s.options;
              const std::vector<double> one = {decay};
              o.decay = 0.25;  // overridden by head_decays
              o.head_decays = one;
              stream = std::make_unique<LinearAttentionStream<T>>(*s.map, s.p.d_v, o);
            }
            Matrix<T> out(s.p.n, s.p.d_v);
            for (Index start = 0; start < s.p.n; start += block) {
              const Index t = std::min(block, s.p.n - start);
              out.middleRows(start, t) =
                  stream->step(cast<T>(s.q.middleRows(start, t)), cast<T>(s.k.middleRows(start, t)),
                               cast<T>(s.v.middleRows(start, t)));
            }
            check_close(out, want.out, tol, "stream vs reference");
            check_close(out, whole.template cast<double>(), tol, "stream vs one call", 2.0);
          }
        };
        run_type(0.0f);
        run_type(0.0);
      }
}

TEST_CASE("batched per-head decays: each slice is its single-head call, padded, states in place") {
  // head_decays {0.9, 1, 0.3}: each head bit for bit its single-head call with its own decay.
  check_batched_states({0.9, 1.0, 0.3});
}

TEST_CASE("a long head with a decay split across threads: forward, state and backward") {
  // n = 1500 with two threads: two segments, each from its prefix state (merged with the
  // headroom), g = 0.97 rescaling every ~364 positions inside both. Against the reference (within
  // its bounds), and the backward against the double backward on one thread (both within gamma G
  // of the exact gradient). The final state's log scale is the same number for both methods and
  // both thread counts: the store puts it at the peak, a maximum, which no cut changes.
  for (const FeatureMapKind kind : {FeatureMapKind::EluPlusOne, FeatureMapKind::FavorPositive})
    for (const double decay : {0.97, 0.5}) {
      const std::string name = name_of(kind, {RopePlacement::NumeratorOnly, true}, decay);
      CAPTURE(name);
      Setup s(decay_problem(kind, RopePlacement::NumeratorOnly, decay, 1500, 1500, 9, 9));
      const ref::LinearResult want = s.reference();
      std::vector<double> log_scales;
      for (const int threads : {1, kSplitThreads}) {
        const ThreadCount count(threads);
        CAPTURE(threads);
        for (const CausalMethod method : kMethodsSwept) {
          LinearOptions o = s.options;
          o.method = method;
          check_forward<float>(s, o, want);
          check_forward<double>(s, o, want);
          LinearAttentionStateF state;
          linear_attention(cast<float>(s.q), cast<float>(s.k), cast<float>(s.v), *s.map, o, state);
          log_scales.push_back(state.log_scale);
        }
      }
      for (const double l : log_scales) CHECK(l == log_scales.front());
      const ThreadCount split(kSplitThreads);
      check_against_one_thread(s.run<float>(), s, want);
    }
}

TEST_CASE("causality with a decay: later keys change no earlier output and no earlier dq") {
  // Keys and values after row i replaced (fresh ones, and one of norm 300 right after i): outputs
  // 0..i and dq rows 0..i keep their bits, whichever method and g, across the scan's block of 64
  // and the chunks of 16.
  for (const FeatureMapKind kind : {FeatureMapKind::FavorPositive, FeatureMapKind::EluPlusOne})
    for (const RopePlacement placement : {RopePlacement::NumeratorOnly, RopePlacement::Full})
      for (const double decay : kDecaysBelowOne)
        for (const CausalMethod method : kMethodsSwept) {
          const std::string name = name_of(kind, {placement, true}, decay);
          CAPTURE(name);
          const std::string method_name = to_string(method);
          CAPTURE(method_name);
          Setup s(decay_problem(kind, placement, decay, 70, 70, 2, 2));
          LinearOptions o = s.options;
          o.method = method;
          o.chunk_size = 16;
          const MatrixF q = cast<float>(s.q), k = cast<float>(s.k), v = cast<float>(s.v),
                        g = cast<float>(s.d_out);
          const MatrixF base = linear_attention(q, k, v, *s.map, o);
          const MatrixF base_dq = linear_attention_backward(q, k, v, g, *s.map, o).dq;
          for (const Index i : {0, 15, 16, 40, 63, 64}) {
            CAPTURE(i);
            const Index later = s.p.n - 1 - i;
            MatrixF k2 = k, v2 = v;
            k2.bottomRows(later) = gaussian(later, s.p.d, 99 + i, 0.7).cast<float>();
            v2.bottomRows(later) = gaussian(later, s.p.d_v, 98 + i, 50.0).cast<float>();
            k2.row(i + 1) *= 300.0f / k2.row(i + 1).norm();
            const MatrixF changed = linear_attention(q, k2, v2, *s.map, o);
            CHECK(changed.topRows(i + 1) == base.topRows(i + 1));
            const MatrixF changed_dq = linear_attention_backward(q, k2, v2, g, *s.map, o).dq;
            CHECK(changed_dq.topRows(i + 1) == base_dq.topRows(i + 1));
          }
        }
}

namespace {

// The long-sequence check: the output at position i depends on the keys before the window
// [n - W, n) only through terms weighted g^(p_i - p_j) <= g^(W - 64) for the window's last 64
// rows: W = 64 + 2 log(2^-53) / log g makes that at most u_double^2, times the terms' ratio (the
// largest term of the whole row over the largest in the window), which the bound below computes
// rather than assumes.
Index window_for(double decay) {
  return 64 + Index(std::ceil(2 * std::log(kUnitDouble) / std::log(decay)));
}

// Per tail row (the last `tail` of n queries), a bound on |num_i| and |den_i| of the keys before
// the window: sum_{j < n - W} g^(p_i - p_j) |phi_i| . |psi_j| (element-wise, times max |v_j| for
// num), <= g^(p_i - (n - W - 1)) / (1 - g) times the largest such product (the pair bound for
// rotated features).
struct Truncation {
  VectorD num, den;
};
Truncation truncation(const Setup& s, Index window, Index tail) {
  const Index n = s.q.rows(), first = n - window;
  const double g = s.p.decay;
  const MatrixD key_mag = ref::magnitude_rows(s.phi(s.k.topRows(first)), s.spec);
  double vmax = 0, key_max = 0;
  for (Index j = 0; j < first; ++j) {
    vmax = std::max(vmax, s.v.row(j).cwiseAbs().maxCoeff());
    key_max = std::max(key_max, key_mag.row(j).sum());
  }
  const MatrixD query_mag = ref::magnitude_rows(s.phi(s.q.bottomRows(tail)), s.spec);
  Truncation t{VectorD(tail), VectorD(tail)};
  for (Index r = 0; r < tail; ++r) {
    const Index i = n - tail + r;
    const double weight = std::pow(g, double(i - (first - 1))) / (1 - g);
    t.den(r) = weight * query_mag.row(r).cwiseAbs().maxCoeff() * key_max;
    t.num(r) = t.den(r) * vmax;
  }
  return t;
}

}  // namespace

TEST_CASE("65536 tokens at g = 0.9 and 0.5: finite, and the tail equals the reference's window") {
  // g^65536 underflows to 0 long before the end (0.9^7000 < 1e-320); the shifted log scales do
  // not. Every output, the final state and every gradient finite; the last 64 outputs against the
  // reference on the window [n - W, n) at the same positions (within its row bound plus the
  // truncation above), float and double, scan and chunked; the last 64 rows of dq, dk and dv
  // against the double backward on the window (both within gamma G of the window's exact gradient
  // to within u_double^2, the whole call's with the decay_gamma of its 65536 positions).
  const Index n = 65536, tail = 64;
  for (const FeatureMapKind kind : {FeatureMapKind::EluPlusOne, FeatureMapKind::FavorPositive})
    for (const double decay : {0.9, 0.5}) {
      const std::string name = name_of(kind, {RopePlacement::NumeratorOnly, true}, decay);
      CAPTURE(name);
      const Index window = window_for(decay), first = n - window;
      Setup s(decay_problem(kind, RopePlacement::NumeratorOnly, decay, n, n, 0, 0));
      Setup w(
          decay_problem(kind, RopePlacement::NumeratorOnly, decay, window, window, first, first));
      w.q = s.q.bottomRows(window);
      w.k = s.k.bottomRows(window);
      w.v = s.v.bottomRows(window);
      w.d_out = s.d_out.bottomRows(window);
      const ref::LinearResult want = w.reference();
      const Truncation cut = truncation(s, window, tail);
      const double whole_shifts = ref::decay_gamma(reference_spec(s.options, s.spec), n, n);
      for (const CausalMethod method : kMethodsSwept) {
        const std::string method_name = to_string(method);
        CAPTURE(method_name);
        LinearOptions o = s.options;
        o.method = method;
        const auto check_type = [&](auto zero) {
          using T = decltype(zero);
          CAPTURE(sizeof(T));
          LinearAttentionState<T> state;
          const Matrix<T> out =
              linear_attention(cast<T>(s.q), cast<T>(s.k), cast<T>(s.v), *s.map, o, state);
          CHECK(out.allFinite());
          CHECK(std::isfinite(state.log_scale));
          CHECK(state.S.allFinite());
          CHECK(state.z.allFinite());
          // The window's row bound, with the shifts of the whole call (|log g| 65536: 2e-11
          // relative in double), and the truncation through the same division.
          const VectorD bound = ref::row_tolerances(want, forward_gamma<T>(w) + whole_shifts,
                                                    w.p.eps, double(std::numeric_limits<T>::min()));
          VectorD tol = bound.tail(tail);
          for (Index r = 0; r < tail; ++r) {
            const Index i = window - tail + r;
            const double o_max = want.out.row(i).cwiseAbs().maxCoeff();
            const double divisor = std::abs(want.den(i) + w.p.eps) - cut.den(r);
            tol(r) += (cut.num(r) + o_max * cut.den(r)) / divisor;
          }
          check_close(Matrix<T>(out.bottomRows(tail)), MatrixD(want.out.bottomRows(tail)), tol,
                      "the tail of 65536 tokens vs the reference's window");
        };
        check_type(0.0f);
        check_type(0.0);
      }
      const AttentionGradients<double> all = s.run<double>();
      CHECK(all.dq.allFinite());
      CHECK(all.dk.allFinite());
      CHECK(all.dv.allFinite());
      const AttentionGradients<float> all_float = s.run<float>();
      CHECK(all_float.dq.allFinite());
      CHECK(all_float.dk.allFinite());
      CHECK(all_float.dv.allFinite());
      const AttentionGradients<double> windowed = w.run<double>();
      const Bounds b = gradient_bounds(w, want);
      const double gamma = 2 * rounding_gamma_of<double>(w) + whole_shifts;
      const auto tail_of = [&](const MatrixD& x) { return MatrixD(x.bottomRows(tail)); };
      check_matrix<double>("dq", tail_of(all.dq), tail_of(windowed.dq), tail_of(b.dq), gamma, 0.0);
      check_matrix<double>("dk", tail_of(all.dk), tail_of(windowed.dk), tail_of(b.dk), gamma, 0.0);
      check_matrix<double>("dv", tail_of(all.dv), tail_of(windowed.dv), tail_of(b.dv), gamma, 0.0);
    }
}

TEST_CASE("refused decays: g outside 0 < g <= 1, non-causal, head_decays of the wrong size") {
  Setup s(decay_problem(FeatureMapKind::EluPlusOne, RopePlacement::None, 0.9, 5, 5, 0, 0));
  const Index d = s.p.d, d_v = s.p.d_v, n = 5;
  for (const double bad : {0.0, -0.5, 1.5, std::nan(""), std::numeric_limits<double>::infinity()}) {
    CAPTURE(bad);
    LinearOptions o = s.options;
    o.decay = bad;
    check_invalid([&] { linear_attention(s.q, s.k, s.v, *s.map, o); },
                  {"linear_attention", "options.decay is", "expected a decay in (0, 1]"});
    check_invalid([&] { linear_attention_backward(s.q, s.k, s.v, s.d_out, *s.map, o); },
                  {"linear_attention_backward", "options.decay is", "expected a decay in (0, 1]"});
    check_invalid([&] { LinearAttentionStreamD(*s.map, d_v, o); },
                  {"LinearAttentionStream", "options.decay is", "expected a decay in (0, 1]"});
    LinearAttentionStateD state{MatrixD::Ones(s.m, d_v), MatrixD::Ones(s.m, 1), 0.0};
    check_invalid([&] { linear_attention(s.q, s.k, s.v, *s.map, o, state); },
                  {"options.decay is", "expected a decay in (0, 1]"});
    CHECK(state.log_scale == 0.0);  // unchanged
  }
  {  // non-causal with g < 1: refused, saying why; with g = 1: fine
    LinearOptions o = s.options;
    o.causal = false;
    const char* why[] = {"options.decay is 0.9", "options.causal is false",
                         "a decay is causal only", "grows without bound"};
    check_invalid([&] { linear_attention(s.q, s.k, s.v, *s.map, o); },
                  {"linear_attention", why[0], why[1], why[2], why[3]});
    check_invalid([&] { linear_attention_backward(s.q, s.k, s.v, s.d_out, *s.map, o); },
                  {"linear_attention_backward", why[0], why[1], why[2], why[3]});
    o.decay = 1.0;
    CHECK_NOTHROW(linear_attention(s.q, s.k, s.v, *s.map, o));
    // The stream is causal whatever options.causal says: a decay is fine there.
    LinearOptions stream_options = s.options;
    stream_options.causal = false;
    CHECK_NOTHROW(LinearAttentionStreamD(*s.map, d_v, stream_options));
  }
  {  // single-head: none or one head_decays value
    LinearOptions o = s.options;
    const std::vector<double> two = {0.9, 0.8};
    o.head_decays = two;
    check_invalid([&] { linear_attention(s.q, s.k, s.v, *s.map, o); },
                  {"options.head_decays has 2 values but expected 1 (a single head) or none"});
    check_invalid([&] { LinearAttentionStreamD(*s.map, d_v, o); },
                  {"LinearAttentionStream", "options.head_decays has 2 values"});
  }
  {  // batched: none or H values, each in (0, 1], causal for any below 1
    const Index B = 1, H = 3;
    std::vector<double> q(B * H * n * d, 0.1), k(B * H * n * d, 0.2), v(B * H * n * d_v, 0.3),
        out(B * H * n * d_v), dq(q.size()), dk(k.size()), dv(v.size());
    const auto in = [&](const std::vector<double>& x, Index width) {
      return Heads<const double>{x.data(), B, H, n, width};
    };
    const auto mut = [&](std::vector<double>& x, Index width) {
      return Heads<double>{x.data(), B, H, n, width};
    };
    LinearOptions o = s.options;
    const std::vector<double> two = {0.9, 0.8}, bad_entry = {0.9, 1.5, 0.8}, fine = {0.9, 1.0, 0.8};
    o.head_decays = two;
    check_invalid(
        [&] { linear_attention(in(q, d), in(k, d), in(v, d_v), mut(out, d_v), *s.map, o); },
        {"options.head_decays has 2 values but expected 3 (one per head) or none"});
    check_invalid(
        [&] {
          linear_attention_backward(in(q, d), in(k, d), in(v, d_v), in(out, d_v), mut(dq, d),
                                    mut(dk, d), mut(dv, d_v), *s.map, o);
        },
        {"linear_attention_backward", "options.head_decays has 2 values"});
    o.head_decays = bad_entry;
    check_invalid(
        [&] { linear_attention(in(q, d), in(k, d), in(v, d_v), mut(out, d_v), *s.map, o); },
        {"options.head_decays[1] is 1.5 but expected a decay in (0, 1]"});
    o.head_decays = fine;
    o.causal = false;
    o.decay = 1.0;
    check_invalid(
        [&] { linear_attention(in(q, d), in(k, d), in(v, d_v), mut(out, d_v), *s.map, o); },
        {"options.head_decays[0] is 0.9", "a decay is causal only"});
    o.causal = true;
    CHECK_NOTHROW(linear_attention(in(q, d), in(k, d), in(v, d_v), mut(out, d_v), *s.map, o));
  }
}
