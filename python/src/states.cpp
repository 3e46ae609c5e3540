// NumPy states for state in, state out (states.hpp).
#include "states.hpp"

#include <string>

namespace linrope::python {

std::vector<py::ssize_t> leading_shape(const py::array& q) {
  return std::vector<py::ssize_t>(q.shape(), q.shape() + q.ndim() - 2);
}

namespace {

std::string shape_string(const std::vector<py::ssize_t>& shape) {
  std::string s = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

std::vector<py::ssize_t> with(std::vector<py::ssize_t> shape, std::initializer_list<Index> tail) {
  for (const Index t : tail) shape.push_back(py::ssize_t(t));
  return shape;
}

// One member of a state: an array of dtype U and exactly `shape`.
template <class U>
CArray<U> member(std::string_view function, const std::string& name, const py::handle& item,
                 const std::vector<py::ssize_t>& shape, const char* dtype) {
  if (!py::isinstance<py::array>(item))
    fail(function, name, " is a ", std::string(py::str(item.get_type().attr("__name__"))),
         " but expected a NumPy array");
  const py::array a = py::reinterpret_borrow<py::array>(item);
  if (!a.dtype().is(py::dtype::of<U>()))
    fail(function, name, " has dtype ", std::string(py::str(a.dtype())), " but expected ", dtype);
  const std::vector<py::ssize_t> got(a.shape(), a.shape() + a.ndim());
  if (got != shape)
    fail(function, name, " has shape ", shape_text(a), " but expected ", shape_string(shape),
         " (q's leading dimensions, m = feature_map.output_dim, v's d_v)");
  return contiguous<U>(a);
}

}  // namespace

template <class T>
StateArrays<T> read_state(std::string_view function, const char* name, const py::object& state,
                          const py::array& q, Index m, Index d_v, bool with_scale) {
  StateArrays<T> s;
  if (state.is_none()) return s;
  const std::size_t count = with_scale ? 3 : 2;
  if (!py::isinstance<py::tuple>(state) && !py::isinstance<py::list>(state))
    fail(function, name, " is a ", std::string(py::str(state.get_type().attr("__name__"))),
         " but expected None or a tuple ", with_scale ? "(S, z, log_scale)" : "(dS, dz)");
  const py::sequence items = state;
  if (items.size() != count)
    fail(function, name, " has ", items.size(), " items but expected ", count,
         with_scale ? ": (S, z, log_scale)" : ": (dS, dz)");
  const std::vector<py::ssize_t> lead = leading_shape(q);
  const char* dtype = std::is_same_v<T, float> ? "float32 (q's dtype)" : "float64 (q's dtype)";
  const std::string prefix(name);
  s.present = true;
  s.S = member<T>(function, prefix + (with_scale ? ".S" : ".dS"), items[0], with(lead, {m, d_v}),
                  dtype);
  s.z = member<T>(function, prefix + (with_scale ? ".z" : ".dz"), items[1], with(lead, {m}), dtype);
  s.has_scale = with_scale;
  if (with_scale)
    s.log_scale = member<double>(function, prefix + ".log_scale", items[2], lead, "float64");
  return s;
}

template <class T>
StateArrays<T> new_state(const py::array& q, Index m, Index d_v, bool with_scale) {
  const std::vector<py::ssize_t> lead = leading_shape(q);
  StateArrays<T> s;
  s.present = true;
  s.has_scale = with_scale;
  s.S = CArray<T>(with(lead, {m, d_v}));
  s.z = CArray<T>(with(lead, {m}));
  if (with_scale) s.log_scale = CArray<double>(lead);
  return s;
}

template StateArrays<float> read_state<float>(std::string_view, const char*, const py::object&,
                                              const py::array&, Index, Index, bool);
template StateArrays<double> read_state<double>(std::string_view, const char*, const py::object&,
                                                const py::array&, Index, Index, bool);
template StateArrays<float> new_state<float>(const py::array&, Index, Index, bool);
template StateArrays<double> new_state<double>(const py::array&, Index, Index, bool);

}  // namespace linrope::python
