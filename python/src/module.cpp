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

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
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
#include <variant>
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

// Seconds spent inside KernelScopes since import, summed over threads: what the benchmark of the
// binding's overhead subtracts from the time of a whole call (bench/bench_torch_layer.py).
std::atomic<std::int64_t>& kernel_nanoseconds() {
  static std::atomic<std::int64_t> total{0};
  return total;
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
    kernel_nanoseconds() += std::chrono::duration_cast<std::chrono::nanoseconds>(
                                std::chrono::steady_clock::now() - start_)
                                .count();
  }
  KernelScope(const KernelScope&) = delete;
  KernelScope& operator=(const KernelScope&) = delete;

 private:
  py::gil_scoped_release release_;
  int previous_ = 1;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
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
  // By value, not identity: NumPy does not always reuse its dtype objects (an unpickled array's is
  // another); a non-native byte order compares unequal and is refused.
  if (a.dtype().equal(py::dtype::of<float>())) return DType::Float32;
  if (a.dtype().equal(py::dtype::of<double>())) return DType::Float64;
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

// A C-contiguous view of `a` (dtype already checked): the same buffer when `a` is C-contiguous
// and aligned, else a C-contiguous, aligned copy. (NumPy can view a buffer at any byte offset;
// the kernels read whole floats, which C++ requires aligned.)
template <class T>
CArray<T> contiguous(const py::array& a) {
  CArray<T> c = CArray<T>::ensure(a);
  if (c.flags() & py::detail::npy_api::NPY_ARRAY_ALIGNED_) return c;
  return CArray<T>::ensure(c.attr("copy")());
}

// "(2, 3, 5)": a's shape as NumPy prints it.
std::string shape_text(const py::array& a) {
  std::string text = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) text += (i ? ", " : "") + std::to_string(a.shape(i));
  return text + (a.ndim() == 1 ? ",)" : ")");
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

// The same, zero-filled: the attention calls leave rows past the lengths unwritten.
template <class T>
CArray<T> zero_array(const py::array& like, py::ssize_t last) {
  CArray<T> a = new_array<T>(like, last);
  std::fill_n(a.mutable_data(), a.size(), T(0));
  return a;
}

template <class T>
Heads<T> output_heads(CArray<T>& a) {
  return heads_of<T>(a.mutable_data(), a);
}

// Padding: lengths[b] for every batch entry b of `a`, or none. The C++ call reads a raw pointer,
// so the count is checked here; the values (in [0, n]) are checked by the C++ call.
using Lengths = std::optional<std::vector<Index>>;

void check_lengths(std::string_view function, const char* name, const Lengths& lengths,
                   const py::array& a, const char* of) {
  if (!lengths) return;
  const auto batch = a.ndim() == 4 ? std::size_t(a.shape(0)) : std::size_t(1);
  if (lengths->size() != batch)
    fail(function, name, " has ", lengths->size(), " entries but ", of, " has batch ", batch);
}

template <class H>
H with_lengths(H heads, const Lengths& lengths) {
  heads.lengths = lengths ? lengths->data() : nullptr;
  return heads;
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
  if (scale && !(std::isfinite(*scale) && *scale > 0))
    fail(function, "scale is ", *scale, " but expected a finite scale > 0 (None means 1/sqrt(d))");
  return {.causal = causal,
          .scale = scale.value_or(0.0),
          .rope = rope,
          .q_offset = q_offset,
          .k_offset = k_offset};
}

LinearOptions linear_options(std::string_view function, bool causal, const std::string& placement,
                             const Rope* rope, double eps, Index q_offset, Index k_offset,
                             const std::string& method, Index chunk_size) {
  return {.causal = causal,
          .placement = parse_name(function, rope_placement_from_string, placement),
          .rope = rope,
          .eps = eps,
          .q_offset = q_offset,
          .k_offset = k_offset,
          .method = parse_name(function, causal_method_from_string, method),
          .chunk_size = chunk_size};
}

py::dict stats_dict(const DenominatorStats& s) {
  return py::dict("min"_a = s.min, "nonpositive"_a = s.nonpositive,
                  "below_threshold"_a = s.below_threshold, "threshold"_a = s.threshold,
                  "count"_a = s.count);
}

// ---- Attention ----------------------------------------------------------------------------------

// Checks q, k, v (and d_out) and the lengths, and calls body.template operator()<T>() with T their
// dtype.
template <class Body>
py::object with_inputs(std::string_view function, const py::array& q, const py::array& k,
                       const py::array& v, const py::array* d_out, const Lengths& q_lengths,
                       const Lengths& k_lengths, Body&& body) {
  require_rank(function, "q", q);
  require_rank(function, "k", k);
  require_rank(function, "v", v);
  for (const auto& [name, a] : {std::pair{"k", &k}, std::pair{"v", &v}})
    if (a->ndim() != q.ndim())
      fail(function, name, " has ", a->ndim(), " dimensions but q has ", q.ndim());
  check_lengths(function, "q_lengths", q_lengths, q, "q");
  check_lengths(function, "k_lengths", k_lengths, k, "k");
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

// The C-contiguous q, k, v (and d_out) of one call, as the Heads views its kernels read: q and
// d_out with q's lengths, k and v with k's.
template <class T>
struct Inputs {
  CArray<T> q, k, v, d_out;
  const Lengths &q_lengths, &k_lengths;

  Heads<const T> q_heads() const { return with_lengths(input_heads(q), q_lengths); }
  Heads<const T> k_heads() const { return with_lengths(input_heads(k), k_lengths); }
  Heads<const T> v_heads() const { return with_lengths(input_heads(v), k_lengths); }
  Heads<const T> d_out_heads() const { return with_lengths(input_heads(d_out), q_lengths); }
  // The output [.., n, d_v], zero where the lengths leave rows unwritten.
  CArray<T> new_output() const {
    const py::ssize_t d_v = v.shape(v.ndim() - 1);
    return q_lengths ? zero_array<T>(q, d_v) : new_array<T>(q, d_v);
  }
};

template <class T>
Inputs<T> inputs(const py::array& q, const py::array& k, const py::array& v, const py::array* d_out,
                 const Lengths& q_lengths, const Lengths& k_lengths) {
  return {contiguous<T>(q), contiguous<T>(k),
          contiguous<T>(v), d_out ? contiguous<T>(*d_out) : CArray<T>(),
          q_lengths,        k_lengths};
}

py::object softmax_forward(const py::array& q, const py::array& k, const py::array& v, bool causal,
                           std::optional<double> scale, const Rope* rope, Index q_offset,
                           Index k_offset, const Lengths& q_lengths, const Lengths& k_lengths) {
  constexpr std::string_view fn = "softmax_attention";
  const SoftmaxOptions options = softmax_options(fn, causal, scale, rope, q_offset, k_offset);
  return with_inputs(fn, q, k, v, nullptr, q_lengths, k_lengths, [&]<class T>() -> py::object {
    const Inputs<T> in = inputs<T>(q, k, v, nullptr, q_lengths, k_lengths);
    CArray<T> out = in.new_output();
    {
      KernelScope scope;
      softmax_attention(in.q_heads(), in.k_heads(), in.v_heads(),
                        with_lengths(output_heads(out), q_lengths), options);
    }
    return out;
  });
}

py::object linear_forward(const py::array& q, const py::array& k, const py::array& v,
                          const FeatureMap& map, bool causal, const std::string& placement,
                          const Rope* rope, double eps, Index q_offset, Index k_offset,
                          bool return_stats, double stats_threshold, const std::string& method,
                          Index chunk_size, const Lengths& q_lengths, const Lengths& k_lengths) {
  constexpr std::string_view fn = "linear_attention";
  const LinearOptions options =
      linear_options(fn, causal, placement, rope, eps, q_offset, k_offset, method, chunk_size);
  return with_inputs(fn, q, k, v, nullptr, q_lengths, k_lengths, [&]<class T>() -> py::object {
    const Inputs<T> in = inputs<T>(q, k, v, nullptr, q_lengths, k_lengths);
    CArray<T> out = in.new_output();
    DenominatorStats stats{.threshold = stats_threshold};
    {
      KernelScope scope;
      linear_attention(in.q_heads(), in.k_heads(), in.v_heads(),
                       with_lengths(output_heads(out), q_lengths), map, options,
                       return_stats ? &stats : nullptr);
    }
    if (return_stats) return py::make_tuple(std::move(out), stats_dict(stats));
    return out;
  });
}

// dq, dk, dv: new arrays of the shapes of q, k, v; `run` calls the C++ backward on their views
// (which writes every row, zeros past the lengths).
template <class T, class Run>
py::object gradients(const Inputs<T>& in, Run&& run) {
  CArray<T> dq = new_array<T>(in.q, in.q.shape(in.q.ndim() - 1));
  CArray<T> dk = new_array<T>(in.k, in.k.shape(in.k.ndim() - 1));
  CArray<T> dv = new_array<T>(in.v, in.v.shape(in.v.ndim() - 1));
  {
    KernelScope scope;
    run(with_lengths(output_heads(dq), in.q_lengths), with_lengths(output_heads(dk), in.k_lengths),
        with_lengths(output_heads(dv), in.k_lengths));
  }
  return py::make_tuple(std::move(dq), std::move(dk), std::move(dv));
}

py::object softmax_backward(const py::array& q, const py::array& k, const py::array& v,
                            const py::array& d_out, bool causal, std::optional<double> scale,
                            const Rope* rope, Index q_offset, Index k_offset,
                            const Lengths& q_lengths, const Lengths& k_lengths) {
  constexpr std::string_view fn = "softmax_attention_backward";
  const SoftmaxOptions options = softmax_options(fn, causal, scale, rope, q_offset, k_offset);
  return with_inputs(fn, q, k, v, &d_out, q_lengths, k_lengths, [&]<class T>() -> py::object {
    const Inputs<T> in = inputs<T>(q, k, v, &d_out, q_lengths, k_lengths);
    return gradients<T>(in, [&](Heads<T> dq, Heads<T> dk, Heads<T> dv) {
      softmax_attention_backward(in.q_heads(), in.k_heads(), in.v_heads(), in.d_out_heads(), dq, dk,
                                 dv, options);
    });
  });
}

py::object linear_backward(const py::array& q, const py::array& k, const py::array& v,
                           const py::array& d_out, const FeatureMap& map, bool causal,
                           const std::string& placement, const Rope* rope, double eps,
                           Index q_offset, Index k_offset, const std::string& method,
                           Index chunk_size, const Lengths& q_lengths, const Lengths& k_lengths) {
  constexpr std::string_view fn = "linear_attention_backward";
  const LinearOptions options =
      linear_options(fn, causal, placement, rope, eps, q_offset, k_offset, method, chunk_size);
  return with_inputs(fn, q, k, v, &d_out, q_lengths, k_lengths, [&]<class T>() -> py::object {
    const Inputs<T> in = inputs<T>(q, k, v, &d_out, q_lengths, k_lengths);
    return gradients<T>(in, [&](Heads<T> dq, Heads<T> dk, Heads<T> dv) {
      linear_attention_backward(in.q_heads(), in.k_heads(), in.v_heads(), in.d_out_heads(), dq, dk,
                                dv, map, options);
    });
  });
}

// ---- Rope ---------------------------------------------------------------------------------------

enum class Turn { Apply, Inverse, Transpose };

// rope.apply, apply_inverse or apply_transpose on rows, at `where`: a first position or a list.
template <class T, class Where>
void turn_rows(const Rope& rope, Turn turn, Eigen::Ref<Matrix<T>> rows, Where where) {
  switch (turn) {
    case Turn::Apply:
      return rope.apply(rows, where);
    case Turn::Inverse:
      return rope.apply_inverse(rows, where);
    case Turn::Transpose:
      return rope.apply_transpose(rows, where);
  }
}

// A turned copy of x: in each (n, d) slice (all of x when 2-D) row i is at first_position + i, or
// at positions[i].
template <class T, class Where>
py::object rope_turn(const Rope& rope, Turn turn, const py::array& x, Where where) {
  CArray<T> out = new_array<T>(x, x.shape(x.ndim() - 1));
  auto rows = rows_of(out);
  const CArray<T> xc = contiguous<T>(x);
  const auto x_rows = rows_of(xc);
  const Index n = Index(x.shape(x.ndim() - 2));
  {
    KernelScope scope;
    rows = x_rows;  // the copy the rotation works in place on, also without the GIL
    if (n == 0 || rows.rows() == 0) {
      // Nothing to turn, but the width is still checked (a position list's length is checked
      // by rope_call: here it may not match the zero rows of an empty batch).
      turn_rows<T>(rope, turn, rows, Index(0));
    } else {
      for (Index s = 0; s < rows.rows() / n; ++s)
        turn_rows<T>(rope, turn, rows.middleRows(s * n, n), where);
    }
  }
  return out;
}

using Positions = std::optional<std::vector<Index>>;

py::object rope_call(std::string_view function, Turn turn, const Rope& rope, const py::array& x,
                     Index first_position, const Positions& positions) {
  require_rank(function, "x", x);
  const bool single = dtype_of(function, "x", x) == DType::Float32;
  if (!positions) {
    if (single) return rope_turn<float>(rope, turn, x, first_position);
    return rope_turn<double>(rope, turn, x, first_position);
  }
  if (first_position != 0)
    fail(function, "first_position is ", first_position, " and positions are given: pass one");
  const auto n = std::size_t(x.shape(x.ndim() - 2));
  if (positions->size() != n)
    fail(function, "positions has ", positions->size(), " entries but x has n = ", n,
         " rows in each (n, d) slice");
  const std::span<const Index> list(*positions);  // its length is checked by the C++ call
  if (single) return rope_turn<float>(rope, turn, x, list);
  return rope_turn<double>(rope, turn, x, list);
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

std::unique_ptr<FeatureMap> make_map(const std::string& kind, Index input_dim, Index num_features,
                                     bool orthogonal, std::uint64_t seed, bool regularized) {
  return make_feature_map({.kind = parse_name("FeatureMap", feature_map_kind_from_string, kind),
                           .input_dim = input_dim,
                           .num_features = num_features,
                           .orthogonal = orthogonal,
                           .seed = seed,
                           .regularized = regularized});
}

template <class T>
py::object map_apply(const FeatureMap& map, const py::array& x) {
  const CArray<T> xc = contiguous<T>(x);
  CArray<T> out = new_array<T>(x, map.output_dim());
  auto rows = rows_of(out);
  const auto x_rows = rows_of(xc);
  {
    KernelScope scope;
    map.apply(x_rows, rows);
  }
  return out;
}

template <class T>
py::object map_backward(const FeatureMap& map, const py::array& x, const py::array& d_out) {
  const CArray<T> xc = contiguous<T>(x), gc = contiguous<T>(d_out);
  CArray<T> dx = new_array<T>(x, x.shape(x.ndim() - 1));
  auto rows = rows_of(dx);
  const auto x_rows = rows_of(xc), g_rows = rows_of(gc);
  {
    KernelScope scope;
    map.backward(x_rows, g_rows, rows);
  }
  return dx;
}

// ---- Stream -------------------------------------------------------------------------------------

// LinearAttentionStream<float> or <double>, chosen by the dtype named at construction. The C++
// stream keeps references to the map and the rope; Python keeps them alive (keep_alive below).
class Stream {
 public:
  Stream(const FeatureMap& map, Index value_dim, const std::string& dtype,
         const std::string& placement, const Rope* rope, double eps, Index offset)
      : stream_(make(map, value_dim, dtype,
                     linear_options("LinearAttentionStream", true, placement, rope, eps, offset,
                                    offset, "scan", 64))) {}

  // q [t, d], k [t, d], v [t, d_v] of the stream's dtype -> [t, d_v] (and the statistics).
  py::object step(const py::array& q, const py::array& k, const py::array& v, bool return_stats,
                  double stats_threshold) {
    constexpr std::string_view fn = "LinearAttentionStream.step";
    return std::visit(
        [&]<class T>(LinearAttentionStream<T>& stream) -> py::object {
          const std::array<const char*, 3> names = {"q", "k", "v"};
          const std::array<const py::array*, 3> arrays = {&q, &k, &v};
          for (std::size_t i = 0; i < 3; ++i) {
            if (arrays[i]->ndim() != 2)
              fail(fn, names[i], " has ", arrays[i]->ndim(), " dimensions but expected 2 (t, d)");
            if (!arrays[i]->dtype().equal(py::dtype::of<T>()))
              fail(fn, names[i], " has dtype ", std::string(py::str(arrays[i]->dtype())),
                   " but the stream's is ", std::string(py::str(py::dtype::of<T>())));
          }
          // Copies: step takes Matrix<T>, and a step's few rows cost nothing to copy.
          const Matrix<T> qm = rows_of(contiguous<T>(q)), km = rows_of(contiguous<T>(k)),
                          vm = rows_of(contiguous<T>(v));
          DenominatorStats stats{.threshold = stats_threshold};
          Matrix<T> out;
          {
            KernelScope scope;
            out = stream.step(qm, km, vm, return_stats ? &stats : nullptr);
          }
          CArray<T> result({out.rows(), out.cols()});
          rows_of(result) = out;
          if (return_stats) return py::make_tuple(std::move(result), stats_dict(stats));
          return result;
        },
        stream_);
  }

  Index position() const {
    return std::visit([](const auto& stream) { return stream.position(); }, stream_);
  }
  void reset() {
    std::visit([](auto& stream) { stream.reset(); }, stream_);
  }
  std::string dtype() const {
    return std::holds_alternative<LinearAttentionStream<float>>(stream_) ? "float32" : "float64";
  }

 private:
  using Either = std::variant<LinearAttentionStream<float>, LinearAttentionStream<double>>;
  static Either make(const FeatureMap& map, Index value_dim, const std::string& dtype,
                     const LinearOptions& options) {
    if (dtype == "float32") return LinearAttentionStream<float>(map, value_dim, options);
    if (dtype == "float64") return LinearAttentionStream<double>(map, value_dim, options);
    fail("LinearAttentionStream", "dtype is \"", dtype, "\" but expected one of float32, float64");
  }
  Either stream_;
};

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
  // For the benchmarks: seconds spent in the C++ kernels since import (GIL released, threads set).
  m.def("_kernel_seconds", [] { return double(kernel_nanoseconds().load()) * 1e-9; });
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
          [](const Rope& r, const py::array& x, Index first_position, const Positions& positions) {
            return rope_call("Rope.apply", Turn::Apply, r, x, first_position, positions);
          },
          "x"_a, "first_position"_a = 0, "positions"_a = py::none(),
          "R x: a rotated copy of x, row i at first_position + i (or at positions[i]).")
      .def(
          "apply_inverse",
          [](const Rope& r, const py::array& x, Index first_position, const Positions& positions) {
            return rope_call("Rope.apply_inverse", Turn::Inverse, r, x, first_position, positions);
          },
          "x"_a, "first_position"_a = 0, "positions"_a = py::none(), "R^-1 x.")
      .def(
          "apply_transpose",
          [](const Rope& r, const py::array& x, Index first_position, const Positions& positions) {
            return rope_call("Rope.apply_transpose", Turn::Transpose, r, x, first_position,
                             positions);
          },
          "x"_a, "first_position"_a = 0, "positions"_a = py::none(),
          "R^T x, the gradient of apply (differs from R^-1 under YaRN).")
      // Pickled as its configuration, from which the tables are rebuilt.
      .def(py::pickle(
          [](const Rope& r) {
            const RopeConfig& c = r.config();
            return py::make_tuple(c.dim, r.rotary_dim(), c.base, to_string(c.layout),
                                  to_string(c.scaling.kind), c.scaling.factor,
                                  c.scaling.original_max_position, c.scaling.beta_fast,
                                  c.scaling.beta_slow);
          },
          [](const py::tuple& t) {
            return make_rope(t[0].cast<Index>(), t[1].cast<Index>(), t[2].cast<double>(),
                             t[3].cast<std::string>(), t[4].cast<std::string>(),
                             t[5].cast<double>(), t[6].cast<Index>(), t[7].cast<double>(),
                             t[8].cast<double>());
          }));

  py::class_<FeatureMap, std::unique_ptr<FeatureMap>>(
      m, "FeatureMap", "A feature map phi: R^d -> R^m; see include/linrope/feature_maps.hpp.")
      .def(py::init(&make_map), "kind"_a, "input_dim"_a, "num_features"_a = 0,
           "orthogonal"_a = true, "seed"_a = 0, "regularized"_a = false)
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
            // The C++ call sees rows only: x [..., d] and d_out [..., m] must share the leading
            // shape, or rows would pair up in flattened order.
            if (d_out.ndim() != x.ndim() ||
                !std::equal(x.shape(), x.shape() + x.ndim() - 1, d_out.shape()))
              fail(fn, "d_out has shape ", shape_text(d_out), " but x has ", shape_text(x),
                   ": expected the same leading dimensions");
            if (common_dtype<2>(fn, {"x", "d_out"}, {&x, &d_out}) == DType::Float32)
              return map_backward<float>(f, x, d_out);
            return map_backward<double>(f, x, d_out);
          },
          "x"_a, "d_out"_a, "J^T d_out, the gradient through apply at x: [..., d].")
      .def("redraw", &FeatureMap::redraw, "seed"_a,
           "Draws a new W from seed. Not while a kernel that uses the map runs in another thread.")
      // Pickled as its configuration: the seed determines W (copy.deepcopy, torch.save).
      .def(py::pickle(
          [](const FeatureMap& f) {
            const FeatureMapConfig& c = f.config();
            return py::make_tuple(to_string(c.kind), c.input_dim, c.num_features, c.orthogonal,
                                  c.seed, c.regularized);
          },
          [](const py::tuple& t) {
            return make_map(t[0].cast<std::string>(), t[1].cast<Index>(), t[2].cast<Index>(),
                            t[3].cast<bool>(), t[4].cast<std::uint64_t>(), t[5].cast<bool>());
          }));

  py::class_<Stream>(m, "LinearAttentionStream",
                     "Causal linear attention for decoding, a few tokens per step; "
                     "see include/linrope/attention.hpp.")
      .def(py::init<const FeatureMap&, Index, const std::string&, const std::string&, const Rope*,
                    double, Index>(),
           "feature_map"_a, "value_dim"_a, py::kw_only(), "dtype"_a = "float32",
           "placement"_a = "numerator_only", "rope"_a = py::none(), "eps"_a = 1e-6, "offset"_a = 0,
           py::keep_alive<1, 2>(), py::keep_alive<1, 6>())
      .def("step", &Stream::step, "q"_a, "k"_a, "v"_a, py::kw_only(), "return_stats"_a = false,
           "stats_threshold"_a = 1e-3,
           "Appends t tokens (q, k [t, d], v [t, d_v]) and returns their outputs [t, d_v].")
      .def_property_readonly("position", &Stream::position, "Position of the next token.")
      .def_property_readonly("dtype", &Stream::dtype)
      .def("reset", &Stream::reset, "Back to an empty state at the first offset.");

  // The attention functions' arguments in DESIGN.md's order (positional use allowed), then the
  // ones added since: method, chunk_size, the lengths.
  m.def("softmax_attention", &softmax_forward, "q"_a, "k"_a, "v"_a, "causal"_a = false,
        "scale"_a = py::none(), "rope"_a = py::none(), "q_offset"_a = 0, "k_offset"_a = 0,
        "q_lengths"_a = py::none(), "k_lengths"_a = py::none(),
        "Exact softmax attention: q [.., n, d], k [.., n_k, d], v [.., n_k, d_v] -> [.., n, d_v].");
  m.def("linear_attention", &linear_forward, "q"_a, "k"_a, "v"_a, "feature_map"_a,
        "causal"_a = false, "placement"_a = "numerator_only", "rope"_a = py::none(), "eps"_a = 1e-6,
        "q_offset"_a = 0, "k_offset"_a = 0, "return_stats"_a = false, "stats_threshold"_a = 1e-3,
        "method"_a = "scan", "chunk_size"_a = 64, "q_lengths"_a = py::none(),
        "k_lengths"_a = py::none(),
        "Linear attention; with return_stats=True returns (out, denominator statistics).");
  m.def("softmax_attention_backward", &softmax_backward, "q"_a, "k"_a, "v"_a, "d_out"_a,
        "causal"_a = false, "scale"_a = py::none(), "rope"_a = py::none(), "q_offset"_a = 0,
        "k_offset"_a = 0, "q_lengths"_a = py::none(), "k_lengths"_a = py::none(),
        "(dq, dk, dv) of sum(d_out * softmax_attention(...)).");
  m.def("linear_attention_backward", &linear_backward, "q"_a, "k"_a, "v"_a, "d_out"_a,
        "feature_map"_a, "causal"_a = false, "placement"_a = "numerator_only",
        "rope"_a = py::none(), "eps"_a = 1e-6, "q_offset"_a = 0, "k_offset"_a = 0,
        "method"_a = "scan", "chunk_size"_a = 64, "q_lengths"_a = py::none(),
        "k_lengths"_a = py::none(), "(dq, dk, dv) of sum(d_out * linear_attention(...)).");
}
