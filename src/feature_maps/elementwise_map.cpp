// elu+1, relu and 1+cos: the element-wise feature maps.
#include <algorithm>
#include <cmath>

#include "common/packet_map.hpp"
#include "common/parallel.hpp"
#include "feature_maps/maps.hpp"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace linrope::detail {
namespace {

// exp(t) of a packet of t <= 0: Eigen's packet exp, and the overload below for float with AVX-512.
template <class Packet>
inline Packet pexp_nonpositive(const Packet& t) {
  return Eigen::internal::pexp(t);
}

#if defined(__AVX512F__)
// elu_plus_one's float packets: exp(t) for float t <= 0 (or NaN), 16 at a time (the map alone at
// 4096 x 64, one thread: 56.9 -> 52.6 us; exp in elu+1 attention's profile 14.6% -> 13.0%). The
// cephes polynomial of Eigen's generic pexp_float on r = t - m ln 2 (m = floor(t log2(e) + 1/2),
// ln 2 in two parts), with 2^m exp(r) rebuilt by one exact vscalefps, and no upper clamp
// (t <= 0). Subnormal results are correctly rounded and exp(t) rounds to 0 below ~-103.9. Eigen
// 3.4's AVX-512 pexp<Packet16f>, used before, builds 2^m from exponent bits and returns 0 below
// ~-87.3; its generic pexp_float (the portable build) clamps t at -88.7 and returns 2.9e-39 below.
inline __m512 pexp_nonpositive(const __m512& x) {
  const auto c = [](float v) { return _mm512_set1_ps(v); };
  // max returns its second operand when either is NaN: NaN stays NaN.
  const __m512 t = _mm512_max_ps(c(-104.0f), x);
  const __m512 m = _mm512_roundscale_ps(_mm512_fmadd_ps(t, c(1.44269504088896341f), c(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(m, c(-0.693359375f), t);
  r = _mm512_fmadd_ps(m, c(2.12194440e-4f), r);
  const __m512 r2 = _mm512_mul_ps(r, r), r3 = _mm512_mul_ps(r2, r);
  __m512 y = _mm512_fmadd_ps(c(1.9875691500E-4f), r, c(1.3981999507E-3f));
  __m512 y1 = _mm512_fmadd_ps(c(4.1665795894E-2f), r, c(1.6666665459E-1f));
  const __m512 y2 = _mm512_add_ps(r, c(1.0f));
  y = _mm512_fmadd_ps(y, r, c(8.3334519073E-3f));
  y1 = _mm512_fmadd_ps(y1, r, c(5.0000001201E-1f));
  y = _mm512_fmadd_ps(y, r3, y1);
  y = _mm512_fmadd_ps(y, r2, y2);
  return _mm512_scalef_ps(y, m);
}
#endif

// elu(x) + 1 over n contiguous values. elu(x) + 1 = x + 1 for x > 0, exp(x) otherwise, written as
// max(x, 0) + exp(min(x, 0)): the same roundings (x + 1, or exp(x) + 0), no overflow, and no
// select on a comparison (which made Eigen fall back to scalar code, 8 ns per element). Every
// element goes through the same packet exp (pexp_nonpositive), the tail too (map_packets), so
// that a value's features do not depend on where it sits.
template <class T>
void elu_plus_one(const T* x, T* out, Index n) {
  namespace ei = Eigen::internal;
  map_packets(x, out, n, [](const Packet<T>& v) {
    const Packet<T> zero = ei::pzero(v);
    return ei::padd(ei::pmax(v, zero), pexp_nonpositive(ei::pmin(v, zero)));
  });
}

class ElementwiseMap final : public FeatureMap {
 public:
  explicit ElementwiseMap(const FeatureMapConfig& config) : FeatureMap(config) {}

  Index output_dim() const override {
    return kind() == FeatureMapKind::OnePlusCosine ? input_dim() + 1 : input_dim();
  }
  // elu+1 and relu features are >= 0. The 1+cos features x/|x| are signed, but every kernel value
  // phi(q).phi(k) = 1 + cos(q, k) is >= 0, which is what the attention denominators rely on.
  bool nonnegative() const override { return true; }

  // Nothing to stabilise: every feature is at most max(x + 1, 1) (elu+1, relu) or 1 (1+cos), and
  // the attention kernels want these unscaled, so log_scale is exactly 0 and out == apply().
  void map_rows(const Eigen::Ref<const MatrixF>& x, Eigen::Ref<MatrixF> out, double* log_scale,
                bool parallel) const override {
    run<float>(x, out, parallel);
    if (log_scale) std::fill(log_scale, log_scale + x.rows(), 0.0);
  }
  void map_rows(const Eigen::Ref<const MatrixD>& x, Eigen::Ref<MatrixD> out, double* log_scale,
                bool parallel) const override {
    run<double>(x, out, parallel);
    if (log_scale) std::fill(log_scale, log_scale + x.rows(), 0.0);
  }

  void backward_rows(const Eigen::Ref<const MatrixF>& x, const Eigen::Ref<const MatrixF>& features,
                     const Eigen::Ref<const MatrixF>& g, Eigen::Ref<MatrixF> dx) const override {
    run_backward<float>(x, features, g, dx);
  }
  void backward_rows(const Eigen::Ref<const MatrixD>& x, const Eigen::Ref<const MatrixD>& features,
                     const Eigen::Ref<const MatrixD>& g, Eigen::Ref<MatrixD> dx) const override {
    run_backward<double>(x, features, g, dx);
  }

  void redraw(std::uint64_t seed) override { config_.seed = seed; }

 private:
  template <class T>
  void run(const Eigen::Ref<const Matrix<T>>& x, Eigen::Ref<Matrix<T>> out, bool parallel) const {
    const Index n = x.rows();
    const Index blocks = (n + kBlockRows - 1) / kBlockRows;
    for_each_index(blocks, parallel ? Threads::Parallel : Threads::Serial, [&](Index b) {
      const Index first = b * kBlockRows, rows = std::min(kBlockRows, n - first);
      const auto xb = x.middleRows(first, rows).array();
      auto ob = out.middleRows(first, rows);
      switch (kind()) {
        case FeatureMapKind::EluPlusOne:
          if (x.outerStride() == x.cols() && out.outerStride() == out.cols()) {
            // Contiguous blocks as one flat run: one vectorised loop instead of one per row of d
            // (measured 2.7 us instead of 5.4 for 256 x 64 floats).
            elu_plus_one(x.data() + first * x.cols(), out.data() + first * out.cols(),
                         rows * x.cols());
          } else {
            for (Index i = first; i < first + rows; ++i)
              elu_plus_one(x.data() + i * x.outerStride(), &out(i, 0), x.cols());
          }
          break;
        case FeatureMapKind::Relu:
          ob.array() = xb.max(T(0));
          break;
        default:
          for (Index i = first; i < first + rows; ++i)
            unit_row(x.data() + i * x.outerStride(), &out(i, 0));
          break;
      }
    });
  }

  // The gradient (log_scale is 0, so g is d_out and the features are phi(x) itself):
  //   elu+1  dx = g (x > 0 ? 1 : exp(x)), and exp(x) is the feature there; 1 at x = 0
  //   relu   dx = g (x > 0 ? 1 : 0)
  //   1+cos  dx = (g' - u (u . g')) / |x| with u = x / |x| (the features' first d) and g' the
  //          first d entries of g (the constant feature has no gradient); 0 at x = 0
  template <class T>
  void run_backward(const Eigen::Ref<const Matrix<T>>& x,
                    const Eigen::Ref<const Matrix<T>>& features,
                    const Eigen::Ref<const Matrix<T>>& g, Eigen::Ref<Matrix<T>> dx) const {
    const Index d = input_dim();
    namespace ei = Eigen::internal;
    // Row by row through packets (zip_packets), branch-free.
    const auto rows = [&](const auto& of_row, auto op) {
      for (Index i = 0; i < x.rows(); ++i)
        zip_packets(g.data() + i * g.outerStride(), of_row.data() + i * of_row.outerStride(),
                    dx.data() + i * dx.outerStride(), d, op);
    };
    switch (kind()) {
      case FeatureMapKind::EluPlusOne:  // the feature is x + 1 > 1 for x > 0, exp(x) <= 1 otherwise
        rows(features, [](const Packet<T>& grad, const Packet<T>& f) {
          return ei::pmul(grad, ei::pmin(f, ei::pset1<Packet<T>>(T(1))));
        });
        break;
      case FeatureMapKind::Relu:  // g where 0 < x, else 0: a mask
        rows(x, [](const Packet<T>& grad, const Packet<T>& v) {
          return ei::pand(grad, ei::pcmp_lt(ei::pzero(v), v));
        });
        break;
      default:
        for (Index i = 0; i < x.rows(); ++i) {
          const double norm = norm_of(x.data() + i * x.outerStride(), d);
          if (norm == 0) {
            dx.row(i).setZero();
            continue;
          }
          const T* u = features.data() + i * features.outerStride();
          const T* grad = g.data() + i * g.outerStride();
          const double along_u = dot_of(u, grad, d);
          for (Index j = 0; j < d; ++j)
            dx(i, j) = T((double(grad[j]) - double(u[j]) * along_u) / norm);
        }
        break;
    }
  }

  // |x| in double: directly for float (whose squares cannot leave double's range) and moderate
  // double rows, else as 2^e |x 2^-e| with 2^e the power of two nearest the largest |x_j|.
  template <class T>
  static double norm_of(const T* x, Index d) {
    const double sum = sum_of_squares(x, d);
    if (sum > 0x1.0p-900 && sum < 0x1.0p+900) return std::sqrt(sum);
    int e = 0;
    const double scaled = scaled_norm(x, d, e);
    return std::ldexp(scaled, e);
  }

  // |x 2^-e| with e the exponent of the largest |x_j| (0 and e = 0 for x = 0).
  template <class T>
  static double scaled_norm(const T* x, Index d, int& e) {
    double largest = 0;
    for (Index j = 0; j < d; ++j) largest = std::max(largest, std::abs(double(x[j])));
    e = 0;
    if (largest == 0) return 0;
    std::frexp(largest, &e);
    double scaled_sum = 0;
    for (Index j = 0; j < d; ++j)
      scaled_sum += std::ldexp(double(x[j]), -e) * std::ldexp(double(x[j]), -e);
    return std::sqrt(scaled_sum);
  }

  // 1+cos: out = [x / |x|, 1], and [0, ..., 0, 1] for x = 0, normalised in double. For float input
  // |x|^2 in double can neither overflow nor underflow. A double row whose |x|^2 leaves
  // [2^-900, 2^900] is first scaled exactly by the power of two 2^-e nearest its largest |x_j|.
  template <class T>
  void unit_row(const T* x, T* out) const {
    const Index d = input_dim();
    out[d] = T(1);
    const double sum = sum_of_squares(x, d);
    if (sum > 0x1.0p-900 && sum < 0x1.0p+900) {
      const double inv = 1.0 / std::sqrt(sum);
      for (Index j = 0; j < d; ++j) out[j] = T(double(x[j]) * inv);
      return;
    }
    int e = 0;
    const double scaled = scaled_norm(x, d, e);
    if (scaled == 0) {
      std::fill(out, out + d, T(0));
      return;
    }
    const double inv = 1.0 / scaled;
    for (Index j = 0; j < d; ++j) out[j] = T(std::ldexp(double(x[j]), -e) * inv);
  }
};

}  // namespace

std::unique_ptr<FeatureMap> make_elementwise_map(const FeatureMapConfig& config) {
  return std::make_unique<ElementwiseMap>(config);
}

}  // namespace linrope::detail
