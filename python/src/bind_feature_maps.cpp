// linrope.FeatureMap: phi row by row on NumPy arrays, its backward, and redraw.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "arrays.hpp"
#include "bindings.hpp"
#include "options.hpp"
#include "threads.hpp"

namespace linrope::python {
namespace {

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
    KernelScope scope(&map);
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
    KernelScope scope(&map);
    map.backward(x_rows, g_rows, rows);
  }
  return dx;
}

}  // namespace

void bind_feature_maps(py::module_& m) {
  using namespace pybind11::literals;
  const FeatureMapConfig& c = map_defaults;
  py::class_<FeatureMap, std::unique_ptr<FeatureMap>>(
      m, "FeatureMap", "A feature map phi: R^d -> R^m; see include/linrope/feature_maps.hpp.")
      .def(py::init(&make_map), "kind"_a, "input_dim"_a, "num_features"_a = c.num_features,
           "orthogonal"_a = c.orthogonal, "seed"_a = c.seed, "regularized"_a = c.regularized)
      .def_property_readonly("kind", [](const FeatureMap& f) { return name_of(f.kind()); })
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
      .def("redraw", &redraw_unless_in_use, "seed"_a,
           "Draws a new W from seed. Kernels read W without the GIL, so while a call that uses "
           "this map (apply, backward, linear_attention, its backward, a stream's step) runs in "
           "another thread, redraw raises RuntimeError and leaves W unchanged; redraw after the "
           "call returns, or draw a new FeatureMap.")
      // Pickled as its configuration: the seed determines W (copy.deepcopy, torch.save).
      .def(py::pickle(
          [](const FeatureMap& f) {
            const FeatureMapConfig& fc = f.config();
            return py::make_tuple(name_of(fc.kind), fc.input_dim, fc.num_features, fc.orthogonal,
                                  fc.seed, fc.regularized);
          },
          [](const py::tuple& t) {
            return make_map(t[0].cast<std::string>(), t[1].cast<Index>(), t[2].cast<Index>(),
                            t[3].cast<bool>(), t[4].cast<std::uint64_t>(), t[5].cast<bool>());
          }));
}

}  // namespace linrope::python
