// linrope.gelu, gelu_backward, rms_norm, rms_norm_backward: the element-wise and row-wise pieces
// of a transformer block around attention (include/linrope/activation.hpp, normalization.hpp), on
// NumPy arrays of any shape (RMSNorm over the last dimension). Every output is a new array.
#include <algorithm>
#include <cmath>
#include <string_view>
#include <vector>

#include "arrays.hpp"
#include "bindings.hpp"
#include "threads.hpp"

namespace linrope::python {
namespace {

// x's values as one flat vector, and a new array of x's shape viewed the same way.
template <class T>
Eigen::Map<const Vector<T>> flat(const CArray<T>& x) {
  return {x.data(), Index(x.size())};
}
template <class T>
Eigen::Map<Vector<T>> flat(CArray<T>& x) {
  return {x.mutable_data(), Index(x.size())};
}

template <class T>
CArray<T> like(const py::array& x) {
  return new_array<T>(std::vector<py::ssize_t>(x.shape(), x.shape() + x.ndim()));
}

void same_shape(std::string_view fn, const char* name, const py::array& a, const py::array& x) {
  if (!std::equal(a.shape(), a.shape() + a.ndim(), x.shape(), x.shape() + x.ndim()))
    fail(fn, name, " has shape ", shape_text(a), " but x has shape ", shape_text(x));
}

template <class T>
py::object gelu_of(const py::array& x_in) {
  const CArray<T> x = contiguous<T>(x_in);
  CArray<T> y = like<T>(x);
  {
    KernelScope scope;
    gelu(flat(x), flat(y));
  }
  return y;
}

template <class T>
py::object gelu_backward_of(const py::array& x_in, const py::array& d_y_in) {
  const CArray<T> x = contiguous<T>(x_in), d_y = contiguous<T>(d_y_in);
  CArray<T> d_x = like<T>(x);
  {
    KernelScope scope;
    gelu_backward(flat(x), flat(d_y), flat(d_x));
  }
  return d_x;
}

template <class T>
py::tuple rms_norm_of(const py::array& x_in, const py::array& weight_in, double eps) {
  const CArray<T> x = contiguous<T>(x_in), weight = contiguous<T>(weight_in);
  CArray<T> y = like<T>(x);
  const auto rows = rows_of(x);
  CArray<T> inv_rms(std::vector<py::ssize_t>(x.shape(), x.shape() + x.ndim() - 1));
  {
    KernelScope scope;
    rms_norm(rows, flat(weight), T(eps), rows_of(y), flat(inv_rms));
  }
  return py::make_tuple(y, inv_rms);
}

template <class T>
py::tuple rms_norm_backward_of(const py::array& x_in, const py::array& weight_in,
                               const py::array& inv_rms_in, const py::array& d_y_in) {
  const CArray<T> x = contiguous<T>(x_in), weight = contiguous<T>(weight_in);
  const CArray<T> inv_rms = contiguous<T>(inv_rms_in), d_y = contiguous<T>(d_y_in);
  CArray<T> d_x = like<T>(x), d_weight = like<T>(weight);
  {
    KernelScope scope;
    rms_norm_backward(rows_of(x), flat(weight), flat(inv_rms), rows_of(d_y), rows_of(d_x),
                      flat(d_weight));
  }
  return py::make_tuple(d_x, d_weight);
}

py::object gelu_call(const py::array& x) {
  if (dtype_of("gelu", "x", x) == DType::Float32) return gelu_of<float>(x);
  return gelu_of<double>(x);
}

py::object gelu_backward_call(const py::array& x, const py::array& d_y) {
  constexpr std::string_view fn = "gelu_backward";
  const DType dtype = common_dtype<2>(fn, {"x", "d_y"}, {&x, &d_y});
  same_shape(fn, "d_y", d_y, x);
  if (dtype == DType::Float32) return gelu_backward_of<float>(x, d_y);
  return gelu_backward_of<double>(x, d_y);
}

// x [..., d], d >= 1 (checked here: with d = 0 the row matrix the C++ call sees has 0 rows too),
// weight 1-D; the C++ call checks weight's length and the rest against d.
void require_rows_and_weight(std::string_view fn, const py::array& x, const py::array& weight) {
  require_rows(fn, "x", x);
  if (x.shape(x.ndim() - 1) == 0)
    fail(fn, "x has shape ", shape_text(x), "; expected a last dimension d >= 1");
  if (weight.ndim() != 1) fail(fn, "weight has ", weight.ndim(), " dimensions but expected 1");
}

py::tuple rms_norm_call(const py::array& x, const py::array& weight, double eps) {
  constexpr std::string_view fn = "rms_norm";
  require_rows_and_weight(fn, x, weight);
  // Checked as given: float32 would round 1e-50 to 0 and -1e-6 to -9.99...e-07 in the message.
  if (!(std::isfinite(eps) && eps > 0)) fail(fn, "eps is ", eps, " but expected > 0");
  if (dtype_of(fn, "x", x) == DType::Float32 && !(std::isfinite(float(eps)) && float(eps) > 0))
    fail(fn, "eps is ", eps, ", which float32 rounds to ", float(eps), "; expected > 0");
  if (common_dtype<2>(fn, {"x", "weight"}, {&x, &weight}) == DType::Float32)
    return rms_norm_of<float>(x, weight, eps);
  return rms_norm_of<double>(x, weight, eps);
}

py::tuple rms_norm_backward_call(const py::array& x, const py::array& weight,
                                 const py::array& inv_rms, const py::array& d_y) {
  constexpr std::string_view fn = "rms_norm_backward";
  require_rows_and_weight(fn, x, weight);
  const DType dtype =
      common_dtype<4>(fn, {"x", "weight", "inv_rms", "d_y"}, {&x, &weight, &inv_rms, &d_y});
  same_shape(fn, "d_y", d_y, x);
  if (inv_rms.ndim() != x.ndim() - 1 ||
      !std::equal(x.shape(), x.shape() + x.ndim() - 1, inv_rms.shape()))
    fail(fn, "inv_rms has shape ", shape_text(inv_rms), " but x has shape ", shape_text(x),
         "; expected x's shape without its last dimension");
  if (dtype == DType::Float32) return rms_norm_backward_of<float>(x, weight, inv_rms, d_y);
  return rms_norm_backward_of<double>(x, weight, inv_rms, d_y);
}

}  // namespace

void bind_layer_functions(py::module_& m) {
  using namespace pybind11::literals;
  m.def("gelu", &gelu_call, "x"_a,
        "GELU(x) = x Phi(x) (exact form, nn.GELU's default), element by element: a new array.");
  m.def("gelu_backward", &gelu_backward_call, "x"_a, "d_y"_a,
        "d_y * GELU'(x), GELU'(x) = Phi(x) + x phi(x): a new array.");
  m.def("rms_norm", &rms_norm_call, "x"_a, "weight"_a, "eps"_a,
        "RMSNorm over x's last dimension d: (y, inv_rms), y = x * inv_rms[..., None] * weight, "
        "inv_rms = 1 / sqrt(mean(x^2, -1) + eps) (x's shape without d).");
  m.def("rms_norm_backward", &rms_norm_backward_call, "x"_a, "weight"_a, "inv_rms"_a, "d_y"_a,
        "The gradients of rms_norm: (d_x, d_weight) for d_y = dL/dy.");
}

}  // namespace linrope::python
