// linrope.matmul: the library's matrix product (include/linrope/matmul.hpp) on 2-D NumPy arrays,
// into a new array or into `out` in place (linrope.torch.Linear writes into a tensor's memory).
#include <array>
#include <optional>
#include <string>
#include <string_view>

#include "arrays.hpp"
#include "bindings.hpp"
#include "threads.hpp"

namespace linrope::python {
namespace {

constexpr std::string_view kName = "matmul";

void require_matrix(const char* name, const py::array& a) {
  if (a.ndim() != 2) fail(kName, name, " has ", a.ndim(), " dimensions but expected 2");
}

template <class T>
py::object multiply(const py::array& a, const py::array& b, std::optional<py::array> out,
                    const MatmulOptions& options) {
  const CArray<T> ac = contiguous<T>(a), bc = contiguous<T>(b);
  const Eigen::Map<const Matrix<T>> a_rows(ac.data(), Index(a.shape(0)), Index(a.shape(1)));
  const Eigen::Map<const Matrix<T>> b_rows(bc.data(), Index(b.shape(0)), Index(b.shape(1)));
  const py::ssize_t m = options.transpose_a ? a.shape(1) : a.shape(0);
  const py::ssize_t n = options.transpose_b ? b.shape(0) : b.shape(1);
  CArray<T> c;
  if (out) {
    // Written in place, so it must be the very buffer: no copy could carry the result back.
    const bool in_place = (out->flags() & py::array::c_style) && out->writeable() &&
                          (out->flags() & py::detail::npy_api::NPY_ARRAY_ALIGNED_);
    if (!in_place)
      fail(kName, "out must be a C-contiguous, aligned, writeable array (it is written in place)");
    if (out->shape(0) != m || out->shape(1) != n)
      fail(kName, "out has shape ", shape_text(*out), " but expected (", m, ", ", n, ")");
    c = CArray<T>::ensure(*out);
  } else {
    c = new_array<T>({m, n});
  }
  // Named as Python names them (the C++ call would say c); the buffers are dense, so comparing
  // their byte ranges is exact.
  const auto shares = [&](const py::array& x) {
    const auto* first = static_cast<const char*>(x.data());
    const auto* c_first = reinterpret_cast<const char*>(c.data());
    return x.nbytes() > 0 && c.nbytes() > 0 && first < c_first + c.nbytes() &&
           c_first < first + x.nbytes();
  };
  if (shares(ac)) fail(kName, "out overlaps a; expected separate storage");
  if (shares(bc)) fail(kName, "out overlaps b; expected separate storage");
  Eigen::Map<Matrix<T>> c_rows(c.mutable_data(), Index(c.shape(0)), Index(c.shape(1)));
  {
    KernelScope scope;
    matmul(a_rows, b_rows, c_rows, options);
  }
  return c;
}

py::object matmul_call(const py::array& a, const py::array& b, bool transpose_a, bool transpose_b,
                       std::optional<py::array> out, bool accumulate) {
  require_matrix("a", a);
  require_matrix("b", b);
  if (accumulate && !out) fail(kName, "accumulate is true but no out is given to add to");
  if (out) {
    require_matrix("out", *out);
    common_dtype<3>(kName, {"a", "b", "out"}, {&a, &b, &*out});
  }
  const MatmulOptions options{
      .transpose_a = transpose_a, .transpose_b = transpose_b, .accumulate = accumulate};
  if (common_dtype<2>(kName, {"a", "b"}, {&a, &b}) == DType::Float32)
    return multiply<float>(a, b, out, options);
  return multiply<double>(a, b, out, options);
}

}  // namespace

void bind_matmul(py::module_& m) {
  using namespace pybind11::literals;
  m.def("matmul", &matmul_call, "a"_a, "b"_a, "transpose_a"_a = false, "transpose_b"_a = false,
        "out"_a = py::none(), "accumulate"_a = false,
        "op(a) op(b), op(x) = x.T when its transpose flag is set: a new array, or written into "
        "out (added to it when accumulate). y = x W^T for an nn.Linear's weight W is "
        "matmul(x, W, transpose_b=True).");
}

}  // namespace linrope::python
