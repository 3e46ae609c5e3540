// The C++ options structs as Python classes (SoftmaxOptions, LinearOptions, DenominatorStats,
// RopeConfig, FeatureMapConfig): default-constructed, they hold the defaults of every keyword
// argument that mirrors one of their fields, which is where linrope.torch takes its own from.
// Enum fields read and write as the names the functions take ("numerator_only", "favor+", ...).
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "bindings.hpp"
#include "options.hpp"

namespace linrope::python {

namespace {

// A C++ struct bound as a Python class: default-constructible, its fields read-write, its repr a
// constructor call listing them in the order they were bound.
template <class Struct>
class StructBinding {
 public:
  StructBinding(py::module_& m, const char* name, const char* doc) : class_(m, name, doc) {
    class_.def(py::init<>());
    class_.def("__repr__", [names = names_](const py::object& self) {
      std::string text = py::type::of(self).attr("__name__").cast<std::string>() + "(";
      for (std::size_t i = 0; i < names->size(); ++i)
        text += (i ? ", " : "") + (*names)[i] + "=" +
                std::string(py::repr(self.attr((*names)[i].c_str())));
      return text + ")";
    });
  }

  template <class Member>
  StructBinding& field(const char* name, Member Struct::*member) {
    class_.def_readwrite(name, member);
    return add(name);
  }

  // A field of a nested struct: s.*outer.*member.
  template <class Outer, class Member>
  StructBinding& field(const char* name, Outer Struct::*outer, Member Outer::*member) {
    return property(
        name, [outer, member](const Struct& s) { return s.*outer.*member; },
        [outer, member](Struct& s, const Member& value) { s.*outer.*member = value; });
  }

  // An enum field as a str, the names the functions take: `field(&s)` points at it in s, `parse`
  // is the C++ name parser (a bad name is a ValueError naming "<class>.<field>").
  template <class Field, class Parse>
  StructBinding& name(const char* name, Field field, Parse parse) {
    const std::string where = class_.attr("__name__").template cast<std::string>() + "." + name;
    return property(
        name, [field](Struct& s) { return name_of(*field(&s)); },
        [field, parse, where](Struct& s, const std::string& value) {
          *field(&s) = parse_name(where, parse, value);
        });
  }

  StructBinding(const StructBinding&) = delete;
  StructBinding& operator=(const StructBinding&) = delete;

 private:
  template <class Get, class Set>
  StructBinding& property(const char* name, Get get, Set set) {
    class_.def_property(name, get, set);
    names_->emplace_back(name);
    return *this;
  }
  StructBinding& add(const char* name) {
    names_->emplace_back(name);
    return *this;
  }

  py::class_<Struct> class_;
  // Shared with __repr__, which is bound first and sees the fields bound after it.
  std::shared_ptr<std::vector<std::string>> names_ = std::make_shared<std::vector<std::string>>();
};

}  // namespace

void bind_options(py::module_& m) {
  StructBinding<SoftmaxOptions>(
      m, "SoftmaxOptions",
      "The C++ SoftmaxOptions (include/linrope/attention.hpp). Default-constructed, it holds the "
      "defaults of softmax_attention's keyword arguments; scale 0 is the C++ spelling of "
      "scale=None (1/sqrt(d)), and rope is an argument of its own.")
      .field("causal", &SoftmaxOptions::causal)
      .field("scale", &SoftmaxOptions::scale)
      .field("q_offset", &SoftmaxOptions::q_offset)
      .field("k_offset", &SoftmaxOptions::k_offset)
      .field("block_size", &SoftmaxOptions::block_size);

  StructBinding<LinearOptions>(
      m, "LinearOptions",
      "The C++ LinearOptions (include/linrope/attention.hpp). Default-constructed, it holds the "
      "defaults of linear_attention's keyword arguments (and LinearAttentionStream's); rope is an "
      "argument of its own.")
      .field("causal", &LinearOptions::causal)
      .name(
          "placement", [](LinearOptions* o) { return &o->placement; }, rope_placement_from_string)
      .field("eps", &LinearOptions::eps)
      .field("q_offset", &LinearOptions::q_offset)
      .field("k_offset", &LinearOptions::k_offset)
      .name(
          "method", [](LinearOptions* o) { return &o->method; }, causal_method_from_string)
      .field("chunk_size", &LinearOptions::chunk_size)
      .field("denominator", &LinearOptions::denominator)
      .field("decay", &LinearOptions::decay);

  StructBinding<DenominatorStats>(
      m, "DenominatorStats",
      "The C++ DenominatorStats (include/linrope/attention.hpp); the functions return them as a "
      "dict. Default-constructed, its threshold is the default of stats_threshold.")
      .field("min", &DenominatorStats::min)
      .field("nonpositive", &DenominatorStats::nonpositive)
      .field("below_threshold", &DenominatorStats::below_threshold)
      .field("threshold", &DenominatorStats::threshold)
      .field("count", &DenominatorStats::count)
      .field("no_keys", &DenominatorStats::no_keys)
      .field("zero_divisor", &DenominatorStats::zero_divisor);

  StructBinding<RopeConfig>(
      m, "RopeConfig",
      "The C++ RopeConfig (include/linrope/rope.hpp), its scaling's fields flattened as Rope's "
      "arguments are. Default-constructed, it holds the defaults of Rope's arguments.")
      .field("dim", &RopeConfig::dim)
      .field("rotary_dim", &RopeConfig::rotary_dim)
      .field("base", &RopeConfig::base)
      .name(
          "layout", [](RopeConfig* c) { return &c->layout; }, rope_layout_from_string)
      .name(
          "scaling", [](RopeConfig* c) { return &c->scaling.kind; }, rope_scaling_kind_from_string)
      .field("factor", &RopeConfig::scaling, &RopeScaling::factor)
      .field("original_max_position", &RopeConfig::scaling, &RopeScaling::original_max_position)
      .field("beta_fast", &RopeConfig::scaling, &RopeScaling::beta_fast)
      .field("beta_slow", &RopeConfig::scaling, &RopeScaling::beta_slow);

  StructBinding<FeatureMapConfig>(
      m, "FeatureMapConfig",
      "The C++ FeatureMapConfig (include/linrope/feature_maps.hpp). Default-constructed, it holds "
      "the defaults of FeatureMap's arguments.")
      .name(
          "kind", [](FeatureMapConfig* c) { return &c->kind; }, feature_map_kind_from_string)
      .field("input_dim", &FeatureMapConfig::input_dim)
      .field("num_features", &FeatureMapConfig::num_features)
      .field("orthogonal", &FeatureMapConfig::orthogonal)
      .field("seed", &FeatureMapConfig::seed)
      .field("regularized", &FeatureMapConfig::regularized);
}

}  // namespace linrope::python
