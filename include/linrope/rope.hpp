// linrope: Rotary Position Embedding (RoPE).
//
// A row x at position p has each rotary pair (a, b) rotated by the angle p * theta_i:
//   (a, b) -> (a cos(p theta_i) - b sin(p theta_i),  a sin(p theta_i) + b cos(p theta_i)),
//   theta_i = base^(-2i / r),  i = 0 .. r/2 - 1,  r = rotary_dim (even, r <= dim).
// Dimensions >= r pass through unchanged. So <R_m q, R_n k> depends on m - n only and |R_m x| = |x|
// (YaRN alone multiplies the rotated part by its magnitude, see RopeScaling).
//
// Which dimensions form pair i (c = a cosine slot, s = its sine partner, 0 = pass-through), for
// dim = 8 and rotary_dim = 4:
//   Interleaved (RoFormer, GPT-J):   pair i = (2i, 2i+1)      [c s c s 0 0 0 0]
//   Half        (GPT-NeoX, LLaMA):   pair i = (i, i + r/2)    [c c s s 0 0 0 0]
#pragma once

#include <linrope/types.hpp>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

namespace linrope {

namespace detail {
struct RopeAccess;
struct RopeTables;
enum class Turn;
}  // namespace detail

enum class RopeLayout { Interleaved, Half };

enum class RopeScalingKind { None, Linear, Ntk, Yarn };

// Context-extension scalings, with factor s = `factor` (s > 0; s = 1 is plain RoPE):
// - Linear (position interpolation, Chen et al. 2023): theta_i' = theta_i / s.
// - Ntk ("NTK-aware", bloc97): base' = base * s^(r / (r - 2)); needs r > 2.
// - Yarn (Peng et al. 2023, "NTK-by-parts" + attention temperature), following the paper's eq.
// 17-23
//   and the reference implementation: with L = original_max_position and the wavelength ratio
//   rho_i = L * theta_i / (2 pi) (how many turns pair i makes over the original context),
//     gamma_i = clamp((rho_i - beta_slow) / (beta_fast - beta_slow), 0, 1),
//     theta_i' = (1 - gamma_i) * theta_i / s + gamma_i * theta_i,
//   i.e. slow pairs (< beta_slow turns) are interpolated, fast ones (> beta_fast turns) kept; and
//   the rotated dimensions are multiplied by the magnitude 0.1 ln(s) + 1 (so logits scale by its
//   square; 1 for s <= 1, as in the reference implementation).
//   Needs original_max_position > 0 and beta_fast > beta_slow.
struct RopeScaling {
  RopeScalingKind kind = RopeScalingKind::None;
  double factor = 1.0;
  Index original_max_position = 0;
  double beta_fast = 32.0, beta_slow = 1.0;
};

struct RopeConfig {
  Index dim = 0;         // width of the rows the rope is applied to
  Index rotary_dim = 0;  // r: how many leading dimensions rotate (even); 0 means dim
  double base = 10000.0;
  RopeLayout layout = RopeLayout::Interleaved;
  RopeScaling scaling = {};
};

// A rope of fixed width. Immutable after construction, so one Rope may be shared across threads.
// Angles are exact to double precision at every position (at position 65536 a float angle is
// already off by ~4e-3 rad): cos/sin of each block of 16 or 32 rows come from small cached tables
// joined by angle additions in double, and each row's from one more angle addition: in float in
// the AVX-512 float kernel (cos and sin then within 4 * 2^-24), in double elsewhere (rounded once).
// So a float row at position 10^6 matches the exact rotation to within 12 * 2^-24 = 7.2e-7 of its
// largest entry times the magnitude (6 * 2^-24 without AVX-512; measured at d = 128: 3.2 and
// 2.2 * 2^-24).
// Throws std::invalid_argument on: dim < 1, odd rotary_dim, rotary_dim > dim, base <= 0 or not
// finite, factor <= 0 or not finite (scaled kinds), Ntk with r = 2, Yarn without
// original_max_position or with beta_fast <= beta_slow (or either not finite).
class Rope {
 public:
  explicit Rope(const RopeConfig& config);

  const RopeConfig& config() const { return config_; }
  Index dim() const { return config_.dim; }
  Index rotary_dim() const { return rotary_dim_; }
  // theta_i after scaling, i = 0 .. r/2 - 1.
  std::vector<double> frequencies() const { return theta_; }
  // Factor on the rotated dimensions: 0.1 ln(s) + 1 for Yarn with s > 1, 1 otherwise.
  double magnitude() const { return magnitude_; }

  // x [n x dim], in place: row i is at position first_position + i (first_position may be < 0).
  // O(n dim) time, O(dim) extra memory. Throws if x.cols() != dim or a position is beyond +-2^53
  // (where p itself is no longer exact in the double angle p theta).
  void apply(Eigen::Ref<MatrixF> x, Index first_position = 0) const;
  void apply(Eigen::Ref<MatrixD> x, Index first_position = 0) const;
  // Row i is at position positions[i] (packed sequences); positions.size() must equal x.rows(),
  // and every |positions[i]| <= 2^53.
  void apply(Eigen::Ref<MatrixF> x, std::span<const Index> positions) const;
  void apply(Eigen::Ref<MatrixD> x, std::span<const Index> positions) const;

  // R^-1 (rotation by -p theta_i, divided by the magnitude): apply_inverse(apply(x)) == x.
  void apply_inverse(Eigen::Ref<MatrixF> x, Index first_position = 0) const;
  void apply_inverse(Eigen::Ref<MatrixD> x, Index first_position = 0) const;
  void apply_inverse(Eigen::Ref<MatrixF> x, std::span<const Index> positions) const;
  void apply_inverse(Eigen::Ref<MatrixD> x, std::span<const Index> positions) const;

  // R^T, the gradient of apply: a rotation by -p theta_i times the magnitude. The same as
  // apply_inverse except under Yarn, whose magnitude != 1 makes R a scaled rotation.
  void apply_transpose(Eigen::Ref<MatrixF> x, Index first_position = 0) const;
  void apply_transpose(Eigen::Ref<MatrixD> x, Index first_position = 0) const;
  void apply_transpose(Eigen::Ref<MatrixF> x, std::span<const Index> positions) const;
  void apply_transpose(Eigen::Ref<MatrixD> x, std::span<const Index> positions) const;

 private:
  template <class T>
  void apply_checked(Eigen::Ref<Matrix<T>> x, Index first_position, detail::Turn turn) const;
  template <class T>
  void apply_checked(Eigen::Ref<Matrix<T>> x, std::span<const Index> positions,
                     detail::Turn turn) const;

  friend struct detail::RopeAccess;  // the attention kernels' unchecked rotations

  RopeConfig config_;
  Index rotary_dim_ = 0;
  double magnitude_ = 1.0;
  std::vector<double> theta_;
  // The kernel's angle tables (src/rope/rope_tables.hpp), built once, immutable, shared by copies.
  std::shared_ptr<const detail::RopeTables> tables_;
};

// The long-term decay of RoPE (RoFormer sec. 3.4.3, and the kexue.fm derivation):
//   decay(m) = (1 / (r/2)) * sum_{j=1}^{r/2} | sum_{i<j} exp(1j * m * theta_i) |,  theta_i =
//   base^(-2i/r)
// for relative distance m = 0 .. max_distance (returns max_distance + 1 values). The RoFormer blog
// plots it for dim 128, m = 0 .. 256. Uses frequencies() of the given rope, so scalings apply too.
std::vector<double> rope_decay_curve(const Rope& rope, Index max_distance);
std::vector<double> rope_decay_curve(Index dim, double base, Index max_distance);

// Names used on the command line and in Python: "interleaved", "half"; "none", "linear", "ntk",
// "yarn"; and their inverses (throw std::invalid_argument listing the valid names).
const char* to_string(RopeLayout layout);
RopeLayout rope_layout_from_string(std::string_view name);
const char* to_string(RopeScalingKind kind);
RopeScalingKind rope_scaling_kind_from_string(std::string_view name);

}  // namespace linrope
