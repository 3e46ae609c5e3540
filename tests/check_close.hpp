// Row-by-row comparison of a kernel's output with the reference under per-row tolerances, for the
// linear-attention tests (single-head and batched). A row whose tolerance is +inf is
// ill-conditioned at the kernel's precision (reference::row_tolerances: not even the sign of
// den + eps is determined) and is skipped, but counted: a comparison passes only if it compared at
// least one row and skipped at most a stated share of them. Without that minimum a case whose
// rows were all skipped (or that had no rows) would pass having compared nothing.
// Also the check of DenominatorStats against the reference's denominators.
#pragma once

#include <doctest/doctest.h>

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <limits>
#include <linrope/attention.hpp>
#include <linrope/types.hpp>
#include <vector>

namespace linrope::testing {

// What a comparison of rows [0, rows) found.
struct RowComparison {
  Index rows = 0;      // rows asked for
  Index compared = 0;  // rows with a finite tolerance, compared
  Index failed = 0;    // compared rows off by more than their bound (a NaN counts as off)
  Index worst = -1;    // the compared row with the largest error / bound, -1 if none
  double worst_error = 0, worst_bound = 0;

  Index skipped() const { return rows - compared; }
};

// |got_i - want_i|_inf against slack * tol_i for rows [0, rows); rows whose tol_i is not finite
// are skipped. No doctest assertion here: check_close asserts on the result, and the test of the
// minimum (test_linear_attention.cpp) calls this directly.
template <class T>
RowComparison compare_rows(const Matrix<T>& got, const MatrixD& want, const Eigen::VectorXd& tol,
                           double slack, Index rows) {
  RowComparison r;
  r.rows = rows;
  double worst_ratio = 0;
  for (Index i = 0; i < rows; ++i) {
    if (!std::isfinite(tol(i))) continue;
    ++r.compared;
    double error = 0;
    for (Index c = 0; c < want.cols(); ++c) {
      const double e = std::abs(double(got(i, c)) - want(i, c));
      if (std::isnan(e)) {
        error = e;
        break;
      }
      error = std::max(error, e);
    }
    const double bound = slack * tol(i);
    const double inf = std::numeric_limits<double>::infinity();
    const double ratio = std::isnan(error) ? inf : bound > 0 ? error / bound : error > 0 ? inf : 0;
    if (!(error <= bound)) ++r.failed;
    if (r.worst < 0 || ratio > worst_ratio) {
      r.worst = i;
      r.worst_error = error;
      r.worst_bound = bound;
      worst_ratio = ratio;
    }
  }
  return r;
}

// The minimum: at least one row compared, and at most max_skipped_percent of the rows skipped,
// rounded up (10: one row in every started ten, so 1 of 1..10 rows, 2 of 11..20, ...).
inline bool enough_rows_compared(const RowComparison& r, int max_skipped_percent) {
  return r.compared > 0 && r.skipped() * 100 <= r.rows * max_skipped_percent + 99;
}

// |got_i - want_i|_inf <= slack * tol_i for rows [0, rows) (all rows of want when rows < 0), with
// the minimum above. slack = 2 when two kernel results, each within tol of the reference, are
// compared with each other. A caller whose case has no rows must not call this: there is nothing
// to compare, and check_close fails.
template <class T>
void check_close(const Matrix<T>& got, const MatrixD& want, const Eigen::VectorXd& tol,
                 const char* what, double slack = 1, Index rows = -1,
                 int max_skipped_percent = 10) {
  INFO(what);
  REQUIRE(got.cols() == want.cols());
  if (rows < 0) {
    REQUIRE(got.rows() == want.rows());
    rows = want.rows();
  }
  REQUIRE(got.rows() >= rows);
  REQUIRE(want.rows() >= rows);
  REQUIRE(tol.size() >= rows);
  const RowComparison r = compare_rows(got, want, tol, slack, rows);
  INFO("rows checked ", r.compared, ", ill-conditioned and skipped ", r.skipped());
  INFO("worst row ", r.worst, ": |error| = ", r.worst_error, ", tolerance ", r.worst_bound);
  CHECK(r.failed == 0);
  // A comparison that skips most rows, or every row, would prove nothing.
  INFO("at least one row and ", 100 - max_skipped_percent, "% of the ", rows,
       " rows must be compared");
  CHECK(enough_rows_compared(r, max_skipped_percent));
}

// DenominatorStats against the reference's den_i, each of which the kernel computes to within
// t_i: the counts are pinned between those of the rows certainly on one side and the rows possibly
// so, and the minimum to within the largest t_i. Rows with no admissible key
// (admissible_keys[i] == 0) have no denominator: they are counted in no_keys only.
inline void check_denominator_stats(const DenominatorStats& got, const Eigen::VectorXd& den,
                                    const Eigen::VectorXd& t,
                                    const std::vector<Index>& admissible_keys, double threshold) {
  const Index n = den.size();
  REQUIRE(t.size() == n);
  REQUIRE(Index(admissible_keys.size()) == n);
  CHECK(got.count == n);
  CHECK(got.threshold == threshold);
  double slack = 0, ref_min = std::numeric_limits<double>::infinity();
  Index no_keys = 0, nonpos_lo = 0, nonpos_hi = 0, below_lo = 0, below_hi = 0;
  for (Index i = 0; i < n; ++i) {
    if (admissible_keys[std::size_t(i)] == 0) {
      ++no_keys;
      continue;
    }
    slack = std::max(slack, t(i));
    ref_min = std::min(ref_min, den(i));
    nonpos_lo += den(i) <= -t(i);
    nonpos_hi += den(i) <= t(i);
    below_lo += std::abs(den(i)) < threshold - t(i);
    below_hi += std::abs(den(i)) < threshold + t(i);
  }
  CHECK(got.no_keys == no_keys);
  if (no_keys == n) ref_min = 0;  // no denominator at all: min keeps its default
  INFO("reference min ", ref_min, ", nonpositive in [", nonpos_lo, ", ", nonpos_hi,
       "], below_threshold in [", below_lo, ", ", below_hi, "]");
  CHECK(std::abs(got.min - ref_min) <= slack);
  CHECK(got.nonpositive >= nonpos_lo);
  CHECK(got.nonpositive <= nonpos_hi);
  CHECK(got.below_threshold >= below_lo);
  CHECK(got.below_threshold <= below_hi);
}

}  // namespace linrope::testing
