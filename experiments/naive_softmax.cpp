#include "naive_softmax.hpp"

#include <cmath>
#include <limits>

namespace linrope::experiments {

void naive_softmax_attention(Heads<const float> q, Heads<const float> k, Heads<const float> v,
                             Heads<float> out, bool causal, const Rope* rope) {
  using ConstMap = Eigen::Map<const MatrixF>;
  const Index n = q.n, n_k = k.n, d = q.d, d_v = v.d;
  const float scale = float(1.0 / std::sqrt(double(d)));
  MatrixF scores(n, n_k);
  for (Index slice = 0; slice < q.batch * q.heads; ++slice) {
    MatrixF qr = ConstMap(q.data + slice * n * d, n, d);
    MatrixF kr = ConstMap(k.data + slice * n_k * d, n_k, d);
    if (rope) {
      rope->apply(qr, 0);
      rope->apply(kr, 0);
    }
    // Eigen runs this GEMM on all OpenMP threads.
    scores.noalias() = qr * kr.transpose();
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
    for (Index i = 0; i < n; ++i) {
      auto row = scores.row(i);
      const Index admissible = causal ? std::min(i + 1, n_k) : n_k;
      if (admissible < n_k) row.tail(n_k - admissible).setZero();
      if (admissible == 0) continue;
      auto head = row.head(admissible);
      const float top = head.maxCoeff();
      head = ((head.array() - top) * scale).exp();
      head /= head.sum();
    }
    Eigen::Map<MatrixF> o(out.data + slice * n * d_v, n, d_v);
    o.noalias() = scores * ConstMap(v.data + slice * n_k * d_v, n_k, d_v);
  }
}

}  // namespace linrope::experiments
