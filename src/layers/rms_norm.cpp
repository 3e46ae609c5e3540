// linrope::rms_norm and rms_norm_backward (include/linrope/normalization.hpp): one pass over each
// row, through packets that start at the row's first element (so a row's bits depend on its
// values and d alone, never on its address), rows in fixed blocks on linrope's threads.
#include <algorithm>
#include <cmath>
#include <linrope/normalization.hpp>
#include <string_view>
#include <vector>

#include "common/check.hpp"
#include "common/packet_map.hpp"
#include "common/parallel.hpp"

namespace linrope {
namespace {

namespace ei = Eigen::internal;
using detail::kPacketSize;
using detail::Packet;
using detail::shape_of;
using detail::throw_invalid;

// Rows per task, and per partial sum of d_weight: the partition depends on n alone, so d_weight's
// bits do not depend on the thread count. 256 rows of d <= 1024 are <= 1 MiB of x.
constexpr Index kRowBlock = 256;

// Row i's first element.
template <class M>
auto* row(M& m, Index i) {
  return m.data() + i * m.outerStride();
}

// f(j, count) for each packet of a row of d values: j its first column, count its width.
template <class T, class F>
void over_packets(Index d, F f) {
  for (Index j = 0; j < d; j += kPacketSize<T>) f(j, std::min(kPacketSize<T>, d - j));
}

template <class T>
T row_norm(const T* x, const T* w, T eps, T* y, Index d) {
  Packet<T> squares = ei::pset1<Packet<T>>(T(0));
  over_packets<T>(d, [&](Index j, Index count) {
    const Packet<T> v = detail::load_padded(x + j, count);
    squares = ei::padd(squares, ei::pmul(v, v));
  });
  const T inv_rms = T(1) / std::sqrt(ei::predux(squares) / T(d) + eps);
  const Packet<T> r = ei::pset1<Packet<T>>(inv_rms);
  over_packets<T>(d, [&](Index j, Index count) {
    detail::store_part(
        y + j,
        ei::pmul(ei::pmul(detail::load_padded(x + j, count), r), detail::load_padded(w + j, count)),
        count);
  });
  return inv_rms;
}

// d_x for one row, and its d_y x r added to d_weight_sum.
template <class T>
void row_backward(const T* x, const T* w, T inv_rms, const T* d_y, T* d_x, T* d_weight_sum,
                  Index d) {
  Packet<T> dot = ei::pset1<Packet<T>>(T(0));  // sum_j (d_y w)_j x_j
  over_packets<T>(d, [&](Index j, Index count) {
    const Packet<T> g =
        ei::pmul(detail::load_padded(d_y + j, count), detail::load_padded(w + j, count));
    dot = ei::padd(dot, ei::pmul(g, detail::load_padded(x + j, count)));
  });
  const Packet<T> r = ei::pset1<Packet<T>>(inv_rms);
  const Packet<T> c = ei::pset1<Packet<T>>(inv_rms * inv_rms * inv_rms * ei::predux(dot) / T(d));
  over_packets<T>(d, [&](Index j, Index count) {
    const Packet<T> v = detail::load_padded(x + j, count), dy = detail::load_padded(d_y + j, count);
    const Packet<T> g = ei::pmul(dy, detail::load_padded(w + j, count));
    detail::store_part(d_x + j, ei::psub(ei::pmul(r, g), ei::pmul(c, v)), count);
    detail::store_part(
        d_weight_sum + j,
        ei::padd(detail::load_padded(d_weight_sum + j, count), ei::pmul(ei::pmul(dy, v), r)),
        count);
  });
}

template <class T>
void check_row_shapes(std::string_view fn, const Eigen::Ref<const Matrix<T>>& x,
                      const Eigen::Ref<const Vector<T>>& weight) {
  if (x.cols() == 0) throw_invalid(fn, "x is ", shape_of(x), "; expected d >= 1 columns");
  if (weight.size() != x.cols())
    throw_invalid(fn, "weight has ", weight.size(), " elements but x is ", shape_of(x),
                  " (expected d = ", x.cols(), ")");
}

template <class T>
void check_same_shape(std::string_view fn, const char* name, Index rows, Index cols,
                      const Eigen::Ref<const Matrix<T>>& x) {
  if (rows != x.rows() || cols != x.cols())
    throw_invalid(fn, name, " is [", rows, " x ", cols, "] but x is ", shape_of(x),
                  "; expected the same shape");
}

void check_length(std::string_view fn, const char* name, Index size, Index expected) {
  if (size != expected)
    throw_invalid(fn, name, " has ", size, " elements but expected ", expected,
                  " (one per row of x)");
}

template <class T>
void rms_norm_checked(const Eigen::Ref<const Matrix<T>>& x,
                      const Eigen::Ref<const Vector<T>>& weight, T eps, Eigen::Ref<Matrix<T>> y,
                      Eigen::Ref<Vector<T>> inv_rms) {
  constexpr std::string_view fn = "rms_norm";
  check_row_shapes<T>(fn, x, weight);
  check_same_shape<T>(fn, "y", y.rows(), y.cols(), x);
  check_length(fn, "inv_rms", inv_rms.size(), x.rows());
  if (!(std::isfinite(eps) && eps > 0)) throw_invalid(fn, "eps is ", eps, " but expected > 0");
  if (detail::spans_overlap(y, x)) throw_invalid(fn, "y overlaps x; expected separate storage");
  if (detail::spans_overlap(y, weight))
    throw_invalid(fn, "y overlaps weight; expected separate storage");
  if (detail::spans_overlap(inv_rms, x) || detail::spans_overlap(inv_rms, weight) ||
      detail::spans_overlap(inv_rms, y))
    throw_invalid(fn, "inv_rms overlaps x, weight or y; expected separate storage");
  const Index n = x.rows(), d = x.cols();
  detail::for_each_index((n + kRowBlock - 1) / kRowBlock, detail::Threads::Parallel,
                         [&](Index block) {
                           const Index last = std::min(n, (block + 1) * kRowBlock);
                           for (Index i = block * kRowBlock; i < last; ++i)
                             inv_rms[i] = row_norm(row(x, i), weight.data(), eps, row(y, i), d);
                         });
}

template <class T>
void rms_norm_backward_checked(const Eigen::Ref<const Matrix<T>>& x,
                               const Eigen::Ref<const Vector<T>>& weight,
                               const Eigen::Ref<const Vector<T>>& inv_rms,
                               const Eigen::Ref<const Matrix<T>>& d_y, Eigen::Ref<Matrix<T>> d_x,
                               Eigen::Ref<Vector<T>> d_weight) {
  constexpr std::string_view fn = "rms_norm_backward";
  check_row_shapes<T>(fn, x, weight);
  check_length(fn, "inv_rms", inv_rms.size(), x.rows());
  check_same_shape<T>(fn, "d_y", d_y.rows(), d_y.cols(), x);
  check_same_shape<T>(fn, "d_x", d_x.rows(), d_x.cols(), x);
  if (d_weight.size() != x.cols())
    throw_invalid(fn, "d_weight has ", d_weight.size(), " elements but expected d = ", x.cols());
  if (detail::spans_overlap(d_x, x)) throw_invalid(fn, "d_x overlaps x; expected separate storage");
  if (detail::spans_overlap(d_x, d_y))
    throw_invalid(fn, "d_x overlaps d_y; expected separate storage");
  if (detail::spans_overlap(d_x, weight) || detail::spans_overlap(d_x, inv_rms))
    throw_invalid(fn, "d_x overlaps weight or inv_rms; expected separate storage");
  if (detail::spans_overlap(d_weight, x) || detail::spans_overlap(d_weight, weight) ||
      detail::spans_overlap(d_weight, inv_rms) || detail::spans_overlap(d_weight, d_y) ||
      detail::spans_overlap(d_weight, d_x))
    throw_invalid(fn, "d_weight overlaps an input or d_x; expected separate storage");
  const Index n = x.rows(), d = x.cols(), blocks = (n + kRowBlock - 1) / kRowBlock;
  std::vector<T> partial(std::size_t(blocks * d), T(0));  // block b's sum at b * d
  detail::for_each_index(blocks, detail::Threads::Parallel, [&](Index block) {
    T* sum = partial.data() + block * d;
    const Index last = std::min(n, (block + 1) * kRowBlock);
    for (Index i = block * kRowBlock; i < last; ++i)
      row_backward(row(x, i), weight.data(), inv_rms[i], row(d_y, i), row(d_x, i), sum, d);
  });
  d_weight.setZero();
  for (Index block = 0; block < blocks; ++block)
    for (Index j = 0; j < d; ++j) d_weight[j] += partial[std::size_t(block * d + j)];
}

}  // namespace

void rms_norm(const Eigen::Ref<const MatrixF>& x, const Eigen::Ref<const Vector<float>>& weight,
              float eps, Eigen::Ref<MatrixF> y, Eigen::Ref<Vector<float>> inv_rms) {
  rms_norm_checked<float>(x, weight, eps, y, inv_rms);
}
void rms_norm(const Eigen::Ref<const MatrixD>& x, const Eigen::Ref<const Vector<double>>& weight,
              double eps, Eigen::Ref<MatrixD> y, Eigen::Ref<Vector<double>> inv_rms) {
  rms_norm_checked<double>(x, weight, eps, y, inv_rms);
}
void rms_norm_backward(const Eigen::Ref<const MatrixF>& x,
                       const Eigen::Ref<const Vector<float>>& weight,
                       const Eigen::Ref<const Vector<float>>& inv_rms,
                       const Eigen::Ref<const MatrixF>& d_y, Eigen::Ref<MatrixF> d_x,
                       Eigen::Ref<Vector<float>> d_weight) {
  rms_norm_backward_checked<float>(x, weight, inv_rms, d_y, d_x, d_weight);
}
void rms_norm_backward(const Eigen::Ref<const MatrixD>& x,
                       const Eigen::Ref<const Vector<double>>& weight,
                       const Eigen::Ref<const Vector<double>>& inv_rms,
                       const Eigen::Ref<const MatrixD>& d_y, Eigen::Ref<MatrixD> d_x,
                       Eigen::Ref<Vector<double>> d_weight) {
  rms_norm_backward_checked<double>(x, weight, inv_rms, d_y, d_x, d_weight);
}

}  // namespace linrope
