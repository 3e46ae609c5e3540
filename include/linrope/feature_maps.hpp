// linrope: feature maps phi: R^d -> R^m whose inner products replace the softmax kernel.
//
// All maps act row-wise on x [n x d] -> [n x m]. With x' = x * d^(-1/4) and W [f x d] the random
// projection (f = num_features):
//   EluPlusOne      phi(x) = elu(x) + 1                                          m = d
//   Relu            phi(x) = max(x, 0)                                           m = d
//   FavorPositive   phi(x) = exp(W x' - |x'|^2 / 2) / sqrt(f)                    m = f
//   FavorTrig       phi(x) = exp(|x'|^2 / 2) / sqrt(f) [sin(W x'), cos(W x')]    m = 2f (signed)
//   OnePlusCosine   phi(x) = [x / |x|, 1], so phi(q).phi(k) = 1 + cos(q, k)      m = d + 1
//   FavorHyperbolic phi(x) = exp(-|x'|^2/2) / sqrt(2f) [exp(W x'), exp(-W x')]   m = 2f
// The three Favor maps are unbiased: E[phi(q) . phi(k)] = exp(<q, k> / sqrt(d)) (Performer,
// FAVOR+). OnePlusCosine maps x = 0 to [0, ..., 0, 1].
//
// W: rows iid N(0, I_d), or (orthogonal = true) blocks of d mutually orthogonal rows, each block
// the Q of a QR of a Gaussian d x d matrix with the signs of R's diagonal folded into Q (so that Q
// is Haar-distributed), each row rescaled to the norm of an independent N(0, I_d) vector, or to
// sqrt(d) when `regularized`. f need not be a multiple of d: the last block is cut. Gaussians come
// from a splitmix64/xoshiro256** stream and a Box-Muller transform written here (the standard
// library's normal_distribution differs between implementations), so a seed gives bit-identical W
// on every platform.
#pragma once

#include <cstdint>
#include <linrope/types.hpp>
#include <memory>
#include <span>
#include <string_view>

namespace linrope {

namespace detail {
struct FeatureMapAccess;  // lets the attention kernels map rows they have already checked
}

enum class FeatureMapKind {
  EluPlusOne,
  Relu,
  FavorPositive,
  FavorTrig,
  OnePlusCosine,
  FavorHyperbolic
};

struct FeatureMapConfig {
  FeatureMapKind kind = FeatureMapKind::EluPlusOne;
  Index input_dim = 0;  // d
  Index num_features =
      0;  // f: rows of W (Favor maps only; must be >= 1 for them, ignored otherwise)
  bool orthogonal = true;  // orthogonal blocks of W instead of iid rows
  std::uint64_t seed = 0;
  bool regularized = false;  // orthogonal rows of norm exactly sqrt(d) instead of random norms
};

class FeatureMap {
 public:
  virtual ~FeatureMap() = default;

  const FeatureMapConfig& config() const { return config_; }
  FeatureMapKind kind() const { return config_.kind; }
  Index input_dim() const { return config_.input_dim; }
  virtual Index output_dim() const = 0;
  // True when every kernel value phi(q).phi(k) is >= 0 for all inputs: all maps but FavorTrig
  // (elu+1, relu and the Favor exp maps have non-negative features; 1+cos has signed features
  // x/|x| but every inner product is 1 + cos >= 0).
  virtual bool nonnegative() const = 0;
  // The random projection W [f x d] (double), or an empty matrix for deterministic maps.
  virtual const MatrixD& projection() const;

  // out = phi(x), exactly as defined above (unstabilised; may overflow for large inputs).
  //   x [n x d] -> out [n x m]. Throws if the shapes do not fit, out overlaps x (elu+1 and relu may
  //   map exactly in place), or x has a non-finite value.
  void apply(const Eigen::Ref<const MatrixF>& x, Eigen::Ref<MatrixF> out) const;
  void apply(const Eigen::Ref<const MatrixD>& x, Eigen::Ref<MatrixD> out) const;

  // dx = J^T d_out, J the Jacobian of phi at x (W held fixed): the gradient through apply.
  //   x [n x d], d_out [n x m] -> dx [n x d]. Relu's derivative at 0 is taken as 0, elu+1's is 1.
  //   Throws as apply does, and when d_out is not [n x m] or not finite, or dx overlaps either.
  void backward(const Eigen::Ref<const MatrixF>& x, const Eigen::Ref<const MatrixF>& d_out,
                Eigen::Ref<MatrixF> dx) const;
  void backward(const Eigen::Ref<const MatrixD>& x, const Eigen::Ref<const MatrixD>& d_out,
                Eigen::Ref<MatrixD> dx) const;

  // Stabilised form for the attention kernels: out = phi(x) * exp(-log_scale[i]) row by row, with
  // u = W x', h = |x'|^2 / 2:
  //   favor+      log_scale = max_l u_l - h - ln(f)/2    (largest feature of the row exactly 1)
  //   favor-hyp   log_scale = max_l |u_l| - h - ln(2f)/2 (largest feature exactly 1)
  //   favor-trig  log_scale = h - ln(f)/2                (features [sin u, cos u])
  //   elu+1, relu, 1+cos: log_scale = 0 and out == apply(x).
  // Finite for any finite float x, and double x with |x| < ~1e150. log_scale.size() == x.rows().
  void apply_stabilized(const Eigen::Ref<const MatrixF>& x, Eigen::Ref<MatrixF> out,
                        std::span<double> log_scale) const;
  void apply_stabilized(const Eigen::Ref<const MatrixD>& x, Eigen::Ref<MatrixD> out,
                        std::span<double> log_scale) const;

  // Draws a new W from `seed` (no effect on deterministic maps beyond recording the seed).
  virtual void redraw(std::uint64_t seed) = 0;

 protected:
  explicit FeatureMap(const FeatureMapConfig& config) : config_(config) {}

  // The map itself, on arguments already checked: phi(x) when log_scale is null, the stabilised
  // form (writing log_scale[0 .. rows)) otherwise. `parallel`: may open an OpenMP region over
  // blocks of rows (the public calls); the attention kernels, which parallelise further out, pass
  // false.
  virtual void map_rows(const Eigen::Ref<const MatrixF>& x, Eigen::Ref<MatrixF> out,
                        double* log_scale, bool parallel) const = 0;
  virtual void map_rows(const Eigen::Ref<const MatrixD>& x, Eigen::Ref<MatrixD> out,
                        double* log_scale, bool parallel) const = 0;

  // The map's backward on arguments already checked: dx = J^T d_out at the rows x, given the
  // stabilised features f = phi(x) exp(-log_scale) that map_rows wrote for x and the gradient on
  // their reciprocal scale, g = d_out exp(log_scale) (row by row). J^T d_out depends on d_out
  // only through products g f, in which the two scales cancel, so large inputs stay finite.
  virtual void backward_rows(const Eigen::Ref<const MatrixF>& x,
                             const Eigen::Ref<const MatrixF>& features,
                             const Eigen::Ref<const MatrixF>& g, Eigen::Ref<MatrixF> dx) const = 0;
  virtual void backward_rows(const Eigen::Ref<const MatrixD>& x,
                             const Eigen::Ref<const MatrixD>& features,
                             const Eigen::Ref<const MatrixD>& g, Eigen::Ref<MatrixD> dx) const = 0;

  FeatureMapConfig config_;

 private:
  template <class T>
  void backward_checked(const Eigen::Ref<const Matrix<T>>& x,
                        const Eigen::Ref<const Matrix<T>>& d_out, Eigen::Ref<Matrix<T>> dx) const;

  friend struct detail::FeatureMapAccess;
};

// Throws std::invalid_argument on input_dim < 1, or num_features < 1 for a Favor map.
std::unique_ptr<FeatureMap> make_feature_map(const FeatureMapConfig& config);

// Name used in CSV files and on the command line: "elu+1", "relu", "favor+", "favor-trig", "1+cos",
// "favor-hyp"; and its inverse (throws std::invalid_argument listing the valid names).
const char* to_string(FeatureMapKind kind);
FeatureMapKind feature_map_kind_from_string(std::string_view name);

}  // namespace linrope
