// linear_attention_backward (include/linrope/attention.hpp, "Gradients"; batched.hpp) against
// central finite differences of the naive reference forward (tests/reference/linear_reference.hpp:
// explicit rotation matrices, explicit n x n_k weights, features by the reference formulas), never
// of the library's forward; plus the properties a causal gradient must have, batched against
// per-head, long sequences split across threads against a double backward, and bad input.
//
// The tolerances and the finite differences: linear_gradient_cases.hpp, at the top.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <limits>
#include <linrope/linrope.hpp>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "linear_cases.hpp"
#include "linear_gradient_cases.hpp"
#include "map_cases.hpp"
#include "reference/finite_difference.hpp"
#include "reference/linear_reference.hpp"
#include "reference/random.hpp"
#include "threads.hpp"

namespace {

using namespace linrope;
using namespace linrope::testing;

// The shapes every (map, placement, causal) combination runs.
std::vector<Problem> shapes(FeatureMapKind kind, RopePlacement placement, bool causal,
                            std::uint64_t seed) {
  std::vector<Problem> out;
  Problem base;
  base.kind = kind;
  base.placement = placement;
  base.causal = causal;
  base.seed = seed;
  {  // n = 1
    Problem p = base;
    p.n = p.n_k = 1;
    p.d = 4;
    p.d_v = 2;
    out.push_back(p);
  }
  {  // odd sizes, half layout, partial rotary width
    Problem p = base;
    p.n = p.n_k = 7;
    p.d = 5;
    p.d_v = 3;
    p.layout = RopeLayout::Half;
    p.partial = true;
    out.push_back(p);
  }
  {  // cross: 4 new queries after 5 cached keys (9 keys in all), eps > 0 that matters
    Problem p = base;
    p.n = 4;
    p.n_k = 9;
    p.q_offset = 5;
    p.d = 5;
    p.d_v = 2;
    p.eps = 0.3;
    p.partial = true;
    out.push_back(p);
  }
  {  // negative offsets, q_offset != k_offset: causal rows 0-2 see no key; eps = 0
    Problem p = base;
    p.n = 6;
    p.n_k = 5;
    p.q_offset = -8;
    p.k_offset = -5;
    p.d = 4;
    p.d_v = 3;
    p.eps = 0;
    p.layout = RopeLayout::Half;
    out.push_back(p);
  }
  {  // YaRN rope (magnitude 1.21), offsets 3 and 1
    Problem p = base;
    p.n = p.n_k = 6;
    p.q_offset = 3;
    p.k_offset = 1;
    p.d = 6;
    p.d_v = 2;
    p.yarn = true;
    out.push_back(p);
  }
  for (std::size_t i = 0; i < out.size(); ++i) out[i].seed = seed + 10 * i;
  return out;
}

// Calls `call` and checks it throws std::invalid_argument whose message contains every fragment.
template <class F>
void check_invalid(F&& call, std::initializer_list<const char*> fragments) {
  std::string message;
  bool thrown = false;
  try {
    call();
  } catch (const std::invalid_argument& e) {
    thrown = true;
    message = e.what();
  }
  CAPTURE(message);
  CHECK(thrown);
  for (const char* fragment : fragments) {
    CAPTURE(fragment);
    CHECK(message.find(fragment) != std::string::npos);
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------

TEST_CASE("the reference's YaRN rope: frequencies and magnitude of the explicit rotation") {
  // The extension of linear_reference.hpp's RopeSpec that the YaRN problems rely on: R(p) is g
  // times a rotation by p theta_i' on each pair, theta' from rope_reference.hpp, and it matches
  // the library's Rope::apply to rounding (test_rope.cpp proves the library against
  // rope_reference.hpp in depth).
  const RopeConfig c{
      .dim = 6,
      .layout = RopeLayout::Interleaved,
      .scaling = {.kind = RopeScalingKind::Yarn, .factor = 8, .original_max_position = 256}};
  const ref::RopeSpec spec = ref::rope_spec(c);
  REQUIRE(spec.frequencies.size() == 3);
  CHECK(spec.magnitude == doctest::Approx(0.1 * std::log(8.0) + 1).epsilon(1e-15));
  const MatrixD r = ref::rotation_matrix(spec, 5);
  CHECK((r.transpose() * r - spec.magnitude * spec.magnitude * MatrixD::Identity(6, 6))
            .cwiseAbs()
            .maxCoeff() <= 1e-14);
  MatrixD x = gaussian(3, 6, 1);
  const MatrixD want = ref::rotate_rows(spec, x, -2);
  Rope(c).apply(x, -2);
  CHECK((x - want).cwiseAbs().maxCoeff() <= 1e-14);
}

TEST_CASE(
    "linear_attention_backward matches finite differences: map x placement x causal x shape") {
  // Every map and placement, causal or not; shapes: n = 1, odd n with the half layout and a
  // partial rotary width, cross lengths with eps = 0.3, negative offsets with q_offset != k_offset
  // and eps = 0 (causal rows without keys), YaRN. Causal problems run Scan and Chunked with chunks
  // of 1, 2, 3 and 1000 (> n), float and double, all against one set of finite differences.
  Tally tally;
  std::uint64_t seed = 1;
  for (const auto kind : kMaps)
    for (const auto placement : kPlacements)
      for (const bool causal : {false, true}) {
        for (const Problem& p : shapes(kind, placement, causal, seed)) check_problem(p, tally);
        seed += 100;
      }
  INFO("float: ", tally.run_float, " run, ", tally.skipped_float,
       " skipped; double: ", tally.run_double, " run, ", tally.skipped_double, " skipped");
  // Ill-conditioned problems (a denominator within rounding of zero) are rare: Full or
  // favor-trig with eps = 0 only.
  CHECK(tally.skipped_double == 0);
  CHECK(tally.skipped_float * 20 <= tally.run_float);
}

TEST_CASE("dk includes the denominator's dependence on the keys: numerator-only and full") {
  // Through den_i, every key j <= i moves o_i: dk_j = sum_i <g_i, v_j> dA_ij/dk_j - c_i
  // dB_ij/dk_j. For NumeratorOnly, B_ij = <phi_i, psi_j> (unrotated), for Full
  // B_ij = <R_i phi_i, R_j psi_j>. A kernel that drops the c_i term, or that takes NumeratorOnly's
  // unrotated B for Full (or the reverse), is caught here: v has mean 2 and d_out mean 1, so
  // c_i = <d_out_i, o_i>/D_i is large, and eps = 0 so that the denominator is all there is. The
  // wrong gradients are finite differences of the reference with den frozen at its value (no
  // c_i term) or with the other placement's den; the check asserts they lie far outside the
  // tolerance that the kernel meets.
  for (const auto kind : {FeatureMapKind::EluPlusOne, FeatureMapKind::FavorPositive})
    for (const auto placement : {RopePlacement::NumeratorOnly, RopePlacement::Full})
      for (const bool causal : {false, true}) {
        Problem p;
        p.kind = kind;
        p.placement = placement;
        p.causal = causal;
        p.n = p.n_k = 6;
        p.d = 4;
        p.d_v = 2;
        p.eps = 0;
        p.v_mean = 2;
        p.seed = 4242;
        const std::string name = describe(p);
        CAPTURE(name);
        Setup s(p);
        s.d_out = Setup::as_float((s.d_out.array() + 1.0).matrix());
        const ref::LinearResult want = s.reference();
        const Gradients fd = finite_differences(s);
        const Bounds b = gradient_bounds(s, want);
        const double gamma = rounding_gamma_of<double>(s);
        REQUIRE(b.conditioned(gamma));
        const AttentionGradients<double> got = s.run<double>();
        check_gradients(got, fd, b, gamma);
        const AttentionGradients<float> got_f = s.run<float>();
        check_gradients(got_f, fd, b, rounding_gamma_of<float>(s));

        // The wrong dk's: den frozen, and the other placement's den.
        Problem other = p;
        other.placement =
            placement == RopePlacement::Full ? RopePlacement::NumeratorOnly : RopePlacement::Full;
        const Setup s_other(other);
        const auto loss_with_den = [&](const MatrixD& kk, bool frozen) {
          const ref::LinearResult r = s.reference(s.q, kk, s.v);
          const VectorD den =
              frozen ? want.den : s_other.reference(s.q, kk, s.v).den;  // other placement's den
          double total = 0;
          for (Index i = 0; i < r.num.rows(); ++i) {
            if (want.admissible[std::size_t(i)] == 0) continue;
            for (Index c = 0; c < r.num.cols(); ++c)
              total += s.d_out(i, c) * r.num(i, c) / (den(i) + p.eps);
          }
          return total;
        };
        const MatrixD dk_frozen = ref::central_difference(
            s.k, [&](const MatrixD& kk) { return loss_with_den(kk, true); });
        const MatrixD dk_swapped = ref::central_difference(
            s.k, [&](const MatrixD& kk) { return loss_with_den(kk, false); });
        // Entry by entry, how far outside the tolerances the wrong gradients fall: the double
        // one (FD-limited, ~1e-8 relative) by 10^4 at least, the float one (looser where Full's
        // den with eps = 0 is ill-conditioned: cond up to ~30 here) by 10 at least; the kernel
        // meets both (ratio <= 1, checked above).
        const double gamma_f = rounding_gamma_of<float>(s);
        const MatrixD& fd_dk = fd.error_k;
        for (const MatrixD* wrong : {&dk_frozen, &dk_swapped}) {
          const char* which = wrong == &dk_frozen ? "den frozen" : "other placement's den";
          CAPTURE(which);
          const double in_double = max_ratio(*wrong, fd.dk, b.dk, gamma, fd_dk);
          const double in_float = max_ratio(*wrong, fd.dk, b.dk, gamma_f, fd_dk);
          CAPTURE(in_double);
          CAPTURE(in_float);
          CAPTURE(b.cond_max);
          CHECK(in_double > 1e4);
          CHECK(in_float > 10);
          CHECK(max_ratio(got.dk, *wrong, b.dk, gamma, fd_dk) > 1e4 / 2);
        }
      }
}

TEST_CASE("causal gradients: what may and may not depend on what") {
  // With p_i = q_offset + i and p_j = k_offset + j, o_i depends on q_i and on the keys and values
  // with p_j <= p_i only, and L = sum_i <d_out_i, o_i>. Hence:
  //   (a) dq_i = d<d_out_i, o_i>/dq_i does not change when k_j, v_j change for p_j > p_i (nor
  //       when q or d_out of other rows change);
  //   (b) dk_j, dv_j sum over the rows with p_i >= p_j: they do not change when q_i or d_out_i
  //       change for p_i < p_j (they do depend on later keys, through those rows' den);
  //   (c) dv_j = sum_i A_ij d_out_i / D_i involves no v at all: any change of v leaves dv as is;
  //   (d) and the checks can fail: changing a key at p_j <= p_i does change dq_i.
  // Both runs are within gamma G of the same exact values (G of the rows concerned is the same in
  // both, as it involves the same rows and keys), so they may differ by 2 gamma G. Later keys are
  // also replaced by keys of norm 20 and values of size 50: a stabiliser that looks ahead (a global
  // key max) would move the earlier rows.
  int counter = 0;
  for (const auto kind : {FeatureMapKind::FavorPositive, FeatureMapKind::EluPlusOne,
                          FeatureMapKind::FavorHyperbolic, FeatureMapKind::OnePlusCosine})
    for (const auto placement : kPlacements)
      for (const Method method : {Method{CausalMethod::Scan, 64}, Method{CausalMethod::Chunked, 2},
                                  Method{CausalMethod::Chunked, 4}}) {
        Problem p;
        p.kind = kind;
        p.placement = placement;
        p.causal = true;
        p.n = 9;
        p.n_k = 10;
        p.q_offset = 1;  // key j at position j, query i at i + 1
        p.d = 5;
        p.d_v = 3;
        p.layout = counter % 2 == 0 ? RopeLayout::Interleaved : RopeLayout::Half;
        p.seed = std::uint64_t(500 + 10 * counter++);
        const std::string name = describe(p);
        CAPTURE(name);
        CAPTURE(int(method.method));
        CAPTURE(method.chunk);
        Setup s(p);
        const ref::LinearResult want = s.reference();
        const Bounds b = gradient_bounds(s, want);
        const double gamma_f = rounding_gamma_of<float>(s), gamma_d = rounding_gamma_of<double>(s);
        REQUIRE(b.conditioned(gamma_f));
        const AttentionGradients<double> base = s.run<double>(method);
        const AttentionGradients<float> base_f = s.run<float>(method);
        const MatrixD q0 = s.q, k0 = s.k, v0 = s.v, d0 = s.d_out;
        for (const Index i : {Index(0), Index(3), Index(7)}) {
          CAPTURE(i);
          const Index p_i = p.q_offset + i;  // keys 0 .. p_i are admissible for row i
          // (a) keys and values after p_i replaced, large.
          s.k = k0;
          s.v = v0;
          const Index later = p.n_k - 1 - p_i;
          if (later > 0) {
            MatrixD big = gaussian(later, p.d, 900 + std::uint64_t(i));
            for (Index r = 0; r < later; ++r) big.row(r) *= 20 / big.row(r).norm();
            s.k.bottomRows(later) = Setup::as_float(big);
            s.v.bottomRows(later) = Setup::as_float(gaussian(later, p.d_v, 901, 50.0));
          }
          // ... and q, d_out of the other rows.
          s.q = q0;
          s.d_out = d0;
          for (Index r = 0; r < p.n; ++r)
            if (r != i) {
              s.q.row(r) = Setup::as_float(gaussian(1, p.d, 902 + std::uint64_t(r), 0.7));
              s.d_out.row(r) = Setup::as_float(gaussian(1, p.d_v, 903 + std::uint64_t(r)));
            }
          {
            const AttentionGradients<double> changed = s.run<double>(method);
            const AttentionGradients<float> changed_f = s.run<float>(method);
            INFO("(a) dq_i after changing later keys, values and other rows");
            check_matrix<double>("dq double", changed.dq.row(i), base.dq.row(i), b.dq.row(i),
                                 2 * gamma_d, 0);
            check_matrix<float>("dq float", changed_f.dq.row(i), base_f.dq.row(i).cast<double>(),
                                b.dq.row(i), 2 * gamma_f, 0);
          }
          // (b) q and d_out of rows 0 .. i changed: dk_j, dv_j for p_j > p_i stay.
          s.q = q0;
          s.k = k0;
          s.v = v0;
          s.d_out = d0;
          s.q.topRows(i + 1) = Setup::as_float(gaussian(i + 1, p.d, 904, 0.7));
          s.d_out.topRows(i + 1) = Setup::as_float(gaussian(i + 1, p.d_v, 905));
          const Index keep = p.n_k - 1 - p_i;  // keys after p_i
          if (keep > 0) {
            const AttentionGradients<double> changed = s.run<double>(method);
            const AttentionGradients<float> changed_f = s.run<float>(method);
            INFO("(b) dk_j, dv_j of later keys after changing earlier queries and d_out");
            check_matrix<double>("dk double", MatrixD(changed.dk.bottomRows(keep)),
                                 base.dk.bottomRows(keep), b.dk.bottomRows(keep), 2 * gamma_d, 0);
            check_matrix<double>("dv double", MatrixD(changed.dv.bottomRows(keep)),
                                 base.dv.bottomRows(keep), b.dv.bottomRows(keep), 2 * gamma_d, 0);
            check_matrix<float>("dk float", MatrixF(changed_f.dk.bottomRows(keep)),
                                base_f.dk.bottomRows(keep).cast<double>(), b.dk.bottomRows(keep),
                                2 * gamma_f, 0);
            check_matrix<float>("dv float", MatrixF(changed_f.dv.bottomRows(keep)),
                                base_f.dv.bottomRows(keep).cast<double>(), b.dv.bottomRows(keep),
                                2 * gamma_f, 0);
          }
          // (d) a key at or before p_i changed: dq_i moves by far more than the tolerance.
          s.q = q0;
          s.d_out = d0;
          s.k.row(p_i) = Setup::as_float(gaussian(1, p.d, 906, 0.7));
          {
            const AttentionGradients<double> changed = s.run<double>(method);
            // ... by far more than (a)'s double tolerance, which would then catch it.
            const double moved = max_ratio(MatrixD(changed.dq.row(i)), MatrixD(base.dq.row(i)),
                                           MatrixD(b.dq.row(i)), 2 * gamma_d, 0);
            INFO("(d) dq_i after changing key p_i: moved by ", moved, " tolerances");
            CHECK(moved > 1e3);
          }
          s.k = k0;
        }
        // (c) every v changed: dv identical up to rounding.
        s.v = Setup::as_float(gaussian(p.n_k, p.d_v, 907, 3.0));
        {
          const AttentionGradients<double> changed = s.run<double>(method);
          INFO("(c) dv after changing every v");
          check_matrix<double>("dv double", changed.dv, base.dv, b.dv, 2 * gamma_d, 0);
        }
        s.v = v0;
      }
}

TEST_CASE("non-causal: dq_i depends on no other query and no other row of d_out") {
  // L is a sum over rows of terms that each involve one query: changing q_r and d_out_r for r != i
  // leaves dq_i as it was (to 2 gamma G, both being within gamma G of the same value).
  for (const auto placement : kPlacements) {
    Problem p;
    p.kind = FeatureMapKind::FavorPositive;
    p.placement = placement;
    p.n = 7;
    p.n_k = 8;
    p.seed = 77;
    const std::string name = describe(p);
    CAPTURE(name);
    Setup s(p);
    const Bounds b = gradient_bounds(s, s.reference());
    const double gamma = rounding_gamma_of<double>(s);
    const AttentionGradients<double> base = s.run<double>();
    s.q.bottomRows(4) = Setup::as_float(gaussian(4, p.d, 78, 0.7));
    s.d_out.bottomRows(4) = Setup::as_float(gaussian(4, p.d_v, 79));
    const AttentionGradients<double> changed = s.run<double>();
    check_matrix<double>("dq", MatrixD(changed.dq.topRows(3)), base.dq.topRows(3), b.dq.topRows(3),
                         2 * gamma, 0);
  }
}

TEST_CASE("large-norm float inputs: finite gradients that match the reference") {
  // Rows of q and k of norm 20: |x'|^2/2 = 82 at d = 6, so the exp-based features span e^(+-100)
  // on the unstabilised scale and a kernel that does not stabilise its backward (or that forms
  // exp(W x') and exp(-|x'|^2/2) apart) overflows. Gradients must be finite and match the finite
  // differences of the reference (in double, where these values are representable) to gamma G, the
  // exponent size z ~ 10^3 making gamma_float ~ 1e-3. eps: 0 where den > 0 (favor+ and favor-hyp
  // but Full), else the median |den| (the exact den ~ e^-100 would be swamped by the default 1e-6).
  for (const auto kind : {FeatureMapKind::FavorPositive, FeatureMapKind::FavorHyperbolic})
    for (const auto placement : kPlacements)
      for (const bool causal : {false, true}) {
        Problem p;
        p.kind = kind;
        p.placement = placement;
        p.causal = causal;
        p.n = p.n_k = 6;
        p.d = 6;
        p.d_v = 2;
        p.seed = 31;
        Setup s(p);
        for (MatrixD* x : {&s.q, &s.k}) {
          for (Index r = 0; r < x->rows(); ++r) x->row(r) *= 20 / x->row(r).norm();
          *x = Setup::as_float(*x);
        }
        if (placement == RopePlacement::Full) {
          const VectorD den = s.reference().den;
          std::vector<double> a(den.data(), den.data() + den.size());
          for (double& e : a) e = std::abs(e);
          std::nth_element(a.begin(), a.begin() + std::ptrdiff_t(a.size() / 2), a.end());
          s.p.eps = s.options.eps = a[a.size() / 2];
        } else {
          s.p.eps = s.options.eps = 0;
        }
        const std::string name = describe(s.p);
        CAPTURE(name);
        const ref::LinearResult want = s.reference();
        const Bounds b = gradient_bounds(s, want);
        const double gamma = rounding_gamma_of<float>(s);
        for (const Method method :
             {Method{CausalMethod::Scan, 64}, Method{CausalMethod::Chunked, 2}}) {
          if (!causal && method.method != CausalMethod::Scan) continue;
          CAPTURE(int(method.method));
          const AttentionGradients<float> got = s.run<float>(method);
          CHECK(got.dq.allFinite());
          CHECK(got.dk.allFinite());
          CHECK(got.dv.allFinite());
          if (!b.conditioned(gamma)) {  // Full's den can cross 0; nothing else's can
            CHECK(denominator_may_vanish(kind, placement));
            continue;
          }
          const Gradients fd = finite_differences(s);
          check_gradients(got, fd, b, gamma);
        }
      }
}

TEST_CASE("long sequences split across threads: float and double against the double backward") {
  // n = 600 - 1200 on 2 threads: the kernels cut the sequence into segments (causal) or parts
  // (non-causal) on the threads. Against the double backward on one thread (the whole sequence in
  // one piece): float within (gamma_float + gamma_double) G, double on 2 threads within
  // 2 gamma_double G. Finite differences would take minutes here; the small shapes above carry
  // them. Maps, placements and methods rotate over the cases.
  struct Case {
    FeatureMapKind kind;
    RopePlacement placement;
    bool causal;
    Method method;
    Index n, n_k;
  };
  const Case cases[] = {
      {FeatureMapKind::FavorPositive,
       RopePlacement::NumeratorOnly,
       true,
       {CausalMethod::Scan, 64},
       640,
       640},
      {FeatureMapKind::EluPlusOne,
       RopePlacement::Full,
       true,
       {CausalMethod::Chunked, 64},
       700,
       700},
      {FeatureMapKind::OnePlusCosine,
       RopePlacement::BeforeMap,
       true,
       {CausalMethod::Chunked, 48},
       1100,
       1100},
      {FeatureMapKind::FavorHyperbolic,
       RopePlacement::None,
       false,
       {CausalMethod::Scan, 64},
       1200,
       1200},
      {FeatureMapKind::Relu,
       RopePlacement::NumeratorOnly,
       false,
       {CausalMethod::Scan, 64},
       600,
       1100},
      {FeatureMapKind::FavorTrig,
       RopePlacement::NumeratorOnly,
       true,
       {CausalMethod::Scan, 64},
       600,
       900},
  };
  int counter = 0;
  for (const Case& c : cases) {
    Problem p;
    p.kind = c.kind;
    p.placement = c.placement;
    p.causal = c.causal;
    p.n = c.n;
    p.n_k = c.n_k;
    p.q_offset = c.n_k - c.n;  // queries are the last n positions of the keys
    p.d = 6;
    p.d_v = 4;
    p.layout = counter % 2 == 0 ? RopeLayout::Half : RopeLayout::Interleaved;
    p.partial = counter % 3 == 1;
    p.yarn = counter == 2;
    p.scale = c.kind == FeatureMapKind::FavorTrig ? 0.4 : 0.7;
    p.seed = std::uint64_t(3000 + 10 * counter++);
    const std::string name = describe(p);
    CAPTURE(name);
    CAPTURE(int(c.method.method));
    CAPTURE(c.method.chunk);
    const Setup s(p);
    const ref::LinearResult want = s.reference();
    const Bounds b = gradient_bounds(s, want);
    const double gamma_f = rounding_gamma_of<float>(s), gamma_d = rounding_gamma_of<double>(s);
    REQUIRE(b.conditioned(gamma_d));
    AttentionGradients<double> one;
    {
      const ThreadCount threads(1);
      one = s.run<double>(c.method);
    }
    const ThreadCount threads(kSplitThreads);
    const AttentionGradients<double> two = s.run<double>(c.method);
    check_matrix<double>("dq double, 2 threads", two.dq, one.dq, b.dq, 2 * gamma_d, 0);
    check_matrix<double>("dk double, 2 threads", two.dk, one.dk, b.dk, 2 * gamma_d, 0);
    check_matrix<double>("dv double, 2 threads", two.dv, one.dv, b.dv, 2 * gamma_d, 0);
    if (!b.conditioned(gamma_f)) {
      CHECK(denominator_may_vanish(p.kind, p.placement));
      MESSAGE("float comparison skipped: ill-conditioned at float precision: ", name);
      continue;
    }
    const AttentionGradients<float> f = s.run<float>(c.method);
    check_matrix<float>("dq float", f.dq, one.dq, b.dq, gamma_f + gamma_d, 0);
    check_matrix<float>("dk float", f.dk, one.dk, b.dk, gamma_f + gamma_d, 0);
    check_matrix<float>("dv float", f.dv, one.dv, b.dv, gamma_f + gamma_d, 0);
  }
}

TEST_CASE("causal heads cut into 3 and 4 segments, with offsets that empty or clamp segments") {
  // The split paths the case above never reaches: more than two segments (the suffix states'
  // merge), segments whose first keys are clamped to 0 (queries that see no key), segments past
  // the horizon with no key of their own, and queries absorbed in bulk because their own key lies
  // past the last (n_k < n + shift, or shift > n_k). Against one thread in double, as above.
  struct Case {
    FeatureMapKind kind;
    RopePlacement placement;
    Index n, n_k, q_offset, k_offset;
    int threads;
  };
  const Case cases[] = {
      // shift -600: the first 600 queries see nothing, segment 1 starts at key 0 too
      {FeatureMapKind::FavorPositive, RopePlacement::NumeratorOnly, 1100, 1100, 0, 600, 4},
      // n_k < n: the keys end at 700; the later segments have none of their own
      {FeatureMapKind::EluPlusOne, RopePlacement::Full, 1100, 700, 0, 0, 3},
      // shift 900: keys [0, 900) seen by all, queries from 400 on see every key
      {FeatureMapKind::FavorPositive, RopePlacement::Full, 1000, 1300, 900, 0, 4},
      // shift 2000 > n_k: every query sees every key; segment 0 takes all keys, none its own
      {FeatureMapKind::OnePlusCosine, RopePlacement::NumeratorOnly, 1100, 1100, 2000, 0, 3},
      {FeatureMapKind::Relu, RopePlacement::BeforeMap, 1300, 1000, 0, 150, 4},
  };
  int counter = 0;
  for (const Case& c : cases) {
    Problem p;
    p.kind = c.kind;
    p.placement = c.placement;
    p.causal = true;
    p.n = c.n;
    p.n_k = c.n_k;
    p.q_offset = c.q_offset;
    p.k_offset = c.k_offset;
    p.d = 6;
    p.d_v = 4;
    p.layout = counter % 2 == 0 ? RopeLayout::Interleaved : RopeLayout::Half;
    p.seed = std::uint64_t(5000 + 10 * counter++);
    const std::string name = describe(p);
    CAPTURE(name);
    CAPTURE(c.threads);
    const Setup s(p);
    const ref::LinearResult want = s.reference();
    const Bounds b = gradient_bounds(s, want);
    const double gamma_d = rounding_gamma_of<double>(s);
    REQUIRE(b.conditioned(gamma_d));
    const Method scan{CausalMethod::Scan, 64};
    AttentionGradients<double> one;
    {
      const ThreadCount threads(1);
      one = s.run<double>(scan);
    }
    const ThreadCount threads(c.threads);
    const AttentionGradients<double> split = s.run<double>(scan);
    check_matrix<double>("dq double, split", split.dq, one.dq, b.dq, 2 * gamma_d, 0);
    check_matrix<double>("dk double, split", split.dk, one.dk, b.dk, 2 * gamma_d, 0);
    check_matrix<double>("dv double, split", split.dv, one.dv, b.dv, 2 * gamma_d, 0);
  }
}

TEST_CASE("float against double on the same inputs, every map and placement") {
  // Each within gamma_T G of the exact gradient: within (gamma_float + gamma_double) G of each
  // other. n = 65 (past the default chunk and Scan's block of 64), causal and not.
  int counter = 0;
  for (const auto kind : kMaps)
    for (const auto placement : kPlacements) {
      Problem p;
      p.kind = kind;
      p.placement = placement;
      p.causal = counter % 2 == 0;
      p.n = p.n_k = 65;
      p.d = 6;
      p.d_v = 3;
      p.scale = kind == FeatureMapKind::FavorTrig ? 0.4 : 0.7;
      p.seed = std::uint64_t(4000 + 10 * counter++);
      const std::string name = describe(p);
      CAPTURE(name);
      const Setup s(p);
      const Bounds b = gradient_bounds(s, s.reference());
      const double gamma = rounding_gamma_of<float>(s) + rounding_gamma_of<double>(s);
      if (!b.conditioned(rounding_gamma_of<float>(s))) {
        CHECK(denominator_may_vanish(kind, placement));
        continue;
      }
      for (const Method method :
           {Method{CausalMethod::Scan, 64}, Method{CausalMethod::Chunked, 16}}) {
        if (!p.causal && method.method != CausalMethod::Scan) continue;
        CAPTURE(int(method.method));
        const AttentionGradients<double> d = s.run<double>(method);
        const AttentionGradients<float> f = s.run<float>(method);
        check_matrix<float>("dq", f.dq, d.dq, b.dq, gamma, 0);
        check_matrix<float>("dk", f.dk, d.dk, b.dk, gamma, 0);
        check_matrix<float>("dv", f.dv, d.dv, b.dv, gamma, 0);
      }
    }
}

TEST_CASE("batched backward equals the per-head backward, padded rows get zero gradients") {
  // [B, H, n, d] buffers, lengths {9, 4} and {0, 7}: every slice's rows below its length against
  // the single-head backward on the truncated slice (both within gamma G of the exact gradient:
  // 2 gamma G apart; attention.hpp also promises the same bits when the slice is not split), rows
  // at or past it exactly 0. The padding of q, k, v and d_out holds NaN: never read.
  const Index batch = 2, heads = 2, n = 9, d = 5, d_v = 3;
  int counter = 0;
  for (const auto kind :
       {FeatureMapKind::FavorPositive, FeatureMapKind::EluPlusOne, FeatureMapKind::OnePlusCosine})
    for (const auto placement : kPlacements)
      for (const bool causal : {false, true})
        for (const std::vector<Index>& lengths :
             {std::vector<Index>{9, 4}, std::vector<Index>{0, 7}, std::vector<Index>{}}) {
          Problem p;
          p.kind = kind;
          p.placement = placement;
          p.causal = causal;
          p.n = p.n_k = n;
          p.d = d;
          p.d_v = d_v;
          p.q_offset = 2;
          p.k_offset = 1;
          p.seed = std::uint64_t(6000 + 10 * counter++);
          const std::string name = describe(p);
          CAPTURE(name);
          CAPTURE(lengths.size());
          const Setup s(p);  // map, rope and options; the slices' data below
          const double nan = std::numeric_limits<double>::quiet_NaN();
          const std::size_t slice_q = std::size_t(n * d), slice_v = std::size_t(n * d_v);
          std::vector<double> q(batch * heads * slice_q), k(q.size()), v(batch * heads * slice_v),
              d_out(v.size()), dq(q.size(), 7.0), dk(q.size(), 7.0), dv(v.size(), 7.0);
          const auto slice = [&](std::vector<double>& buf, Index b, Index h, Index cols) {
            return Eigen::Map<MatrixD>(buf.data() + (b * heads + h) * n * cols, n, cols);
          };
          for (Index b = 0; b < batch; ++b)
            for (Index h = 0; h < heads; ++h) {
              const std::uint64_t seed = p.seed + std::uint64_t(100 * b + 10 * h);
              slice(q, b, h, d) = Setup::as_float(gaussian(n, d, seed, 0.7));
              slice(k, b, h, d) = Setup::as_float(gaussian(n, d, seed + 1, 0.7));
              slice(v, b, h, d_v) = Setup::as_float(gaussian(n, d_v, seed + 2));
              slice(d_out, b, h, d_v) = Setup::as_float(gaussian(n, d_v, seed + 3));
              if (!lengths.empty()) {
                const Index len = lengths[std::size_t(b)];
                for (auto* buf : {&q, &k})
                  slice(*buf, b, h, d).bottomRows(n - len).setConstant(nan);
                for (auto* buf : {&v, &d_out})
                  slice(*buf, b, h, d_v).bottomRows(n - len).setConstant(nan);
              }
            }
          const Index* len = lengths.empty() ? nullptr : lengths.data();
          const auto in = [&](const std::vector<double>& buf, Index cols) {
            return Heads<const double>{buf.data(), batch, heads, n, cols, len};
          };
          const auto out = [&](std::vector<double>& buf, Index cols) {
            return Heads<double>{buf.data(), batch, heads, n, cols, len};
          };
          linear_attention_backward(in(q, d), in(k, d), in(v, d_v), in(d_out, d_v), out(dq, d),
                                    out(dk, d), out(dv, d_v), *s.map, s.options);
          for (Index b = 0; b < batch; ++b)
            for (Index h = 0; h < heads; ++h) {
              CAPTURE(b);
              CAPTURE(h);
              const Index rows = len ? len[b] : n;
              const MatrixD got_q = slice(dq, b, h, d), got_k = slice(dk, b, h, d),
                            got_v = slice(dv, b, h, d_v);
              CHECK(got_q.bottomRows(n - rows).isZero(0));
              CHECK(got_k.bottomRows(n - rows).isZero(0));
              CHECK(got_v.bottomRows(n - rows).isZero(0));
              if (rows == 0) continue;
              Problem ps = p;
              ps.n = ps.n_k = rows;
              Setup one(ps);
              one.q = slice(q, b, h, d).topRows(rows);
              one.k = slice(k, b, h, d).topRows(rows);
              one.v = slice(v, b, h, d_v).topRows(rows);
              one.d_out = slice(d_out, b, h, d_v).topRows(rows);
              const AttentionGradients<double> single = one.run<double>();
              const Bounds bounds = gradient_bounds(one, one.reference());
              const double gamma = rounding_gamma_of<double>(one);
              check_matrix<double>("dq", MatrixD(got_q.topRows(rows)), single.dq, bounds.dq,
                                   2 * gamma, 0);
              check_matrix<double>("dk", MatrixD(got_k.topRows(rows)), single.dk, bounds.dk,
                                   2 * gamma, 0);
              check_matrix<double>("dv", MatrixD(got_v.topRows(rows)), single.dv, bounds.dv,
                                   2 * gamma, 0);
              CHECK(got_q.topRows(rows) == single.dq);
              CHECK(got_k.topRows(rows) == single.dk);
              CHECK(got_v.topRows(rows) == single.dv);
            }
        }
}

TEST_CASE("batched backward: one long float head split along the sequence") {
  // One slice on 2 threads: the batched path splits it along the sequence (as the forward does
  // from n = 512 causal, 1024 non-causal). Against the single-head float call: both within
  // gamma_float G of the exact gradient.
  const ThreadCount threads(kSplitThreads);
  for (const bool causal : {true, false}) {
    Problem p;
    p.kind = FeatureMapKind::FavorPositive;
    p.placement = RopePlacement::NumeratorOnly;
    p.causal = causal;
    p.n = p.n_k = causal ? 600 : 1100;
    p.d = 6;
    p.d_v = 4;
    p.seed = 7000;
    const std::string name = describe(p);
    CAPTURE(name);
    const Setup s(p);
    const Bounds b = gradient_bounds(s, s.reference());
    const double gamma = rounding_gamma_of<float>(s);
    REQUIRE(b.conditioned(gamma));
    const MatrixF q = s.q.cast<float>(), k = s.k.cast<float>(), v = s.v.cast<float>(),
                  d_out = s.d_out.cast<float>();
    MatrixF dq(p.n, p.d), dk(p.n, p.d), dv(p.n, p.d_v);
    const auto in = [&](const MatrixF& x) {
      return Heads<const float>{x.data(), 1, 1, x.rows(), x.cols(), nullptr};
    };
    const auto out = [&](MatrixF& x) {
      return Heads<float>{x.data(), 1, 1, x.rows(), x.cols(), nullptr};
    };
    linear_attention_backward(in(q), in(k), in(v), in(d_out), out(dq), out(dk), out(dv), *s.map,
                              s.options);
    const AttentionGradients<float> single = s.run<float>();
    check_matrix<float>("dq", dq, single.dq.cast<double>(), b.dq, 2 * gamma, 0);
    check_matrix<float>("dk", dk, single.dk.cast<double>(), b.dk, 2 * gamma, 0);
    check_matrix<float>("dv", dv, single.dv.cast<double>(), b.dv, 2 * gamma, 0);
  }
}

// The bad-input tests' problem: FAVOR+ with d = 6 and 8 features, eq. 19's rope of width m.
struct SmallFavor {
  static constexpr Index d = 6;
  std::unique_ptr<FeatureMap> map =
      make_feature_map({.kind = FeatureMapKind::FavorPositive, .input_dim = d, .num_features = 8});
  Rope rope{RopeConfig{.dim = map->output_dim()}};
};

TEST_CASE("linear_attention_backward: a non-finite value anywhere in q, k, v or d_out is found") {
  // The kernels find non-finite values as they read the inputs (NonFiniteFlag), so every row must
  // pass through a check on every path, including those no gradient reads: keys past the last
  // query's horizon, queries that see no key, a head split into segments (n >= 512 on 2 or more
  // threads), the single-head and the batched calls. One value at a time: the first row, a middle
  // one and the last, of each argument.
  const SmallFavor favor;
  const Index d = favor.d;
  const auto& map = favor.map;
  const Rope& rope = favor.rope;
  struct Case {
    bool causal;
    Index n, n_k, q_offset, k_offset;
  };
  const Case cases[] = {
      {true, 7, 7, 0, 0},       {true, 7, 12, 0, 0},     // keys 7..11 past the horizon
      {true, 9, 9, 0, 4},       {true, 600, 700, 0, 0},  // queries 0..3 see no key; split
      {true, 600, 500, 300, 0}, {false, 7, 9, 0, 0},    {false, 1100, 600, 0, 0}};
  const char* fn = "linear_attention_backward";
  for (const Case& c : cases) {
    CAPTURE(c.causal);
    CAPTURE(c.n);
    CAPTURE(c.n_k);
    CAPTURE(c.q_offset);
    CAPTURE(c.k_offset);
    LinearOptions options;
    options.rope = &rope;
    options.causal = c.causal;
    options.q_offset = c.q_offset;
    options.k_offset = c.k_offset;
    const MatrixF q = gaussian(c.n, d, 1).cast<float>(), k = gaussian(c.n_k, d, 2).cast<float>(),
                  v = gaussian(c.n_k, 3, 3).cast<float>(),
                  d_out = gaussian(c.n, 3, 4).cast<float>();
    REQUIRE_NOTHROW(linear_attention_backward(q, k, v, d_out, *map, options));
    for (int which = 0; which < 4; ++which) {
      const char* name = which == 0 ? "q" : which == 1 ? "k" : which == 2 ? "v" : "d_out";
      CAPTURE(name);
      MatrixF x[4] = {q, k, v, d_out};
      const Index rows = x[which].rows();
      for (const Index row : {Index(0), rows / 2, rows - 1}) {
        CAPTURE(row);
        MatrixF bad[4] = {q, k, v, d_out};
        bad[which](row, row % bad[which].cols()) = std::numeric_limits<float>::quiet_NaN();
        const std::string message = std::string(name) + " has the non-finite value";
        check_invalid(
            [&] { linear_attention_backward(bad[0], bad[1], bad[2], bad[3], *map, options); },
            {fn, message.c_str()});
        const auto in = [](const MatrixF& m) {
          return Heads<const float>{m.data(), 1, 1, m.rows(), m.cols(), nullptr};
        };
        MatrixF dq(c.n, d), dk(c.n_k, d), dv(c.n_k, 3);
        const auto out = [](MatrixF& m) {
          return Heads<float>{m.data(), 1, 1, m.rows(), m.cols(), nullptr};
        };
        const std::string sliced = std::string(name) + "[0, 0] has the non-finite value";
        check_invalid(
            [&] {
              linear_attention_backward(in(bad[0]), in(bad[1]), in(bad[2]), in(bad[3]), out(dq),
                                        out(dk), out(dv), *map, options);
            },
            {fn, sliced.c_str()});
      }
    }
  }
}

TEST_CASE("linear_attention_backward: bad input throws std::invalid_argument naming the argument") {
  const SmallFavor favor;
  const Index d = favor.d;
  const auto& map = favor.map;
  const Rope& rope = favor.rope;
  LinearOptions ok;
  ok.rope = &rope;
  const MatrixF q = gaussian(7, d, 1).cast<float>(), k = gaussian(9, d, 2).cast<float>(),
                v = gaussian(9, 3, 3).cast<float>(), d_out = gaussian(7, 3, 4).cast<float>();
  const MatrixD qd = q.cast<double>(), kd = k.cast<double>(), vd = v.cast<double>(),
                dd = d_out.cast<double>();
  REQUIRE_NOTHROW(linear_attention_backward(q, k, v, d_out, *map, ok));
  const char* fn = "linear_attention_backward";

  SUBCASE("d_out of the wrong shape or not finite") {
    check_invalid([&] { linear_attention_backward(q, k, v, MatrixF(d_out.leftCols(2)), *map, ok); },
                  {fn, "d_out is [7 x 2]"});
    check_invalid([&] { linear_attention_backward(q, k, v, MatrixF(d_out.topRows(6)), *map, ok); },
                  {fn, "d_out is [6 x 3]"});
    check_invalid([&] { linear_attention_backward(qd, kd, vd, MatrixD(8, 3), *map, ok); },
                  {fn, "d_out is [8 x 3]"});
    for (const double bad :
         {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
      CAPTURE(bad);
      MatrixF bad_f = d_out;
      bad_f(5, 1) = float(bad);
      check_invalid([&] { linear_attention_backward(q, k, v, bad_f, *map, ok); },
                    {fn, "d_out has the non-finite value"});
      MatrixD bad_d = dd;
      bad_d(0, 2) = bad;
      LinearOptions causal = ok;
      causal.causal = true;
      check_invalid([&] { linear_attention_backward(qd, kd, vd, bad_d, *map, causal); },
                    {fn, "d_out has the non-finite value"});
    }
  }
  SUBCASE("mismatched q, k, v and non-finite inputs") {
    check_invalid(
        [&] {
          linear_attention_backward(q, MatrixF(gaussian(9, d + 1, 2).cast<float>()), v, d_out, *map,
                                    ok);
        },
        {fn, "k is ["});
    check_invalid([&] { linear_attention_backward(q, k, MatrixF(v.topRows(8)), d_out, *map, ok); },
                  {fn, "v is ["});
    check_invalid(
        [&] {
          linear_attention_backward(MatrixD(gaussian(7, d + 2, 1)), MatrixD(gaussian(9, d + 2, 2)),
                                    vd, dd, *map, ok);
        },
        {fn, "q has d = 8"});
    MatrixF bad_q = q;
    bad_q(2, 3) = std::numeric_limits<float>::quiet_NaN();
    check_invalid([&] { linear_attention_backward(bad_q, k, v, d_out, *map, ok); },
                  {fn, "q has the non-finite value"});
    MatrixD bad_k = kd;
    bad_k(8, 0) = -std::numeric_limits<double>::infinity();
    check_invalid([&] { linear_attention_backward(qd, bad_k, vd, dd, *map, ok); },
                  {fn, "k has the non-finite value"});
  }
  SUBCASE("options") {
    LinearOptions no_rope = ok;
    no_rope.rope = nullptr;
    check_invalid([&] { linear_attention_backward(q, k, v, d_out, *map, no_rope); }, {fn, "rope"});
    const Rope narrow(RopeConfig{.dim = d});
    LinearOptions wrong_width = ok;
    wrong_width.rope = &narrow;  // width d, but NumeratorOnly needs m
    check_invalid([&] { linear_attention_backward(q, k, v, d_out, *map, wrong_width); },
                  {fn, "rope"});
    LinearOptions bad_eps = ok;
    bad_eps.eps = -1;
    check_invalid([&] { linear_attention_backward(qd, kd, vd, dd, *map, bad_eps); }, {fn, "eps"});
    LinearOptions bad_chunk = ok;
    bad_chunk.causal = true;
    bad_chunk.method = CausalMethod::Chunked;
    bad_chunk.chunk_size = 0;
    check_invalid([&] { linear_attention_backward(q, k, v, d_out, *map, bad_chunk); },
                  {fn, "chunk_size"});
  }
  SUBCASE("batched views") {
    const Index b = 2, h = 2, n = 5;
    std::vector<float> qb(std::size_t(b * h * n * d), 0.5f), vb(std::size_t(b * h * n * 3), 0.5f);
    std::vector<float> dqb(qb.size()), dkb(qb.size()), dvb(vb.size());
    const Heads<const float> hq{qb.data(), b, h, n, d}, hv{vb.data(), b, h, n, 3};
    const Heads<float> hdq{dqb.data(), b, h, n, d}, hdk{dkb.data(), b, h, n, d},
        hdv{dvb.data(), b, h, n, 3};
    REQUIRE_NOTHROW(linear_attention_backward(hq, hq, hv, hv, hdq, hdk, hdv, *map, ok));
    Heads<const float> short_d = hv;
    short_d.n = 4;
    check_invalid([&] { linear_attention_backward(hq, hq, hv, short_d, hdq, hdk, hdv, *map, ok); },
                  {fn, "d_out is ["});
    Heads<float> wide_dq = hdq;
    wide_dq.d = d + 1;
    check_invalid([&] { linear_attention_backward(hq, hq, hv, hv, wide_dq, hdk, hdv, *map, ok); },
                  {fn, "dq is ["});
    Heads<float> null_dv = hdv;
    null_dv.data = nullptr;
    check_invalid([&] { linear_attention_backward(hq, hq, hv, hv, hdq, hdk, null_dv, *map, ok); },
                  {fn, "dv.data"});
    std::vector<float> nan_d = vb;
    nan_d[7] = std::numeric_limits<float>::quiet_NaN();
    const Heads<const float> hnan{nan_d.data(), b, h, n, 3};
    check_invalid([&] { linear_attention_backward(hq, hq, hv, hnan, hdq, hdk, hdv, *map, ok); },
                  {fn, "non-finite"});
    // Past the lengths, a NaN is never read.
    const Index lengths[] = {2, 5};  // row 2 of slice (0, 0) is padding: index 2 * 3 + 1
    std::vector<float> padded_nan = vb;
    padded_nan[7] = std::numeric_limits<float>::quiet_NaN();
    const Heads<const float> lq{qb.data(), b, h, n, d, lengths}, lv{vb.data(), b, h, n, 3, lengths},
        lnan{padded_nan.data(), b, h, n, 3, lengths};
    const Heads<float> ldq{dqb.data(), b, h, n, d, lengths}, ldk{dkb.data(), b, h, n, d, lengths},
        ldv{dvb.data(), b, h, n, 3, lengths};
    CHECK_NOTHROW(linear_attention_backward(lq, lq, lv, lnan, ldq, ldk, ldv, *map, ok));
  }
}
