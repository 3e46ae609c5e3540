// The product under every kernel, detail::gemm (src/gemm.cpp), against Eigen's GEMM on the shapes
// the kernels actually run, one thread each, beside the machine references:
//   gemm/<shape>/ours     detail::gemm (the AVX-512 micro-kernel when the build has AVX-512)
//   gemm/<shape>/eigen    Eigen's product on the same operands (Eigen::setNbThreads(1))
//   gemm/<shape>/openblas cblas_sgemm, when CMake found Debian's OpenBLAS
//   (openblas_set_num_threads(1))
// Shapes (m x n x k, with the storage of A and B):
//   features   256 x 256 x 64    x_block [256 x d] * (d^-1/4 W^T) [d x 256]   FAVOR+ projection
//   state      256 x 64 x 256    phi(K)^T (column-major view) * V             S += ...
//   readout    256 x 64 x 256    phi(Q) * S
//   scores     128 x 256 x 64    Q_b * K_b^T (B column-major view)            softmax
//   pv         128 x 64 x 256    P * V_b                                      softmax
//   chunk      64 x 256 x 64     one 64-row chunk's feature projection        causal chunked
//   square     1024 x 1024 x 1024                                             the classic yardstick
// and the products of a decoder layer's linear maps at the study's step (16 x 256 tokens, d_model
// 128, the MLP 4x wider; nn.Linear's weight W [out x in] row-major):
//   proj       4096 x 128 x 128  x * W^T (B column-major view)                 q, k, v, out
//   mlp_up     4096 x 512 x 128  x * W^T                                       the MLP's first
//   mlp_down   4096 x 128 x 512  h * W^T                                       the MLP's second
//   up_dx      4096 x 128 x 512  dy * W                                        its input gradient
//   up_dw      512 x 128 x 4096  dy^T (column-major view) * x                  its weight gradient
//   proj_dw    128 x 128 x 4096  dy^T * x                                      a projection's
// The single-thread fp32 peak is machine/peak_fma divided by its thread count (reported there).
#include <Eigen/Core>
#include <string>

#include "bench_common.hpp"
#include "common/gemm.hpp"

#ifdef LINROPE_BENCH_OPENBLAS
#include <cblas.h>
extern "C" void openblas_set_num_threads(int);
#endif

namespace {

using linrope::Index;
using linrope::MatrixF;

struct Shape {
  const char* name;
  Index m, n, k;
  bool a_columns, b_columns;  // stored transposed: a column-major view
};
constexpr Shape kShapes[] = {
    {"features", 256, 256, 64, false, false},   {"state", 256, 64, 256, true, false},
    {"readout", 256, 64, 256, false, false},    {"scores", 128, 256, 64, false, true},
    {"pv", 128, 64, 256, false, false},         {"chunk", 64, 256, 64, false, false},
    {"square", 1024, 1024, 1024, false, false}, {"proj", 4096, 128, 128, false, true},
    {"mlp_up", 4096, 512, 128, false, true},    {"mlp_down", 4096, 128, 512, false, true},
    {"up_dx", 4096, 128, 512, false, false},    {"up_dw", 512, 128, 4096, true, false},
    {"proj_dw", 128, 128, 4096, true, false}};

// Operands as the kernels hold them: A [m x k] or, when a_columns, A^T [k x m] row-major.
struct Operands {
  explicit Operands(const Shape& s)
      : a(s.a_columns ? MatrixF::Random(s.k, s.m) : MatrixF::Random(s.m, s.k)),
        b(s.b_columns ? MatrixF::Random(s.n, s.k) : MatrixF::Random(s.k, s.n)),
        c(MatrixF::Zero(s.m, s.n)),
        shape(s) {}
  linrope::detail::ConstView<float> a_view() const {
    const auto v = linrope::detail::const_view(a);
    return shape.a_columns ? v.transposed() : v;
  }
  linrope::detail::ConstView<float> b_view() const {
    const auto v = linrope::detail::const_view(b);
    return shape.b_columns ? v.transposed() : v;
  }
  MatrixF a, b, c;
  Shape shape;
};

void finish(benchmark::State& state, const Shape& s) {
  linrope::bench::set_flops(state, 2.0 * double(s.m) * double(s.n) * double(s.k));
}

// Eigen::setNbThreads and openblas_set_num_threads (in its OpenMP build) change the OpenMP
// default for the whole process; this puts it back, so that the machine references that run
// afterwards still use every thread.
class SingleThreaded {
 public:
  SingleThreaded() : saved_(linrope::bench::threads()) {}
  ~SingleThreaded() {
    Eigen::setNbThreads(saved_);
#ifdef _OPENMP
    omp_set_num_threads(saved_);
#endif
  }

 private:
  int saved_;
};

void BM_Ours(benchmark::State& state, Shape s) {
  Operands x(s);
  for (auto _ : state) {
    linrope::detail::gemm(x.a_view(), x.b_view(), linrope::detail::view(x.c),
                          linrope::detail::Write::Overwrite);
    benchmark::DoNotOptimize(x.c.data());
    benchmark::ClobberMemory();
  }
  finish(state, s);
}

void BM_Eigen(benchmark::State& state, Shape s) {
  const SingleThreaded restore;
  Eigen::setNbThreads(1);
  Operands x(s);
  for (auto _ : state) {
    if (s.a_columns)
      x.c.noalias() = x.a.transpose() * x.b;
    else if (s.b_columns)
      x.c.noalias() = x.a * x.b.transpose();
    else
      x.c.noalias() = x.a * x.b;
    benchmark::DoNotOptimize(x.c.data());
    benchmark::ClobberMemory();
  }
  finish(state, s);
}

#ifdef LINROPE_BENCH_OPENBLAS
void BM_OpenBlas(benchmark::State& state, Shape s) {
  const SingleThreaded restore;
  openblas_set_num_threads(1);
  Operands x(s);
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, s.a_columns ? CblasTrans : CblasNoTrans,
                s.b_columns ? CblasTrans : CblasNoTrans, int(s.m), int(s.n), int(s.k), 1.0f,
                x.a.data(), int(x.a.cols()), x.b.data(), int(x.b.cols()), 0.0f, x.c.data(),
                int(x.c.cols()));
    benchmark::DoNotOptimize(x.c.data());
    benchmark::ClobberMemory();
  }
  finish(state, s);
}
#endif

bool register_all() {
  for (const Shape& s : kShapes) {
    const std::string base = std::string("gemm/") + s.name + "/";
    benchmark::RegisterBenchmark((base + "ours").c_str(), BM_Ours, s);
    benchmark::RegisterBenchmark((base + "eigen").c_str(), BM_Eigen, s);
#ifdef LINROPE_BENCH_OPENBLAS
    benchmark::RegisterBenchmark((base + "openblas").c_str(), BM_OpenBlas, s);
#endif
  }
  return true;
}
}  // namespace

// The machine references first: after OpenBLAS has run, its OpenMP threads were seen sharing one
// core (peak_fma at half its value), which would misstate "the machine" for the whole run.
LINROPE_REGISTER_MACHINE_REFERENCES();

namespace {
const bool registered = register_all();
}  // namespace

BENCHMARK_MAIN();
