// The causal core on its own: the scan engine that the forward scan and the three sweeps of the
// backward run on (scan_strips.hpp), the stabiliser's running prefix (admit_key) and the segment
// plan (causal_plan.hpp) that the forward and the backward both cut by. The attention tests prove
// the whole against the naive references; these pin each piece down where a fault would be hard
// to trace from there.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "linear/causal_plan.hpp"
#include "linear/linear_blocks.hpp"
#include "linear/scan_strips.hpp"

namespace {

using linrope::Index;
using linrope::detail::ScanSteps;

// A scan's operands, owned: `count` steps over a rows x cols state, with the keys absent at every
// `gap`-th step (0: never), and the state rescaled at every `rescale`-th step (0: never).
template <class T>
struct ScanCase {
  Index rows, cols, count;
  std::vector<T> state, reads, keys, values, outs;
  std::vector<T> factor, weight;
  std::vector<char> has_key;

  ScanCase(Index rows_, Index cols_, Index count_, Index gap, Index rescale, unsigned seed)
      : rows(rows_),
        cols(cols_),
        count(count_),
        state(rows_ * cols_),
        reads(count_ * rows_),
        keys(count_ * rows_),
        values(count_ * cols_),
        outs(count_ * cols_),
        factor(count_, T(1)),
        weight(count_),
        has_key(count_, 1) {
    std::mt19937 engine(seed);
    std::uniform_real_distribution<double> uniform(-1.0, 1.0), positive(0.1, 1.0);
    for (auto* x : {&state, &reads, &keys, &values})
      for (T& e : *x) e = T(uniform(engine));
    for (Index r = 0; r < count; ++r) {
      weight[r] = T(positive(engine));
      if (gap > 0 && r % gap == gap - 1) has_key[r] = 0;
      if (rescale > 0 && r % rescale == rescale - 1) factor[r] = T(positive(engine));
    }
  }

  // Steps [first, first + n) as the engine takes them.
  ScanSteps<T> steps(Index first, Index n) {
    ScanSteps<T> s;
    s.count = n;
    for (Index r = 0; r < n; ++r) {
      const Index at = first + r;
      s.read[r] = reads.data() + at * rows;
      s.key[r] = has_key[at] ? keys.data() + at * rows : nullptr;
      s.value[r] = values.data() + at * cols;
      s.out[r] = outs.data() + at * cols;
      s.factor[r] = factor[at];
      s.weight[r] = weight[at];
    }
    return s;
  }
};

// The definition, in double, one entry at a time: X *= f; X += w key value^T; out = read^T X.
// Returns the outputs and leaves the final state in `state`. For the tolerances: `state_bound`
// gets, per entry of X, the sum of its magnitudes over the steps; `out_bound`, per output entry,
// sum_l |read_l| times that sum for x_l.
template <class T>
std::vector<double> naive_scan(const ScanCase<T>& c, std::vector<double>& state,
                               std::vector<double>& state_bound, std::vector<double>& out_bound) {
  state.assign(c.state.begin(), c.state.end());
  state_bound.assign(state.size(), 0.0);
  for (std::size_t e = 0; e < state.size(); ++e) state_bound[e] = std::abs(state[e]);
  std::vector<double> out(c.count * c.cols, 0.0);
  out_bound.assign(c.count * c.cols, 0.0);
  for (Index r = 0; r < c.count; ++r) {
    for (Index l = 0; l < c.rows; ++l)
      for (Index j = 0; j < c.cols; ++j) {
        double& x = state[l * c.cols + j];
        x *= double(c.factor[r]);
        if (c.has_key[r])
          x += double(c.weight[r]) * double(c.keys[r * c.rows + l]) *
               double(c.values[r * c.cols + j]);
        state_bound[l * c.cols + j] += std::abs(x);
        out[r * c.cols + j] += double(c.reads[r * c.rows + l]) * x;
        out_bound[r * c.cols + j] +=
            std::abs(double(c.reads[r * c.rows + l])) * state_bound[l * c.cols + j];
      }
  }
  return out;
}

template <class T>
void check_scan_against_definition() {
  const double eps = std::numeric_limits<T>::epsilon();
  for (Index rows : {1, 3, 16, 64, 257})
    for (Index cols : {1, 5, 16, 33, 64, 100})
      for (Index count : {1, 7, 64})
        for (auto [gap, rescale] : {std::pair<Index, Index>{0, 0}, {3, 0}, {0, 5}, {4, 6}}) {
          CAPTURE(rows);
          CAPTURE(cols);
          CAPTURE(count);
          CAPTURE(gap);
          CAPTURE(rescale);
          ScanCase<T> c(rows, cols, count, gap, rescale, unsigned(rows * 1000 + cols + count));
          std::vector<double> state, state_bound, out_bound;
          const std::vector<double> expected = naive_scan(c, state, state_bound, out_bound);
          linrope::detail::scan_steps(c.state.data(), rows, cols, c.steps(0, count));
          // Each step rounds an entry of X at most 4 times in T (the rescaling, weight x value,
          // key x that, the sum; 3 when fused) and the reference at most 4 times in double, each
          // by at most eps of the entry's magnitude then: |error| <= 8 eps state_bound. A
          // read-out adds its sum over `rows` terms, each rounding at most eps of the sum of
          // magnitudes so far, and its products: (rows + 1) eps out_bound, 8 eps out_bound
          // inherited from X; twice that for the reference's own sum in double.
          Index failures = 0;
          for (Index e = 0; e < count * cols; ++e)
            failures += !(std::abs(double(c.outs[e]) - expected[e]) <=
                          (2.0 * double(rows + 1) + 8.0) * eps * out_bound[e]);
          for (Index e = 0; e < rows * cols; ++e)
            failures += !(std::abs(double(c.state[e]) - state[e]) <= 8.0 * eps * state_bound[e]);
          CHECK(failures == 0);
        }
}

TEST_CASE("scan_steps: the rank-one updates and read-outs of its definition, every shape") {
  SUBCASE("double") { check_scan_against_definition<double>(); }
  SUBCASE("float") { check_scan_against_definition<float>(); }
}

template <class T>
void check_grouping_keeps_bits() {
  for (Index rows : {5, 64, 256})
    for (Index cols : {7, 16, 32, 64, 96})
      for (unsigned seed : {7u, 8u}) {
        CAPTURE(rows);
        CAPTURE(cols);
        CAPTURE(seed);
        ScanCase<T> together(rows, cols, 64, 9, 13, seed), alone = together;
        linrope::detail::scan_steps(together.state.data(), rows, cols, together.steps(0, 64));
        for (Index r = 0; r < 64; ++r)
          linrope::detail::scan_steps(alone.state.data(), rows, cols, alone.steps(r, 1));
        CHECK(together.outs == alone.outs);
        CHECK(together.state == alone.state);
      }
}

TEST_CASE("scan_steps: steps run together give the bits of the steps run one at a time") {
  // The engine groups steps that need no rescaling into one pass over each strip; the header
  // promises every entry the same operations in the same order as one step at a time.
  SUBCASE("float") { check_grouping_keeps_bits<float>(); }
  SUBCASE("double") { check_grouping_keeps_bits<double>(); }
}

TEST_CASE("admit_key: the running maximum and the rescaled sum of the keys admitted so far") {
  // Headroom 0 (no decay): M is the running maximum. With a decay's headroom H, M moves only when
  // a key passes it by more than H, and then to exactly that key's scale: M <= max <= M + H, every
  // weight <= e^H, and a rising scale (0.3 a key) rescales every ceil(H / 0.3) = 37 keys.
  using linrope::Vector;
  std::mt19937 engine(11);
  std::normal_distribution<double> normal(0.0, 3.0);
  const Index m = 9;
  for (const double headroom : {0.0, linrope::detail::kDecayHeadroom})
    for (int pattern = 0; pattern < 3; ++pattern) {
      CAPTURE(headroom);
      CAPTURE(pattern);
      Vector<double> z = Vector<double>::Zero(m);
      double M = linrope::detail::kEmpty, largest = -std::numeric_limits<double>::infinity();
      Vector<double> plain = Vector<double>::Zero(m);      // sum_j exp(c_j) e_j, no stabiliser
      Vector<double> magnitude = Vector<double>::Zero(m);  // sum_j exp(c_j) |e_j|
      double numerator_side = 0.0, numerator_plain = 0.0;  // a scalar carried as the state would be
      int rescales = 0;
      for (int j = 0; j < 80; ++j) {
        // rising, falling and random log scales
        const double c = pattern == 0 ? 0.3 * j : pattern == 1 ? 5.0 - 0.2 * j : normal(engine);
        Vector<double> e(m);
        for (Index l = 0; l < m; ++l) e[l] = normal(engine);
        const double before = M;
        const auto a = linrope::detail::admit_key(z, M, c, e.data(), headroom);
        numerator_side = numerator_side * a.factor + a.weight;
        numerator_plain += std::exp(c);
        plain += std::exp(c) * e;
        magnitude += std::exp(c) * e.cwiseAbs();
        largest = std::max(largest, c);
        if (M != before) {
          ++rescales;
          CHECK(M == c);
          CHECK(c > before + headroom);
        }
        CHECK(M <= largest);
        CHECK(largest <= M + headroom);
        CHECK(a.weight <= std::exp(headroom));
        CHECK(a.factor <= 1.0);
        // Each admission rounds z at most 3 times (rescale, weight, add) and exp's result by a
        // few ulps, relative to the magnitudes summed so far; 80 keys: far below 1e-12 of them.
        for (Index l = 0; l < m; ++l)
          CHECK(std::abs(z[l] * std::exp(M) - plain[l]) <= 1e-12 * magnitude[l]);
        CHECK(std::abs(numerator_side * std::exp(M) - numerator_plain) <= 1e-12 * numerator_plain);
      }
      if (pattern == 0) CHECK(rescales == (headroom == 0 ? 80 : 3));  // j = 0, 37, 74
    }
}

TEST_CASE("plan_causal: segments that cover the sequence, aligned, and the keys each sees first") {
  for (Index n : {0, 1, 255, 256, 1000, 1100, 4096})
    for (Index n_k : {Index(0), n / 2, n, n + 37})
      for (Index shift : {-300, -1, 0, 5, 64})
        for (Index align : {16, 64})
          for (int threads : {1, 2, 3, 8}) {
            CAPTURE(n);
            CAPTURE(n_k);
            CAPTURE(shift);
            CAPTURE(align);
            CAPTURE(threads);
            const Index q_offset = 400 + shift, k_offset = 400;
            const auto plan =
                linrope::detail::plan_causal(n, n_k, q_offset, k_offset, align, threads);
            const auto first_key = [&](Index i) { return std::clamp(i + shift, Index(0), n_k); };
            // The rule: one segment per thread, each at least max(4 align, 256) queries long
            // before alignment, so a short head is never cut.
            const Index unit = std::max<Index>(4 * align, 256);
            CHECK(plan.segments == std::clamp<Index>(n / unit, 1, threads));
            REQUIRE(plan.query_start.size() == std::size_t(plan.segments + 1));
            REQUIRE(plan.key_start.size() == std::size_t(plan.segments + 1));
            CHECK(plan.query_start.front() == 0);
            CHECK(plan.query_start.back() == n);
            CHECK(plan.key_start.front() == 0);
            CHECK(plan.key_start.back() == first_key(n));
            for (Index t = 1; t < plan.segments; ++t) {
              CHECK(plan.query_start[t] % align == 0);
              CHECK(plan.query_start[t] - plan.query_start[t - 1] >= unit - align);
              CHECK(plan.query_start[t] > plan.query_start[t - 1]);
              CHECK(plan.key_start[t] == first_key(plan.query_start[t]));
            }
          }
}

}  // namespace
