// detail::gemm, the product under every kernel (the AVX-512 micro-kernel for float when the build
// has AVX-512, Eigen otherwise and for double), against the naive double product: swept shapes on
// both sides of every register and cache block edge, all four storage orders of A and B,
// accumulate or not, strided blocks in and out, and determinism.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "common/gemm.hpp"
#include "reference/matmul_reference.hpp"
#include "reference/random.hpp"
#include "threads.hpp"

namespace {

using linrope::Index;
using linrope::Matrix;
using linrope::MatrixD;
using linrope::detail::ConstView;
using linrope::detail::View;
using linrope::detail::Write;

// The sweeps below run over accumulate = false, true.
Write write_of(bool accumulate) { return accumulate ? Write::Add : Write::Overwrite; }

// One operand stored row-major or column-major (as its transpose, row-major) inside a larger
// buffer with a padded outer stride, so that neither the order nor the stride is the trivial one.
template <class T>
struct Operand {
  Matrix<T> storage;
  ConstView<T> view;
  Operand(const MatrixD& value, bool column_major) {
    const MatrixD stored = column_major ? MatrixD(value.transpose()) : value;
    storage = Matrix<T>::Constant(stored.rows(), stored.cols() + 3, T(-7));
    storage.leftCols(stored.cols()) = stored.cast<T>();
    view = {storage.data(), stored.rows(), stored.cols(), storage.cols(), 1};
    if (column_major) view = view.transposed();
  }
};

// Float inputs and products are exact in double, so only the float sums round: each c_ij is a sum
// of k products plus (accumulating) the old c_ij, k + 1 roundings of relative size u, each bounded
// by the running sum of magnitudes: |c - ref| <= (k + 1) u (sum_p |a_ip b_pj| + |c0_ij|)
// (Higham, Accuracy and Stability, 3.1). The factor 1.01 covers gamma_{k+1} vs (k + 1) u.
template <class T>
void check_product(Index m, Index n, Index k, bool a_columns, bool b_columns, bool accumulate,
                   std::uint64_t seed) {
  CAPTURE(m);
  CAPTURE(n);
  CAPTURE(k);
  CAPTURE(a_columns);
  CAPTURE(b_columns);
  CAPTURE(accumulate);
  // Round the inputs to T first so that the reference sees exactly what gemm sees.
  const MatrixD a = linrope::testing::gaussian(m, k, seed).cast<T>().template cast<double>();
  const MatrixD b = linrope::testing::gaussian(k, n, seed + 1).cast<T>().template cast<double>();
  const MatrixD c0 = linrope::testing::gaussian(m, n, seed + 2).cast<T>().template cast<double>();
  const Operand<T> a_op(a, a_columns), b_op(b, b_columns);

  // c lives in the middle of a larger buffer: nothing outside its block may change.
  const T sentinel = T(12345);
  Matrix<T> buffer = Matrix<T>::Constant(m + 2, n + 5, sentinel);
  buffer.block(1, 2, m, n) = c0.cast<T>();
  const View<T> c{buffer.data() + buffer.cols() + 2, m, n, buffer.cols()};
  linrope::detail::gemm(a_op.view, b_op.view, c, write_of(accumulate));

  const auto [expected, bound] =
      linrope::reference::product_check<T>(a, b, accumulate ? &c0 : nullptr);
  const MatrixD got = buffer.block(1, 2, m, n).template cast<double>();
  CHECK(((got - expected).cwiseAbs().array() <= bound.array()).all());
  Matrix<T> outside = buffer;
  outside.block(1, 2, m, n).setConstant(sentinel);
  CHECK((outside.array() == sentinel).all());
}

template <class T>
void sweep_shapes() {
  // Around the register tile (8 x 32 for float AVX-512) and the K block (256); K = 0 is the
  // empty sum (c = 0, or c unchanged when accumulating).
  std::uint64_t seed = 100;
  for (Index m : {1, 2, 3, 6, 7, 8, 9, 13, 100})  // tiles of 8, and tails of every size
    for (Index n : {1, 16, 31, 33, 64, 65})
      for (Index k : {0, 1, 64, 257})
        for (int order = 0; order < 4; ++order)
          check_product<T>(m, n, k, order & 1, order & 2, order == 1 || order == 2, seed++);
}

TEST_CASE("gemm float matches the naive double product over swept shapes") {
  sweep_shapes<float>();
}
TEST_CASE("gemm double matches the naive double product over swept shapes") {
  sweep_shapes<double>();
}

TEST_CASE("gemm crosses every cache block (M > 96, N > 512, K > 256) in all storage orders") {
  for (int order = 0; order < 4; ++order)
    for (bool accumulate : {false, true})
      check_product<float>(200, 600, 400, order & 1, order & 2, accumulate, 7 + order);
}

TEST_CASE("gemm reads A in place across K and M blocks") {
  // A is read in place (not packed) when it is row-major with N <= 64 or short rows, or
  // column-major with narrow columns; these shapes put such an A past the first K block (k > 256)
  // and, row-major, past the first M block (m > 96), where its offsets must advance.
  struct Case {
    Index m, n, k;
    bool a_columns;
  };
  std::uint64_t seed = 500;
  for (const Case c : {Case{100, 64, 300, false}, Case{200, 33, 513, false},
                       Case{50, 64, 300, true}, Case{61, 17, 600, true}})
    for (bool accumulate : {false, true})
      check_product<float>(c.m, c.n, c.k, c.a_columns, false, accumulate, seed++);
}

TEST_CASE("gemm is deterministic: repeated calls give bitwise the same result") {
  const MatrixD a = linrope::testing::gaussian(77, 300, 1),
                b = linrope::testing::gaussian(300, 45, 2);
  const Operand<float> a_op(a, false), b_op(b, true);
  linrope::MatrixF first(77, 45), second(77, 45);
  linrope::detail::gemm(a_op.view, b_op.view, linrope::detail::view(first), Write::Overwrite);
  linrope::detail::gemm(a_op.view, b_op.view, linrope::detail::view(second), Write::Overwrite);
  CHECK((first.array() == second.array()).all());
}

// A product that fetches memory for its caller (Prefetch) takes another path through the
// micro-kernel's inner loop (steps in pairs while lines remain), so it is compared, bitwise, with
// the same product without one: every A layout (row-major in place, column-major in place, and
// packed, for N > 64), odd and even K below and above a cache block, accumulate or not, and
// ranges that run out mid-product, outlast it, start unaligned, end mid-line, are empty, or are
// the operands themselves.
TEST_CASE("gemm fetching memory for its caller (Prefetch) gives bitwise what gemm without gives") {
  using linrope::detail::Prefetch;
  const std::vector<float> elsewhere(5000, 3.0f);
  std::uint64_t seed = 1300;
  for (const Index k : {1, 2, 3, 64, 255, 257, 600})
    for (const Index m : {1, 8, 37, 130})
      for (const Index n : {45, 200})
        for (const bool a_columns : {false, true})
          for (const bool accumulate : {false, true}) {
            CAPTURE(k);
            CAPTURE(m);
            CAPTURE(n);
            CAPTURE(a_columns);
            CAPTURE(accumulate);
            const Operand<float> a_op(linrope::testing::gaussian(m, k, seed), a_columns);
            const Operand<float> b_op(linrope::testing::gaussian(k, n, seed + 1), true);
            const linrope::MatrixF c0 = linrope::testing::gaussian(m, n, seed + 2).cast<float>();
            seed += 3;
            linrope::MatrixF plain = c0;
            linrope::detail::gemm(a_op.view, b_op.view, linrope::detail::view(plain),
                                  write_of(accumulate));
            const Index a_bytes = Index(sizeof(float)) * a_op.storage.size();
            for (const Prefetch& next :
                 {Prefetch{{Prefetch::Range{elsewhere.data() + 3, 4 * 41}, Prefetch::Range{}}},
                  Prefetch{{Prefetch::Range{elsewhere.data(), 4 * 5000},
                            Prefetch::Range{a_op.storage.data(), a_bytes}}},
                  Prefetch{{Prefetch::Range{}, Prefetch::Range{elsewhere.data() + 1, 4 * 4000}}},
                  Prefetch{{Prefetch::Range{b_op.storage.data(), 4},
                            Prefetch::Range{plain.data(), 8}}}}) {
              linrope::MatrixF fetched = c0;
              linrope::detail::gemm(a_op.view, b_op.view, linrope::detail::view(fetched),
                                    write_of(accumulate), next);
              CHECK((fetched.array() == plain.array()).all());
            }
          }
}

// What the micro-kernel fetches: LineFeed hands out exactly the cache lines the ranges touch,
// each once, the first range's before the second's, in runs of at most the size asked for that
// lie in one range. Model: line numbers address / 64 from the first byte's to the last byte's.
TEST_CASE("LineFeed hands out exactly the cache lines a Prefetch's ranges touch, in order") {
  using linrope::detail::LineFeed;
  using linrope::detail::Prefetch;
  alignas(64) static const char memory[4096] = {};
  const auto lines_of = [](const Prefetch::Range& r) {
    std::vector<std::uintptr_t> lines;
    if (r.bytes <= 0) return lines;
    const auto start = reinterpret_cast<std::uintptr_t>(r.data);
    for (std::uintptr_t l = start / 64; l <= (start + r.bytes - 1) / 64; ++l) lines.push_back(l);
    return lines;
  };
  const std::vector<Prefetch::Range> ranges = {
      {memory, 64}, {memory + 1, 64},   {memory + 63, 2},    {memory + 7, 1},     {memory + 128, 0},
      {nullptr, 0}, {memory + 5, 1000}, {memory + 640, 640}, {memory + 100, 3000}};
  for (const auto& first : ranges)
    for (const auto& second : ranges)
      for (const Index most : {1, 3, 128}) {
        CAPTURE(first.bytes);
        CAPTURE(second.bytes);
        CAPTURE(most);
        std::vector<std::uintptr_t> expected = lines_of(first);
        const std::vector<std::uintptr_t> of_second = lines_of(second);
        expected.insert(expected.end(), of_second.begin(), of_second.end());

        LineFeed feed(Prefetch{{first, second}});
        CHECK(feed.take(0).count == 0);  // asks for nothing, takes nothing
        std::vector<std::uintptr_t> handed;
        for (LineFeed::Run run = feed.take(most); run.count > 0; run = feed.take(most)) {
          CHECK(run.count <= most);
          // One run lies in one range: its lines are the next ones of the expected sequence and
          // consecutive (two ranges may touch the same or adjacent lines, never within a run).
          for (Index i = 0; i < run.count; ++i) handed.push_back(run.first + std::uintptr_t(i));
          const std::size_t at = handed.size() - std::size_t(run.count);
          const bool in_first = at + std::size_t(run.count) <= lines_of(first).size();
          const bool in_second = at >= lines_of(first).size();
          CHECK((in_first || in_second));
        }
        CHECK(handed == expected);
        CHECK(feed.take(most).count == 0);  // and stays empty
      }
}

// B [k x n] stored as b_columns says, and what a PackedRight of it multiplies as: for float with
// AVX-512 the view itself (the same panels, the same micro-kernel calls); elsewhere a contiguous
// row-major copy of b through Eigen. PackedRight is compared, bitwise, with gemm on that; gemm
// itself is checked against the naive product above.
template <class T>
struct PackedOperand {
  PackedOperand(const MatrixD& b, bool b_columns) : b_op(b, b_columns), row_major(b.cast<T>()) {}
  ConstView<T> reference() const {
#ifdef __AVX512F__
    if constexpr (std::is_same_v<T, float>) return b_op.view;
#endif
    return {row_major.data(), row_major.rows(), row_major.cols(), row_major.cols(), 1};
  }
  Operand<T> b_op;
  Matrix<T> row_major;
};

template <class T>
void check_packed_right(Index m, Index n, Index k, bool b_columns, bool accumulate,
                        std::uint64_t seed) {
  CAPTURE(m);
  CAPTURE(n);
  CAPTURE(k);
  CAPTURE(b_columns);
  CAPTURE(accumulate);
  const Operand<T> a_op(linrope::testing::gaussian(m, k, seed), false);
  PackedOperand<T> b(linrope::testing::gaussian(k, n, seed + 1), b_columns);
  const ConstView<T> reference_b = b.reference();
  const Matrix<T> c0 = linrope::testing::gaussian(m, n, seed + 2).cast<T>();
  Matrix<T> from_view = c0, from_packed = c0;
  linrope::detail::gemm(a_op.view, reference_b, linrope::detail::view(from_view),
                        write_of(accumulate));
  const linrope::detail::PackedRight<T> packed(b.b_op.view);
  b.b_op.storage.setConstant(T(-99));  // the packed copy must not refer to b's memory
  linrope::detail::gemm(a_op.view, packed, linrope::detail::view(from_packed),
                        write_of(accumulate));
  CHECK((from_packed.array() == from_view.array()).all());
}

TEST_CASE("gemm with B packed once (PackedRight) gives bitwise what gemm on B gives") {
  // Shapes inside one register tile, across the tile edges, and across every cache block
  // (N > 512, K > 256, also K > 512) where the packed blocks' offsets must advance; a single row
  // (Eigen's matrix-vector path elsewhere); K = 0, M = 0, N = 0.
  struct Case {
    Index m, n, k;
  };
  std::uint64_t seed = 900;
  for (const Case c :
       {Case{1, 1, 1}, Case{9, 33, 64}, Case{100, 65, 257}, Case{200, 600, 400}, Case{13, 545, 513},
        Case{1, 300, 64}, Case{5, 7, 0}, Case{0, 40, 30}, Case{6, 0, 30}})
    for (bool b_columns : {false, true})
      for (bool accumulate : {false, true}) {
        check_packed_right<float>(c.m, c.n, c.k, b_columns, accumulate, seed);
        check_packed_right<double>(c.m, c.n, c.k, b_columns, accumulate, seed);
        seed += 3;
      }
}

// A block of a PackedRight (rows [0, rows), columns [col0, col0 + cols)) against gemm on the same
// block of what the whole multiplies as (PackedOperand): bitwise, the block's panels being the
// whole's.
template <class T>
void check_packed_block(Index m, Index k, Index n, Index rows, Index col0, Index cols,
                        bool b_columns, std::uint64_t seed) {
  INFO("m ", m, ", B ", k, " x ", n, (b_columns ? " column-major" : " row-major"), ", block rows ",
       rows, ", columns ", col0, " + ", cols);
  const Operand<T> a_op(linrope::testing::gaussian(m, rows, seed), false);
  PackedOperand<T> b(linrope::testing::gaussian(k, n, seed + 1), b_columns);
  const ConstView<T> whole = b.reference();
  const ConstView<T> block{whole.data + col0 * whole.col_stride, rows, cols, whole.row_stride,
                           whole.col_stride};
  Matrix<T> from_view(m, cols), from_block(m, cols);
  linrope::detail::gemm(a_op.view, block, linrope::detail::view(from_view), Write::Overwrite);
  const linrope::detail::PackedRight<T> packed(b.b_op.view);
  b.b_op.storage.setConstant(T(-99));
  REQUIRE(packed.blockable(col0));
  linrope::detail::gemm(a_op.view, packed.block(rows, col0, cols),
                        linrope::detail::view(from_block), Write::Overwrite);
  CHECK((from_block.array() == from_view.array()).all());
}

TEST_CASE("a block of a PackedRight multiplies as gemm on that block of B") {
  struct Case {
    Index k, n, rows, col0, cols;
  };
  // Few rows (<= 256: any column panel starts a block): blocks inside the first cache block of
  // columns, across the 512-column edge, the last partial panel, a prefix of the rows. Many rows:
  // blocks at column 0 and 512, prefixes ending inside and at the edge of a 256-row cache block.
  std::uint64_t seed = 950;
  for (const Case c :
       {Case{64, 1000, 64, 0, 256}, Case{64, 1000, 64, 256, 256}, Case{64, 1000, 64, 480, 100},
        Case{64, 1000, 64, 992, 8}, Case{64, 1000, 30, 32, 33}, Case{256, 70, 256, 64, 6},
        Case{700, 64, 700, 0, 64}, Case{700, 64, 384, 0, 64}, Case{700, 64, 300, 0, 40},
        Case{600, 1100, 600, 512, 588}, Case{600, 1100, 520, 512, 100},
        Case{600, 1100, 100, 0, 1100}})
    for (bool b_columns : {false, true})
      for (Index m : {1, 13, 100}) {
        check_packed_block<float>(m, c.k, c.n, c.rows, c.col0, c.cols, b_columns, seed);
        check_packed_block<double>(m, c.k, c.n, c.rows, c.col0, c.cols, b_columns, seed);
        seed += 3;
      }
}

TEST_CASE("PackedRight::blockable: columns at panel starts, and at cache blocks when b is deep") {
  const linrope::MatrixF shallow = linrope::MatrixF::Ones(64, 1000),
                         deep = linrope::MatrixF::Ones(300, 1100);
  const linrope::detail::PackedRight<float> few(linrope::detail::const_view(shallow));
  const linrope::detail::PackedRight<float> many(linrope::detail::const_view(deep));
  CHECK(few.blockable(0));
  CHECK(few.blockable(96));
  CHECK_FALSE(few.blockable(40));
  CHECK(many.blockable(0));
  CHECK(many.blockable(512));
  CHECK_FALSE(many.blockable(17));
#ifdef __AVX512F__
  CHECK_FALSE(many.blockable(64));  // inside a cache block of 512 columns, 256 rows deep
#else
  CHECK(many.blockable(64));  // a row-major copy: any panel start
#endif
}

// The Eigen path's determinism. gemm's double products, and its float products on machines
// without AVX-512, call Eigen::internal::generic_product_impl<..., GemmProduct>::scaleAndAddTo
// (src/common/gemm.cpp, gemm_eigen): Eigen's blocked GEMM, or its GEMV for one row or column, at
// every size. Eigen's public `c.noalias() += a * b` instead takes its coefficient-based product
// when rows + cols + depth < 20, which sums the elements before the output's first aligned
// address in another order than the rest: the same product written at another address rounds
// differently. Every determinism guarantee of the kernels (test_determinism.cpp) rests on this
// internal, undocumented entry point. An Eigen upgrade that renames it breaks the build; one that
// routes some sizes elsewhere, or lets the product split itself across threads, fails this test.
// What is guaranteed is reproducibility, not one summation order (Eigen's blocking, and with it
// the order, follows the machine's cache sizes): the same inputs give the same bits wherever the
// operands sit, whatever the thread count, from whichever thread, however often. On this build
// float runs the AVX-512 micro-kernel where the machine has it; the same guarantee is checked.

// A [rows x cols] block at `offset` elements past a 64-byte boundary, with a padded row stride
// (cols + 3) and the padding set to a sentinel.
template <class T>
struct Placed {
  std::vector<T> storage;
  T* data;
  Index rows, cols, stride;
  Placed(const Matrix<T>& value, Index offset)
      : storage(std::size_t(value.rows() * (value.cols() + 3) + offset) + 64 / sizeof(T), T(-7)),
        rows(value.rows()),
        cols(value.cols()),
        stride(value.cols() + 3) {
    const auto address = reinterpret_cast<std::uintptr_t>(storage.data());
    const std::uintptr_t aligned = (address + 63) / 64 * 64;
    data = storage.data() + (aligned - address) / sizeof(T) + std::size_t(offset);
    for (Index i = 0; i < rows; ++i)
      for (Index j = 0; j < cols; ++j) data[i * stride + j] = value(i, j);
  }
  Matrix<T> value() const {
    Matrix<T> out(rows, cols);
    for (Index i = 0; i < rows; ++i)
      for (Index j = 0; j < cols; ++j) out(i, j) = data[i * stride + j];
    return out;
  }
};

// gemm with A, B (each row-major, or column-major stored as its transpose) and C all placed at
// `offset` elements past a 64-byte boundary; returns C.
template <class T>
Matrix<T> placed_product(const Matrix<T>& a, const Matrix<T>& b, const Matrix<T>& c0,
                         bool a_columns, bool b_columns, bool accumulate, Index offset) {
  const Placed<T> pa(a_columns ? Matrix<T>(a.transpose()) : a, offset);
  const Placed<T> pb(b_columns ? Matrix<T>(b.transpose()) : b, offset);
  Placed<T> pc(c0, offset);
  ConstView<T> av{pa.data, pa.rows, pa.cols, pa.stride, 1};
  ConstView<T> bv{pb.data, pb.rows, pb.cols, pb.stride, 1};
  if (a_columns) av = av.transposed();
  if (b_columns) bv = bv.transposed();
  linrope::detail::gemm(av, bv, View<T>{pc.data, pc.rows, pc.cols, pc.stride},
                        write_of(accumulate));
  return pc.value();
}

// Bytes, not values: +0 and -0 differ.
template <class T>
bool same_bits(const Matrix<T>& x, const Matrix<T>& y) {
  return x.rows() == y.rows() && x.cols() == y.cols() &&
         std::memcmp(x.data(), y.data(), sizeof(T) * std::size_t(x.size())) == 0;
}

template <class T>
void check_eigen_path_determinism() {
  struct Case {
    Index m, n, k;
  };
  // Small products where rows + cols + depth < 20 (the coefficient-based product's range), one
  // row or column (GEMV), a dot product, and products across Eigen's register and cache blocks.
  const Case cases[] = {{2, 3, 4}, {3, 5, 7},  {4, 4, 4},     {1, 6, 5},     {6, 1, 5},
                        {1, 1, 9}, {7, 9, 33}, {65, 67, 300}, {100, 45, 257}};
  // Every element offset within 64 bytes: all alignments of A, B and C.
  const Index offsets = Index(64 / sizeof(T));
  std::uint64_t seed = 4000;
  for (const Case c : cases)
    for (int order = 0; order < 4; ++order)
      for (const bool accumulate : {false, true}) {
        const bool a_columns = order & 1, b_columns = order & 2;
        CAPTURE(c.m);
        CAPTURE(c.n);
        CAPTURE(c.k);
        CAPTURE(a_columns);
        CAPTURE(b_columns);
        CAPTURE(accumulate);
        const Matrix<T> a = linrope::testing::gaussian(c.m, c.k, seed).template cast<T>();
        const Matrix<T> b = linrope::testing::gaussian(c.k, c.n, seed + 1).template cast<T>();
        const Matrix<T> c0 = linrope::testing::gaussian(c.m, c.n, seed + 2).template cast<T>();
        seed += 3;
        const auto at = [&](Index offset) {
          return placed_product(a, b, c0, a_columns, b_columns, accumulate, offset);
        };
        const Matrix<T> first = [&] {
          const linrope::testing::ThreadCount one(1);
          return at(0);
        }();
        // Every alignment, and the first one again (repeated calls).
        for (Index offset = 0; offset <= offsets; ++offset) {
          CAPTURE(offset);
          CHECK(same_bits(at(offset % offsets), first));
        }
        // OpenMP thread counts 2 to 4 (gemm is single-threaded: Eigen is built with
        // EIGEN_DONT_PARALLELIZE, whose removal would let it split the product by the count).
        for (const int threads : {2, 3, 4}) {
          CAPTURE(threads);
          const linrope::testing::ThreadCount count(threads);
          CHECK(same_bits(at(1), first));
        }
        // Called from two threads at once, each at its own alignment (and its own per-thread
        // packing buffers on the AVX-512 float path).
        Matrix<T> from_thread[2];
        std::thread t0([&] { from_thread[0] = at(2); });
        std::thread t1([&] { from_thread[1] = at(3); });
        t0.join();
        t1.join();
        CHECK(same_bits(from_thread[0], first));
        CHECK(same_bits(from_thread[1], first));
      }
}

TEST_CASE(
    "gemm's Eigen path (Eigen::internal::generic_product_impl, GemmProduct): same bits at every "
    "alignment, thread count and call") {
  check_eigen_path_determinism<double>();
  check_eigen_path_determinism<float>();
}

}  // namespace
