// Private: the matrix products of the attention kernels, C = A B or C += A B, on strided views.
//
// Every kernel's time goes mostly into products whose inner dimension is small (d = 64 for the
// feature projection, a block of 64-256 rows for the state update). On AVX-512 machines a packed
// micro-kernel of our own runs these at about twice the rate of Eigen's (whose 48 x 4 register
// tile is load-bound there); elsewhere, and for double, Eigen does the work. Single-threaded and
// deterministic: the same inputs give bitwise the same C whatever thread calls it.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <linrope/types.hpp>
#include <type_traits>
#include <vector>

namespace linrope::detail {

// A read-only matrix: element (i, j) at data[i * row_stride + j * col_stride]. One of the strides
// must be 1 (a row-major or column-major block), which is all the kernels need.
template <class T>
struct ConstView {
  const T* data;
  Index rows, cols, row_stride, col_stride;
  ConstView transposed() const { return {data, cols, rows, col_stride, row_stride}; }
};

// A writable row-major block: element (i, j) at data[i * row_stride + j].
template <class T>
struct View {
  T* data;
  Index rows, cols, row_stride;
};

// Views of Eigen matrices, maps and blocks (anything with data() and strides).
template <class M>
ConstView<typename M::Scalar> const_view(const M& m) {
  if constexpr (M::IsRowMajor)
    return {m.data(), m.rows(), m.cols(), m.outerStride(), m.innerStride()};
  else
    return {m.data(), m.rows(), m.cols(), m.innerStride(), m.outerStride()};
}
template <class M>
View<typename std::remove_reference_t<M>::Scalar> view(M&& m) {
  static_assert(std::remove_reference_t<M>::IsRowMajor, "a product's output must be row-major");
  return {m.data(), m.rows(), m.cols(), m.outerStride()};
}

// Memory the caller touches right after a product (the next block of its inputs, the rows it is
// about to write): the product fetches it into L2 while it computes, so that the fetch overlaps
// the arithmetic instead of stalling the pass that reads it. Ranges are fetched in order, one
// cache line per two steps of the micro-kernel's inner loop, so a product [m x k] x [k x n] has
// room for at least ceil(m / 8) ceil(n / 32) k / 2 lines (a 512-key block's state update at
// d = 64: 4096 lines, exactly its next keys and values; rows past a multiple of 8 add up to
// three more tiles); what does not fit is not fetched. The result is unaffected. Only the AVX-512
// float kernel fetches (Eigen's products ignore it).
struct Prefetch {
  struct Range {
    const void* data = nullptr;
    Index bytes = 0;
  };
  std::array<Range, 2> ranges{};
};

// The cache lines of a Prefetch, handed out in order a run at a time: what the micro-kernel
// fetches. Every line a range touches is covered, from the one holding its first byte to the one
// holding its last. Lines are numbered (address / kLineBytes), so no pointer is ever formed
// outside the caller's arrays.
class LineFeed {
 public:
  static constexpr Index kLineBytes = 64;
  struct Run {
    std::uintptr_t first = 0;  // line number
    Index count = 0;
  };

  explicit LineFeed(const Prefetch& next) {
    for (const auto& range : next.ranges) {
      if (range.bytes <= 0) continue;
      const auto start = reinterpret_cast<std::uintptr_t>(range.data);
      next_[count_] = start / kLineBytes;
      end_[count_] = (start + std::uintptr_t(range.bytes) - 1) / kLineBytes + 1;
      ++count_;
    }
  }

  // The next at most `most` lines, all of one range (count 0 once none are left).
  Run take(Index most) {
    while (current_ < count_ && next_[current_] >= end_[current_]) ++current_;
    if (current_ == count_ || most <= 0) return {};
    const std::uintptr_t left = end_[current_] - next_[current_];
    const Run run{next_[current_], Index(std::min(left, std::uintptr_t(most)))};
    next_[current_] += std::uintptr_t(run.count);
    return run;
  }

 private:
  std::array<std::uintptr_t, 2> next_{}, end_{};  // lines [next, end) of each range still to go
  int count_ = 0, current_ = 0;
};

// What a product does to c: c = a b (Overwrite) or c += a b (Add).
enum class Write { Overwrite, Add };

// c = a b, or c += a b (`write`). Shapes must agree: a [m x k], b [k x n], c [m x n]; c must not
// overlap a or b. Never throws but std::bad_alloc (packing buffers, grown once per thread).
template <class T>
void gemm(ConstView<T> a, ConstView<T> b, View<T> c, Write write, Prefetch next = {});

// Whether float products run on the packed micro-kernel (and PackedRight<float> holds panels):
// float with AVX-512. Elsewhere a PackedRight is a row-major copy, which saves no work.
template <class T>
constexpr bool kPackedKernel =
#ifdef __AVX512F__
    std::is_same_v<T, float>;
#else
    false;
#endif

template <class T>
struct PackedBlock;

// Columns are packed in panels of this many: a PackedBlock starts at a multiple of it.
constexpr Index kPackedPanel = 32;

// A right-hand factor laid out once in the form gemm would otherwise rebuild on every call: for a
// fixed matrix used in many products (FAVOR+'s projection, multiplied by every block of 64-128
// rows, where repacking it cost about a third as much as the product itself). A copy of b, so it
// does not refer to b's memory afterwards.
template <class T>
class PackedRight {
 public:
  PackedRight() = default;
  explicit PackedRight(ConstView<T> b);
  Index rows() const { return rows_; }
  Index cols() const { return cols_; }
  const T* data() const { return data_.data(); }
  // Rows [0, rows) and columns [col0, col0 + cols) of b, multiplied from the packed form: for a
  // matrix packed once and used block by block (softmax's keys and values, a block of keys per
  // product: repacking them for every block of queries was ~6% of its backward). col0 must be a
  // multiple of kPackedPanel and, where the form holds panels (kPackedKernel), either b has at
  // most 256 rows or col0 is a multiple of 512 (its cache blocks): blockable(col0).
  bool blockable(Index col0) const;
  PackedBlock<T> block(Index rows, Index col0, Index cols) const;

 private:
  Index rows_ = 0, cols_ = 0;
  std::vector<T, Eigen::aligned_allocator<T>> data_;
};

template <class T>
struct PackedBlock {
  const PackedRight<T>* whole;
  Index rows, col0, cols;
};

// c = a b, or c += a b (`write`), b a block of a packed matrix: bitwise gemm's c on the block's
// view with AVX-512 (float); elsewhere Eigen multiplies the block of PackedRight's row-major copy.
template <class T>
void gemm(ConstView<T> a, const PackedBlock<T>& b, View<T> c, Write write);

// c = a b, or c += a b (`write`), with b packed beforehand. Float with AVX-512: bitwise the same c
// as gemm on b's view (the same panels through the same micro-kernel calls). Elsewhere (double, or
// no AVX-512) Eigen multiplies a contiguous row-major copy of b: bitwise gemm's c when b's view is
// itself contiguous and row-major (FAVOR+'s projection), otherwise equal up to rounding (Eigen
// may pick another product kernel for another layout, e.g. for m = 1).
template <class T>
void gemm(ConstView<T> a, const PackedRight<T>& b, View<T> c, Write write);

}  // namespace linrope::detail
