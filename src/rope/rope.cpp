// RoPE: configuration checks, the scaled frequencies and angle tables a Rope holds, and the
// checked public calls (the kernel is rope_kernel.cpp).
#include <algorithm>
#include <array>
#include <cmath>
#include <linrope/rope.hpp>
#include <memory>
#include <numbers>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/check.hpp"
#include "common/enum_names.hpp"
#include "rope/rope_access.hpp"
#include "rope/rope_tables.hpp"

namespace linrope {
namespace detail {

RopeTables::RopeTables(std::span<const double> theta, [[maybe_unused]] RopeLayout layout) {
  const Index half = Index(theta.size());
  const Index B = block = block_size(half), R = B / 2;
  lo_cos.resize((2 * R + 1) * half);
  lo_sin.resize((2 * R + 1) * half);
  mid_cos.resize(2 * B * half);
  mid_sin.resize(2 * B * half);
  for (Index l = -R; l <= R; ++l)
    for (Index k = 0; k < half; ++k) {
      lo_cos[(l + R) * half + k] = std::cos(double(l) * theta[std::size_t(k)]);
      lo_sin[(l + R) * half + k] = std::sin(double(l) * theta[std::size_t(k)]);
    }
  for (Index l = 0; l < B; ++l)
    for (Index k = 0; k < half; ++k) {
      mid_cos[l * half + k] = std::cos(double(l * B) * theta[std::size_t(k)]);
      mid_sin[l * half + k] = std::sin(double(l * B) * theta[std::size_t(k)]);
      mid_cos[(B + l) * half + k] = std::cos(double(l * B * B) * theta[std::size_t(k)]);
      mid_sin[(B + l) * half + k] = std::sin(double(l * B * B) * theta[std::size_t(k)]);
    }
#if defined(__AVX512F__)  // only the AVX-512 float kernel reads them
  const Index v16 = whole16(half);
  const bool interleaved = layout == RopeLayout::Interleaved;
  lo_cos_f.resize((2 * R + 1) * v16);
  lo_sin_f.resize((2 * R + 1) * v16);
  for (Index l = 0; l <= 2 * R; ++l)
    for (Index s = 0; s < v16; ++s) {
      lo_cos_f[l * v16 + s] = float(lo_cos[l * half + float_slot_pair(s, interleaved)]);
      lo_sin_f[l * v16 + s] = float(lo_sin[l * half + float_slot_pair(s, interleaved)]);
    }
#endif
}

}  // namespace detail

namespace {

using detail::kMaxPosition;
constexpr std::string_view kFn = "Rope";

void check_config(const RopeConfig& c) {
  if (c.dim < 1) detail::throw_invalid(kFn, "dim is ", c.dim, " but expected dim >= 1");
  const Index r = c.rotary_dim == 0 ? c.dim : c.rotary_dim;
  if (r < 0 || r % 2 != 0)
    detail::throw_invalid(kFn, "rotary_dim is ", r, " but expected an even number >= 2",
                          c.rotary_dim == 0 ? " (rotary_dim = 0 means dim)" : "");
  if (r > c.dim)
    detail::throw_invalid(kFn, "rotary_dim is ", r, " but expected rotary_dim <= dim = ", c.dim);
  if (c.layout != RopeLayout::Interleaved && c.layout != RopeLayout::Half)
    detail::throw_invalid(kFn, "layout is ", static_cast<int>(c.layout),
                          " but expected a RopeLayout (0 Interleaved, 1 Half)");
  const int kind = static_cast<int>(c.scaling.kind);
  if (kind < 0 || kind > static_cast<int>(RopeScalingKind::Yarn))
    detail::throw_invalid(kFn, "scaling.kind is ", kind,
                          " but expected a RopeScalingKind (0 None, 1 Linear, 2 Ntk, 3 Yarn)");
  if (!std::isfinite(c.base) || c.base <= 0)
    detail::throw_invalid(kFn, "base is ", c.base, " but expected a finite base > 0");
  const RopeScaling& s = c.scaling;
  if (s.kind == RopeScalingKind::None) return;
  if (!std::isfinite(s.factor) || s.factor <= 0)
    detail::throw_invalid(kFn, "scaling.factor is ", s.factor, " but expected a finite factor > 0");
  if (s.kind == RopeScalingKind::Ntk && r <= 2)
    detail::throw_invalid(kFn, "rotary_dim is ", r,
                          " but Ntk scaling needs rotary_dim > 2 (base * s^(r/(r-2)))");
  if (s.kind == RopeScalingKind::Yarn) {
    if (s.original_max_position <= 0)
      detail::throw_invalid(kFn, "scaling.original_max_position is ", s.original_max_position,
                            " but Yarn needs original_max_position > 0");
    if (!std::isfinite(s.beta_fast) || !std::isfinite(s.beta_slow) || s.beta_fast <= s.beta_slow)
      detail::throw_invalid(kFn, "scaling.beta_fast is ", s.beta_fast, " and beta_slow is ",
                            s.beta_slow, " but Yarn needs finite beta_fast > beta_slow");
  }
}

}  // namespace

Rope::Rope(const RopeConfig& config) : config_(config) {
  check_config(config);
  rotary_dim_ = config.rotary_dim == 0 ? config.dim : config.rotary_dim;
  const Index half = rotary_dim_ / 2;
  const RopeScaling& s = config.scaling;
  double base = config.base;
  if (s.kind == RopeScalingKind::Ntk)
    base *= std::pow(s.factor, double(rotary_dim_) / double(rotary_dim_ - 2));
  theta_.resize(half);
  for (Index i = 0; i < half; ++i)
    theta_[i] = std::pow(base, -2.0 * double(i) / double(rotary_dim_));
  if (s.kind == RopeScalingKind::Linear) {
    for (double& t : theta_) t /= s.factor;
  } else if (s.kind == RopeScalingKind::Yarn) {
    for (double& t : theta_) {
      const double turns = double(s.original_max_position) * t / (2 * std::numbers::pi);
      const double gamma =
          std::clamp((turns - s.beta_slow) / (s.beta_fast - s.beta_slow), 0.0, 1.0);
      t = (1 - gamma) * t / s.factor + gamma * t;
    }
    if (s.factor > 1) magnitude_ = 0.1 * std::log(s.factor) + 1.0;
  }
  tables_ = std::make_shared<const detail::RopeTables>(theta_, config.layout);
}

namespace {
std::string_view function_name(detail::Turn turn) {
  return turn == detail::Turn::Apply     ? "Rope::apply"
         : turn == detail::Turn::Inverse ? "Rope::apply_inverse"
                                         : "Rope::apply_transpose";
}
}  // namespace

template <class T>
void Rope::apply_checked(Eigen::Ref<Matrix<T>> x, Index first_position, detail::Turn turn) const {
  const std::string_view fn = function_name(turn);
  if (x.cols() != config_.dim)
    detail::throw_invalid(fn, "x is ", detail::shape_of(x),
                          " but the rope has dim = ", config_.dim);
  if (first_position < -kMaxPosition || first_position > kMaxPosition ||
      x.rows() - 1 > kMaxPosition - first_position)
    detail::throw_invalid(fn, "first_position is ", first_position, " with ", x.rows(),
                          " rows but expected every position within +-2^53 = ", kMaxPosition);
  detail::RopeAccess::rotate_rows(*this, x.data(), x.rows(), x.outerStride(), first_position, turn);
}

template <class T>
void Rope::apply_checked(Eigen::Ref<Matrix<T>> x, std::span<const Index> positions,
                         detail::Turn turn) const {
  const std::string_view fn = function_name(turn);
  if (x.cols() != config_.dim)
    detail::throw_invalid(fn, "x is ", detail::shape_of(x),
                          " but the rope has dim = ", config_.dim);
  if (Index(positions.size()) != x.rows())
    detail::throw_invalid(fn, "positions has ", positions.size(), " entries but x has ", x.rows(),
                          " rows");
  for (std::size_t i = 0; i < positions.size(); ++i)
    if (positions[i] < -kMaxPosition || positions[i] > kMaxPosition)
      detail::throw_invalid(fn, "positions[", i, "] is ", positions[i],
                            " but expected a position within +-2^53 = ", kMaxPosition);
  detail::RopeAccess::rotate_rows(*this, x.data(), x.rows(), x.outerStride(), positions, turn);
}

using detail::Turn;
void Rope::apply(Eigen::Ref<MatrixF> x, Index p) const { apply_checked<float>(x, p, Turn::Apply); }
void Rope::apply(Eigen::Ref<MatrixD> x, Index p) const { apply_checked<double>(x, p, Turn::Apply); }
void Rope::apply(Eigen::Ref<MatrixF> x, std::span<const Index> p) const {
  apply_checked<float>(x, p, Turn::Apply);
}
void Rope::apply(Eigen::Ref<MatrixD> x, std::span<const Index> p) const {
  apply_checked<double>(x, p, Turn::Apply);
}
void Rope::apply_inverse(Eigen::Ref<MatrixF> x, Index p) const {
  apply_checked<float>(x, p, Turn::Inverse);
}
void Rope::apply_inverse(Eigen::Ref<MatrixD> x, Index p) const {
  apply_checked<double>(x, p, Turn::Inverse);
}
void Rope::apply_inverse(Eigen::Ref<MatrixF> x, std::span<const Index> p) const {
  apply_checked<float>(x, p, Turn::Inverse);
}
void Rope::apply_inverse(Eigen::Ref<MatrixD> x, std::span<const Index> p) const {
  apply_checked<double>(x, p, Turn::Inverse);
}
void Rope::apply_transpose(Eigen::Ref<MatrixF> x, Index p) const {
  apply_checked<float>(x, p, Turn::Transpose);
}
void Rope::apply_transpose(Eigen::Ref<MatrixD> x, Index p) const {
  apply_checked<double>(x, p, Turn::Transpose);
}
void Rope::apply_transpose(Eigen::Ref<MatrixF> x, std::span<const Index> p) const {
  apply_checked<float>(x, p, Turn::Transpose);
}
void Rope::apply_transpose(Eigen::Ref<MatrixD> x, std::span<const Index> p) const {
  apply_checked<double>(x, p, Turn::Transpose);
}

namespace {

constexpr std::array<const char*, 2> kLayoutNames = {"interleaved", "half"};
constexpr std::array<const char*, 4> kScalingNames = {"none", "linear", "ntk", "yarn"};

}  // namespace

const char* to_string(RopeLayout layout) {
  return detail::enum_name(layout, kLayoutNames, "RopeLayout");
}
RopeLayout rope_layout_from_string(std::string_view name) {
  return detail::enum_from_name<RopeLayout>(name, kLayoutNames, "rope_layout_from_string",
                                            "layout");
}
const char* to_string(RopeScalingKind kind) {
  return detail::enum_name(kind, kScalingNames, "RopeScalingKind");
}
RopeScalingKind rope_scaling_kind_from_string(std::string_view name) {
  return detail::enum_from_name<RopeScalingKind>(name, kScalingNames,
                                                 "rope_scaling_kind_from_string", "scaling");
}

}  // namespace linrope
