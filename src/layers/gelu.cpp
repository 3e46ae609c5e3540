// linrope::gelu and gelu_backward (include/linrope/activation.hpp): GELU(x) = x Phi(x), element
// by element, in fixed blocks of elements on linrope's threads.
#include <algorithm>
#include <cmath>
#include <linrope/activation.hpp>
#include <string_view>

#include "common/check.hpp"
#include "common/packet_map.hpp"
#include "common/parallel.hpp"

namespace linrope {
namespace {

namespace ei = Eigen::internal;
using detail::Packet;
using detail::throw_invalid;

// Elements per task: enough work (~10 us) to hide a task's start; results are element-wise, so
// the partition never changes a bit.
constexpr Index kBlock = Index(1) << 14;

constexpr double kInvSqrt2 = 0.70710678118654752440;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;

// Phi(x) and exp(-x^2 / 2) of a packet of floats. Abramowitz and Stegun 7.1.26:
// erfc(z) = t (a1 + t (a2 + t (a3 + t (a4 + t a5)))) exp(-z^2) + e(z), t = 1 / (1 + p z), z >= 0,
// |e(z)| <= 1.5e-7. With z = |x| / sqrt 2, E = erfc(z) and Phi(x) = E / 2 for x < 0, 1 - E / 2
// otherwise: |Phi - exact| <= 0.75e-7 plus rounding.
struct NormalTerms {
  Packet<float> cdf, gauss;  // Phi(x), exp(-x^2 / 2)
};
inline NormalTerms normal_terms(const Packet<float>& x) {
  const auto c = [](double v) { return ei::pset1<Packet<float>>(float(v)); };
  const Packet<float> z = ei::pmul(ei::pabs(x), c(kInvSqrt2));
  const Packet<float> t = ei::pdiv(c(1.0), ei::padd(c(1.0), ei::pmul(c(0.3275911), z)));
  Packet<float> poly = c(1.061405429);
  for (const double a : {-1.453152027, 1.421413741, -0.284496736, 0.254829592})
    poly = ei::padd(ei::pmul(poly, t), c(a));
  poly = ei::pmul(poly, t);
  const Packet<float> gauss = ei::pexp(ei::pnegate(ei::pmul(z, z)));
  const Packet<float> half_tail = ei::pmul(c(0.5), ei::pmul(poly, gauss));  // Phi(-|x|)
  const Packet<float> negative = ei::pcmp_lt(x, ei::pzero(x));
  return {ei::pselect(negative, half_tail, ei::psub(c(1.0), half_tail)), gauss};
}

void check_sizes(std::string_view fn, const char* a_name, Index a_size, const char* b_name,
                 Index b_size) {
  if (a_size != b_size)
    throw_invalid(fn, b_name, " has ", b_size, " elements but ", a_name, " has ", a_size);
}

// Whether out's elements partly overlap in's (the very same elements are allowed: in place).
template <class Out, class In>
bool partly_overlaps(const Out& out, const In& in) {
  return out.data() != in.data() && detail::spans_overlap(out, in);
}

// f(first, count) over [0, n) in kBlock pieces on linrope's threads.
template <class F>
void over_blocks(Index n, F f) {
  detail::for_each_index((n + kBlock - 1) / kBlock, detail::Threads::Parallel, [&](Index block) {
    const Index first = block * kBlock;
    f(first, std::min(kBlock, n - first));
  });
}

void gelu_range(const float* x, float* y, Index n) {
  detail::map_packets(x, y, n,
                      [](const Packet<float>& v) { return ei::pmul(v, normal_terms(v).cdf); });
}
void gelu_range(const double* x, double* y, Index n) {
  for (Index i = 0; i < n; ++i) y[i] = x[i] * 0.5 * std::erfc(-x[i] * kInvSqrt2);
}

void gelu_backward_range(const float* x, const float* d_y, float* d_x, Index n) {
  detail::zip_packets(x, d_y, d_x, n, [](const Packet<float>& v, const Packet<float>& g) {
    const NormalTerms terms = normal_terms(v);
    const Packet<float> density =
        ei::pmul(ei::pset1<Packet<float>>(float(kInvSqrt2Pi)), terms.gauss);
    return ei::pmul(g, ei::padd(terms.cdf, ei::pmul(v, density)));
  });
}
void gelu_backward_range(const double* x, const double* d_y, double* d_x, Index n) {
  for (Index i = 0; i < n; ++i) {
    const double cdf = 0.5 * std::erfc(-x[i] * kInvSqrt2);
    const double density = kInvSqrt2Pi * std::exp(-0.5 * x[i] * x[i]);
    d_x[i] = d_y[i] * (cdf + x[i] * density);
  }
}

template <class T>
void gelu_checked(const Eigen::Ref<const Vector<T>>& x, Eigen::Ref<Vector<T>> y) {
  constexpr std::string_view fn = "gelu";
  check_sizes(fn, "x", x.size(), "y", y.size());
  if (partly_overlaps(y, x))
    throw_invalid(fn, "y partly overlaps x; expected x itself or separate storage");
  over_blocks(x.size(), [&](Index first, Index count) {
    gelu_range(x.data() + first, y.data() + first, count);
  });
}

template <class T>
void gelu_backward_checked(const Eigen::Ref<const Vector<T>>& x,
                           const Eigen::Ref<const Vector<T>>& d_y, Eigen::Ref<Vector<T>> d_x) {
  constexpr std::string_view fn = "gelu_backward";
  check_sizes(fn, "x", x.size(), "d_y", d_y.size());
  check_sizes(fn, "x", x.size(), "d_x", d_x.size());
  if (partly_overlaps(d_x, x))
    throw_invalid(fn, "d_x partly overlaps x; expected x itself or separate storage");
  if (partly_overlaps(d_x, d_y))
    throw_invalid(fn, "d_x partly overlaps d_y; expected d_y itself or separate storage");
  over_blocks(x.size(), [&](Index first, Index count) {
    gelu_backward_range(x.data() + first, d_y.data() + first, d_x.data() + first, count);
  });
}

}  // namespace

void gelu(const Eigen::Ref<const Vector<float>>& x, Eigen::Ref<Vector<float>> y) {
  gelu_checked<float>(x, y);
}
void gelu(const Eigen::Ref<const Vector<double>>& x, Eigen::Ref<Vector<double>> y) {
  gelu_checked<double>(x, y);
}
void gelu_backward(const Eigen::Ref<const Vector<float>>& x,
                   const Eigen::Ref<const Vector<float>>& d_y, Eigen::Ref<Vector<float>> d_x) {
  gelu_backward_checked<float>(x, d_y, d_x);
}
void gelu_backward(const Eigen::Ref<const Vector<double>>& x,
                   const Eigen::Ref<const Vector<double>>& d_y, Eigen::Ref<Vector<double>> d_x) {
  gelu_backward_checked<double>(x, d_y, d_x);
}

}  // namespace linrope
