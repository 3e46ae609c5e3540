// Private: argument checking that produces messages of the form
//   "linear_attention: k is [7 x 8] but q has d = 16".
// Every public function checks all of its arguments before any parallel region.
#pragma once

#include <cmath>
#include <cstdint>
#include <linrope/types.hpp>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string_view>
#include <type_traits>

// The non-finite checks (x * 0 sums, std::isfinite) rely on IEEE arithmetic, which
// -ffast-math and -ffinite-math-only let the compiler assume away: every NaN would pass.
#if defined(__FINITE_MATH_ONLY__) && __FINITE_MATH_ONLY__
#error "linrope needs NaN and inf: compile it without -ffast-math and -ffinite-math-only"
#endif

namespace linrope::detail {

struct Shape {
  Index rows, cols;
};
inline std::ostream& operator<<(std::ostream& out, Shape s) {
  return out << '[' << s.rows << " x " << s.cols << ']';
}
template <class M>
Shape shape_of(const M& m) {
  return {static_cast<Index>(m.rows()), static_cast<Index>(m.cols())};
}

// Throws Error("<function>: <parts...>"), numbers with 17 significant digits.
template <class Error, class... Parts>
[[noreturn]] void throw_error(std::string_view function, const Parts&... parts) {
  std::ostringstream message;
  message.precision(17);
  message << function << ": ";
  (message << ... << parts);
  throw Error(message.str());
}

// A call that is wrong: a shape, an option, an overlap.
template <class... Parts>
[[noreturn]] void throw_invalid(std::string_view function, const Parts&... parts) {
  throw_error<std::invalid_argument>(function, parts...);
}

// True when the memory spans of two row-major matrices or contiguous vectors (each from its first
// element to its last, through a matrix's outer stride) overlap. Exact for dense matrices and
// vectors; for strided blocks it is conservative: two column blocks of one matrix overlap by this
// test though no element is shared.
template <class A, class B>
bool spans_overlap(const A& a, const B& b) {
  if (a.size() == 0 || b.size() == 0) return false;
  const auto begin = [](const auto* p) { return reinterpret_cast<std::uintptr_t>(p); };
  const auto end = [&](const auto& m) {
    if constexpr (std::decay_t<decltype(m)>::ColsAtCompileTime == 1)
      return begin(m.data() + m.size());
    else
      return begin(m.data() + (m.rows() - 1) * m.outerStride() + m.cols());
  };
  return begin(a.data()) < end(b) && begin(b.data()) < end(a);
}

// Input data that is not finite (types.hpp, NonFiniteError).
template <class... Parts>
[[noreturn]] void throw_nonfinite(std::string_view function, const Parts&... parts) {
  throw_error<NonFiniteError>(function, parts...);
}

// sum over x[0, n) of x * 0, which is 0 when every value is finite and NaN otherwise (inf * 0 is
// NaN). 64 independent sums, which the compiler keeps in vector registers: one running sum (or
// Eigen's reduction, two) is a chain of dependent additions that checks one vector per 4 cycles,
// which made the check 4-8% of an elu+1 causal backward (perf, bench_linear, n = 4096).
template <class T>
T zero_sum(const T* x, Index n) {
  constexpr int kSums = 64;
  T sums[kSums] = {};
  Index j = 0;
  for (; j + kSums <= n; j += kSums)
    for (int t = 0; t < kSums; ++t) sums[t] += x[j + t] * T(0);
  for (int t = 0; j + t < n; ++t) sums[t] += x[j + t] * T(0);  // the tail, in lanes too
  for (int width = kSums / 2; width > 0; width /= 2)  // in halves: vector adds, not a chain of 64
    for (int t = 0; t < width; ++t) sums[t] += sums[t + width];
  return sums[0];
}

// The shortest run that zero_sum checks; shorter ones go to Eigen's reduction. zero_sum's 64 sums
// cost a fixed ~10-30 ns a call (zeroed, then reduced), which a short run does not repay: a
// 16-float run took 13-34 ns against Eigen's 1.6, a strided block 16 wide and 4096 rows 132 us
// against 6; the two break even near 1024 floats (a review's micro-benchmarks, AVX-512,
// 2026-11-29).
inline constexpr Index kZeroSumRun = 1024;

// True when every element of `m` is finite. x * 0 is 0 for finite x and NaN for inf or NaN: a
// vectorised sum (zero_sum over each contiguous row or column of at least kZeroSumRun elements,
// where the elements are stored so; Eigen's sum otherwise).
template <class M>
bool all_finite(const M& m) {
  using Scalar = typename M::Scalar;
  if (m.size() == 0) return true;
  if constexpr (bool(M::Flags & Eigen::DirectAccessBit)) {
    if (m.innerStride() == 1 && m.outerStride() == m.innerSize() && m.size() >= kZeroSumRun)
      return zero_sum(m.data(), m.size()) == Scalar(0);  // one contiguous run
    if (m.innerStride() == 1 && m.innerSize() >= kZeroSumRun) {
      for (Index o = 0; o < m.outerSize(); ++o)
        if (zero_sum(m.data() + o * m.outerStride(), m.innerSize()) != Scalar(0)) return false;
      return true;
    }
  }
  return (m.array() * Scalar(0)).sum() == Scalar(0);
}

// Throws naming the first non-finite element of `m` (the matrix called `name`).
template <class M>
void require_finite(std::string_view function, std::string_view name, const M& m) {
  if (all_finite(m)) return;
  for (Index i = 0; i < m.rows(); ++i)
    for (Index j = 0; j < m.cols(); ++j)
      if (!std::isfinite(m(i, j)))
        throw_nonfinite(function, name, " has the non-finite value ", m(i, j), " at row ", i,
                        ", column ", j, "; expected finite values");
}

}  // namespace linrope::detail

namespace linrope::detail {

// Positions first .. first + rows - 1 must be exact in double (|p| <= 2^53), which RoPE's angle
// arithmetic needs.
inline void require_positions(std::string_view function, std::string_view name, Index first,
                              Index rows) {
  constexpr Index kLimit = Index(1) << 53;
  if (first < -kLimit || first > kLimit || rows > kLimit - first)
    throw_invalid(function, name, " is ", first, " with ", rows,
                  " rows but expected every position within +-2^53 = ", kLimit);
}

}  // namespace linrope::detail
