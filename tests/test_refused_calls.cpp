// Calls that must be refused with a clear std::invalid_argument rather than run on memory they
// would corrupt or misread: outputs that share memory with inputs, views too large to address, a
// moved-from stream. Non-finite input data refused with its own type, NonFiniteError, and
// non-finite options without it. And the statistics of rows whose output is zero by rule, not by
// value.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <linrope/linrope.hpp>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace linrope;

// A message-checking CHECK_THROWS: the call throws std::invalid_argument whose text holds
// `expected`.
template <class Call>
void check_refused(Call call, const std::string& expected) {
  try {
    call();
    FAIL("no exception; expected one saying: " << expected);
  } catch (const std::invalid_argument& e) {
    CHECK_MESSAGE(std::string(e.what()).find(expected) != std::string::npos, e.what());
  }
}

// One [batch, heads, n, d] buffer of `size` floats with a view over [offset, offset + extent).
struct Storage {
  std::vector<float> data;
  explicit Storage(Index size) : data(size, 0.5f) {}
  Heads<const float> in(Index offset, Index n, Index d) const {
    return {data.data() + offset, 1, 2, n, d};
  }
  Heads<float> out(Index offset, Index n, Index d) { return {data.data() + offset, 1, 2, n, d}; }
};

TEST_CASE("batched attention refuses an output that shares memory with an input") {
  constexpr Index n = 6, d = 4;
  constexpr Index view = 2 * n * d;  // one [1, 2, n, d] view
  const auto map = make_feature_map({.kind = FeatureMapKind::EluPlusOne, .input_dim = d});
  LinearOptions none;
  none.placement = RopePlacement::None;
  Storage s(4 * view);
  const Heads<const float> q = s.in(0, n, d), k = s.in(view, n, d), v = s.in(2 * view, n, d);

  SUBCASE("forward in place: out is q, or starts inside v") {
    check_refused([&] { linear_attention(q, k, v, s.out(0, n, d), *map, none); }, "out overlaps q");
    check_refused([&] { linear_attention(q, k, v, s.out(2 * view + 3, n, d), *map, none); },
                  "out overlaps v");
    check_refused([&] { softmax_attention(q, k, v, s.out(view - 1, n, d)); }, "out overlaps q");
  }
  SUBCASE("forward with separate storage runs") {
    CHECK_NOTHROW(linear_attention(q, k, v, s.out(3 * view, n, d), *map, none));
  }
  SUBCASE("backward: a gradient over d_out, or two gradients over each other") {
    Storage g(4 * view);
    const Heads<const float> d_out = g.in(0, n, d);
    check_refused(
        [&] {
          linear_attention_backward(q, k, v, d_out, g.out(0, n, d), g.out(view, n, d),
                                    g.out(2 * view, n, d), *map, none);
        },
        "dq overlaps d_out");
    check_refused(
        [&] {
          linear_attention_backward(q, k, v, d_out, g.out(view, n, d), g.out(2 * view, n, d),
                                    g.out(2 * view + 1, n, d), *map, none);
        },
        "dv overlaps dk");
    check_refused(
        [&] {
          softmax_attention_backward(q, k, v, d_out, g.out(view, n, d), s.out(view, n, d),
                                     g.out(2 * view, n, d));
        },
        "dk overlaps k");
  }
}

TEST_CASE("batched attention refuses a view whose batch * heads * n * d overflows") {
  // Never dereferenced: the sizes are refused first.
  float dummy = 0;
  constexpr Index huge = Index(1) << 20;
  const Heads<const float> q{&dummy, huge, huge, huge, 64};
  const Heads<const float> small{&dummy, 1, 1, 1, 64};
  std::vector<float> out(64);
  check_refused([&] { softmax_attention(q, q, q, {out.data(), 1, 1, 1, 64}); }, "overflows");
  const auto map = make_feature_map({.kind = FeatureMapKind::Relu, .input_dim = 64});
  check_refused(
      [&] {
        linear_attention(q, small, small, {out.data(), 1, 1, 1, 64}, *map);
      },
      "overflows");
}

TEST_CASE("a moved-from LinearAttentionStream refuses every call instead of crashing") {
  const auto map = make_feature_map({.kind = FeatureMapKind::EluPlusOne, .input_dim = 3});
  LinearOptions options;
  options.placement = RopePlacement::None;
  LinearAttentionStream<double> stream(*map, 2, options);
  LinearAttentionStream<double> taker(std::move(stream));
  const MatrixD q = MatrixD::Ones(1, 3), v = MatrixD::Ones(1, 2);
  check_refused([&] { stream.step(q, q, v); }, "moved from");
  check_refused([&] { (void)stream.position(); }, "moved from");
  check_refused([&] { stream.reset(); }, "moved from");
  CHECK(taker.step(q, q, v).rows() == 1);  // the state went to the new owner
  stream = std::move(taker);               // assigning a stream makes it usable again
  CHECK(stream.position() == 1);
}

TEST_CASE("non-finite input data throws NonFiniteError, a non-finite option does not") {
  constexpr Index n = 5, d = 4;
  constexpr double nan = std::numeric_limits<double>::quiet_NaN();
  constexpr double inf = std::numeric_limits<double>::infinity();
  const auto map = make_feature_map({.kind = FeatureMapKind::EluPlusOne, .input_dim = d});
  LinearOptions linear;
  linear.placement = RopePlacement::None;
  LinearOptions causal = linear;
  causal.causal = true;
  const MatrixD good = MatrixD::Constant(n, d, 0.25);
  MatrixD bad = good;
  bad(3, 1) = nan;
  const std::string message =
      "linear_attention: v has the non-finite value nan at row 3, column 1; expected finite values";

  SUBCASE("the type, and the message it always had") {
    try {
      linear_attention(good, good, bad, *map, linear);
      FAIL("no exception");
    } catch (const NonFiniteError& e) {
      CHECK(std::string(e.what()) == message);
    }
    // Still a std::invalid_argument: every handler of bad input catches it.
    CHECK_THROWS_AS(linear_attention(good, good, bad, *map, linear), std::invalid_argument);
  }
  SUBCASE("every input of every call: q, k, v, d_out, x, a state's S and z") {
    for (const double value : {nan, -inf}) {
      CAPTURE(value);
      MatrixD wrong = good;
      wrong(3, 1) = value;
      CHECK_THROWS_AS(softmax_attention(wrong, good, good), NonFiniteError);
      CHECK_THROWS_AS(softmax_attention(good, wrong, good), NonFiniteError);
      CHECK_THROWS_AS(softmax_attention_backward(good, good, good, wrong), NonFiniteError);
      CHECK_THROWS_AS(linear_attention(wrong, good, good, *map, linear), NonFiniteError);
      CHECK_THROWS_AS(linear_attention(good, wrong, good, *map, causal), NonFiniteError);
      CHECK_THROWS_AS(linear_attention_backward(good, good, good, wrong, *map, linear),
                      NonFiniteError);
      CHECK_THROWS_AS(linear_attention_backward(good, wrong, good, good, *map, causal),
                      NonFiniteError);
      MatrixD features(n, map->output_dim());
      CHECK_THROWS_AS(map->apply(wrong, features), NonFiniteError);
      MatrixD dx(n, d);
      CHECK_THROWS_AS(map->backward(good, wrong, dx), NonFiniteError);
      LinearAttentionStream<double> stream(*map, d, linear);
      CHECK_THROWS_AS(stream.step(wrong, good, good), NonFiniteError);

      LinearAttentionStateD state;
      linear_attention(good, good, good, *map, causal, state);
      LinearAttentionStateD state_bad_S = state, state_bad_z = state;
      state_bad_S.S(1, 2) = value;
      state_bad_z.z(0) = value;
      for (LinearAttentionStateD* s : {&state_bad_S, &state_bad_z}) {
        CHECK_THROWS_AS(linear_attention(good, good, good, *map, causal, *s), NonFiniteError);
        CHECK_THROWS_AS(linear_attention_backward(good, good, good, good, *map, causal, *s, {}),
                        NonFiniteError);
      }
      LinearStateGradient<double> d_final{state_bad_S.S, state.z};
      CHECK_THROWS_AS(
          linear_attention_backward(good, good, good, good, *map, causal, state, d_final),
          NonFiniteError);
    }
  }
  SUBCASE("batched calls: the slice's input") {
    std::vector<double> data(2 * n * d, 0.5), out(2 * n * d);
    data[n * d + 7] = nan;  // head 1
    const Heads<const double> x{data.data(), 1, 2, n, d};
    const Heads<double> o{out.data(), 1, 2, n, d};
    CHECK_THROWS_AS(softmax_attention(x, x, x, o), NonFiniteError);
    CHECK_THROWS_AS(linear_attention(x, x, x, o, *map, linear), NonFiniteError);
  }
  SUBCASE("options that are not finite are settings, not data: plain std::invalid_argument") {
    const auto refused_without_type = [](auto call) {
      try {
        call();
        FAIL("no exception");
      } catch (const NonFiniteError& e) {
        FAIL("a non-finite option threw NonFiniteError: " << e.what());
      } catch (const std::invalid_argument&) {
      }
    };
    LinearOptions eps = linear;
    eps.eps = nan;
    refused_without_type([&] { linear_attention(good, good, good, *map, eps); });
    SoftmaxOptions scale;
    scale.scale = inf;
    refused_without_type([&] { softmax_attention(good, good, good, scale); });
    refused_without_type([&] { Rope({.dim = d, .base = nan}); });
  }
}

TEST_CASE("DenominatorStats: rows with no keys and rows with a zero divisor are their own counts") {
  constexpr Index d = 2;
  const auto map = make_feature_map({.kind = FeatureMapKind::Relu, .input_dim = d});
  LinearOptions options;
  options.placement = RopePlacement::None;

  SUBCASE("causal, keys starting 3 positions after the queries: the first 3 rows see no key") {
    options.causal = true;
    options.k_offset = 3;
    const MatrixD q = MatrixD::Ones(5, d);
    DenominatorStats stats;
    const MatrixD out = linear_attention(q, q, q.leftCols(1), *map, options, &stats);
    CHECK(stats.count == 5);
    CHECK(stats.no_keys == 3);
    CHECK(stats.nonpositive == 0);  // before: the 3 rows were counted as den = 0
    CHECK(stats.below_threshold == 0);
    CHECK(stats.zero_divisor == 0);
    CHECK(stats.min == doctest::Approx(2.0));  // row 3 sees one key: <relu(1,1), relu(1,1)> = 2
    CHECK(out.topRows(3).isZero());
  }
  SUBCASE("every row without keys: min stays 0, nothing else counted") {
    options.causal = true;
    options.k_offset = 10;
    const MatrixD q = MatrixD::Ones(4, d);
    DenominatorStats stats;
    linear_attention(q, q, q.leftCols(1), *map, options, &stats);
    CHECK(stats.count == 4);
    CHECK(stats.no_keys == 4);
    CHECK(stats.nonpositive == 0);
    CHECK(stats.min == 0);
  }
  SUBCASE("a denominator that overflows to inf: the row is zeroed and counted") {
    // relu(1e30)^2 * 2 keys overflows float: den = inf, so the divisor is not finite.
    MatrixF q = MatrixF::Ones(3, d);
    q.row(1).setConstant(1e30f);
    const MatrixF v = MatrixF::Ones(3, 1);
    DenominatorStats stats;
    const MatrixF out = linear_attention(q, q, v, *map, options, &stats);
    CHECK(stats.count == 3);
    CHECK(stats.no_keys == 0);
    CHECK(stats.zero_divisor == 1);
    CHECK(out(1, 0) == 0.0f);
    CHECK(out(0, 0) != 0.0f);
  }
}

}  // namespace
