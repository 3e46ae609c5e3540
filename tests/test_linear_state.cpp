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
#include "map_cases.hpp"
#include "reference/linear_reference.hpp"
#include "reference/random.hpp"
#include "threads.hpp"

namespace {

using namespace linrope;
using namespace linrope::testing;

constexpr double kEmptyScale = -std::numeric_limits<double>::infinity();

// The key features that enter the state, by the reference's formulas for the placement (the
// table in attention.hpp): the numerator side (S) and the denominator side (z).
struct KeySides {
  MatrixD num, den;
};
KeySides key_sides(const Setup& s, const MatrixD& k, Index k_offset) {
  switch (s.p.placement) {
    case RopePlacement::None:
      return {s.phi(k), s.phi(k)};
    case RopePlacement::BeforeMap: {
      const MatrixD f = s.phi(ref::rotate_rows(*s.spec, k, k_offset));
      return {f, f};
    }
    case RopePlacement::NumeratorOnly:
      return {ref::rotate_rows(*s.spec, s.phi(k), k_offset), s.phi(k)};
    case RopePlacement::Full: {
      const MatrixD f = ref::rotate_rows(*s.spec, s.phi(k), k_offset);
      return {f, f};
    }
  }
  throw std::logic_error("key_sides: placement");
}

// exp(log_scale) S and exp(log_scale) z against the explicit sums over every key, each entry
// within gamma times the sum of its terms' absolute values (plus T's smallest normal, for sums
// that underflow in float).
template <class T>
void check_state(const LinearAttentionState<T>& got, const Setup& s, double gamma) {
  const KeySides sides = key_sides(s, s.k, s.p.k_offset);
  const MatrixD want_S = sides.num.transpose() * s.v, want_z = sides.den.colwise().sum();
  const MatrixD size_S = sides.num.cwiseAbs().transpose() * s.v.cwiseAbs();
  const MatrixD size_z = sides.den.cwiseAbs().colwise().sum();
  REQUIRE(std::isfinite(got.log_scale));
  const double scale = std::exp(got.log_scale), absolute = double(std::numeric_limits<T>::min());
  const MatrixD got_S = scale * got.S.template cast<double>();
  const MatrixD got_z = scale * got.z.transpose().template cast<double>();
  const auto check = [&](const char* what, const MatrixD& a, const MatrixD& b,
                         const MatrixD& size) {
    INFO(what);
    double worst = 0;
    for (Index i = 0; i < a.rows(); ++i)
      for (Index j = 0; j < a.cols(); ++j)
        worst = std::max(worst, std::abs(a(i, j) - b(i, j)) / (gamma * size(i, j) + absolute));
    INFO("worst |error| / tolerance = ", worst);
    CHECK(worst <= 1);
  };
  check("S", got_S, want_S, size_S);
  check("z", got_z, want_z, size_z);
}

// The problems the cut tests sweep: every map and placement, causal, odd n, queries and keys the
// same tokens at a shared offset. `larger` multiplies the keys on one side of the cut so that the
// stabiliser's scale grows across it (FAVOR+ maps; the others have no scale).
Problem cut_problem(FeatureMapKind kind, RopePlacement placement, Index n) {
  Problem p;
  p.kind = kind;
  p.placement = placement;
  p.causal = true;
  p.n = p.n_k = n;
  p.d = 5;
  p.d_v = 3;
  p.q_offset = p.k_offset = 4;
  return p;
}

// Parts [0, cut) and [cut, n) run in turn from one state, in precision T.
template <class T>
struct CutRun {
  Matrix<T> out;
  LinearAttentionState<T> first_state, final_state;
};
template <class T>
CutRun<T> run_cut(const Setup& s, Index cut, const LinearOptions& options) {
  const Index n = s.q.rows();
  const auto part = [&](const MatrixD& x, Index first, Index count) {
    return Matrix<T>(x.middleRows(first, count).template cast<T>());
  };
  CutRun<T> r;
  LinearAttentionState<T> state;
  LinearOptions o = options;
  const Matrix<T> out1 =
      linear_attention(part(s.q, 0, cut), part(s.k, 0, cut), part(s.v, 0, cut), *s.map, o, state);
  r.first_state = state;
  o.q_offset = o.k_offset = options.q_offset + cut;
  const Matrix<T> out2 = linear_attention(part(s.q, cut, n - cut), part(s.k, cut, n - cut),
                                          part(s.v, cut, n - cut), *s.map, o, state);
  r.out.resize(n, s.v.cols());
  r.out << out1, out2;
  r.final_state = std::move(state);
  return r;
}

// The cut's gradients: the second part's backward from the first's state (d_final zero), giving
// d_initial, then the first part's backward with that as its d_final; dq, dk, dv concatenated.
template <class T>
AttentionGradients<T> run_cut_backward(const Setup& s, Index cut, const LinearOptions& options) {
  const Index n = s.q.rows();
  const auto part = [&](const MatrixD& x, Index first, Index count) {
    return Matrix<T>(x.middleRows(first, count).template cast<T>());
  };
  LinearAttentionState<T> empty, between;
  LinearOptions o1 = options, o2 = options;
  o2.q_offset = o2.k_offset = options.q_offset + cut;
  linear_attention(part(s.q, 0, cut), part(s.k, 0, cut), part(s.v, 0, cut), *s.map, o1, between);
  LinearStateGradient<T> none, d_between;
  const AttentionGradients<T> g2 = linear_attention_backward(
      part(s.q, cut, n - cut), part(s.k, cut, n - cut), part(s.v, cut, n - cut),
      part(s.d_out, cut, n - cut), *s.map, o2, between, none, &d_between);
  const AttentionGradients<T> g1 =
      linear_attention_backward(part(s.q, 0, cut), part(s.k, 0, cut), part(s.v, 0, cut),
                                part(s.d_out, 0, cut), *s.map, o1, empty, d_between);
  AttentionGradients<T> g{Matrix<T>(n, s.q.cols()), Matrix<T>(n, s.k.cols()),
                          Matrix<T>(n, s.v.cols())};
  g.dq << g1.dq, g2.dq;
  g.dk << g1.dk, g2.dk;
  g.dv << g1.dv, g2.dv;
  return g;
}

// Keys [from, to) times `factor`: their features' stabiliser shift grows (FAVOR+).
void scale_keys(Setup& s, Index from, Index to, double factor) {
  s.k.middleRows(from, to - from) = Setup::as_float(s.k.middleRows(from, to - from) * factor);
}

const CausalMethod kMethodsSwept[] = {CausalMethod::Scan, CausalMethod::Chunked};

// Outputs and the final state for every cut, in float and double, each method, against the
// reference on the whole.
void check_forward_cuts(Setup& s, const std::vector<Index>& cuts) {
  const ref::LinearResult want = s.reference();
  const double z = std::max(ref::exponent_size(*s.map, s.q), ref::exponent_size(*s.map, s.k));
  const Index n = s.q.rows();
  for (const CausalMethod method : kMethodsSwept) {
    LinearOptions o = s.options;
    o.method = method;
    o.chunk_size = 3;
    for (const Index cut : cuts) {
      CAPTURE(cut);
      const std::string method_name = to_string(method);
      CAPTURE(method_name);
      const double gamma_f = ref::rounding_gamma<float>(s.m, s.p.d, n, z);
      const double gamma_d = ref::rounding_gamma<double>(s.m, s.p.d, n, z);
      const CutRun<double> d = run_cut<double>(s, cut, o);
      check_close(d.out, want.out, ref::row_tolerances(want, gamma_d, s.p.eps), "double cut");
      check_state(d.final_state, s, gamma_d);
      const CutRun<float> f = run_cut<float>(s, cut, o);
      check_close(f.out, want.out,
                  ref::row_tolerances(want, gamma_f, s.p.eps, std::numeric_limits<float>::min()),
                  "float cut");
      check_state(f.final_state, s, gamma_f);
    }
  }
}

}  // namespace

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
        const ref::LinearResult want = s.reference();
        const Gradients fd = finite_differences(s);
        const Bounds b = gradient_bounds(s, want);
        const double gamma_f = rounding_gamma_of<float>(s), gamma_d = rounding_gamma_of<double>(s);
        if (!b.conditioned(gamma_f)) {  // ill-conditioned in float (a Full den near 0): rare
          ++skipped;
          continue;
        }
        for (const CausalMethod method : kMethodsSwept)
          for (const Index cut : {Index(0), Index(1), Index(6), Index(12), n}) {
            CAPTURE(cut);
            const std::string method_name = to_string(method);
            CAPTURE(method_name);
            LinearOptions o = s.options;
            o.method = method;
            o.chunk_size = 3;
            check_gradients(run_cut_backward<double>(s, cut, o), fd, b, gamma_d);
            check_gradients(run_cut_backward<float>(s, cut, o), fd, b, gamma_f);
            ++run;
          }
      }
  INFO("ran ", run, ", skipped ", skipped, " ill-conditioned problems");
  CHECK(run >= 250);
  CHECK(skipped <= 3);
}

TEST_CASE("d_initial and d_final at the state's own scale: the state's gradient by differences") {
  // L = sum(d_out . out) + <G, S_final> + <g, z_final>, S_final = exp(-l_f) (sums of the whole,
  // l_f held fixed), for a call started from a non-empty state at log scale l_0 != 0: dL/dS_0,
  // dL/dz_0 (at l_0), dk and dv against central differences of an explicit formula that builds
  // the state from the reference's features. One map with a scale (favor+) and one without
  // (elu+1), numerator-only (S and z from different features).
  // Also with fewer queries than keys (the last keys read by the final state alone) and with none
  // (keys only: the state alone, as linrope.torch.distributed sums a rank's).
  for (const FeatureMapKind kind : {FeatureMapKind::FavorPositive, FeatureMapKind::EluPlusOne})
    for (const Index queries : {Index(6), Index(4), Index(0)}) {
      const std::string kind_name = to_string(kind);
      CAPTURE(kind_name);
      CAPTURE(queries);
      Problem p = cut_problem(kind, RopePlacement::NumeratorOnly, 6);
      Setup s(p);
      s.q = MatrixD(s.q.topRows(queries));
      s.d_out = MatrixD(s.d_out.topRows(queries));
      const Index m = s.m, d_v = p.d_v;
      // The initial state: the sums of 4 earlier keys at positions 0..3, stored at log scale 0.3.
      const MatrixD k0 = gaussian(4, p.d, 91, 0.7), v0 = gaussian(4, d_v, 92);
      const KeySides first = key_sides(s, k0, 0);
      const double l0 = 0.3;
      const MatrixD S0 = std::exp(-l0) * first.num.transpose() * v0;
      const MatrixD z0 = std::exp(-l0) * first.den.colwise().sum().transpose();
      const MatrixD G = gaussian(m, d_v, 93), g = gaussian(m, 1, 94);
      // The state after the call, by the kernel (for l_f), then the loss by formula.
      LinearAttentionStateD state{S0, z0, l0};
      linear_attention(s.q, s.k, s.v, *s.map, s.options, state);
      const double lf = state.log_scale;
      const auto loss = [&](const MatrixD& q, const MatrixD& k, const MatrixD& v, const MatrixD& S,
                            const MatrixD& z) {
        const KeySides keys = key_sides(s, k, p.k_offset);
        // Query sides: the same formulas at the queries' positions.
        const KeySides queries = key_sides(s, q, p.q_offset);
        double total = 0;
        MatrixD num_state = std::exp(l0) * S, den_state = std::exp(l0) * z;
        for (Index i = 0; i < q.rows(); ++i) {
          const MatrixD num_i = queries.num.row(i) * num_state;
          const double den_i = (queries.den.row(i) * den_state)(0, 0);
          MatrixD num = num_i;
          double den = den_i;
          for (Index j = 0; j <= i; ++j) {
            num += (queries.num.row(i) * keys.num.row(j).transpose())(0, 0) * v.row(j);
            den += (queries.den.row(i) * keys.den.row(j).transpose())(0, 0);
          }
          total += (s.d_out.row(i) * (num / (den + p.eps)).transpose())(0, 0);
        }
        const MatrixD S_final = std::exp(-lf) * (num_state + keys.num.transpose() * v);
        const MatrixD z_final = std::exp(-lf) * (den_state + keys.den.colwise().sum().transpose());
        return total + (G.array() * S_final.array()).sum() + (g.array() * z_final.array()).sum();
      };
      LinearStateGradient<double> d_initial;
      const AttentionGradients<double> got = linear_attention_backward(
          s.q, s.k, s.v, s.d_out, *s.map, s.options, LinearAttentionStateD{S0, z0, l0},
          LinearStateGradient<double>{G, g}, &d_initial);
      const MatrixD fd_S =
          ref::central_difference(S0, [&](const MatrixD& x) { return loss(s.q, s.k, s.v, x, z0); });
      const MatrixD fd_z =
          ref::central_difference(z0, [&](const MatrixD& x) { return loss(s.q, s.k, s.v, S0, x); });
      const MatrixD fd_k =
          ref::central_difference(s.k, [&](const MatrixD& x) { return loss(s.q, x, s.v, S0, z0); });
      const MatrixD fd_v =
          ref::central_difference(s.v, [&](const MatrixD& x) { return loss(s.q, s.k, x, S0, z0); });
      const MatrixD fd_q =
          ref::central_difference(s.q, [&](const MatrixD& x) { return loss(x, s.k, s.v, S0, z0); });
      // Differences of a smooth loss of size ~1 with h = 1e-5: error ~1e-10
      // (finite_difference.hpp); the double kernel's rounding is far below. 1e-7 relative to the
      // largest entry is three orders above both and six below a missing term.
      const auto check = [](const char* what, const MatrixD& a, const MatrixD& b) {
        INFO(what);
        REQUIRE(a.rows() == b.rows());
        REQUIRE(a.cols() == b.cols());
        if (b.size() == 0) return;
        const double size = std::max(b.cwiseAbs().maxCoeff(), 1e-3);
        INFO("max |error| ", (a - b).cwiseAbs().maxCoeff(), " against size ", size);
        CHECK((a - b).cwiseAbs().maxCoeff() <= 1e-7 * size);
      };
      check("dS_initial", d_initial.dS, fd_S);
      check("dz_initial", MatrixD(d_initial.dz), fd_z);
      check("dq", got.dq, fd_q);
      check("dk", got.dk, fd_k);
      check("dv", got.dv, fd_v);
    }
}

TEST_CASE("batched state in, state out equals the single-head calls, padded rows left out") {
  // B = 2, H = 3, per-slice states of their own (one empty), lengths {9, 5}: each slice's output,
  // final state and gradients are the single-head call's bits. Then the same in place.
  const Index B = 2, H = 3, n = 9, d = 5, d_v = 3;
  const std::vector<Index> lengths = {9, 5};
  const auto map = make_map(FeatureMapKind::FavorPositive, d, 6);
  const Index m = map->output_dim();
  const Rope rope(placement_rope(RopePlacement::NumeratorOnly, d, m, false));
  LinearOptions o;
  o.causal = true;
  o.placement = RopePlacement::NumeratorOnly;
  o.rope = &rope;
  o.q_offset = o.k_offset = 7;
  const auto data = [](Index count, std::uint64_t seed) {
    const MatrixD x = gaussian(count, 1, seed, 0.7);
    return std::vector<double>(x.data(), x.data() + count);
  };
  const std::vector<double> q = data(B * H * n * d, 1), k = data(B * H * n * d, 2),
                            v = data(B * H * n * d_v, 3), d_out = data(B * H * n * d_v, 4);
  std::vector<double> S0 = data(B * H * m * d_v, 5), z0 = data(B * H * m, 6);
  for (double& x : z0) x = std::abs(x);  // a positive denominator state, as a map's sums are
  std::vector<double> l0 = {0.1, -0.2, kEmptyScale, 0.4, 0.0, 1.5};
  const std::vector<double> dS_final = data(B * H * m * d_v, 7), dz_final = data(B * H * m, 8);
  std::vector<double> out(B * H * n * d_v), S(B * H * m * d_v), z(B * H * m), l(B * H);
  const auto in = [&](const std::vector<double>& x, Index width) {
    return Heads<const double>{x.data(), B, H, n, width, lengths.data()};
  };
  const HeadStates<const double> initial{S0.data(), z0.data(), l0.data(), B, H, m, d_v};
  linear_attention(in(q, d), in(k, d), in(v, d_v), Heads<double>{out.data(), B, H, n, d_v}, *map, o,
                   initial, HeadStates<double>{S.data(), z.data(), l.data(), B, H, m, d_v});
  std::vector<double> dq(q.size()), dk(k.size()), dv(v.size()), dS(S.size()), dz(z.size());
  linear_attention_backward(
      in(q, d), in(k, d), in(v, d_v), in(d_out, d_v), Heads<double>{dq.data(), B, H, n, d},
      Heads<double>{dk.data(), B, H, n, d}, Heads<double>{dv.data(), B, H, n, d_v}, *map, o,
      initial, HeadStates<const double>{dS_final.data(), dz_final.data(), nullptr, B, H, m, d_v},
      HeadStates<double>{dS.data(), dz.data(), nullptr, B, H, m, d_v});
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h) {
      CAPTURE(b);
      CAPTURE(h);
      const Index s = b * H + h, rows = lengths[std::size_t(b)];
      const auto mat = [&](const std::vector<double>& x, Index r, Index c, Index at) {
        return MatrixD(Eigen::Map<const MatrixD>(x.data() + at, r, c));
      };
      const MatrixD qs = mat(q, rows, d, s * n * d), ks = mat(k, rows, d, s * n * d),
                    vs = mat(v, rows, d_v, s * n * d_v), gs = mat(d_out, rows, d_v, s * n * d_v);
      LinearAttentionStateD state;
      if (l0[std::size_t(s)] != kEmptyScale)
        state = {mat(S0, m, d_v, s * m * d_v), mat(z0, m, 1, s * m), l0[std::size_t(s)]};
      const LinearAttentionStateD initial_state = state;
      const MatrixD want = linear_attention(qs, ks, vs, *map, o, state);
      CHECK(mat(out, rows, d_v, s * n * d_v) == want);
      CHECK(mat(S, m, d_v, s * m * d_v) == state.S);
      CHECK(mat(z, m, 1, s * m) == MatrixD(state.z));
      CHECK(l[std::size_t(s)] == state.log_scale);
      LinearStateGradient<double> d_initial;
      const AttentionGradients<double> g = linear_attention_backward(
          qs, ks, vs, gs, *map, o, initial_state,
          {mat(dS_final, m, d_v, s * m * d_v), mat(dz_final, m, 1, s * m)}, &d_initial);
      CHECK(mat(dq, rows, d, s * n * d) == g.dq);
      CHECK(mat(dk, rows, d, s * n * d) == g.dk);
      CHECK(mat(dv, rows, d_v, s * n * d_v) == g.dv);
      CHECK(mat(dS, m, d_v, s * m * d_v) == d_initial.dS);
      CHECK(mat(dz, m, 1, s * m) == MatrixD(d_initial.dz));
      // Padded rows: zero outputs' neighbours untouched, zero gradients.
      if (rows < n)
        CHECK(Eigen::Map<const MatrixD>(dk.data() + s * n * d + rows * d, n - rows, d).isZero(0));
    }
  // In place: the final states written over the initial ones give the same bits.
  std::vector<double> S_in = S0, z_in = z0, l_in = l0, out2(out.size());
  linear_attention(in(q, d), in(k, d), in(v, d_v), Heads<double>{out2.data(), B, H, n, d_v}, *map,
                   o, HeadStates<const double>{S_in.data(), z_in.data(), l_in.data(), B, H, m, d_v},
                   HeadStates<double>{S_in.data(), z_in.data(), l_in.data(), B, H, m, d_v});
  CHECK(out2 == out);
  CHECK(S_in == S);
  CHECK(z_in == z);
  CHECK(l_in == l);
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
  const AttentionGradients<float> got = run_cut_backward<float>(s, cut, s.options);
  AttentionGradients<double> whole;
  {
    const ThreadCount one(1);
    whole = s.run<double>();
  }
  const Bounds b = gradient_bounds(s, want);
  const double gamma_sum = rounding_gamma_of<float>(s) + rounding_gamma_of<double>(s);
  check_matrix<float>("dq", got.dq, whole.dq, b.dq, gamma_sum, 0.0);
  check_matrix<float>("dk", got.dk, whole.dk, b.dk, gamma_sum, 0.0);
  check_matrix<float>("dv", got.dv, whole.dv, b.dv, gamma_sum, 0.0);
}

namespace {

template <class F>
void check_invalid(F&& call, std::initializer_list<const char*> fragments) {
  try {
    call();
    FAIL("expected std::invalid_argument");
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    for (const char* fragment : fragments) {
      INFO("message: ", what);
      CHECK(what.find(fragment) != std::string::npos);
    }
  }
}

}  // namespace

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
