#include "arrays.hpp"

#include <cstdint>

#include "attention_inputs.hpp"
#include "bindings.hpp"

namespace linrope::python {

DType dtype_of(std::string_view function, const char* name, const py::array& a) {
  // By value, not identity: NumPy does not always reuse its dtype objects (an unpickled array's is
  // another); a non-native byte order compares unequal and is refused.
  if (a.dtype().equal(py::dtype::of<float>())) return DType::Float32;
  if (a.dtype().equal(py::dtype::of<double>())) return DType::Float64;
  fail(function, name, " has dtype ", std::string(py::str(a.dtype())),
       " but expected float32 or float64");
}

std::string shape_text(const py::array& a) {
  std::string text = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) text += (i ? ", " : "") + std::to_string(a.shape(i));
  return text + (a.ndim() == 1 ? ",)" : ")");
}

void require_rank(std::string_view function, const char* name, const py::array& a) {
  if (a.ndim() != 2 && a.ndim() != 4)
    fail(function, name, " has ", a.ndim(), " dimensions but expected 2 (n, d) or 4 (B, H, n, d)");
}

void require_rows(std::string_view function, const char* name, const py::array& a) {
  if (a.ndim() < 1) fail(function, name, " has 0 dimensions but expected at least 1 (..., d)");
}

void check_lengths(std::string_view function, const char* name, const Lengths& lengths,
                   const py::array& a, const char* of) {
  if (!lengths) return;
  const auto batch = a.ndim() == 4 ? std::size_t(a.shape(0)) : std::size_t(1);
  if (lengths->size() != batch)
    fail(function, name, " has ", lengths->size(), " entries but ", of, " has batch ", batch);
}

void bind_arrays(py::module_& m) {
  // For the tests: the address of the buffer a kernel would read for x (x's own when C-contiguous).
  m.def("_kernel_view", [](const py::array& x) -> std::uintptr_t {
    if (dtype_of("_kernel_view", "x", x) == DType::Float32)
      return reinterpret_cast<std::uintptr_t>(contiguous<float>(x).data());
    return reinterpret_cast<std::uintptr_t>(contiguous<double>(x).data());
  });
  // The same for an attention's input (attention_inputs.hpp, heads_array), and the layout the
  // kernels are told it has.
  m.def("_kernel_heads_view", [](const py::array& x) -> py::tuple {
    const auto view = [](const auto& heads) {
      const py::array& a = heads.array;
      return py::make_tuple(reinterpret_cast<std::uintptr_t>(a.data()),
                            heads.layout == HeadsLayout::BNHD ? "BNHD" : "BHND");
    };
    if (dtype_of("_kernel_heads_view", "x", x) == DType::Float32)
      return view(heads_array<float>(x));
    return view(heads_array<double>(x));
  });
}

}  // namespace linrope::python
