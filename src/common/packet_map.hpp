// Private: element-wise functions whose result for a value never depends on where it sits.
//
// Eigen's vectorised assignment handles the elements before the first aligned address with scalar
// code (std::exp, std::sin, ...), and the rest with its packet code, which rounds differently. So
// `row = row.exp()` gives other bits for the same values at another address: a feature map's
// output would depend on where the caller's buffer starts. map_packets sends every element through
// the same packet code instead, the last partial packet padded, from the first element on.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <linrope/types.hpp>

namespace linrope::detail {

template <class T>
using Packet = typename Eigen::internal::packet_traits<T>::type;
template <class T>
inline constexpr Index kPacketSize = Eigen::internal::packet_traits<T>::size;

// The `count` (<= one packet) values at p, zeros after them; and the first `count` lanes of v
// stored at p. The tails of the loops below: a partial packet computed as a whole one.
template <class T>
Packet<T> load_padded(const T* p, Index count) {
  if (count == kPacketSize<T>) return Eigen::internal::ploadu<Packet<T>>(p);
  T padded[kPacketSize<T>] = {};
  std::copy(p, p + count, padded);
  return Eigen::internal::ploadu<Packet<T>>(padded);
}
template <class T>
void store_part(T* p, const Packet<T>& v, Index count) {
  if (count == kPacketSize<T>) return Eigen::internal::pstoreu(p, v);
  T whole[kPacketSize<T>];
  Eigen::internal::pstoreu(whole, v);
  std::copy(whole, whole + count, p);
}

// out[i] = op(x[i]) for i in [0, n), op taking and returning a Packet<T>. x and out may be the
// same array (not otherwise overlapping); no alignment is required of either.
template <class T, class Op>
void map_packets(const T* x, T* out, Index n, Op op) {
  for (Index i = 0; i < n; i += kPacketSize<T>) {
    const Index count = std::min(kPacketSize<T>, n - i);
    store_part(out + i, op(load_padded(x + i, count)), count);
  }
}

// out[i] = op(a[i], b[i]) for i in [0, n), as map_packets does with one input: the element-wise
// steps of the maps' backward, branch-free (a select written in C++ became a branch per element,
// half of them mispredicted, and was 22% of an elu+1 attention backward).
template <class T, class Op>
void zip_packets(const T* a, const T* b, T* out, Index n, Op op) {
  for (Index i = 0; i < n; i += kPacketSize<T>) {
    const Index count = std::min(kPacketSize<T>, n - i);
    store_part(out + i, op(load_padded(a + i, count), load_padded(b + i, count)), count);
  }
}

// exp(x - shift), sin(x), cos(x) over n values, element by element as map_packets does. Where
// Eigen has no packet sin or cos for T (double, in Eigen 3.4), std::sin and std::cos serve every
// element alike.
template <class T>
void exp_shifted(const T* x, T* out, Index n, T shift) {
  namespace ei = Eigen::internal;
  const Packet<T> s = ei::pset1<Packet<T>>(shift);
  map_packets(x, out, n, [&](const Packet<T>& p) { return ei::pexp(ei::psub(p, s)); });
}
template <class T>
void sin_of(const T* x, T* out, Index n) {
  if constexpr (Eigen::internal::packet_traits<T>::HasSin)
    map_packets(x, out, n, [](const Packet<T>& p) { return Eigen::internal::psin(p); });
  else
    std::transform(x, x + n, out, [](T v) { return T(std::sin(v)); });
}
template <class T>
void cos_of(const T* x, T* out, Index n) {
  if constexpr (Eigen::internal::packet_traits<T>::HasCos)
    map_packets(x, out, n, [](const Packet<T>& p) { return Eigen::internal::pcos(p); });
  else
    std::transform(x, x + n, out, [](T v) { return T(std::cos(v)); });
}

}  // namespace linrope::detail
