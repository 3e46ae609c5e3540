// RoPE in linear attention, numerator only (RoFormer eq. 19), checked against exact softmax, and
// its gradients.
#include <cstdio>
#include <linrope/linrope.hpp>

int main() {
  using namespace linrope;
  const Index n = 512, d = 64, m = 128;
  const MatrixF q = MatrixF::Random(n, d), k = MatrixF::Random(n, d), v = MatrixF::Random(n, d);

  // FAVOR+ with m orthogonal random features; RoPE acts on the features, so its width is m.
  auto favor = make_feature_map(
      {.kind = FeatureMapKind::FavorPositive, .input_dim = d, .num_features = m, .seed = 42});
  Rope feature_rope({.dim = m});
  DenominatorStats stats;
  MatrixF approx = linear_attention(
      q, k, v, *favor,
      {.causal = true, .placement = RopePlacement::NumeratorOnly, .rope = &feature_rope}, &stats);

  // The exact baseline: softmax attention with RoPE on q and k (width d).
  Rope rope({.dim = d});
  MatrixF exact = softmax_attention(q, k, v, {.causal = true, .rope = &rope});

  // Gradients of sum(d_out .* approx) with respect to q, k and v (exact, O(n) memory).
  const MatrixF d_out = MatrixF::Random(n, d);
  AttentionGradients<float> grads = linear_attention_backward(
      q, k, v, d_out, *favor,
      {.causal = true, .placement = RopePlacement::NumeratorOnly, .rope = &feature_rope});

  std::printf("relative error %.3f, smallest denominator %.3g, %td non-positive, |dq| %.3g\n",
              (approx - exact).norm() / exact.norm(), stats.min, stats.nonpositive,
              grads.dq.norm());
  return stats.nonpositive == 0 ? 0 : 1;  // eq. 19 keeps the denominator positive
}
