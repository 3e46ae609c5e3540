// Feature maps: the seeded projection W (iid or Haar-orthogonal blocks) and the fused kernels
// behind FeatureMap::apply / apply_stabilized (one GEMM per block of rows, then one element-wise
// pass).
// (GCC 12's false -Wuninitialized in avx512fintrin.h, hit by Eigen's vectorised float sin/cos, is
// silenced for every target in CMakeLists.txt.)

#include <Eigen/QR>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <linrope/feature_maps.hpp>
#include <linrope/random.hpp>
#include <numbers>
#include <span>
#include <string>
#include <type_traits>

#include "common/check.hpp"
#include "common/gemm.hpp"
#include "common/packet_map.hpp"
#include "common/parallel.hpp"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace linrope {

const MatrixD& FeatureMap::projection() const {
  static const MatrixD empty;
  return empty;
}

namespace {

constexpr std::array<const char*, 6> kNames = {"elu+1",      "relu",  "favor+",
                                               "favor-trig", "1+cos", "favor-hyp"};

// Rows per block of the fused kernel: a float block of 128 x 256 features is 128 KiB, so the GEMM
// writes it and the element-wise pass reads it back while it is still in L2. Blocks are the unit of
// OpenMP work; a call with a single block (e.g. one chunk of an attention kernel) never starts a
// team.
constexpr Index kBlockRows = 128;

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
  detail::map_packets(x, out, n, [](const detail::Packet<T>& v) {
    const detail::Packet<T> zero = ei::pzero(v);
    return ei::padd(ei::pmax(v, zero), pexp_nonpositive(ei::pmin(v, zero)));
  });
}

// sum_j p[j]^2 in double. Eight independent accumulators let the compiler vectorise the loop (a
// single running sum is a serial chain it may not reorder); the result is deterministic per build.
template <class T>
double sum_of_squares(const T* p, Index d) {
  double acc[8] = {};
  Index j = 0;
  for (; j + 8 <= d; j += 8)
    for (int k = 0; k < 8; ++k) acc[k] += double(p[j + k]) * double(p[j + k]);
  for (; j < d; ++j) acc[0] += double(p[j]) * double(p[j]);
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

bool is_favor(FeatureMapKind kind) {
  return kind == FeatureMapKind::FavorPositive || kind == FeatureMapKind::FavorTrig ||
         kind == FeatureMapKind::FavorHyperbolic;
}

// W is drawn from linrope::Random (linrope/random.hpp): platform-independent Gaussians.

// W [f x d], in the order the stream is consumed:
//   iid:        W(i, j) for i = 0..f-1, j = 0..d-1 (row by row).
//   orthogonal: per block of d rows: a Gaussian G [d x d] row by row; Q R = G (Householder, in
//               double); Q <- Q diag(sign R_ii), the unique factor with R_ii > 0, Haar-distributed
//               (Mezzadri 2007: without the fold Eigen's Householder makes Q(0,0) < 0 always);
//               then, for each row r of the block that is kept (the last block is cut at f), the
//               row r of Q times the norm of d fresh Gaussians, or times sqrt(d) when regularized
//               (which consumes nothing).
MatrixD draw_projection(Index d, Index f, bool orthogonal, bool regularized, std::uint64_t seed) {
  Random random(seed);
  const auto gaussian = [&random] { return random.gaussian(); };
  MatrixD w(f, d);
  if (!orthogonal) {
    for (Index i = 0; i < f; ++i)
      for (Index j = 0; j < d; ++j) w(i, j) = gaussian();
    return w;
  }
  Eigen::MatrixXd g(d, d);
  for (Index first = 0; first < f; first += d) {
    for (Index r = 0; r < d; ++r)
      for (Index c = 0; c < d; ++c) g(r, c) = gaussian();
    const Eigen::HouseholderQR<Eigen::MatrixXd> qr(g);
    Eigen::MatrixXd q = qr.householderQ();
    for (Index c = 0; c < d; ++c)
      if (qr.matrixQR()(c, c) < 0) q.col(c) = -q.col(c);
    const Index rows = std::min(d, f - first);
    for (Index r = 0; r < rows; ++r) {
      double norm = std::sqrt(double(d));
      if (!regularized) {
        double sum = 0;
        for (Index j = 0; j < d; ++j) {
          const double z = gaussian();
          sum += z * z;
        }
        norm = std::sqrt(sum);
      }
      w.row(first + r) = q.row(r) * norm;
    }
  }
  return w;
}

// ---- Argument checks ----------------------------------------------------------------------------

template <class T>
bool overlaps(const Eigen::Ref<const Matrix<T>>& x, const Eigen::Ref<Matrix<T>>& out) {
  if (x.size() == 0 || out.size() == 0) return false;
  const auto begin = [](const T* p) { return reinterpret_cast<std::uintptr_t>(p); };
  const auto end = [&](const T* p, Index rows, Index cols, Index stride) {
    return begin(p + (rows - 1) * stride + cols);
  };
  return begin(x.data()) < end(out.data(), out.rows(), out.cols(), out.outerStride()) &&
         begin(out.data()) < end(x.data(), x.rows(), x.cols(), x.outerStride());
}

// Every check runs before any work (and so before any parallel region).
template <class T>
void check_arguments(const FeatureMap& map, std::string_view fn,
                     const Eigen::Ref<const Matrix<T>>& x, const Eigen::Ref<Matrix<T>>& out,
                     const std::span<double>* log_scale) {
  if (x.cols() != map.input_dim())
    detail::throw_invalid(fn, "x is ", detail::shape_of(x), " but input_dim is ", map.input_dim());
  const Index m = map.output_dim();
  if (out.rows() != x.rows() || out.cols() != m)
    detail::throw_invalid(fn, "out is ", detail::shape_of(out), " but expected ",
                          detail::Shape{x.rows(), m}, " (x.rows() x output_dim() of ",
                          to_string(map.kind()), ")");
  if (log_scale && Index(log_scale->size()) != x.rows())
    detail::throw_invalid(fn, "log_scale has size ", log_scale->size(), " but expected ", x.rows(),
                          " (x.rows())");
  if (overlaps<T>(x, out)) {
    // elu+1 and relu are element-wise, so exactly the same storage is fine.
    const bool in_place =
        x.data() == out.data() && x.outerStride() == out.outerStride() &&
        (map.kind() == FeatureMapKind::EluPlusOne || map.kind() == FeatureMapKind::Relu);
    if (!in_place)
      detail::throw_invalid(fn, "out overlaps x; expected separate storage (only elu+1 and relu ",
                            "may map x in place)");
  }
  detail::require_finite(fn, "x", x);
}

// ---- Deterministic maps -------------------------------------------------------------------------

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

  void redraw(std::uint64_t seed) override { config_.seed = seed; }

 private:
  template <class T>
  void run(const Eigen::Ref<const Matrix<T>>& x, Eigen::Ref<Matrix<T>> out, bool parallel) const {
    const Index n = x.rows();
    const Index blocks = (n + kBlockRows - 1) / kBlockRows;
    detail::for_each_index(blocks, parallel, [&](Index b) {
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
    double largest = 0;
    for (Index j = 0; j < d; ++j) largest = std::max(largest, std::abs(double(x[j])));
    if (largest == 0) {
      std::fill(out, out + d, T(0));
      return;
    }
    int e = 0;
    std::frexp(largest, &e);
    double scaled_sum = 0;
    for (Index j = 0; j < d; ++j)
      scaled_sum += std::ldexp(double(x[j]), -e) * std::ldexp(double(x[j]), -e);
    const double inv = 1.0 / std::sqrt(scaled_sum);
    for (Index j = 0; j < d; ++j) out[j] = T(std::ldexp(double(x[j]), -e) * inv);
  }
};

// ---- Favor maps ---------------------------------------------------------------------------------
//
// With x' = x d^(-1/4), u = W x' (f projections), h = |x'|^2 / 2 = |x|^2 / (2 sqrt d):
//   favor+     phi_l = exp(u_l - h) / sqrt(f)
//   favor-trig phi   = exp(h) / sqrt(f) [sin u, cos u]
//   favor-hyp  phi   = exp(-h) / sqrt(2f) [exp(u), exp(-u)]
// apply_stabilized writes out = phi * exp(-log_scale[i]); per row i (c = max_l |u_l| for hyp):
//   favor+      log_scale = max_l u_l - h - ln(f) / 2    out_l = exp(u_l - max_l u_l)
//   favor-hyp   log_scale = c - h - ln(2f) / 2           out = [exp(u - c), exp(-u - c)]
//   favor-trig  log_scale = h - ln(f) / 2                out = [sin u, cos u]
// so the largest feature of a row is exactly 1 for favor+ and favor-hyp, and in [1/sqrt 2, 1] for
// favor-trig (sin^2 + cos^2 = 1); the whole scale lives in log_scale, in double.
//
// Precision: W is pre-scaled by d^(-1/4) in double and rounded once to T; h is accumulated in
// double from the T inputs; the constants (h + ln(f)/2, ...) are formed in double and rounded once
// to T. Float range: the GEMM cannot overflow unless |x'| max_l |w_l| > FLT_MAX; a row where that
// bound exceeds 1e36 is recomputed in double from the double W, so float features are finite for
// every finite float x. Double: finite while |x| < ~1e150 (beyond that |x|^2 itself leaves double
// range).
class FavorMap final : public FeatureMap {
 public:
  explicit FavorMap(const FeatureMapConfig& config) : FeatureMap(config) { draw(); }

  Index output_dim() const override {
    return kind() == FeatureMapKind::FavorPositive ? num_features() : 2 * num_features();
  }
  bool nonnegative() const override { return kind() != FeatureMapKind::FavorTrig; }
  const MatrixD& projection() const override { return w_; }

  void map_rows(const Eigen::Ref<const MatrixF>& x, Eigen::Ref<MatrixF> out, double* log_scale,
                bool parallel) const override {
    run<float>(x, out, log_scale, parallel);
  }
  void map_rows(const Eigen::Ref<const MatrixD>& x, Eigen::Ref<MatrixD> out, double* log_scale,
                bool parallel) const override {
    run<double>(x, out, log_scale, parallel);
  }

  void redraw(std::uint64_t seed) override {
    config_.seed = seed;
    draw();
  }

 private:
  Index num_features() const { return config_.num_features; }

  void draw() {
    const Index d = input_dim();
    w_ = draw_projection(d, num_features(), config_.orthogonal, config_.regularized, config_.seed);
    wt_d_ = w_.transpose() * std::pow(double(d), -0.25);
    wt_d_packed_ = detail::PackedRight<double>(detail::const_view(wt_d_));
    const MatrixF wt_f = wt_d_.cast<float>();
    wt_f_packed_ = detail::PackedRight<float>(detail::const_view(wt_f));
    max_row_norm_ = w_.rowwise().norm().maxCoeff();
  }

  template <class T>
  const detail::PackedRight<T>& scaled_transpose() const {
    if constexpr (std::is_same_v<T, float>)
      return wt_f_packed_;
    else
      return wt_d_packed_;
  }

  // x [n x d] -> out [n x m]; log_scale == nullptr means unstabilised (apply).
  template <class T>
  void run(const Eigen::Ref<const Matrix<T>>& x, Eigen::Ref<Matrix<T>> out, double* log_scale,
           bool parallel) const {
    const Index n = x.rows(), d = input_dim(), f = num_features();
    const detail::PackedRight<T>& wt = scaled_transpose<T>();
    const double inv_two_sqrt_d = 0.5 / std::sqrt(double(d));
    // |u_l| <= |x'| |w_l| bounds every partial sum of the GEMM too (Cauchy-Schwarz on |x'_j w_lj|).
    const double projection_bound = std::pow(double(d), -0.25) * max_row_norm_;
    const Index blocks = (n + kBlockRows - 1) / kBlockRows;
    detail::for_each_index(blocks, parallel, [&](Index b) {
      const Index first = b * kBlockRows, rows = std::min(kBlockRows, n - first);
      detail::gemm(detail::const_view(x.middleRows(first, rows)), wt,
                   detail::view(out.middleRows(first, rows).leftCols(f)), false);
      for (Index i = first; i < first + rows; ++i) {
        const double squared = sum_of_squares(x.data() + i * x.outerStride(), d);
        const double h = squared * inv_two_sqrt_d;
        double scale = 0;
        if (std::is_same_v<T, float> && std::sqrt(squared) * projection_bound > 1e36) {
          // Rare: the float GEMM may have overflowed; redo this row in double (allocates).
          Vector<double> row(output_dim());
          row.head(f) = wt_d_.transpose() * x.row(i).transpose().template cast<double>();
          scale = finish_row<double>(row.data(), h, log_scale != nullptr);
          for (Index l = 0; l < row.size(); ++l) out(i, l) = T(row[l]);
        } else {
          scale = finish_row<T>(&out(i, 0), h, log_scale != nullptr);
        }
        if (log_scale) log_scale[i] = scale;
      }
    });
  }

  // row[0, f) holds u on entry; on exit row[0, m) holds the features of one row. Returns log_scale.
  // The exponentials, sines and cosines go through detail::exp_shifted, sin_of and cos_of, so that
  // a row's features are the same bits wherever the row sits (packet_map.hpp).
  template <class T>
  double finish_row(T* row, double h, bool stabilized) const {
    using Array = Eigen::Array<T, 1, Eigen::Dynamic>;
    const Index f = num_features();
    Eigen::Map<Array> u(row, f);
    const double half_log_f = 0.5 * std::log(double(f));
    switch (kind()) {
      case FeatureMapKind::FavorPositive: {
        if (!stabilized) {
          detail::exp_shifted(row, row, f, T(h + half_log_f));
          return 0;
        }
        const T top = u.maxCoeff();
        detail::exp_shifted(row, row, f, top);
        return double(top) - h - half_log_f;
      }
      case FeatureMapKind::FavorHyperbolic: {
        const double half_log_2f = 0.5 * std::log(2.0 * double(f));
        const T c = stabilized ? u.abs().maxCoeff() : T(h + half_log_2f);
        Eigen::Map<Array>(row + f, f) = -u;  // exact
        detail::exp_shifted(row + f, row + f, f, c);
        detail::exp_shifted(row, row, f, c);
        return stabilized ? double(c) - h - half_log_2f : 0;
      }
      default: {  // FavorTrig
        detail::cos_of(row, row + f, f);
        detail::sin_of(row, row, f);
        if (!stabilized) {
          const T scale = T(std::exp(h - half_log_f));
          Eigen::Map<Array>(row, 2 * f) *= scale;  // one rounding per element, like the scalar path
          return 0;
        }
        return h - half_log_f;
      }
    }
  }

  MatrixD w_;     // [f x d], as drawn
  MatrixD wt_d_;  // [d x f] = d^(-1/4) W^T: x W'^T is then W x' with the d^(-1/4) folded in
  // wt_d_, and wt_d_ rounded once to float, in the form the products read (packed once, not per
  // block of rows)
  detail::PackedRight<double> wt_d_packed_;
  detail::PackedRight<float> wt_f_packed_;
  double max_row_norm_ = 0;
};

}  // namespace

void FeatureMap::apply(const Eigen::Ref<const MatrixF>& x, Eigen::Ref<MatrixF> out) const {
  check_arguments<float>(*this, "FeatureMap::apply", x, out, nullptr);
  map_rows(x, out, nullptr, /*parallel=*/true);
}
void FeatureMap::apply(const Eigen::Ref<const MatrixD>& x, Eigen::Ref<MatrixD> out) const {
  check_arguments<double>(*this, "FeatureMap::apply", x, out, nullptr);
  map_rows(x, out, nullptr, /*parallel=*/true);
}
void FeatureMap::apply_stabilized(const Eigen::Ref<const MatrixF>& x, Eigen::Ref<MatrixF> out,
                                  std::span<double> log_scale) const {
  check_arguments<float>(*this, "FeatureMap::apply_stabilized", x, out, &log_scale);
  map_rows(x, out, log_scale.data(), /*parallel=*/true);
}
void FeatureMap::apply_stabilized(const Eigen::Ref<const MatrixD>& x, Eigen::Ref<MatrixD> out,
                                  std::span<double> log_scale) const {
  check_arguments<double>(*this, "FeatureMap::apply_stabilized", x, out, &log_scale);
  map_rows(x, out, log_scale.data(), /*parallel=*/true);
}

std::unique_ptr<FeatureMap> make_feature_map(const FeatureMapConfig& config) {
  constexpr std::string_view fn = "make_feature_map";
  const int kind = static_cast<int>(config.kind);
  if (kind < 0 || kind >= int(kNames.size()))
    detail::throw_invalid(fn, "kind is ", kind, " but expected a FeatureMapKind in [0, ",
                          kNames.size() - 1, "]");
  if (config.input_dim < 1)
    detail::throw_invalid(fn, "input_dim is ", config.input_dim, " but expected input_dim >= 1");
  if (is_favor(config.kind)) {
    if (config.num_features < 1)
      detail::throw_invalid(fn, "num_features is ", config.num_features,
                            " but expected num_features >= 1 for ", to_string(config.kind));
    return std::make_unique<FavorMap>(config);
  }
  return std::make_unique<ElementwiseMap>(config);
}

const char* to_string(FeatureMapKind kind) {
  const int k = static_cast<int>(kind);
  if (k < 0 || k >= int(kNames.size()))
    detail::throw_invalid("to_string", "FeatureMapKind is ", k, " but expected a value in [0, ",
                          kNames.size() - 1, "]");
  return kNames[std::size_t(k)];
}

FeatureMapKind feature_map_kind_from_string(std::string_view name) {
  for (std::size_t k = 0; k < kNames.size(); ++k)
    if (name == kNames[k]) return static_cast<FeatureMapKind>(k);
  std::string valid;
  for (const char* known : kNames) valid += (valid.empty() ? "" : ", ") + std::string(known);
  detail::throw_invalid("feature_map_kind_from_string", "unknown feature map \"", name,
                        "\"; expected one of ", valid);
}

}  // namespace linrope
