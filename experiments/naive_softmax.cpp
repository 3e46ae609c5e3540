#include "naive_softmax.hpp"

#include <algorithm>
#include <cmath>

namespace linrope::experiments {

void naive_softmax_attention(Heads<const float> q, Heads<const float> k, Heads<const float> v,
                             Heads<float> out, bool causal, const Rope* rope) {
  using ConstMap = Eigen::Map<const MatrixF>;
  const Index n = q.n, n_k = k.n, d = q.d, d_v = v.d, slices = q.batch * q.heads;
  const float scale = float(1.0 / std::sqrt(double(d)));
#ifdef _OPENMP
#pragma omp parallel
#endif
  {
    MatrixF scores(n, n_k), qr(n, d), kr(n_k, d);
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
    for (Index slice = 0; slice < slices; ++slice) {
      qr = ConstMap(q.data + slice * n * d, n, d);
      kr = ConstMap(k.data + slice * n_k * d, n_k, d);
      if (rope) {
        rope->apply(qr, 0);
        rope->apply(kr, 0);
      }
      // Inside the parallel region Eigen keeps this GEMM on the calling thread.
      scores.noalias() = qr * kr.transpose();
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
}

}  // namespace linrope::experiments
