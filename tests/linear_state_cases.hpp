// The pieces of the state in, state out tests (test_linear_state.cpp, and test_decay.cpp with a
// decay): a causal problem cut in two and run part by part from the state between, forward and
// backward; the state checked against its explicit sums; and the outputs and final states of every
// cut checked against the reference on the whole. Tolerances as test_linear_state.cpp derives.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <linrope/linrope.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "check_close.hpp"
#include "linear_cases.hpp"
#include "linear_gradient_cases.hpp"
#include "map_cases.hpp"
#include "reference/finite_difference.hpp"
#include "reference/linear_reference.hpp"
#include "reference/random.hpp"
#include "threads.hpp"

namespace linrope::testing {

// The key features that enter the state, by the reference's formulas for the placement (the
// table in attention.hpp): the numerator side (S) and the denominator side (z).
struct KeySides {
  MatrixD num, den;
};
inline KeySides key_sides(const Setup& s, const MatrixD& k, Index k_offset) {
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
// that underflow in float). With a decay g, key j's terms weigh g^(t - p_j), t the position of
// the last key (attention.hpp, "State in, state out").
template <class T>
void check_state(const LinearAttentionState<T>& got, const Setup& s, double gamma) {
  const KeySides sides = key_sides(s, s.k, s.p.k_offset);
  const Index n_k = s.k.rows();
  VectorD weight(n_k);
  for (Index j = 0; j < n_k; ++j) weight(j) = std::pow(s.p.decay, double(n_k - 1 - j));
  const MatrixD want_S = sides.num.transpose() * weight.asDiagonal() * s.v;
  const MatrixD want_z = weight.transpose() * sides.den;
  const MatrixD size_S = sides.num.cwiseAbs().transpose() * weight.asDiagonal() * s.v.cwiseAbs();
  const MatrixD size_z = weight.transpose() * sides.den.cwiseAbs();
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
inline Problem cut_problem(FeatureMapKind kind, RopePlacement placement, Index n) {
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
inline void scale_keys(Setup& s, Index from, Index to, double factor) {
  s.k.middleRows(from, to - from) = Setup::as_float(s.k.middleRows(from, to - from) * factor);
}

inline constexpr CausalMethod kMethodsSwept[] = {CausalMethod::Scan, CausalMethod::Chunked};

// Outputs and the final state for every cut, in float and double, each method, against the
// reference on the whole.
inline void check_forward_cuts(Setup& s, const std::vector<Index>& cuts) {
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
      const double decay = ref::decay_gamma(reference_spec(s.options, s.spec), n, n);
      const double gamma_f = ref::rounding_gamma<float>(s.m, s.p.d, n, z) + decay;
      const double gamma_d = ref::rounding_gamma<double>(s.m, s.p.d, n, z) + decay;
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

// The gradients of a cut problem at cuts 0, 1, the middle, n - 1 and n, both methods (chunks
// of 3), float and double, against central differences of the reference on the whole (the first
// part's keys get their gradient from the second part's queries only through the state between
// them). Returns the comparisons run, or 0 for a problem ill-conditioned in float (a Full den near
// 0: rare), whose comparisons are skipped.
inline int check_cut_gradients(const Setup& s) {
  const Index n = s.q.rows();
  const ref::LinearResult want = s.reference();
  const Gradients fd = finite_differences(s);
  const Bounds b = gradient_bounds(s, want);
  const double gamma_f = rounding_gamma_of<float>(s), gamma_d = rounding_gamma_of<double>(s);
  if (!b.conditioned(gamma_f)) return 0;
  int run = 0;
  for (const CausalMethod method : kMethodsSwept)
    for (const Index cut : {Index(0), Index(1), n / 2, n - 1, n}) {
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
  return run;
}

// The state's gradient by differences, with a decay g (1: none). L = sum(d_out . out) + <G, S_f>
// + <g, z_f> for a call from a non-empty state S_0, z_0 at log scale l_0 != 0, written out
// explicitly from the reference's features: the state sits at position k_offset - 1 and a query at
// p_i reads it times g^(p_i - (k_offset - 1)); the final state, at the last key's position t, is
// exp(-l_f) (g^(n_k) exp(l_0) S_0 + sum_j g^(t - p_j) num_j v_j^T) with l_f the kernel's (held
// fixed). dL/dS_0, dL/dz_0, dq, dk and dv against central differences of that formula. One map
// with a scale (favor+) and one without (elu+1), numerator-only (S and z from different features);
// also with fewer queries than keys (the last keys read by the final state alone) and with none
// (keys only: the state alone, as linrope.torch.distributed sums a rank's).
inline void check_state_gradient_by_differences(double decay) {
  for (const FeatureMapKind kind : {FeatureMapKind::FavorPositive, FeatureMapKind::EluPlusOne})
    for (const Index queries : {Index(6), Index(4), Index(0)}) {
      const std::string kind_name = to_string(kind);
      CAPTURE(kind_name);
      CAPTURE(decay);
      CAPTURE(queries);
      Problem p = cut_problem(kind, RopePlacement::NumeratorOnly, 6);
      p.decay = decay;
      Setup s(p);
      s.q = MatrixD(s.q.topRows(queries));
      s.d_out = MatrixD(s.d_out.topRows(queries));
      const Index m = s.m, d_v = p.d_v, n_k = s.k.rows();
      const MatrixD k0 = gaussian(4, p.d, 91, 0.7), v0 = gaussian(4, d_v, 92);
      const KeySides first = key_sides(s, k0, 0);
      const double l0 = 0.3;
      const MatrixD S0 = std::exp(-l0) * first.num.transpose() * v0;
      const MatrixD z0 = std::exp(-l0) * first.den.colwise().sum().transpose();
      const MatrixD G = gaussian(m, d_v, 93), g = gaussian(m, 1, 94);
      LinearAttentionStateD state{S0, z0, l0};
      linear_attention(s.q, s.k, s.v, *s.map, s.options, state);
      const double lf = state.log_scale;
      const auto power = [&](Index distance) { return std::pow(decay, double(distance)); };
      const auto loss = [&](const MatrixD& q, const MatrixD& k, const MatrixD& v, const MatrixD& S,
                            const MatrixD& z) {
        const KeySides keys = key_sides(s, k, p.k_offset);
        const KeySides reads = key_sides(s, q, p.q_offset);  // the queries' sides, same formulas
        const MatrixD num_state = std::exp(l0) * S, den_state = std::exp(l0) * z;
        double total = 0;
        for (Index i = 0; i < q.rows(); ++i) {
          const double from_state = power(p.q_offset + i - (p.k_offset - 1));
          MatrixD num = from_state * reads.num.row(i) * num_state;
          double den = from_state * (reads.den.row(i) * den_state)(0, 0);
          for (Index j = 0; p.k_offset + j <= p.q_offset + i && j < n_k; ++j) {
            const double w = power(p.q_offset + i - (p.k_offset + j));
            num += w * (reads.num.row(i) * keys.num.row(j).transpose())(0, 0) * v.row(j);
            den += w * (reads.den.row(i) * keys.den.row(j).transpose())(0, 0);
          }
          total += (s.d_out.row(i) * (num / (den + p.eps)).transpose())(0, 0);
        }
        MatrixD S_final = power(n_k) * num_state, z_final = power(n_k) * den_state;
        for (Index j = 0; j < n_k; ++j) {
          S_final += power(n_k - 1 - j) * keys.num.row(j).transpose() * v.row(j);
          z_final += power(n_k - 1 - j) * keys.den.row(j).transpose();
        }
        return total + std::exp(-lf) * ((G.array() * S_final.array()).sum() +
                                        (g.array() * z_final.array()).sum());
      };
      LinearStateGradient<double> d_initial;
      const AttentionGradients<double> got = linear_attention_backward(
          s.q, s.k, s.v, s.d_out, *s.map, s.options, LinearAttentionStateD{S0, z0, l0},
          LinearStateGradient<double>{G, g}, &d_initial);
      // Differences of a smooth loss of size ~1 with h = 1e-5 err by ~1e-10
      // (finite_difference.hpp) and the double kernel far less: 1e-7 relative to the largest
      // entry is three orders above both and six below a missing or misplaced g^k.
      const auto check = [](const char* what, const MatrixD& a, const MatrixD& b) {
        INFO(what);
        REQUIRE(a.rows() == b.rows());
        REQUIRE(a.cols() == b.cols());
        if (b.size() == 0) return;
        const double size = std::max(b.cwiseAbs().maxCoeff(), 1e-3);
        INFO("max |error| ", (a - b).cwiseAbs().maxCoeff(), " against size ", size);
        CHECK((a - b).cwiseAbs().maxCoeff() <= 1e-7 * size);
      };
      check("dS_initial", d_initial.dS, ref::central_difference(S0, [&](const MatrixD& x) {
              return loss(s.q, s.k, s.v, x, z0);
            }));
      check("dz_initial", MatrixD(d_initial.dz), ref::central_difference(z0, [&](const MatrixD& x) {
              return loss(s.q, s.k, s.v, S0, x);
            }));
      check("dq", got.dq, ref::central_difference(s.q, [&](const MatrixD& x) {
              return loss(x, s.k, s.v, S0, z0);
            }));
      check("dk", got.dk, ref::central_difference(s.k, [&](const MatrixD& x) {
              return loss(s.q, x, s.v, S0, z0);
            }));
      check("dv", got.dv, ref::central_difference(s.v, [&](const MatrixD& x) {
              return loss(s.q, s.k, x, S0, z0);
            }));
    }
}

// Batched state in, state out against the single-head calls, each head h with its decay
// (decays[h]; empty: none): B = 2, H = 3, lengths {9, 5}, per-slice initial states (one empty).
// Outputs, final states and gradients (with d_final and d_initial), and the call without states
// and its backward, are the single-head calls' bits; padded rows get zero gradients; the final
// states written over the initial ones give the same bits. Both methods.
inline void check_batched_states(const std::vector<double>& decays) {
  const Index B = 2, H = 3, n = 9, d = 5, d_v = 3;
  const std::vector<Index> lengths = {9, 5};
  const auto map = make_map(FeatureMapKind::FavorPositive, d, 6);
  const Index m = map->output_dim();
  const Rope rope(placement_rope(RopePlacement::NumeratorOnly, d, m, false));
  const auto data = [](Index count, std::uint64_t seed) {
    const MatrixD x = gaussian(count, 1, seed, 0.7);
    return std::vector<double>(x.data(), x.data() + count);
  };
  const std::vector<double> q = data(B * H * n * d, 1), k = data(B * H * n * d, 2),
                            v = data(B * H * n * d_v, 3), d_out = data(B * H * n * d_v, 4);
  std::vector<double> S0 = data(B * H * m * d_v, 5), z0 = data(B * H * m, 6);
  for (double& x : z0) x = std::abs(x);
  const std::vector<double> l0 = {0.1, -0.2, -std::numeric_limits<double>::infinity(),
                                  0.4, 0.0,  1.5};
  const std::vector<double> dS_final = data(B * H * m * d_v, 7), dz_final = data(B * H * m, 8);
  for (const CausalMethod method : kMethodsSwept) {
    const std::string method_name = to_string(method);
    CAPTURE(method_name);
    LinearOptions o;
    o.causal = true;
    o.placement = RopePlacement::NumeratorOnly;
    o.rope = &rope;
    o.q_offset = o.k_offset = 7;
    o.method = method;
    o.chunk_size = 3;
    o.head_decays = decays;
    const auto in = [&](const std::vector<double>& x, Index width) {
      return Heads<const double>{x.data(), B, H, n, width, lengths.data()};
    };
    std::vector<double> out(B * H * n * d_v), plain_out(B * H * n * d_v), S(S0.size()),
        z(z0.size()), l(B * H);
    const HeadStates<const double> initial{S0.data(), z0.data(), l0.data(), B, H, m, d_v};
    linear_attention(in(q, d), in(k, d), in(v, d_v), Heads<double>{out.data(), B, H, n, d_v}, *map,
                     o, initial, HeadStates<double>{S.data(), z.data(), l.data(), B, H, m, d_v});
    linear_attention(in(q, d), in(k, d), in(v, d_v), Heads<double>{plain_out.data(), B, H, n, d_v},
                     *map, o);
    std::vector<double> dq(q.size()), dk(k.size()), dv(v.size()), dS(S.size()), dz(z.size()),
        pdq(q.size()), pdk(k.size()), pdv(v.size());
    linear_attention_backward(
        in(q, d), in(k, d), in(v, d_v), in(d_out, d_v), Heads<double>{dq.data(), B, H, n, d},
        Heads<double>{dk.data(), B, H, n, d}, Heads<double>{dv.data(), B, H, n, d_v}, *map, o,
        initial, HeadStates<const double>{dS_final.data(), dz_final.data(), nullptr, B, H, m, d_v},
        HeadStates<double>{dS.data(), dz.data(), nullptr, B, H, m, d_v});
    linear_attention_backward(
        in(q, d), in(k, d), in(v, d_v), in(d_out, d_v), Heads<double>{pdq.data(), B, H, n, d},
        Heads<double>{pdk.data(), B, H, n, d}, Heads<double>{pdv.data(), B, H, n, d_v}, *map, o);
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
        LinearOptions single = o;
        single.head_decays = {};
        single.decay = decays.empty() ? 1.0 : decays[std::size_t(h)];
        CHECK(mat(plain_out, rows, d_v, s * n * d_v) == linear_attention(qs, ks, vs, *map, single));
        const AttentionGradients<double> pg =
            linear_attention_backward(qs, ks, vs, gs, *map, single);
        CHECK(mat(pdq, rows, d, s * n * d) == pg.dq);
        CHECK(mat(pdk, rows, d, s * n * d) == pg.dk);
        CHECK(mat(pdv, rows, d_v, s * n * d_v) == pg.dv);
        LinearAttentionStateD state;
        if (l0[std::size_t(s)] != -std::numeric_limits<double>::infinity())
          state = {mat(S0, m, d_v, s * m * d_v), mat(z0, m, 1, s * m), l0[std::size_t(s)]};
        const LinearAttentionStateD initial_state = state;
        CHECK(mat(out, rows, d_v, s * n * d_v) ==
              linear_attention(qs, ks, vs, *map, single, state));
        CHECK(mat(S, m, d_v, s * m * d_v) == state.S);
        CHECK(mat(z, m, 1, s * m) == MatrixD(state.z));
        CHECK(l[std::size_t(s)] == state.log_scale);
        LinearStateGradient<double> d_initial;
        const AttentionGradients<double> g = linear_attention_backward(
            qs, ks, vs, gs, *map, single, initial_state,
            {mat(dS_final, m, d_v, s * m * d_v), mat(dz_final, m, 1, s * m)}, &d_initial);
        CHECK(mat(dq, rows, d, s * n * d) == g.dq);
        CHECK(mat(dk, rows, d, s * n * d) == g.dk);
        CHECK(mat(dv, rows, d_v, s * n * d_v) == g.dv);
        CHECK(mat(dS, m, d_v, s * m * d_v) == d_initial.dS);
        CHECK(mat(dz, m, 1, s * m) == MatrixD(d_initial.dz));
        if (rows < n)
          CHECK(Eigen::Map<const MatrixD>(dk.data() + s * n * d + rows * d, n - rows, d).isZero(0));
      }
    std::vector<double> S_in = S0, z_in = z0, l_in = l0, out2(out.size());
    linear_attention(in(q, d), in(k, d), in(v, d_v), Heads<double>{out2.data(), B, H, n, d_v}, *map,
                     o,
                     HeadStates<const double>{S_in.data(), z_in.data(), l_in.data(), B, H, m, d_v},
                     HeadStates<double>{S_in.data(), z_in.data(), l_in.data(), B, H, m, d_v});
    CHECK(out2 == out);
    CHECK(S_in == S);
    CHECK(z_in == z);
    CHECK(l_in == l);
  }
}

// A float backward's gradients (of a long head, split across threads) against the double backward
// of the whole on one thread: both within gamma G of the exact gradient, so within
// (gamma_float + gamma_double) G of each other.
inline void check_against_one_thread(const AttentionGradients<float>& got, const Setup& s,
                                     const ref::LinearResult& want) {
  AttentionGradients<double> one;
  {
    const ThreadCount single(1);
    one = s.run<double>();
  }
  const Bounds b = gradient_bounds(s, want);
  const double gamma_sum = rounding_gamma_of<float>(s) + rounding_gamma_of<double>(s);
  check_matrix<float>("dq", got.dq, one.dq, b.dq, gamma_sum, 0.0);
  check_matrix<float>("dk", got.dk, one.dk, b.dk, gamma_sum, 0.0);
  check_matrix<float>("dv", got.dv, one.dv, b.dv, gamma_sum, 0.0);
}

// Runs `call`, which must throw std::invalid_argument whose message holds every fragment.
template <class F>
void check_invalid(F&& call, std::initializer_list<const char*> fragments) {
  try {
    call();
    FAIL("expected std::invalid_argument");
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    INFO("message: ", what);
    for (const char* fragment : fragments) CHECK(what.find(fragment) != std::string::npos);
  }
}

}  // namespace linrope::testing
