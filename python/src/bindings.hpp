// The pieces of linrope._core: each bind_* adds one family of names to the module (module.cpp
// calls them in this order, which is the order classes must be registered in before functions
// use them as arguments).
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>  // every unit alike: std::optional, std::vector arguments

namespace linrope::python {

namespace py = pybind11;

void bind_threads(py::module_& m);            // threads.cpp: openmp, set/get_num_threads
void bind_arrays(py::module_& m);             // arrays.cpp: the tests' _kernel_view
void bind_options(py::module_& m);            // bind_options.cpp: the options structs, defaults
void bind_rope(py::module_& m);               // bind_rope.cpp: Rope
void bind_feature_maps(py::module_& m);       // bind_feature_maps.cpp: FeatureMap
void bind_stream(py::module_& m);             // bind_stream.cpp: LinearAttentionStream
void bind_softmax_attention(py::module_& m);  // bind_softmax_attention.cpp
void bind_linear_attention(py::module_& m);   // bind_linear_attention.cpp
void bind_matmul(py::module_& m);             // bind_matmul.cpp: matmul
void bind_layer_functions(py::module_& m);    // bind_layer_functions.cpp: gelu, rms_norm

}  // namespace linrope::python
