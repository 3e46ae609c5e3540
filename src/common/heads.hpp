// Private: what both batched attentions share over [batch, heads, n, d] views: shape checks,
// the slices of a view (and their rows as the kernels read them, whatever the layout), the
// finiteness checks, and the loop that spreads the slices over threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <limits>
#include <linrope/batched.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "common/block_cache.hpp"
#include "common/check.hpp"
#include "common/parallel.hpp"

namespace linrope::detail {

// "[B, H, n, d]". (A stream, not std::string concatenation: GCC 12 raises a false -Wrestrict on
// the latter, GCC bug 105329.)
template <class T>
std::string describe(const Heads<T>& h) {
  std::ostringstream s;
  s << '[' << h.batch << ", " << h.heads << ", " << h.n << ", " << h.d << ']';
  return s.str();
}

// Valid rows of batch b (the padding mask).
template <class T>
Index valid_rows(const Heads<T>& h, Index b) {
  return h.lengths ? h.lengths[b] : h.n;
}

// Row 0 of slice (b, head), and the distance from one of its rows to the next.
template <class T>
T* slice(const Heads<T>& h, Index b, Index head) {
  if (h.layout == HeadsLayout::BNHD) return h.data + (b * h.n * h.heads + head) * h.d;
  return h.data + (b * h.heads + head) * h.n * h.d;
}
template <class T>
Index row_stride(const Heads<T>& h) {
  return h.layout == HeadsLayout::BNHD ? h.heads * h.d : h.d;
}

// Copies `rows` rows of `d` values from rows `from_stride` apart to rows `to_stride` apart: one
// Eigen assignment, inlined and vectorised, rather than a memmove call per row of 16-64 values (the
// two measured alike, within the noise, in bench/head_copies_bound.py --layer).
template <class T>
void copy_rows(const T* from, Index from_stride, T* to, Index to_stride, Index rows, Index d) {
  using Rows = Eigen::Map<Matrix<T>, 0, Eigen::OuterStride<>>;
  using ConstRows = Eigen::Map<const Matrix<T>, 0, Eigen::OuterStride<>>;
  Rows(to, rows, d, Eigen::OuterStride<>(to_stride)) =
      ConstRows(from, rows, d, Eigen::OuterStride<>(from_stride));
}

// True when a slice's rows lie d apart already (BHND, or BNHD with one head): the kernels read
// and write them in place.
template <class T>
bool dense_rows(const Heads<T>& h) {
  return row_stride(h) == h.d;
}

// The [rows x d] values a slice's gathered rows take: none where they are dense. They come from
// the process-wide block cache (CachedArray), so that a training step's repeated shapes find their
// blocks again and release_cached_memory frees them, and go back when the slice is done. 64-byte
// aligned, as Scratch's blocks are: the kernels' vector loads of a row then split no more cache
// lines than they do in a BHND buffer (16-byte aligned buffers measured slower).
template <class T>
Index gathered_size(const Heads<T>& h, Index rows) {
  return dense_rows(h) ? 0 : rows * h.d;
}

// Rows [0, rows) of slice (b, head) as the dense [rows x d] block the single-head kernels read:
// the view's own memory where its rows are dense (dense_rows), else a gathered copy (with fewer
// slices than threads, made by the thread that hands each slice to all of them).
template <class T>
class SliceRows {
 public:
  SliceRows(const Heads<const T>& h, Index b, Index head, Index rows)
      : data_(slice(h, b, head)), gathered_(gathered_size(h, rows)) {
    if (gathered_size(h, rows) == 0) return;
    copy_rows(data_, row_stride(h), gathered_.get(), h.d, rows, h.d);
    data_ = gathered_.get();
  }
  const T* data() const { return data_; }

 private:
  const T* data_;
  CachedArray<T> gathered_;
};

// Where a kernel writes rows [0, rows) of slice (b, head) of an output: the view's own memory
// where its rows are dense; otherwise gathered rows, which write_back copies into the view's.
template <class T>
class SliceOutput {
 public:
  SliceOutput(const Heads<T>& h, Index b, Index head, Index rows)
      : view_(slice(h, b, head)),
        gathered_(gathered_size(h, rows)),
        data_(gathered_size(h, rows) == 0 ? view_ : gathered_.get()),
        d_(h.d),
        stride_(row_stride(h)),
        rows_(rows) {}
  T* data() const { return data_; }
  // The rows written, into the view (where they were gathered; dense views hold them already).
  void write_back() const {
    if (data_ != view_) copy_rows(data_, d_, view_, stride_, rows_, d_);
  }

 private:
  T* view_;
  CachedArray<T> gathered_;
  T* data_;
  Index d_, stride_, rows_;
};

// batch * heads * n * d, the elements a view spans (sizes already known non-negative), or throws
// if their bytes could not be addressed: every offset into the view would overflow.
template <class T>
Index checked_size(std::string_view fn, std::string_view name, const Heads<T>& h) {
  const Index sizes[] = {h.batch, h.heads, h.n, h.d};
  if (std::find(std::begin(sizes), std::end(sizes), 0) != std::end(sizes)) return 0;
  const Index limit = std::numeric_limits<Index>::max() / Index(sizeof(T));
  Index total = 1;
  for (const Index size : sizes) {
    if (total > limit / size)
      throw_invalid(fn, name, " is ", describe(h), " but expected at most ", limit,
                    " elements in all (batch * heads * n * d overflows)");
    total *= size;
  }
  return total;
}

template <class T>
void check_view(std::string_view fn, std::string_view name, const Heads<T>& h) {
  if (h.layout != HeadsLayout::BHND && h.layout != HeadsLayout::BNHD)
    throw_invalid(fn, name, ".layout is ", static_cast<int>(h.layout),
                  " but expected HeadsLayout::BHND or HeadsLayout::BNHD");
  if (h.batch < 0 || h.heads < 0 || h.n < 0 || h.d < 0)
    throw_invalid(fn, name, " is ", describe(h), " but expected non-negative sizes");
  if (checked_size(fn, name, h) > 0 && h.data == nullptr)
    throw_invalid(fn, name, ".data is null but ", name, " is ", describe(h));
  if (h.lengths)
    for (Index b = 0; b < h.batch; ++b)
      if (h.lengths[b] < 0 || h.lengths[b] > h.n)
        throw_invalid(fn, name, ".lengths[", b, "] is ", h.lengths[b],
                      " but expected a length in [0, ", h.n, "]");
}

// `name` (an output, or a backward's d_out and gradients) must be [q.batch, q.heads, n, d].
template <class T, class Q>
void check_shape(std::string_view fn, std::string_view name, const Heads<T>& h, const Heads<Q>& q,
                 Index n, Index d) {
  check_view(fn, name, h);
  if (h.batch != q.batch || h.heads != q.heads || h.n != n || h.d != d)
    throw_invalid(fn, name, " is ", describe(h), " but expected [", q.batch, ", ", q.heads, ", ", n,
                  ", ", d, "]");
}

// The inputs both attentions share: q [B,H,n,d], k [B,H,n_k,d], v [B,H,n_k,d_v].
template <class T>
void check_inputs(std::string_view fn, const Heads<const T>& q, const Heads<const T>& k,
                  const Heads<const T>& v) {
  check_view(fn, "q", q);
  check_view(fn, "k", k);
  check_view(fn, "v", v);
  const auto same_batch_heads = [&](std::string_view name, Index batch, Index heads,
                                    const std::string& shape) {
    if (batch != q.batch || heads != q.heads)
      throw_invalid(fn, name, " is ", shape, " but q has batch = ", q.batch, ", heads = ", q.heads);
  };
  same_batch_heads("k", k.batch, k.heads, describe(k));
  same_batch_heads("v", v.batch, v.heads, describe(v));
  if (k.d != q.d) throw_invalid(fn, "k is ", describe(k), " but q has d = ", q.d);
  if (v.n != k.n) throw_invalid(fn, "v is ", describe(v), " but k has n = ", k.n);
}

// True when the elements of two views share memory. Views are dense in either layout, so each
// spans [data, data + batch heads n d).
template <class A, class B>
bool overlaps(const Heads<A>& a, const Heads<B>& b) {
  const auto begin = [](const auto* p) { return reinterpret_cast<std::uintptr_t>(p); };
  const Index size_a = a.batch * a.heads * a.n * a.d, size_b = b.batch * b.heads * b.n * b.d;
  if (size_a == 0 || size_b == 0) return false;
  return begin(a.data) < begin(b.data + size_b) && begin(b.data) < begin(a.data + size_a);
}

// An output written while the inputs are still being read must not share their memory (an
// in-place call would read its own results): throws naming the pair. Shapes already checked.
template <class Out, class In>
void require_separate(std::string_view fn, std::string_view out_name, const Heads<Out>& out,
                      std::string_view in_name, const Heads<In>& in) {
  if (overlaps(out, in))
    throw_invalid(fn, out_name, " overlaps ", in_name, "; expected separate storage");
}

// The forwards' views: the inputs, and out [B,H,n,d_v], which overlaps none of them.
template <class T>
void check_heads(std::string_view fn, const Heads<const T>& q, const Heads<const T>& k,
                 const Heads<const T>& v, const Heads<T>& out) {
  check_inputs(fn, q, k, v);
  check_shape(fn, "out", out, q, q.n, v.d);
  require_separate(fn, "out", out, "q", q);
  require_separate(fn, "out", out, "k", k);
  require_separate(fn, "out", out, "v", v);
}

// The backwards' views: the inputs, d_out [B,H,n,d_v], and dq, dk, dv the shapes of q, k, v.
template <class T>
void check_backward_heads(std::string_view fn, const Heads<const T>& q, const Heads<const T>& k,
                          const Heads<const T>& v, const Heads<const T>& d_out, const Heads<T>& dq,
                          const Heads<T>& dk, const Heads<T>& dv) {
  check_inputs(fn, q, k, v);
  check_shape(fn, "d_out", d_out, q, q.n, v.d);
  check_shape(fn, "dq", dq, q, q.n, q.d);
  check_shape(fn, "dk", dk, q, k.n, k.d);
  check_shape(fn, "dv", dv, q, v.n, v.d);
  const auto separate_from_all = [&](std::string_view name, const Heads<T>& grad) {
    require_separate(fn, name, grad, "q", q);
    require_separate(fn, name, grad, "k", k);
    require_separate(fn, name, grad, "v", v);
    require_separate(fn, name, grad, "d_out", d_out);
  };
  separate_from_all("dq", dq);
  separate_from_all("dk", dk);
  separate_from_all("dv", dv);
  require_separate(fn, "dk", dk, "dq", dq);
  require_separate(fn, "dv", dv, "dq", dq);
  require_separate(fn, "dv", dv, "dk", dk);
}

// The rows of slice s of q, k or v within the lengths (v's are k's), where they lie.
template <class T>
Eigen::Map<const Matrix<T>, 0, Eigen::OuterStride<>> valid_slice(
    const Heads<const T>& h, Index s, const Heads<const T>& lengths_from) {
  const Index b = s / h.heads;
  return {slice(h, b, s % h.heads), valid_rows(lengths_from, b), h.d,
          Eigen::OuterStride<>(row_stride(h))};
}

// "q[b, h]": slice s of the view called `tensor`, for messages.
inline std::string slice_name(std::string_view tensor, Index s, Index heads) {
  std::ostringstream out;
  out << tensor << '[' << s / heads << ", " << s % heads << ']';
  return out.str();
}

// Throws naming the first non-finite value of slice s (q, then k, then v), if there is one.
template <class T>
void require_finite_slice(std::string_view fn, const Heads<const T>& q, const Heads<const T>& k,
                          const Heads<const T>& v, Index s) {
  require_finite(fn, slice_name("q", s, q.heads), valid_slice(q, s, q));
  require_finite(fn, slice_name("k", s, q.heads), valid_slice(k, s, k));
  require_finite(fn, slice_name("v", s, q.heads), valid_slice(v, s, k));
}

// Every valid row finite, checked before softmax runs (the linear kernels check as they read).
// The scan reads every input once, so the slices are scanned on all threads; the first offending
// slice in order is then reported (the same message whatever the thread count).
template <class T>
void require_finite_heads(std::string_view fn, const Heads<const T>& q, const Heads<const T>& k,
                          const Heads<const T>& v) {
  const Index slices = q.batch * q.heads;
  std::vector<char> finite(slices);
  parallel_for(slices, max_threads(), Schedule::Dynamic, [&](Index s) {
    finite[s] = all_finite(valid_slice(q, s, q)) && all_finite(valid_slice(k, s, k)) &&
                all_finite(valid_slice(v, s, k));
  });
  for (Index s = 0; s < slices; ++s)
    if (!finite[s]) require_finite_slice(fn, q, k, v, s);
}

// The same for one view `h` called `name` (a backward's d_out), its valid rows those of
// `lengths_from`.
template <class T>
void require_finite_view(std::string_view fn, std::string_view name, const Heads<const T>& h,
                         const Heads<const T>& lengths_from) {
  const Index slices = h.batch * h.heads;
  std::vector<char> finite(slices);
  parallel_for(slices, max_threads(), Schedule::Dynamic,
               [&](Index s) { finite[s] = all_finite(valid_slice(h, s, lengths_from)); });
  for (Index s = 0; s < slices; ++s)
    if (!finite[s])
      require_finite(fn, slice_name(name, s, h.heads), valid_slice(h, s, lengths_from));
}

// Runs body(b, h) for every slice, one slice per task on the OpenMP threads.
template <class Body>
void for_each_slice(Index batch, Index heads, Body body) {
  parallel_for(batch * heads, max_threads(), Schedule::Dynamic,
               [&](Index s) { body(s / heads, s % heads); });
}

// Runs run(b, h, threading) on every slice: with enough slices for every thread, one slice per
// thread (threading Serial); otherwise each slice in turn, with all threads (Parallel).
template <class Run>
void for_each_head(Index batch, Index heads, Run run) {
  if (batch * heads >= max_threads()) {
    for_each_slice(batch, heads, [&](Index b, Index h) { run(b, h, Threads::Serial); });
  } else {
    for (Index b = 0; b < batch; ++b)
      for (Index h = 0; h < heads; ++h) run(b, h, Threads::Parallel);
  }
}

// Zeros rows [from, n) of slice (b, head) of a view: a backward's gradients past the lengths.
template <class T>
void zero_rows_past(const Heads<T>& h, Index b, Index head, Index from) {
  T* data = slice(h, b, head);
  const Index stride = row_stride(h);
  for (Index i = from; i < h.n; ++i) std::fill_n(data + i * stride, h.d, T(0));
}

}  // namespace linrope::detail
