// linrope._core: the C++ API on NumPy arrays (DESIGN.md, "Python"). A thin layer: it checks dtype
// and rank, views C-contiguous arrays without a copy, releases the GIL around every kernel and
// calls the C++ API, whose std::invalid_argument pybind11 turns into ValueError with the same
// message. No mathematics here.
//
// Arrays are float32 or float64, shaped (n, d) or (B, H, n, d). The attention calls go through the
// batched Heads entry points for both ranks ((n, d) is B = H = 1), which read raw pointers: the
// single-head calls take `const MatrixF&`, which a NumPy buffer can only reach through a copy.
// Every output is a new array, so none aliases an input.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <linrope/linrope.hpp>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace py = pybind11;
using namespace pybind11::literals;

namespace linrope::python {
namespace {

// ---- Threads ------------------------------------------------------------------------------------

// `import torch` sets libgomp's thread count to 1 on a 2-core machine, and torch and linrope share
// libgomp: left alone, linrope would run on one thread after it. So the count is ours: the
// machine's cores (OMP_NUM_THREADS if set) until set_num_threads changes it, imposed on the
// calling thread for the duration of each kernel and restored after, so that torch keeps its own.
int default_threads() {
#ifdef _OPENMP
  if (const char* env = std::getenv("OMP_NUM_THREADS")) {
    const int n = std::atoi(env);  // "4" or "4,2": the first level
    if (n > 0) return n;
  }
  return omp_get_num_procs();
#else
  return 1;
#endif
}

std::atomic<int>& thread_count() {
  static std::atomic<int> count{default_threads()};
  return count;
}

// Releases the GIL and sets linrope's thread count on this thread, for one kernel call.
class KernelScope {
 public:
  KernelScope() {
#ifdef _OPENMP
    previous_ = omp_get_max_threads();
    omp_set_num_threads(thread_count().load());
#endif
  }
  ~KernelScope() {
#ifdef _OPENMP
    omp_set_num_threads(previous_);
#endif
  }
  KernelScope(const KernelScope&) = delete;
  KernelScope& operator=(const KernelScope&) = delete;

 private:
  py::gil_scoped_release release_;
  int previous_ = 1;
};

// ---- Arrays -------------------------------------------------------------------------------------

template <class... Parts>
[[noreturn]] void fail(std::string_view function, const Parts&... parts) {
  std::ostringstream message;
  message << function << ": ";
  (message << ... << parts);
  throw std::invalid_argument(message.str());
}

template <class T>
using CArray = py::array_t<T, py::array::c_style>;

enum class DType { Float32, Float64 };

DType dtype_of(std::string_view function, const char* name, const py::array& a) {
  if (a.dtype().is(py::dtype::of<float>())) return DType::Float32;
  if (a.dtype().is(py::dtype::of<double>())) return DType::Float64;
  fail(function, name, " has dtype ", std::string(py::str(a.dtype())),
       " but expected float32 or float64");
}

// The dtype shared by all `arrays` (named by `names`), or a ValueError naming the odd one.
template <std::size_t N>
DType common_dtype(std::string_view function, const std::array<const char*, N>& names,
                   const std::array<const py::array*, N>& arrays) {
  const DType first = dtype_of(function, names[0], *arrays[0]);
  for (std::size_t i = 1; i < N; ++i)
    if (dtype_of(function, names[i], *arrays[i]) != first)
      fail(function, names[i], " has dtype ", std::string(py::str(arrays[i]->dtype())), " but ",
           names[0], " has dtype ", std::string(py::str(arrays[0]->dtype())));
  return first;
}

// A C-contiguous view of `a` (dtype already checked): the same buffer when `a` is C-contiguous,
// else a C-contiguous copy.
template <class T>
CArray<T> contiguous(const py::array& a) {
  return CArray<T>::ensure(a);
}

void require_rank(std::string_view function, const char* name, const py::array& a) {
  if (a.ndim() != 2 && a.ndim() != 4)
    fail(function, name, " has ", a.ndim(), " dimensions but expected 2 (n, d) or 4 (B, H, n, d)");
}

template <class T>
Heads<T> heads_of(T* data, const py::array& a) {
  if (a.ndim() == 2) return {data, 1, 1, Index(a.shape(0)), Index(a.shape(1))};
  return {data, Index(a.shape(0)), Index(a.shape(1)), Index(a.shape(2)), Index(a.shape(3))};
}

template <class T>
Heads<const T> input_heads(const CArray<T>& a) {
  return heads_of<const T>(a.data(), a);
}

// A new array of `like`'s shape with its last dimension replaced by `last`.
template <class T>
CArray<T> new_array(const py::array& like, py::ssize_t last) {
  std::vector<py::ssize_t> shape(like.shape(), like.shape() + like.ndim());
  shape.back() = last;
  return CArray<T>(shape);
}

template <class T>
Heads<T> output_heads(CArray<T>& a) {
  return heads_of<T>(a.mutable_data(), a);
}

// x [..., d] as the matrix [rows x d] of all its rows, and its mutable counterpart.
template <class T>
Eigen::Map<const Matrix<T>> rows_of(const CArray<T>& x) {
  const Index d = x.ndim() == 0 ? 0 : Index(x.shape(x.ndim() - 1));
  return {x.data(), d == 0 ? 0 : Index(x.size()) / d, d};
}
template <class T>
Eigen::Map<Matrix<T>> rows_of(CArray<T>& x) {
  const Index d = x.ndim() == 0 ? 0 : Index(x.shape(x.ndim() - 1));
  return {x.mutable_data(), d == 0 ? 0 : Index(x.size()) / d, d};
}

// ---- Names --------------------------------------------------------------------------------------

// The C++ parsers throw std::invalid_argument listing the valid names; prefix the Python function.
template <class Parse>
auto parse_name(std::string_view function, Parse parse, const std::string& name) {
  try {
    return parse(name);
  } catch (const std::invalid_argument& e) {
    fail(function, e.what());
  }
}

// ---- Options ------------------------------------------------------------------------------------

SoftmaxOptions softmax_options(std::string_view function, bool causal, std::optional<double> scale,
                               const Rope* rope, Index q_offset, Index k_offset) {
  // The C++ API reads scale = 0 as "1/sqrt(d)"; in Python that is None, and an explicit 0 (uniform
  // weights) cannot be passed on, so it is refused rather than silently replaced.
  if (scale && *scale == 0)
    fail(function, "scale is 0 but expected a scale > 0 (None means 1/sqrt(d))");
  return {.causal = causal,
          .scale = scale.value_or(0.0),
          .rope = rope,
          .q_offset = q_offset,
          .k_offset = k_offset};
}

LinearOptions linear_options(std::string_view function, bool causal, const std::string& placement,
                             const Rope* rope, double eps, Index q_offset, Index k_offset) {
  return {.causal = causal,
          .placement = parse_name(function, rope_placement_from_string, placement),
          .rope = rope,
          .eps = eps,
          .q_offset = q_offset,
          .k_offset = k_offset};
}

py::dict stats_dict(const DenominatorStats& s) {
  return py::dict("min"_a = s.min, "nonpositive"_a = s.nonpositive,
                  "below_threshold"_a = s.below_threshold, "threshold"_a = s.threshold,
                  "count"_a = s.count);
}

// ---- Attention ----------------------------------------------------------------------------------

// Checks q, k, v (and d_out) and calls body.template operator()<T>() with T their dtype.
template <class Body>
py::object with_inputs(std::string_view function, const py::array& q, const py::array& k,
                       const py::array& v, const py::array* d_out, Body&& body) {
  require_rank(function, "q", q);
  require_rank(function, "k", k);
  require_rank(function, "v", v);
  for (const auto& [name, a] : {std::pair{"k", &k}, std::pair{"v", &v}})
    if (a->ndim() != q.ndim())
      fail(function, name, " has ", a->ndim(), " dimensions but q has ", q.ndim());
  DType dtype;
  if (d_out) {
    if (d_out->ndim() != q.ndim())
      fail(function, "d_out has ", d_out->ndim(), " dimensions but q has ", q.ndim());
    dtype = common_dtype<4>(function, {"q", "k", "v", "d_out"}, {&q, &k, &v, d_out});
  } else {
    dtype = common_dtype<3>(function, {"q", "k", "v"}, {&q, &k, &v});
  }
  if (dtype == DType::Float32) return body.template operator()<float>();
  return body.template operator()<double>();
}

py::object softmax_forward(const py::array& q, const py::array& k, const py::array& v, bool causal,
                           std::optional<double> scale, const Rope* rope, Index q_offset,
                           Index k_offset) {
  constexpr std::string_view fn = "softmax_attention";
  const SoftmaxOptions options = softmax_options(fn, causal, scale, rope, q_offset, k_offset);
  return with_inputs(fn, q, k, v, nullptr, [&]<class T>() -> py::object {
    const CArray<T> qc = contiguous<T>(q), kc = contiguous<T>(k), vc = contiguous<T>(v);
    CArray<T> out = new_array<T>(q, v.shape(v.ndim() - 1));
    {
      KernelScope scope;
      softmax_attention(input_heads(qc), input_heads(kc), input_heads(vc), output_heads(out),
                        options);
    }
    return out;
  });
}

py::object linear_forward(const py::array& q, const py::array& k, const py::array& v,
                          const FeatureMap& map, bool causal, const std::string& placement,
                          const Rope* rope, double eps, Index q_offset, Index k_offset,
                          bool return_stats, double stats_threshold) {
  constexpr std::string_view fn = "linear_attention";
  const LinearOptions options =
      linear_options(fn, causal, placement, rope, eps, q_offset, k_offset);
  return with_inputs(fn, q, k, v, nullptr, [&]<class T>() -> py::object {
    const CArray<T> qc = contiguous<T>(q), kc = contiguous<T>(k), vc = contiguous<T>(v);
    CArray<T> out = new_array<T>(q, v.shape(v.ndim() - 1));
    DenominatorStats stats{.threshold = stats_threshold};
    {
      KernelScope scope;
      linear_attention(input_heads(qc), input_heads(kc), input_heads(vc), output_heads(out), map,
                       options, return_stats ? &stats : nullptr);
    }
    if (return_stats) return py::make_tuple(std::move(out), stats_dict(stats));
    return out;
  });
}

// dq, dk, dv: new arrays of the shapes of q, k, v; `run` calls the C++ backward on their views.
template <class T, class Run>
py::object gradients(const CArray<T>& q, const CArray<T>& k, const CArray<T>& v, Run&& run) {
  CArray<T> dq = new_array<T>(q, q.shape(q.ndim() - 1));
  CArray<T> dk = new_array<T>(k, k.shape(k.ndim() - 1));
  CArray<T> dv = new_array<T>(v, v.shape(v.ndim() - 1));
  {
    KernelScope scope;
    run(output_heads(dq), output_heads(dk), output_heads(dv));
  }
  return py::make_tuple(std::move(dq), std::move(dk), std::move(dv));
}

py::object softmax_backward(const py::array& q, const py::array& k, const py::array& v,
                            const py::array& d_out, bool causal, std::optional<double> scale,
                            const Rope* rope, Index q_offset, Index k_offset) {
  constexpr std::string_view fn = "softmax_attention_backward";
  const SoftmaxOptions options = softmax_options(fn, causal, scale, rope, q_offset, k_offset);
  return with_inputs(fn, q, k, v, &d_out, [&]<class T>() -> py::object {
    const CArray<T> qc = contiguous<T>(q), kc = contiguous<T>(k), vc = contiguous<T>(v),
                    gc = contiguous<T>(d_out);
    return gradients<T>(qc, kc, vc, [&](Heads<T> dq, Heads<T> dk, Heads<T> dv) {
      softmax_attention_backward(input_heads(qc), input_heads(kc), input_heads(vc), input_heads(gc),
                                 dq, dk, dv, options);
    });
  });
}

py::object linear_backward(const py::array& q, const py::array& k, const py::array& v,
                           const py::array& d_out, const FeatureMap& map, bool causal,
                           const std::string& placement, const Rope* rope, double eps,
                           Index q_offset, Index k_offset) {
  constexpr std::string_view fn = "linear_attention_backward";
  const LinearOptions options =
      linear_options(fn, causal, placement, rope, eps, q_offset, k_offset);
  return with_inputs(fn, q, k, v, &d_out, [&]<class T>() -> py::object {
    const CArray<T> qc = contiguous<T>(q), kc = contiguous<T>(k), vc = contiguous<T>(v),
                    gc = contiguous<T>(d_out);
    return gradients<T>(qc, kc, vc, [&](Heads<T> dq, Heads<T> dk, Heads<T> dv) {
      linear_attention_backward(input_heads(qc), input_heads(kc), input_heads(vc), input_heads(gc),
                                dq, dk, dv, map, options);
    });
  });
}

// ---- Rope ---------------------------------------------------------------------------------------

// Rope::apply, apply_inverse or apply_transpose (first_position form), for the one body below.
template <class T>
using RopeTurn = void (Rope::*)(Eigen::Ref<Matrix<T>>, Index) const;

// A turned copy of x: in each (n, d) slice (all of x when 2-D) row i is at first_position + i.
template <class T>
py::object rope_turn(const Rope& rope, const py::array& x, Index first_position, RopeTurn<T> turn) {
  CArray<T> out = new_array<T>(x, x.shape(x.ndim() - 1));
  auto rows = rows_of(out);
  rows = rows_of(contiguous<T>(x));
  const Index n = Index(x.shape(x.ndim() - 2));
  KernelScope scope;
  if (n == 0 || rows.rows() == 0) {
    (rope.*turn)(rows, first_position);  // nothing to turn, but the width is still checked
  } else {
    for (Index s = 0; s < rows.rows() / n; ++s)
      (rope.*turn)(rows.middleRows(s * n, n), first_position);
  }
  return out;
}

template <class Float, class Double>
py::object rope_call(std::string_view function, const Rope& rope, const py::array& x,
                     Index first_position, Float float_turn, Double double_turn) {
  require_rank(function, "x", x);
  if (dtype_of(function, "x", x) == DType::Float32)
    return rope_turn<float>(rope, x, first_position, float_turn);
  return rope_turn<double>(rope, x, first_position, double_turn);
}

std::unique_ptr<Rope> make_rope(Index dim, Index rotary_dim, double base, const std::string& layout,
                                const std::string& scaling, double factor,
                                Index original_max_position, double beta_fast, double beta_slow) {
  return std::make_unique<Rope>(
      RopeConfig{.dim = dim,
                 .rotary_dim = rotary_dim,
                 .base = base,
                 .layout = parse_name("Rope", rope_layout_from_string, layout),
                 .scaling = {.kind = parse_name("Rope", rope_scaling_kind_from_string, scaling),
                             .factor = factor,
                             .original_max_position = original_max_position,
                             .beta_fast = beta_fast,
                             .beta_slow = beta_slow}});
}

// ---- Feature maps -------------------------------------------------------------------------------

template <class T>
py::object map_apply(const FeatureMap& map, const py::array& x) {
  const CArray<T> xc = contiguous<T>(x);
  CArray<T> out = new_array<T>(x, map.output_dim());
  auto rows = rows_of(out);
  KernelScope scope;
  map.apply(rows_of(xc), rows);
  return out;
}

template <class T>
py::object map_backward(const FeatureMap& map, const py::array& x, const py::array& d_out) {
  const CArray<T> xc = contiguous<T>(x), gc = contiguous<T>(d_out);
  CArray<T> dx = new_array<T>(x, x.shape(x.ndim() - 1));
  auto rows = rows_of(dx);
  KernelScope scope;
  map.backward(rows_of(xc), rows_of(gc), rows);
  return dx;
}

// x [..., d] of any rank >= 1: the map acts row-wise.
void require_rows(std::string_view function, const char* name, const py::array& a) {
  if (a.ndim() < 1) fail(function, name, " has 0 dimensions but expected at least 1 (..., d)");
}

}  // namespace
}  // namespace linrope::python

PYBIND11_MODULE(_core, m) {
  using namespace linrope;
  using namespace linrope::python;
  m.doc() = "linrope: linear attention with Rotary Position Embedding, on NumPy arrays.";

#ifdef _OPENMP
  m.attr("openmp") = true;
#else
  m.attr("openmp") = false;
#endif

  m.def(
      "set_num_threads",
      [](int n) {
        if (n < 1) fail("set_num_threads", "n is ", n, " but expected n >= 1");
#ifdef _OPENMP
        thread_count() = n;
#endif
      },
      "n"_a,
      "Threads every linrope kernel runs on (default: the machine's cores, or OMP_NUM_THREADS). "
      "Independent of torch.set_num_threads. A no-op without OpenMP.");
  m.def(
      "get_num_threads", [] { return thread_count().load(); },
      "Threads every linrope kernel runs on.");
  // For the tests: the team size an OpenMP region opened by a kernel would get.
  m.def("_kernel_threads", [] {
    int threads = 1;
    KernelScope scope;
#ifdef _OPENMP
#pragma omp parallel
#pragma omp single
    threads = omp_get_num_threads();
#endif
    return threads;
  });
  // For the tests: the address of the buffer a kernel would read for x (x's own when C-contiguous).
  m.def("_kernel_view", [](const py::array& x) -> std::uintptr_t {
    if (dtype_of("_kernel_view", "x", x) == DType::Float32)
      return reinterpret_cast<std::uintptr_t>(contiguous<float>(x).data());
    return reinterpret_cast<std::uintptr_t>(contiguous<double>(x).data());
  });

  py::class_<Rope>(m, "Rope",
                   "Rotary Position Embedding of width dim; see include/linrope/rope.hpp.")
      .def(py::init(&make_rope), "dim"_a, "rotary_dim"_a = 0, "base"_a = 10000.0,
           "layout"_a = "interleaved", "scaling"_a = "none", "factor"_a = 1.0,
           "original_max_position"_a = 0, "beta_fast"_a = 32.0, "beta_slow"_a = 1.0)
      .def_property_readonly("dim", &Rope::dim)
      .def_property_readonly("rotary_dim", &Rope::rotary_dim)
      .def_property_readonly("base", [](const Rope& r) { return r.config().base; })
      .def_property_readonly("layout", [](const Rope& r) { return to_string(r.config().layout); })
      .def_property_readonly("scaling",
                             [](const Rope& r) { return to_string(r.config().scaling.kind); })
      .def_property_readonly("factor", [](const Rope& r) { return r.config().scaling.factor; })
      .def_property_readonly("magnitude", &Rope::magnitude)
      .def("frequencies",
           [](const Rope& r) {
             const std::vector<double> theta = r.frequencies();
             return CArray<double>(py::ssize_t(theta.size()), theta.data());
           })
      .def(
          "apply",
          [](const Rope& r, const py::array& x, Index first_position) {
            return rope_call("Rope.apply", r, x, first_position, RopeTurn<float>(&Rope::apply),
                             RopeTurn<double>(&Rope::apply));
          },
          "x"_a, "first_position"_a = 0, "R x: a rotated copy of x, row i at first_position + i.")
      .def(
          "apply_inverse",
          [](const Rope& r, const py::array& x, Index first_position) {
            return rope_call("Rope.apply_inverse", r, x, first_position,
                             RopeTurn<float>(&Rope::apply_inverse),
                             RopeTurn<double>(&Rope::apply_inverse));
          },
          "x"_a, "first_position"_a = 0)
      .def(
          "apply_transpose",
          [](const Rope& r, const py::array& x, Index first_position) {
            return rope_call("Rope.apply_transpose", r, x, first_position,
                             RopeTurn<float>(&Rope::apply_transpose),
                             RopeTurn<double>(&Rope::apply_transpose));
          },
          "x"_a, "first_position"_a = 0, "R^T x, the gradient of apply.");

  py::class_<FeatureMap, std::unique_ptr<FeatureMap>>(
      m, "FeatureMap", "A feature map phi: R^d -> R^m; see include/linrope/feature_maps.hpp.")
      .def(py::init([](const std::string& kind, Index input_dim, Index num_features,
                       bool orthogonal, std::uint64_t seed, bool regularized) {
             return make_feature_map(
                 {.kind = parse_name("FeatureMap", feature_map_kind_from_string, kind),
                  .input_dim = input_dim,
                  .num_features = num_features,
                  .orthogonal = orthogonal,
                  .seed = seed,
                  .regularized = regularized});
           }),
           "kind"_a, "input_dim"_a, "num_features"_a = 0, "orthogonal"_a = true, "seed"_a = 0,
           "regularized"_a = false)
      .def_property_readonly("kind", [](const FeatureMap& f) { return to_string(f.kind()); })
      .def_property_readonly("input_dim", &FeatureMap::input_dim)
      .def_property_readonly("output_dim", &FeatureMap::output_dim)
      .def_property_readonly("num_features",
                             [](const FeatureMap& f) { return f.config().num_features; })
      .def_property_readonly("orthogonal",
                             [](const FeatureMap& f) { return f.config().orthogonal; })
      .def_property_readonly("seed", [](const FeatureMap& f) { return f.config().seed; })
      .def_property_readonly("nonnegative", &FeatureMap::nonnegative)
      // A copy: redraw replaces W, and an array must not change under its holder.
      .def_property_readonly("projection",
                             [](const FeatureMap& f) {
                               const MatrixD& w = f.projection();
                               CArray<double> out({w.rows(), w.cols()});
                               rows_of(out) = w;
                               return out;
                             })
      .def(
          "apply",
          [](const FeatureMap& f, const py::array& x) {
            require_rows("FeatureMap.apply", "x", x);
            if (dtype_of("FeatureMap.apply", "x", x) == DType::Float32)
              return map_apply<float>(f, x);
            return map_apply<double>(f, x);
          },
          "x"_a, "phi(x) row by row: x [..., d] -> [..., m].")
      .def(
          "backward",
          [](const FeatureMap& f, const py::array& x, const py::array& d_out) {
            constexpr std::string_view fn = "FeatureMap.backward";
            require_rows(fn, "x", x);
            require_rows(fn, "d_out", d_out);
            if (common_dtype<2>(fn, {"x", "d_out"}, {&x, &d_out}) == DType::Float32)
              return map_backward<float>(f, x, d_out);
            return map_backward<double>(f, x, d_out);
          },
          "x"_a, "d_out"_a, "J^T d_out, the gradient through apply at x: [..., d].")
      .def("redraw", &FeatureMap::redraw, "seed"_a, "Draws a new W from seed.");

  m.def("softmax_attention", &softmax_forward, "q"_a, "k"_a, "v"_a, py::kw_only(),
        "causal"_a = false, "scale"_a = py::none(), "rope"_a = py::none(), "q_offset"_a = 0,
        "k_offset"_a = 0,
        "Exact softmax attention: q [.., n, d], k [.., n_k, d], v [.., n_k, d_v] -> [.., n, d_v].");
  m.def("linear_attention", &linear_forward, "q"_a, "k"_a, "v"_a, "feature_map"_a, py::kw_only(),
        "causal"_a = false, "placement"_a = "numerator_only", "rope"_a = py::none(), "eps"_a = 1e-6,
        "q_offset"_a = 0, "k_offset"_a = 0, "return_stats"_a = false, "stats_threshold"_a = 1e-3,
        "Linear attention; with return_stats=True returns (out, denominator statistics).");
  m.def("softmax_attention_backward", &softmax_backward, "q"_a, "k"_a, "v"_a, "d_out"_a,
        py::kw_only(), "causal"_a = false, "scale"_a = py::none(), "rope"_a = py::none(),
        "q_offset"_a = 0, "k_offset"_a = 0, "(dq, dk, dv) of sum(d_out * softmax_attention(...)).");
  m.def("linear_attention_backward", &linear_backward, "q"_a, "k"_a, "v"_a, "d_out"_a,
        "feature_map"_a, py::kw_only(), "causal"_a = false, "placement"_a = "numerator_only",
        "rope"_a = py::none(), "eps"_a = 1e-6, "q_offset"_a = 0, "k_offset"_a = 0,
        "(dq, dk, dv) of sum(d_out * linear_attention(...)).");
}
