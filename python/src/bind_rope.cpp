// linrope.Rope: RoPE on NumPy arrays, apply / apply_inverse / apply_transpose on copies.
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "arrays.hpp"
#include "bindings.hpp"
#include "options.hpp"
#include "rope/rope_access.hpp"
#include "threads.hpp"

namespace linrope::python {
namespace {

using detail::Turn;  // the kernels' own name for which of R, R^-1, R^T a call applies

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

// One of apply, apply_inverse, apply_transpose: its binding, named "Rope.<name>" in errors.
template <Turn turn>
py::object turn_method(const Rope& r, const py::array& x, Index first_position,
                       const Positions& positions) {
  constexpr std::string_view names[] = {"Rope.apply", "Rope.apply_inverse", "Rope.apply_transpose"};
  return rope_call(names[int(turn)], turn, r, x, first_position, positions);
}

}  // namespace

void bind_rope(py::module_& m) {
  using namespace pybind11::literals;
  const RopeConfig& c = rope_defaults;
  py::class_<Rope>(m, "Rope",
                   "Rotary Position Embedding of width dim; see include/linrope/rope.hpp.")
      .def(py::init(&make_rope), "dim"_a, "rotary_dim"_a = c.rotary_dim, "base"_a = c.base,
           "layout"_a = name_of(c.layout), "scaling"_a = name_of(c.scaling.kind),
           "factor"_a = c.scaling.factor,
           "original_max_position"_a = c.scaling.original_max_position,
           "beta_fast"_a = c.scaling.beta_fast, "beta_slow"_a = c.scaling.beta_slow)
      .def_property_readonly("dim", &Rope::dim)
      .def_property_readonly("rotary_dim", &Rope::rotary_dim)
      .def_property_readonly("base", [](const Rope& r) { return r.config().base; })
      .def_property_readonly("layout", [](const Rope& r) { return name_of(r.config().layout); })
      .def_property_readonly("scaling",
                             [](const Rope& r) { return name_of(r.config().scaling.kind); })
      .def_property_readonly("factor", [](const Rope& r) { return r.config().scaling.factor; })
      .def_property_readonly("magnitude", &Rope::magnitude)
      .def("frequencies",
           [](const Rope& r) {
             const std::vector<double> theta = r.frequencies();
             return CArray<double>(py::ssize_t(theta.size()), theta.data());
           })
      .def("apply", &turn_method<Turn::Apply>, "x"_a, "first_position"_a = 0,
           "positions"_a = py::none(),
           "R x: a rotated copy of x, row i at first_position + i (or at positions[i]).")
      .def("apply_inverse", &turn_method<Turn::Inverse>, "x"_a, "first_position"_a = 0,
           "positions"_a = py::none(), "R^-1 x.")
      .def("apply_transpose", &turn_method<Turn::Transpose>, "x"_a, "first_position"_a = 0,
           "positions"_a = py::none(),
           "R^T x, the gradient of apply (differs from R^-1 under YaRN).")
      // Pickled as its configuration, from which the tables are rebuilt.
      .def(py::pickle(
          [](const Rope& r) {
            const RopeConfig& rc = r.config();
            return py::make_tuple(rc.dim, r.rotary_dim(), rc.base, name_of(rc.layout),
                                  name_of(rc.scaling.kind), rc.scaling.factor,
                                  rc.scaling.original_max_position, rc.scaling.beta_fast,
                                  rc.scaling.beta_slow);
          },
          [](const py::tuple& t) {
            return make_rope(t[0].cast<Index>(), t[1].cast<Index>(), t[2].cast<double>(),
                             t[3].cast<std::string>(), t[4].cast<std::string>(),
                             t[5].cast<double>(), t[6].cast<Index>(), t[7].cast<double>(),
                             t[8].cast<double>());
          }));
}

}  // namespace linrope::python
