// linrope::matmul, the public product for the linear maps around attention (include/linrope/
// matmul.hpp), against the naive double product: transposes, accumulation, strided blocks, row
// counts on both sides of its 256-row blocks, the same bits on 1 and 2 threads, refused calls.
// detail::gemm under it is swept on its own in test_gemm.cpp.
#include <doctest/doctest.h>

#include <cstdint>
#include <linrope/matmul.hpp>
#include <stdexcept>
#include <string>

#include "reference/matmul_reference.hpp"
#include "reference/random.hpp"
#include "refusal.hpp"
#include "threads.hpp"

namespace {

using linrope::Index;
using linrope::MatmulOptions;
using linrope::Matrix;
using linrope::MatrixD;
using linrope::MatrixF;
using linrope::testing::refusal;

// A matrix with the given value, stored (as its transpose when `transposed`) in the left columns
// of a wider buffer, so that its outer stride is not its width.
template <class T>
struct Stored {
  Matrix<T> buffer;
  Index rows, cols;
  Stored(const MatrixD& value, bool transposed) {
    const MatrixD stored = transposed ? MatrixD(value.transpose()) : value;
    rows = stored.rows();
    cols = stored.cols();
    buffer = Matrix<T>::Constant(rows, cols + 3, T(-7));
    buffer.leftCols(cols) = stored.cast<T>();
  }
  auto block() const { return buffer.leftCols(cols); }
};

// op(a) op(b) (+ c0) by matmul against the triple loop, within reference::product_check's bound.
template <class T>
void check(Index m, Index n, Index k, const MatmulOptions& options, std::uint64_t seed) {
  CAPTURE(m);
  CAPTURE(n);
  CAPTURE(k);
  CAPTURE(options.transpose_a);
  CAPTURE(options.transpose_b);
  CAPTURE(options.accumulate);
  const auto rounded = [](const MatrixD& x) { return x.cast<T>().template cast<double>().eval(); };
  const MatrixD a = rounded(linrope::testing::gaussian(m, k, seed));
  const MatrixD b = rounded(linrope::testing::gaussian(k, n, seed + 1));
  const MatrixD c0 = rounded(linrope::testing::gaussian(m, n, seed + 2));
  const Stored<T> a_stored(a, options.transpose_a), b_stored(b, options.transpose_b);
  // c sits inside a larger buffer, a row above and below it and two columns to its right: nothing
  // outside its block may change (a row block written at the wrong offset would show here).
  const T sentinel = T(12345);
  Matrix<T> c_buffer = Matrix<T>::Constant(m + 2, n + 2, sentinel);
  c_buffer.block(1, 0, m, n) = c0.cast<T>();
  linrope::matmul(a_stored.block(), b_stored.block(), c_buffer.block(1, 0, m, n), options);

  const auto [expected, bound] =
      linrope::reference::product_check<T>(a, b, options.accumulate ? &c0 : nullptr);
  const MatrixD got = c_buffer.block(1, 0, m, n).template cast<double>();
  CHECK(((got - expected).cwiseAbs().array() <= bound.array()).all());
  Matrix<T> outside = c_buffer;
  outside.block(1, 0, m, n).setConstant(sentinel);
  CHECK((outside.array() == sentinel).all());
}

template <class T>
void sweep() {
  std::uint64_t seed = 1;
  // Rows around the 256-row blocks (one, a tail of 1, several); widths and depths odd and even;
  // k = 0 is the empty sum.
  for (Index m : {1, 7, 256, 257, 600})
    for (Index n : {1, 5, 33})
      for (Index k : {0, 1, 19, 128})
        for (int flags = 0; flags < 8; ++flags)
          check<T>(m, n, k,
                   {.transpose_a = bool(flags & 1),
                    .transpose_b = bool(flags & 2),
                    .accumulate = bool(flags & 4)},
                   seed++);
}

TEST_CASE("matmul float matches the naive double product: transposes, accumulation, row blocks") {
  sweep<float>();
}
TEST_CASE("matmul double matches the naive double product: transposes, accumulation, row blocks") {
  sweep<double>();
}

TEST_CASE("matmul runs a layer's three products: y = x W^T, dx = dy W, dW = dy^T x") {
  // The shapes of a small decoder's MLP (4 x d_model wide) at 600 tokens, as linrope.torch's
  // Linear calls them.
  check<float>(600, 96, 24, {.transpose_b = true}, 11);
  check<float>(600, 24, 96, {}, 12);
  check<float>(96, 24, 600, {.transpose_a = true}, 13);
}

TEST_CASE("matmul gives the same bits on one thread and on two") {
  const MatrixF a = linrope::testing::gaussian(777, 130, 3).cast<float>();
  const MatrixF b = linrope::testing::gaussian(70, 130, 4).cast<float>();
  MatrixF one(777, 70), two(777, 70);
  {
    const linrope::testing::ThreadCount threads(1);
    linrope::matmul(a, b, one, {.transpose_b = true});
  }
  {
    const linrope::testing::ThreadCount threads(linrope::testing::kSplitThreads);
    linrope::matmul(a, b, two, {.transpose_b = true});
  }
  CHECK((one.array() == two.array()).all());
}

TEST_CASE("matmul refuses shapes that disagree and an output sharing an input's memory") {
  const MatrixF a = MatrixF::Ones(4, 3), b = MatrixF::Ones(5, 2);
  MatrixF c(4, 2);
  CHECK(refusal([&] { linrope::matmul(a, b, c); }) ==
        "matmul: b is [5 x 2] but a is [4 x 3], so op(b) must have k = 3 rows; it has 5");
  CHECK(refusal([&] { linrope::matmul(a, b, c, {.transpose_a = true}); }) ==
        "matmul: b is [5 x 2] but a is [4 x 3] (transposed: op(a) is [k x m] stored), so op(b) "
        "must have k = 4 rows; it has 5");
  const MatrixF b3 = MatrixF::Ones(3, 2);
  MatrixF wrong(4, 3);
  CHECK(refusal([&] { linrope::matmul(a, b3, wrong); }) ==
        "matmul: c is [4 x 3] but expected [4 x 2] (op(a) is [4 x 3], op(b) [3 x 2])");
  MatrixF square = MatrixF::Ones(3, 3);
  CHECK(refusal([&] { linrope::matmul(square, MatrixF::Ones(3, 3), square); }) ==
        "matmul: c overlaps a; expected separate storage");
  CHECK(refusal([&] {
          linrope::matmul(MatrixF::Ones(3, 3), square.leftCols(3), square.leftCols(3));
        }) == "matmul: c overlaps b; expected separate storage");
  // Spans are compared, not elements: two column blocks of one matrix are refused (documented).
  MatrixF wide = MatrixF::Ones(3, 6);
  CHECK(refusal([&] {
          linrope::matmul(wide.rightCols(3), MatrixF::Ones(3, 3), wide.leftCols(3));
        }) == "matmul: c overlaps a; expected separate storage");
  // Disjoint row blocks of one buffer are fine: c below a.
  MatrixF buffer = MatrixF::Ones(6, 3);
  linrope::matmul(buffer.topRows(3), MatrixF::Ones(3, 3), buffer.bottomRows(3));
  CHECK((buffer.bottomRows(3).array() == 3.0f).all());
}

}  // namespace
