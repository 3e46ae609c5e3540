// Heads views in the BNHD layout (include/linrope/batched.hpp, HeadsLayout): the [batch, heads, n,
// d] elements held as [batch, n, heads, d] must give, in every batched call, the same bits as the
// same elements held as [batch, heads, n, d] (BHND), outputs and gradients compared after
// transposing them back; rows past the lengths must be left as BHND leaves them (forward outputs
// untouched, gradients exactly 0), a non-finite input must be named alike, and a layout that is
// neither enumerator must be refused.
//
// Why bit-equality. A BNHD view changes only where a slice's rows lie: its rows are gathered into a
// dense block, the same single-head kernel runs on the same values with the same cut into tasks
// (the cut depends on the shapes and the thread count, never on the layout), and the rows written
// are copied back. Nothing is computed differently, so anything short of the same bits is a wrong
// row, a neighbouring head's row, a stale scratch block or a missed write; a tolerance would let
// some of these through (a row of another head with values alike). The BHND path is itself proven
// against the naive references and the single-head calls (test_batched.cpp,
// test_linear_backward.cpp, test_saved_features.cpp, ...), so equality carries those proofs over.
// The buffers are transposed here with plain loops from batched.hpp's index formula, never with
// the library's code.
//
// Covered: softmax_attention and its backward; linear_attention plain, saving (LinearSaved),
// stateful (initial and final HeadStates) and both, and their four backwards; float and double;
// causal (scan and chunked) and not; elu+1 and FAVOR+ with no rope, numerator-only and full; n = 1,
// 7, 33 and one head long enough to split along the sequence; odd d and m, d_v != d; n_k != n;
// lengths shorter than n, 0 among them, q's apart from k's, the padding rows of every input NaN (so
// a read of padding throws or shows); 1 and 2 threads, so that slices >= threads and < threads
// (one slice then runs on every thread, gathered on the calling one); every view BNHD, and two
// mixes (q and out in one layout, k and v in the other, each gradient unlike its input).
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <linrope/linrope.hpp>
#include <memory>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "linear_cases.hpp"
#include "map_cases.hpp"
#include "reference/random.hpp"
#include "threads.hpp"

namespace {

using namespace linrope;
using namespace linrope::testing;

constexpr HeadsLayout kBHND = HeadsLayout::BHND, kBNHD = HeadsLayout::BNHD;
constexpr double kSentinel = 12345;  // what a call's outputs hold before it runs

// The views of the calls, and a layout for each.
enum View { Q, K, V, Out, DOut, DQ, DK, DV, kViews };
constexpr const char* kViewNames[kViews] = {"q", "k", "v", "out", "d_out", "dq", "dk", "dv"};
using Plan = std::array<HeadsLayout, kViews>;
constexpr Plan kEveryViewBHND = {kBHND, kBHND, kBHND, kBHND, kBHND, kBHND, kBHND, kBHND};
struct NamedPlan {
  const char* name;
  Plan layouts;
};
// Each compared with kEveryViewBHND.
const NamedPlan kPlans[] = {
    {"every view BNHD", {kBNHD, kBNHD, kBNHD, kBNHD, kBNHD, kBNHD, kBNHD, kBNHD}},
    {"q out dk dv BNHD, k v d_out dq BHND",
     {kBNHD, kBHND, kBHND, kBNHD, kBHND, kBHND, kBNHD, kBNHD}},
    {"k v d_out dq BNHD, q out dk dv BHND",
     {kBHND, kBNHD, kBNHD, kBHND, kBNHD, kBNHD, kBHND, kBHND}},
};

// Where element (b, h, i, j) of a [batch, heads, n, d] tensor lies in a buffer of `layout`
// (batched.hpp's definition, written out here).
Index offset(HeadsLayout layout, Index heads, Index n, Index d, Index b, Index h, Index i,
             Index j) {
  if (layout == kBNHD) return ((b * n + i) * heads + h) * d + j;
  return ((b * heads + h) * n + i) * d + j;
}

template <class U>
bool same_bits(U a, U b) {
  return std::memcmp(&a, &b, sizeof(U)) == 0;
}

// A [batch, heads, n, d] tensor in a buffer of `layout`, made from its elements in BHND order and
// read back into that order.
template <class T>
struct Stored {
  Stored(const std::vector<T>& elements, Index batch_, Index heads_, Index n_, Index d_,
         const Index* lengths_, HeadsLayout layout_)
      : batch(batch_),
        heads(heads_),
        n(n_),
        d(d_),
        lengths(lengths_),
        layout(layout_),
        data(elements.size()) {
    REQUIRE(Index(elements.size()) == batch * heads * n * d);
    for_each([&](Index b, Index h, Index i, Index j) {
      data[std::size_t(offset(layout, heads, n, d, b, h, i, j))] =
          elements[std::size_t(offset(kBHND, heads, n, d, b, h, i, j))];
    });
  }
  std::vector<T> elements() const {
    std::vector<T> e(data.size());
    for_each([&](Index b, Index h, Index i, Index j) {
      e[std::size_t(offset(kBHND, heads, n, d, b, h, i, j))] =
          data[std::size_t(offset(layout, heads, n, d, b, h, i, j))];
    });
    return e;
  }
  template <class F>
  void for_each(F f) const {
    for (Index b = 0; b < batch; ++b)
      for (Index h = 0; h < heads; ++h)
        for (Index i = 0; i < n; ++i)
          for (Index j = 0; j < d; ++j) f(b, h, i, j);
  }
  Index valid_rows(Index b) const { return lengths ? lengths[b] : n; }
  Heads<const T> in() const { return {data.data(), batch, heads, n, d, lengths, layout}; }
  Heads<T> out() { return {data.data(), batch, heads, n, d, lengths, layout}; }

  Index batch, heads, n, d;
  const Index* lengths;
  HeadsLayout layout;
  std::vector<T> data;
};

struct Shape {
  Index batch, heads, n, n_k, d, d_v;
  std::vector<Index> q_lengths, k_lengths;  // empty: no padding
};

std::string describe(const Shape& s) {
  std::ostringstream out;
  out << "B " << s.batch << ", H " << s.heads << ", n " << s.n << ", n_k " << s.n_k << ", d " << s.d
      << ", d_v " << s.d_v << ", lengths of q {";
  for (const Index l : s.q_lengths) out << ' ' << l;
  out << " }, of k {";
  for (const Index l : s.k_lengths) out << ' ' << l;
  out << " }";
  return out.str();
}

// Rows, columns and lengths of a view.
struct Extent {
  Index rows, cols;
  const std::vector<Index>& lengths;
};
Extent extent(const Shape& s, View view) {
  switch (view) {
    case Q:
    case DQ:
      return {s.n, s.d, s.q_lengths};
    case K:
    case DK:
      return {s.n_k, s.d, s.k_lengths};
    case V:
    case DV:
      return {s.n_k, s.d_v, s.k_lengths};
    default:  // Out, DOut
      return {s.n, s.d_v, s.q_lengths};
  }
}

// The inputs in BHND order: N(0, 1) within the lengths, NaN in the padding (never read: a NaN
// there must change nothing).
template <class T>
struct Problem {
  explicit Problem(const Shape& s)
      : shape(s), q(random(Q, 1)), k(random(K, 2)), v(random(V, 3)), d_out(random(DOut, 4)) {}
  std::vector<T> random(View view, std::uint64_t seed) const {
    const Extent e = extent(shape, view);
    const MatrixD x = gaussian(shape.batch * shape.heads * e.rows, e.cols, seed);
    std::vector<T> elements(std::size_t(x.size()));
    for (Index r = 0; r < x.rows(); ++r) {
      const Index b = r / (shape.heads * e.rows), i = r % e.rows;
      const bool padding = !e.lengths.empty() && i >= e.lengths[std::size_t(b)];
      for (Index c = 0; c < e.cols; ++c)
        elements[std::size_t(r * e.cols + c)] =
            padding ? std::numeric_limits<T>::quiet_NaN() : T(x(r, c));
    }
    return elements;
  }
  std::vector<T>& input(View view) { return view == Q ? q : view == K ? k : view == V ? v : d_out; }

  Shape shape;
  std::vector<T> q, k, v, d_out;
};

// The batched calls of batched.hpp. A backward from saved features reads those of the saving
// forward run before it on the same Calls.
enum class Op {
  Softmax,
  SoftmaxBackward,
  Linear,
  LinearSaving,
  LinearBackward,
  LinearBackwardSaved,
  LinearStateful,
  LinearStatefulSaving,
  LinearBackwardStateful,
  LinearBackwardStatefulSaved
};
const char* to_string(Op op) {
  constexpr const char* names[] = {"softmax_attention",
                                   "softmax_attention_backward",
                                   "linear_attention",
                                   "linear_attention (saving)",
                                   "linear_attention_backward",
                                   "linear_attention_backward (saved)",
                                   "linear_attention (stateful)",
                                   "linear_attention (stateful, saving)",
                                   "linear_attention_backward (stateful)",
                                   "linear_attention_backward (stateful, saved)"};
  return names[int(op)];
}
bool is_backward(Op op) {
  return op == Op::SoftmaxBackward || op == Op::LinearBackward || op == Op::LinearBackwardSaved ||
         op == Op::LinearBackwardStateful || op == Op::LinearBackwardStatefulSaved;
}
bool is_stateful(Op op) { return op >= Op::LinearStateful; }
bool uses(Op op, View view) { return view <= V || (is_backward(op) ? view >= DOut : view == Out); }
constexpr Op kSoftmaxOps[] = {Op::Softmax, Op::SoftmaxBackward};
// The first four for non-causal calls, all eight for causal ones.
constexpr Op kLinearOps[] = {Op::Linear,
                             Op::LinearSaving,
                             Op::LinearBackward,
                             Op::LinearBackwardSaved,
                             Op::LinearStateful,
                             Op::LinearStatefulSaving,
                             Op::LinearBackwardStateful,
                             Op::LinearBackwardStatefulSaved};
std::span<const Op> linear_ops(bool causal) { return {kLinearOps, causal ? 8u : 4u}; }

// What a call needs besides its views.
struct Setup {
  const FeatureMap* map = nullptr;  // linear calls only
  LinearOptions linear;
  SoftmaxOptions softmax;
};

// A call's outputs in BHND order, each named.
template <class U>
struct Recorded {
  std::string name;
  std::vector<U> values;
  Index heads, rows, cols;  // of the slices
};
template <class T>
struct Results {
  std::vector<Recorded<T>> tensors;
  std::vector<Recorded<double>> scales;  // final log scales, denominator statistics
};

// S, z and log_scale of every (b, h) slice, [batch, heads, m, d_v].
template <class T>
struct States {
  HeadStates<const T> in() const {
    const double* scales = log_scale.empty() ? nullptr : log_scale.data();
    return {S.data(), z.data(), scales, batch, heads, m, d_v};
  }
  HeadStates<T> out() {
    double* scales = log_scale.empty() ? nullptr : log_scale.data();
    return {S.data(), z.data(), scales, batch, heads, m, d_v};
  }
  std::vector<T> S, z;
  std::vector<double> log_scale;  // empty for a gradient
  Index batch, heads, m, d_v;
};

// Records a view's elements under `name`, having checked that its rows past the lengths hold
// `padding`: the sentinel for a forward's out (untouched), 0 for a gradient.
template <class T>
void record(Results<T>& r, const std::string& name, const Stored<T>& x, T padding) {
  const std::vector<T> e = x.elements();
  Index wrong = 0;
  x.for_each([&](Index b, Index h, Index i, Index j) {
    if (i >= x.valid_rows(b))
      wrong += !same_bits(e[std::size_t(offset(kBHND, x.heads, x.n, x.d, b, h, i, j))], padding);
  });
  INFO(name, ": elements past the lengths that do not hold ", padding);
  CHECK(wrong == 0);
  r.tensors.push_back({name, e, x.heads, x.n, x.d});
}

// The inputs of a problem in the layouts of a plan, and the calls on them.
template <class T>
class Calls {
 public:
  Calls(const Problem<T>& p, const Plan& plan, const Setup& setup)
      : p_(p),
        plan_(plan),
        setup_(setup),
        q_(stored(Q, p.q)),
        k_(stored(K, p.k)),
        v_(stored(V, p.v)),
        d_out_(stored(DOut, p.d_out)) {
    if (!setup.map) return;
    const Shape& s = p.shape;
    const Index slices = s.batch * s.heads, m = setup.map->output_dim();
    // S and z of N(0, 1/4) (z's absolute values in an initial state), log scales as given.
    const auto state = [&](std::uint64_t seed, bool positive_z, std::vector<double> log_scale) {
      const MatrixD S = gaussian(slices * m, s.d_v, seed, 0.5),
                    z = gaussian(slices, m, seed + 1, 0.5);
      States<T> states{{}, {}, std::move(log_scale), s.batch, s.heads, m, s.d_v};
      for (Index e = 0; e < S.size(); ++e) states.S.push_back(T(S.data()[e]));
      for (Index e = 0; e < z.size(); ++e)
        states.z.push_back(T(positive_z ? std::abs(z.data()[e]) : z.data()[e]));
      return states;
    };
    initial_ = state(5, true, std::vector<double>(std::size_t(slices), 0.25));
    d_final_ = state(7, false, {});
  }

  // Runs `op` on outputs filled with the sentinel and records them in `r`.
  void run(Op op, Results<T>& r) {
    const std::string prefix = std::string(to_string(op)) + ": ";
    Stored<T> out = output(Out), dq = output(DQ), dk = output(DK), dv = output(DV);
    States<T> final_state = states(true), d_initial = states(false);
    const auto q = q_.in(), k = k_.in(), v = v_.in(), d_out = d_out_.in();
    const LinearOptions& o = setup_.linear;
    switch (op) {
      case Op::Softmax:
        softmax_attention(q, k, v, out.out(), setup_.softmax);
        break;
      case Op::SoftmaxBackward:
        softmax_attention_backward(q, k, v, d_out, dq.out(), dk.out(), dv.out(), setup_.softmax);
        break;
      case Op::Linear: {
        DenominatorStats stats;
        linear_attention(q, k, v, out.out(), *setup_.map, o, &stats);
        std::vector<double> tally = {
            stats.min,           double(stats.nonpositive), double(stats.below_threshold),
            double(stats.count), double(stats.no_keys),     double(stats.zero_divisor)};
        r.scales.push_back({prefix + "stats", std::move(tally), 1, 1, 6});
        break;
      }
      case Op::LinearSaving:
        linear_attention(q, k, v, out.out(), *setup_.map, o, saved_);
        break;
      case Op::LinearBackward:
        linear_attention_backward(q, k, v, d_out, dq.out(), dk.out(), dv.out(), *setup_.map, o);
        break;
      case Op::LinearBackwardSaved:
        linear_attention_backward(q, k, v, d_out, dq.out(), dk.out(), dv.out(), *setup_.map, o,
                                  saved_);
        break;
      case Op::LinearStateful:
        linear_attention(q, k, v, out.out(), *setup_.map, o, initial_.in(), final_state.out());
        break;
      case Op::LinearStatefulSaving:
        linear_attention(q, k, v, out.out(), *setup_.map, o, initial_.in(), final_state.out(),
                         saved_stateful_);
        break;
      case Op::LinearBackwardStateful:
        linear_attention_backward(q, k, v, d_out, dq.out(), dk.out(), dv.out(), *setup_.map, o,
                                  initial_.in(), d_final_.in(), d_initial.out());
        break;
      case Op::LinearBackwardStatefulSaved:
        linear_attention_backward(q, k, v, d_out, dq.out(), dk.out(), dv.out(), *setup_.map, o,
                                  initial_.in(), d_final_.in(), d_initial.out(), saved_stateful_);
        break;
    }
    if (is_backward(op)) {
      record(r, prefix + "dq", dq, T(0));
      record(r, prefix + "dk", dk, T(0));
      record(r, prefix + "dv", dv, T(0));
    } else {
      record(r, prefix + "out", out, T(kSentinel));
    }
    if (is_stateful(op)) {
      const States<T>& s = is_backward(op) ? d_initial : final_state;
      r.tensors.push_back({prefix + "S", s.S, s.heads, s.m, s.d_v});
      r.tensors.push_back({prefix + "z", s.z, s.heads, 1, s.m});
      if (!is_backward(op)) r.scales.push_back({prefix + "log_scale", s.log_scale, s.heads, 1, 1});
    }
  }

 private:
  Stored<T> stored(View view, const std::vector<T>& elements) const {
    const Extent e = extent(p_.shape, view);
    const Index* lengths = e.lengths.empty() ? nullptr : e.lengths.data();
    return {elements, p_.shape.batch, p_.shape.heads, e.rows, e.cols, lengths, plan_[view]};
  }
  Stored<T> output(View view) const {
    const Extent e = extent(p_.shape, view);
    const Index size = p_.shape.batch * p_.shape.heads * e.rows * e.cols;
    return stored(view, std::vector<T>(std::size_t(size), T(kSentinel)));
  }
  // A final state (with log scales) or a gradient of one, filled with the sentinel.
  States<T> states(bool with_log_scale) const {
    const Index slices = p_.shape.batch * p_.shape.heads;
    return {std::vector<T>(std::size_t(slices * initial_.m * initial_.d_v), T(kSentinel)),
            std::vector<T>(std::size_t(slices * initial_.m), T(kSentinel)),
            std::vector<double>(with_log_scale ? std::size_t(slices) : 0, kSentinel),
            p_.shape.batch,
            p_.shape.heads,
            initial_.m,
            initial_.d_v};
  }

  const Problem<T>& p_;
  Plan plan_;
  Setup setup_;
  Stored<T> q_, k_, v_, d_out_;
  States<T> initial_{{}, {}, {}, 1, 1, 0, 0}, d_final_{{}, {}, {}, 1, 1, 0, 0};
  LinearSaved<T> saved_, saved_stateful_;
};

template <class U>
void check_same_bits(const Recorded<U>& got, const Recorded<U>& want) {
  REQUIRE(got.name == want.name);
  REQUIRE(got.values.size() == want.values.size());
  Index differing = 0;
  std::size_t first = 0;
  for (std::size_t e = 0; e < want.values.size(); ++e)
    if (!same_bits(got.values[e], want.values[e]) && differing++ == 0) first = e;
  const Index slice = Index(first) / (want.rows * want.cols), row = Index(first) / want.cols;
  INFO(want.name, ": ", differing, " elements differ; the first: [", slice / want.heads, ", ",
       slice % want.heads, "] row ", row % want.rows, ", column ", Index(first) % want.cols, ": ",
       got.values[first], ", in BHND ", want.values[first]);
  CHECK(differing == 0);
}

// Runs `ops` in order on p with every view BHND, and again under each plan: the same bits.
template <class T>
void check_layouts(const Problem<T>& p, const Setup& setup, std::span<const Op> ops) {
  const auto results = [&](const Plan& plan) {
    Calls<T> calls(p, plan, setup);
    Results<T> r;
    for (const Op op : ops) {
      const std::string call = to_string(op);
      CAPTURE(call);
      calls.run(op, r);
    }
    return r;
  };
  const Results<T> want = results(kEveryViewBHND);
  for (const NamedPlan& plan : kPlans) {
    const std::string plan_name = plan.name;
    CAPTURE(plan_name);
    const Results<T> got = results(plan.layouts);
    REQUIRE(got.tensors.size() == want.tensors.size());
    REQUIRE(got.scales.size() == want.scales.size());
    for (std::size_t i = 0; i < want.tensors.size(); ++i)
      check_same_bits(got.tensors[i], want.tensors[i]);
    for (std::size_t i = 0; i < want.scales.size(); ++i)
      check_same_bits(got.scales[i], want.scales[i]);
  }
}

const Shape kShapes[] = {
    {1, 1, 1, 1, 3, 2, {}, {}},                     // n = 1, a single slice
    {2, 3, 7, 7, 5, 3, {7, 0}, {7, 0}},             // a batch of length 0
    {3, 1, 33, 33, 3, 5, {33, 5, 0}, {30, 12, 1}},  // q's lengths apart from k's
    {1, 2, 7, 33, 5, 4, {6}, {20}},                 // n_k > n
    {2, 1, 33, 7, 4, 3, {33, 2}, {7, 5}},           // n_k < n
};
// One head long enough to be split across 2 threads, run with 2 (kSplitThreads) only: causal linear
// attention into segments of >= 256 queries, non-causal into parts of 512 keys and queries;
// softmax attention into blocks of queries.
const Shape kLongLinear = {1, 1, 1100, 1100, 4, 3, {1037}, {1100}};
const Shape kLongSoftmax = {1, 1, 301, 301, 4, 3, {250}, {301}};

// With 4 threads, fewer slices than threads and more than one head: each slice then runs on every
// thread, gathered on the calling one, its rows H d apart (with one head they are d apart, as in
// BHND, and a stride error would not show).
constexpr int kFewSlicesThreads = 4;
const Shape kFewSlices[] = {
    {1, 2, 7, 33, 5, 4, {6}, {20}},
    {1, 3, 33, 33, 3, 5, {20}, {33}},
};

// The shapes a sweep runs with `threads`.
std::vector<Shape> shapes(int threads, const Shape& long_shape) {
  if (threads == kFewSlicesThreads) {
    std::vector<Shape> few(std::begin(kFewSlices), std::end(kFewSlices));
    Shape long_heads = long_shape;
    long_heads.heads = 2;
    few.push_back(long_heads);
    return few;
  }
  std::vector<Shape> all(std::begin(kShapes), std::end(kShapes));
  if (threads == kSplitThreads) all.push_back(long_shape);
  return all;
}

// The maps: elu+1 (m = d) and FAVOR+ with 7 features (m = 7, odd).
std::unique_ptr<FeatureMap> layout_map(FeatureMapKind kind, Index d) {
  return make_map(kind, d, favor_features(kind, 7), 11);
}

struct LinearCase {
  FeatureMapKind kind;
  RopePlacement placement;
  bool causal;
  CausalMethod method;
};
constexpr auto kElu = FeatureMapKind::EluPlusOne, kFavor = FeatureMapKind::FavorPositive;
constexpr auto kNone = RopePlacement::None, kNumerator = RopePlacement::NumeratorOnly,
               kFull = RopePlacement::Full;
constexpr auto kScan = CausalMethod::Scan, kChunked = CausalMethod::Chunked;
const LinearCase kLinearCases[] = {
    {kElu, kNone, false, kScan},        {kElu, kNone, true, kScan},
    {kElu, kNumerator, false, kScan},   {kElu, kNumerator, true, kChunked},
    {kElu, kFull, false, kScan},        {kElu, kFull, true, kScan},
    {kFavor, kNone, false, kScan},      {kFavor, kNone, true, kChunked},
    {kFavor, kNumerator, false, kScan}, {kFavor, kNumerator, true, kScan},
    {kFavor, kFull, false, kScan},      {kFavor, kFull, true, kChunked},
};

// The options of a linear case on a shape: queries the last n positions of the keys, chunks of 8.
LinearOptions case_options(const LinearCase& c, const Shape& s, const Rope* rope) {
  LinearOptions options = linear_options(c.causal, c.placement, rope, 1e-3, s.n_k - s.n, 0);
  options.method = c.method;
  options.chunk_size = 8;
  return options;
}

// Runs body(problem, shape) on every shape that shapes() gives each thread count.
template <class T, class Body>
void for_each_problem(const Shape& long_shape, Body body) {
  for (const int threads : {1, kSplitThreads, kFewSlicesThreads}) {
    const ThreadCount thread_count(threads);
    CAPTURE(threads);
    for (const Shape& s : shapes(threads, long_shape)) {
      const std::string shape = describe(s);
      CAPTURE(shape);
      body(Problem<T>(s), s);
    }
  }
}

template <class T>
void sweep_linear() {
  for_each_problem<T>(kLongLinear, [](const Problem<T>& p, const Shape& s) {
    for (const LinearCase& c : kLinearCases) {
      const std::string map_name = to_string(c.kind), placement = to_string(c.placement),
                        method = to_string(c.method);
      CAPTURE(map_name);
      CAPTURE(placement);
      CAPTURE(c.causal);
      CAPTURE(method);
      const auto map = layout_map(c.kind, s.d);
      const Rope rope(placement_rope(c.placement, s.d, map->output_dim(), false));
      Setup setup;
      setup.map = map.get();
      setup.linear = case_options(c, s, c.placement == kNone ? nullptr : &rope);
      check_layouts(p, setup, linear_ops(c.causal));
    }
  });
}

// A rope of width d for softmax attention (rotary width even).
RopeConfig softmax_rope(Index d) { return {.dim = d, .rotary_dim = d - d % 2, .base = 100}; }

template <class T>
void sweep_softmax() {
  for_each_problem<T>(kLongSoftmax, [](const Problem<T>& p, const Shape& s) {
    const Rope rope(softmax_rope(s.d));
    for (const bool causal : {false, true})
      for (const bool with_rope : {false, true}) {
        CAPTURE(causal);
        CAPTURE(with_rope);
        Setup setup;
        setup.softmax = {.causal = causal,
                         .rope = with_rope ? &rope : nullptr,
                         .q_offset = s.n_k - s.n,
                         .block_size = 8};
        check_layouts(p, setup, kSoftmaxOps);
      }
  });
}

// The message of the NonFiniteError that `op` throws on p under `plan` ("" if none).
template <class T>
std::string nonfinite_message(const Problem<T>& p, const Plan& plan, const Setup& setup, Op op) {
  Calls<T> calls(p, plan, setup);
  Results<T> r;
  try {
    calls.run(op, r);
  } catch (const NonFiniteError& e) {
    return e.what();
  }
  return "";
}

template <class T>
void check_nonfinite() {
  struct Spot {
    View view;
    Index b, h, i, j;
  };
  struct Case {
    Shape shape;
    std::vector<Spot> spots;  // within the lengths
  };
  const Case cases[] = {
      {{2, 3, 7, 9, 5, 3, {7, 5}, {9, 6}},
       {{Q, 1, 2, 3, 1}, {K, 1, 0, 5, 4}, {V, 0, 2, 8, 0}, {DOut, 1, 1, 4, 2}}},
      // One slice: fewer than 2 threads.
      {{1, 1, 7, 9, 5, 3, {5}, {6}},
       {{Q, 0, 0, 4, 0}, {K, 0, 0, 5, 4}, {V, 0, 0, 2, 2}, {DOut, 0, 0, 4, 1}}},
  };
  for (const int threads : {1, kSplitThreads}) {
    const ThreadCount thread_count(threads);
    CAPTURE(threads);
    for (const Case& c : cases) {
      const std::string shape = describe(c.shape);
      CAPTURE(shape);
      const auto map = layout_map(kFavor, c.shape.d);
      const Rope rope(placement_rope(kNumerator, c.shape.d, map->output_dim(), false));
      for (const bool causal : {false, true}) {
        CAPTURE(causal);
        Setup setup;
        setup.map = map.get();
        setup.linear = case_options({kFavor, kNumerator, causal, kScan}, c.shape, &rope);
        setup.softmax = {.causal = causal, .q_offset = c.shape.n_k - c.shape.n};
        std::vector<Op> ops = {Op::Softmax, Op::SoftmaxBackward, Op::Linear, Op::LinearBackward};
        if (causal) ops.insert(ops.end(), {Op::LinearStateful, Op::LinearBackwardStateful});
        // NaN in every padding row (Problem's): no error, in any layout.
        {
          const Problem<T> p(c.shape);
          for (const Op op : ops) {
            const std::string call = to_string(op);
            CAPTURE(call);
            for (const NamedPlan& plan : kPlans) {
              const std::string plan_name = plan.name;
              CAPTURE(plan_name);
              CHECK(nonfinite_message(p, plan.layouts, setup, op).empty());
            }
          }
        }
        for (const Spot& spot : c.spots) {
          Problem<T> p(c.shape);
          const Extent e = extent(c.shape, spot.view);
          const Index at =
              offset(kBHND, c.shape.heads, e.rows, e.cols, spot.b, spot.h, spot.i, spot.j);
          p.input(spot.view)[std::size_t(at)] = std::numeric_limits<T>::quiet_NaN();
          std::ostringstream expected;
          expected << kViewNames[spot.view] << '[' << spot.b << ", " << spot.h
                   << "] has the non-finite value nan at row " << spot.i << ", column " << spot.j;
          const std::string message = expected.str();
          CAPTURE(message);
          for (const Op op : ops) {
            if (spot.view == DOut && !is_backward(op)) continue;
            const std::string call = to_string(op);
            CAPTURE(call);
            const std::string want = nonfinite_message(p, kEveryViewBHND, setup, op);
            CHECK(want.find(message) != std::string::npos);
            for (const NamedPlan& plan : kPlans) {
              const std::string plan_name = plan.name;
              CAPTURE(plan_name);
              CHECK(nonfinite_message(p, plan.layouts, setup, op) == want);
            }
          }
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("heads layout: softmax attention gives the same bits in BNHD as in BHND") {
  sweep_softmax<float>();
  sweep_softmax<double>();
}

TEST_CASE("heads layout: linear attention gives the same bits in BNHD as in BHND, float") {
  sweep_linear<float>();
}

TEST_CASE("heads layout: linear attention gives the same bits in BNHD as in BHND, double") {
  sweep_linear<double>();
}

TEST_CASE("heads layout: a non-finite input is named as in BHND, and none in the padding") {
  check_nonfinite<float>();
  check_nonfinite<double>();
}

TEST_CASE("heads layout: a layout neither BHND nor BNHD is refused, naming the view") {
  const Shape s{2, 3, 7, 9, 5, 3, {}, {}};
  const Problem<float> p(s);
  const auto map = layout_map(kElu, s.d);
  const Rope rope(placement_rope(kNumerator, s.d, map->output_dim(), false));
  Setup setup;
  setup.map = map.get();
  setup.linear = case_options({kElu, kNumerator, true, kScan}, s, &rope);
  const auto bad = static_cast<HeadsLayout>(7);
  std::vector<Op> ops(std::begin(kSoftmaxOps), std::end(kSoftmaxOps));
  ops.insert(ops.end(), std::begin(kLinearOps), std::end(kLinearOps));
  for (const Op op : ops) {
    const std::string call = to_string(op);
    CAPTURE(call);
    for (int view = 0; view < kViews; ++view) {
      if (!uses(op, View(view))) continue;
      const std::string expected = std::string(kViewNames[view]) + ".layout";
      CAPTURE(expected);
      Plan plan = kEveryViewBHND;
      plan[std::size_t(view)] = bad;
      Calls<float> calls(p, plan, setup);
      Results<float> r;
      CHECK_THROWS_WITH_AS(calls.run(op, r), doctest::Contains(expected.c_str()),
                           std::invalid_argument);
    }
  }
}

// The gathered rows live in blocks of the process-wide cache, given back when their slice is done:
// release_cached_memory then frees exactly one [n x d] block per view gathered (one thread, so the
// two slices reuse them in turn); a BNHD view with one head has its rows d apart already and is
// read and written in place (nothing gathered, nothing cached).
TEST_CASE("heads layout: gathered rows come from the block cache, one head is read in place") {
  const ThreadCount one(1);
  constexpr Index kN = 64, kD = 8;
  const auto map = layout_map(kElu, kD);
  const LinearOptions options = linear_options(false, kNone, nullptr, 1e-3, 0, 0);
  const auto cached_after_call = [&](Index heads, HeadsLayout layout) {
    const Index size = heads * kN * kD;
    const MatrixD x = gaussian(3, size, 3, 1.0);
    std::vector<float> q(static_cast<std::size_t>(size)), k(q.size()), v(q.size()), out(q.size());
    for (Index e = 0; e < size; ++e) {
      q[std::size_t(e)] = float(x(0, e));
      k[std::size_t(e)] = float(x(1, e));
      v[std::size_t(e)] = float(x(2, e));
    }
    const auto in = [&](const std::vector<float>& a) {
      return Heads<const float>{a.data(), 1, heads, kN, kD, nullptr, layout};
    };
    release_cached_memory();
    linear_attention(in(q), in(k), in(v),
                     Heads<float>{out.data(), 1, heads, kN, kD, nullptr, layout}, *map, options);
    return release_cached_memory();
  };
  const std::size_t block = kN * kD * sizeof(float);
  const std::size_t dense = cached_after_call(2, kBHND);
  CHECK(cached_after_call(2, kBNHD) == dense + 4 * block);  // q, k, v and out gathered
  CHECK(cached_after_call(1, kBNHD) == dense);
  CHECK(cached_after_call(1, kBHND) == dense);
}
