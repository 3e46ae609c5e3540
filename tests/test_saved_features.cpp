// LinearSaved (include/linrope/attention.hpp): a forward that keeps its features and a backward
// that reads them. The claim is exact: the saving forward writes the same bits as the plain
// forward, and the backward from the saved features the same bits as the plain backward, whose
// gradients test_linear_backward.cpp checks against finite differences of the naive reference. A
// backward that read a wrong row, a row of the other side, a stale or unrotated row would change
// the bits, so equality is checked, not a tolerance: over every map and placement, causal (both
// methods) and not, the shapes of the gradient sweep (n = 1, odd widths, cross and negative
// offsets), a decay, heads long enough to split across threads, batched calls with lengths and
// per-head decays, the stateful calls (with and without the final state's gradient), and refused
// calls.
#include <doctest/doctest.h>

#include <cstdint>
#include <limits>
#include <linrope/linrope.hpp>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "linear_cases.hpp"
#include "map_cases.hpp"
#include "reference/random.hpp"
#include "refusal.hpp"
#include "threads.hpp"

namespace {

using namespace linrope;
using namespace linrope::testing;

struct Shape {
  Index n, n_k, d, d_v, q_offset = 0, k_offset = 0;
};

// The gradient sweep's shapes (test_linear_backward.cpp), and one longer than a scan block and a
// chunk (70 > 64), so that features cross block boundaries.
const Shape kShapes[] = {
    {1, 1, 4, 2}, {7, 7, 5, 3}, {4, 9, 5, 2, 5, 0}, {6, 5, 4, 3, -8, -5}, {70, 70, 6, 3}};

template <class T>
Matrix<T> input(Index rows, Index cols, std::uint64_t seed) {
  return gaussian(rows, cols, seed).cast<T>();
}

template <class T>
void require_same_bits(const Matrix<T>& got, const Matrix<T>& want, const char* what) {
  INFO(std::string(what));
  REQUIRE(got.rows() == want.rows());
  REQUIRE(got.cols() == want.cols());
  // Bit for bit: equal values (NaN never occurs: finite inputs give finite outputs).
  CHECK((got.array() == want.array()).all());
}

template <class T>
void require_same_gradients(const AttentionGradients<T>& got, const AttentionGradients<T>& want) {
  require_same_bits(got.dq, want.dq, "dq");
  require_same_bits(got.dk, want.dk, "dk");
  require_same_bits(got.dv, want.dv, "dv");
}

// One single-head problem through the plain calls and the saving ones.
template <class T>
void check_single(FeatureMapKind kind, RopePlacement placement, bool causal, CausalMethod method,
                  const Shape& s, double decay) {
  const auto map = make_map(kind, s.d, favor_features(kind, 12), 11);
  const Rope rope(placement_rope(placement, s.d, map->output_dim(), true));
  LinearOptions options = linear_options(causal, placement, &rope, 1e-3, s.q_offset, s.k_offset);
  options.method = method;
  options.decay = decay;
  const Matrix<T> q = input<T>(s.n, s.d, 1), k = input<T>(s.n_k, s.d, 2),
                  v = input<T>(s.n_k, s.d_v, 3), d_out = input<T>(s.n, s.d_v, 4);
  LinearSaved<T> saved;
  CHECK(saved.empty());
  require_same_bits(linear_attention(q, k, v, *map, options, saved),
                    linear_attention(q, k, v, *map, options), "out");
  CHECK_FALSE(saved.empty());
  require_same_gradients(linear_attention_backward(q, k, v, d_out, *map, options, saved),
                         linear_attention_backward(q, k, v, d_out, *map, options));
}

template <class T>
void sweep_single() {
  for (const FeatureMapKind kind : kMaps)
    for (const RopePlacement placement : kPlacements)
      for (const Shape& s : kShapes) {
        CAPTURE(int(kind));
        CAPTURE(int(placement));
        CAPTURE(s.n);
        CAPTURE(s.n_k);
        check_single<T>(kind, placement, false, CausalMethod::Scan, s, 1.0);
        for (const CausalMethod method : kCausalMethods) {
          CAPTURE(int(method));
          check_single<T>(kind, placement, true, method, s, 1.0);
          check_single<T>(kind, placement, true, method, s, 0.9);
        }
      }
}

TEST_CASE("saved features: forward and backward equal the plain calls, float") {
  sweep_single<float>();
}

TEST_CASE("saved features: forward and backward equal the plain calls, double") {
  sweep_single<double>();
}

TEST_CASE("saved features: a long head split across threads equals the plain calls") {
  // n = 1200 splits into one segment per thread, forward and backward (causal_plan.hpp); the
  // non-causal call cuts its keys and queries into parts.
  const ThreadCount threads(kSplitThreads);
  const Shape s{1200, 1200, 8, 4};
  for (const RopePlacement placement : {RopePlacement::NumeratorOnly, RopePlacement::Full}) {
    check_single<float>(FeatureMapKind::FavorPositive, placement, false, CausalMethod::Scan, s, 1);
    for (const CausalMethod method : kCausalMethods)
      check_single<float>(FeatureMapKind::FavorPositive, placement, true, method, s, 1.0);
  }
  check_single<double>(FeatureMapKind::EluPlusOne, RopePlacement::NumeratorOnly, true,
                       CausalMethod::Scan, s, 0.99);
}

// [B = 2, H = 3] with lengths and a decay per head: the plain and the saving batched calls, the
// stateful ones with and without the final state's gradient.
struct Batch {
  static constexpr Index B = 2, H = 3, n = 9, n_k = 11, d = 5, d_v = 3;
  std::unique_ptr<FeatureMap> map = make_map(FeatureMapKind::FavorPositive, d, 8, 5);
  Index m = map->output_dim();
  Rope rope{placement_rope(RopePlacement::NumeratorOnly, d, m, false)};
  std::vector<double> decays{1.0, 0.95, 0.8};
  std::vector<Index> q_lengths{n, n - 3}, k_lengths{n_k, n_k - 2};
  MatrixF q = input<float>(B * H * n, d, 21), k = input<float>(B * H * n_k, d, 22),
          v = input<float>(B * H * n_k, d_v, 23), d_out = input<float>(B * H * n, d_v, 24);
  MatrixF S0 = input<float>(B * H * m, d_v, 25), z0 = input<float>(B * H, m, 26).cwiseAbs();
  std::vector<double> log_scale0 = std::vector<double>(B * H, 0.5);
  MatrixF dS_final = input<float>(B * H * m, d_v, 27), dz_final = input<float>(B * H, m, 28);

  LinearOptions options() const {
    LinearOptions o = linear_options(true, RopePlacement::NumeratorOnly, &rope, 1e-3, 2, 0);
    o.head_decays = decays;
    return o;
  }
  Heads<const float> in(const MatrixF& x, Index rows, const std::vector<Index>& lengths) const {
    return {x.data(), B, H, rows, x.cols(), lengths.data()};
  }
  HeadStates<const float> initial() const {
    return {S0.data(), z0.data(), log_scale0.data(), B, H, m, d_v};
  }
};

TEST_CASE("saved features: batched calls with lengths and per-head decays") {
  Batch b;
  const LinearOptions options = b.options();
  const auto q = b.in(b.q, b.n, b.q_lengths), k = b.in(b.k, b.n_k, b.k_lengths),
             v = b.in(b.v, b.n_k, b.k_lengths), d_out = b.in(b.d_out, b.n, b.q_lengths);
  // Rows past the lengths are not written: both start at zero.
  MatrixF out = MatrixF::Zero(b.B * b.H * b.n, b.d_v), out_saving = out;
  const auto out_view = [&](MatrixF& x) { return Heads<float>{x.data(), b.B, b.H, b.n, b.d_v}; };
  struct Grads {
    MatrixF dq, dk, dv;
  };
  const auto fresh = [&] {
    return Grads{MatrixF(b.B * b.H * b.n, b.d), MatrixF(b.B * b.H * b.n_k, b.d),
                 MatrixF(b.B * b.H * b.n_k, b.d_v)};
  };
  const auto views = [&](Grads& g) {
    return std::tuple{Heads<float>{g.dq.data(), b.B, b.H, b.n, b.d},
                      Heads<float>{g.dk.data(), b.B, b.H, b.n_k, b.d},
                      Heads<float>{g.dv.data(), b.B, b.H, b.n_k, b.d_v}};
  };
  const auto same = [&](const Grads& got, const Grads& want) {
    require_same_bits(got.dq, want.dq, "dq");
    require_same_bits(got.dk, want.dk, "dk");
    require_same_bits(got.dv, want.dv, "dv");
  };

  SUBCASE("plain") {
    LinearSaved<float> saved;
    linear_attention(q, k, v, out_view(out), *b.map, options);
    linear_attention(q, k, v, out_view(out_saving), *b.map, options, saved);
    require_same_bits(out_saving, out, "out");
    Grads want = fresh(), got = fresh();
    auto [dq, dk, dv] = views(want);
    linear_attention_backward(q, k, v, d_out, dq, dk, dv, *b.map, options);
    auto [sq, sk, sv] = views(got);
    linear_attention_backward(q, k, v, d_out, sq, sk, sv, *b.map, options, saved);
    same(got, want);
    // The keys past the last query's horizon are not mapped: per slice n + (n_k within 2 + n) rows.
    Index rows = 0;
    for (Index batch = 0; batch < b.B; ++batch)
      rows += b.H * (b.q_lengths[batch] + std::min(b.k_lengths[batch], b.q_lengths[batch] + 2));
    CHECK(saved.bytes() == std::size_t(rows) * (b.m * sizeof(float) + sizeof(double)));
  }

  SUBCASE("stateful, the final state's gradient from saved keys and from k") {
    MatrixF S1(b.B * b.H * b.m, b.d_v), z1(b.B * b.H, b.m);
    std::vector<double> log_scale1(b.B * b.H);
    const HeadStates<float> final_state{S1.data(), z1.data(), log_scale1.data(), b.B, b.H,
                                        b.m,       b.d_v};
    const HeadStates<const float> d_final{
        b.dS_final.data(), b.dz_final.data(), nullptr, b.B, b.H, b.m, b.d_v};
    MatrixF dS0(b.B * b.H * b.m, b.d_v), dz0(b.B * b.H, b.m), dS0_saved = dS0, dz0_saved = dz0;
    Grads want = fresh();
    auto [dq, dk, dv] = views(want);
    linear_attention_backward(
        q, k, v, d_out, dq, dk, dv, *b.map, options, b.initial(), d_final,
        HeadStates<float>{dS0.data(), dz0.data(), nullptr, b.B, b.H, b.m, b.d_v});
    // A forward that kept its final state mapped every key; one that did not, only those up to
    // the horizon: the backward then maps the rest from k itself.
    for (const bool keep_final : {true, false}) {
      CAPTURE(keep_final);
      LinearSaved<float> saved;
      linear_attention(q, k, v, out_view(out_saving), *b.map, options, b.initial(),
                       keep_final ? final_state : HeadStates<float>{}, saved);
      Grads got = fresh();
      auto [sq, sk, sv] = views(got);
      linear_attention_backward(
          q, k, v, d_out, sq, sk, sv, *b.map, options, b.initial(), d_final,
          HeadStates<float>{dS0_saved.data(), dz0_saved.data(), nullptr, b.B, b.H, b.m, b.d_v},
          saved);
      same(got, want);
      require_same_bits(dS0_saved, dS0, "d_initial S");
      require_same_bits(dz0_saved, dz0, "d_initial z");
    }
  }
}

TEST_CASE("saved features: a backward refuses features of another call") {
  const Shape s{10, 10, 4, 3};
  const auto map = make_map(FeatureMapKind::FavorPositive, s.d, 8, 3);
  const Rope rope(placement_rope(RopePlacement::NumeratorOnly, s.d, map->output_dim(), false));
  const LinearOptions options =
      linear_options(true, RopePlacement::NumeratorOnly, &rope, 1e-3, 0, 0);
  const MatrixF q = input<float>(s.n, s.d, 1), k = input<float>(s.n_k, s.d, 2),
                v = input<float>(s.n_k, s.d_v, 3), d_out = input<float>(s.n, s.d_v, 4);
  LinearSavedF saved;
  const auto backward = [&](const MatrixF& q_now, const MatrixF& k_now, const MatrixF& v_now,
                            const MatrixF& d_out_now, const FeatureMap& map_now,
                            const LinearOptions& options_now) {
    return refusal([&] {
      linear_attention_backward(q_now, k_now, v_now, d_out_now, map_now, options_now, saved);
    });
  };
  CHECK(backward(q, k, v, d_out, *map, options) ==
        "linear_attention_backward: saved is empty; expected the LinearSaved that this call's "
        "forward filled");
  linear_attention(q, k, v, *map, options, saved);
  CHECK(backward(q, k, v, d_out, *map, options).empty());

  const MatrixF q_short = q.topRows(9), d_out_short = d_out.topRows(9);
  CHECK(backward(q_short, k, v, d_out_short, *map, options) ==
        "linear_attention_backward: saved holds the features of another call: its forward had "
        "n = 10, this call has 9");
  LinearOptions other = options;
  other.q_offset = 1;
  CHECK(backward(q, k, v, d_out, *map, other) ==
        "linear_attention_backward: saved holds the features of another call: its forward had "
        "options.q_offset = 0, this call has 1");
  other = options;
  other.placement = RopePlacement::Full;
  CHECK(backward(q, k, v, d_out, *map, other) ==
        "linear_attention_backward: saved holds the features of another call: its forward had "
        "options.placement = numerator_only, this call has full");
  other = options;
  other.decay = 0.9;
  CHECK(backward(q, k, v, d_out, *map, other) ==
        "linear_attention_backward: saved holds the features of another call: its forward had "
        "the decay of head[0] = 1, this call has 0.90000000000000002");
  // The map and the rope are compared by what they compute (their configurations), not by
  // address: a twin made alike is accepted (the same bits), another kind, width or base is not.
  RopeConfig other_config =
      placement_rope(RopePlacement::NumeratorOnly, s.d, map->output_dim(), false);
  const Rope twin_rope(other_config);
  other_config.base = 500;
  const Rope other_rope(other_config);
  other = options;
  other.rope = &other_rope;
  CHECK(backward(q, k, v, d_out, *map, other) ==
        "linear_attention_backward: saved holds the features of another call: its forward had "
        "options.rope's base = 10000, this call has 500");
  const auto twin = make_map(FeatureMapKind::FavorPositive, s.d, 8, 3);
  other = options;
  other.rope = &twin_rope;
  require_same_gradients(linear_attention_backward(q, k, v, d_out, *twin, other, saved),
                         linear_attention_backward(q, k, v, d_out, *map, options));
  const auto wider = make_map(FeatureMapKind::FavorPositive, s.d, 16, 3);
  const Rope wider_rope(placement_rope(RopePlacement::NumeratorOnly, s.d, 16, false));
  other.rope = &wider_rope;
  CHECK(backward(q, k, v, d_out, *wider, other) ==
        "linear_attention_backward: saved holds the features of another call: its forward had "
        "m = map.output_dim() = 8, this call has 16");
  const auto relu = make_map(FeatureMapKind::Relu, s.d);
  const Rope relu_rope(placement_rope(RopePlacement::NumeratorOnly, s.d, s.d, false));
  other.rope = &relu_rope;
  LinearSavedF from_elu;
  const auto elu = make_map(FeatureMapKind::EluPlusOne, s.d);
  linear_attention(q, k, v, *elu, other, from_elu);
  CHECK(refusal([&] { linear_attention_backward(q, k, v, d_out, *relu, other, from_elu); }) ==
        "linear_attention_backward: saved holds the features of another call: its forward had "
        "a map of kind elu+1, this call has relu");
  // Fields no feature depends on are not compared: a deterministic map's seed, a rope's
  // rotary_dim 0 (= dim) against its dim written out, an unscaled rope's scaling factor.
  {
    RopeConfig written_out = placement_rope(RopePlacement::NumeratorOnly, s.d, s.d, false);
    REQUIRE(written_out.rotary_dim == written_out.dim);
    RopeConfig implicit = written_out;
    implicit.rotary_dim = 0;
    written_out.scaling.factor = 2.0;  // kind None: unused
    const Rope implicit_rope(implicit), written_out_rope(written_out);
    LinearOptions forward_options = options, backward_options = options;
    forward_options.rope = &implicit_rope;
    backward_options.rope = &written_out_rope;
    LinearSavedF from_alike;
    linear_attention(q, k, v, *elu, forward_options, from_alike);
    const auto elu_redrawn = make_map(FeatureMapKind::EluPlusOne, s.d);
    elu_redrawn->redraw(4);
    require_same_gradients(
        linear_attention_backward(q, k, v, d_out, *elu_redrawn, backward_options, from_alike),
        linear_attention_backward(q, k, v, d_out, *elu, forward_options));
  }
  const auto redrawn = make_map(FeatureMapKind::FavorPositive, s.d, 8, 3);
  linear_attention(q, k, v, *redrawn, options, saved);
  redrawn->redraw(4);
  CHECK(backward(q, k, v, d_out, *redrawn, options) ==
        "linear_attention_backward: saved holds the features of another call: its forward had "
        "a map drawn from seed 3, this call has 4");
  // A refused backward leaves `saved` as it was; clear() empties it.
  CHECK_FALSE(saved.empty());
  saved.clear();
  CHECK(saved.empty());
  CHECK(saved.bytes() == 0);
}

// One batched call as a backward's check of `saved` (src/linear/saved.hpp, SavedCall) sees it:
// shapes, lengths, options, and the configurations its map and rope are made from. The base call
// sets every compared field to something a single change can move: lengths, offsets, per-head
// decays, a FAVOR+ map, and a YaRN rope (an unscaled rope's scaling fields are not compared).
struct SavedCallCase {
  Index batch = 2, heads = 2, n = 9, n_k = 11, d = 5, d_v = 3;
  std::vector<Index> q_lengths{8, 6}, k_lengths{10, 9};
  FeatureMapConfig map{.kind = FeatureMapKind::FavorPositive,
                       .input_dim = 5,
                       .num_features = 8,
                       .orthogonal = true,
                       .seed = 5,
                       .regularized = false};
  bool has_rope = true;
  RopeConfig rope{.dim = 8,
                  .rotary_dim = 8,
                  .base = 10000.0,
                  .layout = RopeLayout::Interleaved,
                  .scaling = {.kind = RopeScalingKind::Yarn,
                              .factor = 2.0,
                              .original_max_position = 16,
                              .beta_fast = 32.0,
                              .beta_slow = 1.0}};
  LinearOptions options = linear_options(true, RopePlacement::NumeratorOnly, nullptr, 1e-3, 2, 0);
  std::vector<double> head_decays{1.0, 0.9};
};

// Inputs large enough for every call below (the base call is the largest): a call reads a prefix.
struct CallInputs {
  MatrixF q = input<float>(2 * 2 * 9, 5, 41), k = input<float>(2 * 2 * 11, 5, 42),
          v = input<float>(2 * 2 * 11, 3, 43), d_out = input<float>(2 * 2 * 9, 3, 44);
};

struct CallGradients {
  MatrixF dq, dk, dv;
};

// A call's map, rope and options (pointing at the rope and at c's head_decays).
struct BuiltCall {
  explicit BuiltCall(const SavedCallCase& c)
      : map(make_feature_map(c.map)),
        rope(c.has_rope ? std::make_unique<Rope>(c.rope) : nullptr),
        options(c.options) {
    options.rope = rope.get();
    options.head_decays = c.head_decays;
  }
  std::unique_ptr<FeatureMap> map;
  std::unique_ptr<Rope> rope;
  LinearOptions options;
};

Heads<const float> call_view(const SavedCallCase& c, const MatrixF& x, Index rows, Index cols,
                             const std::vector<Index>& lengths) {
  REQUIRE(c.batch * c.heads * rows * cols <= x.size());
  return {x.data(), c.batch, c.heads, rows, cols, lengths.data()};
}

void call_forward(const CallInputs& x, const SavedCallCase& c, LinearSavedF& saved) {
  const BuiltCall built(c);
  MatrixF out = MatrixF::Zero(c.batch * c.heads * c.n, c.d_v);
  linear_attention(
      call_view(c, x.q, c.n, c.d, c.q_lengths), call_view(c, x.k, c.n_k, c.d, c.k_lengths),
      call_view(c, x.v, c.n_k, c.d_v, c.k_lengths),
      Heads<float>{out.data(), c.batch, c.heads, c.n, c.d_v}, *built.map, built.options, saved);
}

// c's backward, reading `saved` when given.
CallGradients call_backward(const CallInputs& x, const SavedCallCase& c,
                            const LinearSavedF* saved) {
  const BuiltCall built(c);
  CallGradients g{MatrixF::Zero(c.batch * c.heads * c.n, c.d),
                  MatrixF::Zero(c.batch * c.heads * c.n_k, c.d),
                  MatrixF::Zero(c.batch * c.heads * c.n_k, c.d_v)};
  const auto q = call_view(c, x.q, c.n, c.d, c.q_lengths),
             k = call_view(c, x.k, c.n_k, c.d, c.k_lengths),
             v = call_view(c, x.v, c.n_k, c.d_v, c.k_lengths),
             d_out = call_view(c, x.d_out, c.n, c.d_v, c.q_lengths);
  const Heads<float> dq{g.dq.data(), c.batch, c.heads, c.n, c.d},
      dk{g.dk.data(), c.batch, c.heads, c.n_k, c.d},
      dv{g.dv.data(), c.batch, c.heads, c.n_k, c.d_v};
  if (saved)
    linear_attention_backward(q, k, v, d_out, dq, dk, dv, *built.map, built.options, *saved);
  else
    linear_attention_backward(q, k, v, d_out, dq, dk, dv, *built.map, built.options);
  return g;
}

void require_same_gradients(const CallGradients& got, const CallGradients& want) {
  require_same_bits(got.dq, want.dq, "dq");
  require_same_bits(got.dk, want.dk, "dk");
  require_same_bits(got.dv, want.dv, "dv");
}

const std::string kAnotherCall =
    "linear_attention_backward: saved holds the features of another call: its forward had ";

// One field of SavedCall changed: the backward's call is the forward's with `change` applied (and
// both are the base call with `both` applied, when given); the refusal reads kAnotherCall + had.
struct FieldChange {
  const char* field;
  void (*change)(SavedCallCase&);
  const char* had;
  void (*both)(SavedCallCase&) = nullptr;
};

// A call without a placement: its rope's width is not checked against d or m, so a rope of
// another width (or none) is a valid call.
void no_placement(SavedCallCase& c) { c.options.placement = RopePlacement::None; }

// Every field check_saved compares (linear_saved.cpp), in its order.
const FieldChange kFieldChanges[] = {
    {"batch",
     [](SavedCallCase& c) {
       c.batch = 1;
       c.q_lengths = {8};
       c.k_lengths = {10};
     },
     "batch = 2, this call has 1"},
    // One decay per head: head_decays follows heads (else a refusal of its own, before saved).
    {"heads",
     [](SavedCallCase& c) {
       c.heads = 1;
       c.head_decays = {1.0};
     },
     "heads = 2, this call has 1"},
    {"n (q's rows)", [](SavedCallCase& c) { c.n = 8; }, "n = 9, this call has 8"},
    {"n_k (k's rows)", [](SavedCallCase& c) { c.n_k = 10; }, "n_k = 11, this call has 10"},
    {"d",
     [](SavedCallCase& c) {
       c.d = 4;
       c.map.input_dim = 4;
     },
     "d = 5, this call has 4"},
    {"q's length, batch entry 1", [](SavedCallCase& c) { c.q_lengths[1] = 5; },
     "q's length[1] = 6, this call has 5"},
    {"k's length, batch entry 0", [](SavedCallCase& c) { c.k_lengths[0] = 7; },
     "k's length[0] = 10, this call has 7"},
    // A decay < 1 is refused on a non-causal call: the decays go too (causal is compared first).
    {"causal",
     [](SavedCallCase& c) {
       c.options.causal = false;
       c.head_decays = {};
     },
     "options.causal = 1, this call has 0"},
    {"placement", [](SavedCallCase& c) { c.options.placement = RopePlacement::Full; },
     "options.placement = numerator_only, this call has full"},
    {"q_offset", [](SavedCallCase& c) { c.options.q_offset = 3; },
     "options.q_offset = 2, this call has 3"},
    {"k_offset", [](SavedCallCase& c) { c.options.k_offset = 1; },
     "options.k_offset = 0, this call has 1"},
    {"head_decays", [](SavedCallCase& c) { c.head_decays[1] = 0.8; },
     "the decay of head[1] = 0.90000000000000002, this call has 0.80000000000000004"},
    {"decay (one for every head)",
     [](SavedCallCase& c) {
       c.head_decays = {};
       c.options.decay = 0.9;
     },
     "the decay of head[0] = 1, this call has 0.90000000000000002"},
    // The rope's width is m for numerator_only: it grows with the map.
    {"m",
     [](SavedCallCase& c) {
       c.map.num_features = 16;
       c.rope.dim = c.rope.rotary_dim = 16;
     },
     "m = map.output_dim() = 8, this call has 16"},
    // num_features cannot differ alone: m is f (favor+) or 2f (favor-trig, favor-hyp), so another
    // f of the same kind changes m, compared first; the m check fires.
    {"num_features",
     [](SavedCallCase& c) {
       c.map.num_features = 4;
       c.rope.dim = c.rope.rotary_dim = 4;
     },
     "m = map.output_dim() = 8, this call has 4"},
    // favor-trig with f = 4 has favor+'s m = 8.
    {"map kind",
     [](SavedCallCase& c) {
       c.map.kind = FeatureMapKind::FavorTrig;
       c.map.num_features = 4;
     },
     "a map of kind favor+, this call has favor-trig"},
    {"map orthogonal", [](SavedCallCase& c) { c.map.orthogonal = false; },
     "map orthogonal = 1, this call has 0"},
    {"map regularized", [](SavedCallCase& c) { c.map.regularized = true; },
     "map regularized = 0, this call has 1"},
    {"map seed", [](SavedCallCase& c) { c.map.seed = 6; },
     "a map drawn from seed 5, this call has 6"},
    // A rope set or not, and its dim, are never compared on their own: a placement needs a rope of
    // the width d (before_map) or m (numerator_only, full), and with placement none the rope is no
    // part of the call ("options no feature depends on", below).
    {"rope rotary_dim", [](SavedCallCase& c) { c.rope.rotary_dim = 6; },
     "options.rope's rotary_dim = 8, this call has 6"},
    {"rope base", [](SavedCallCase& c) { c.rope.base = 500; },
     "options.rope's base = 10000, this call has 500"},
    {"rope layout", [](SavedCallCase& c) { c.rope.layout = RopeLayout::Half; },
     "options.rope's layout = interleaved, this call has half"},
    {"rope scaling kind", [](SavedCallCase& c) { c.rope.scaling.kind = RopeScalingKind::Linear; },
     "options.rope's scaling = yarn, this call has linear"},
    {"rope scaling kind, to none",
     [](SavedCallCase& c) { c.rope.scaling.kind = RopeScalingKind::None; },
     "options.rope's scaling = yarn, this call has none"},
    {"rope scaling factor", [](SavedCallCase& c) { c.rope.scaling.factor = 3.0; },
     "options.rope's scaling factor = 2, this call has 3"},
    {"rope original_max_position",
     [](SavedCallCase& c) { c.rope.scaling.original_max_position = 32; },
     "options.rope's original_max_position = 16, this call has 32"},
    {"rope beta_fast", [](SavedCallCase& c) { c.rope.scaling.beta_fast = 16.0; },
     "options.rope's beta_fast = 32, this call has 16"},
    {"rope beta_slow", [](SavedCallCase& c) { c.rope.scaling.beta_slow = 2.0; },
     "options.rope's beta_slow = 1, this call has 2"},
};

TEST_CASE("saved features: a backward refuses a forward that differs in any one compared field") {
  const CallInputs x;
  for (const FieldChange& f : kFieldChanges) {
    INFO("field: " << std::string(f.field));
    SavedCallCase forward_call;
    if (f.both) f.both(forward_call);
    SavedCallCase backward_call = forward_call;
    f.change(backward_call);
    LinearSavedF saved;
    call_forward(x, forward_call, saved);
    const std::size_t bytes = saved.bytes();
    CHECK(refusal([&] { call_backward(x, backward_call, &saved); }) == kAnotherCall + f.had);
    // The changed call is a valid call of its own: with its own forward's features, accepted.
    LinearSavedF own;
    call_forward(x, backward_call, own);
    CHECK(refusal([&] { call_backward(x, backward_call, &own); }).empty());
    // The refusal left `saved` as it was: the forward's own backward reads it, the plain bits.
    CHECK_FALSE(saved.empty());
    CHECK(saved.bytes() == bytes);
    require_same_gradients(call_backward(x, forward_call, &saved),
                           call_backward(x, forward_call, nullptr));
  }
}

TEST_CASE("saved features: options no feature depends on are not compared") {
  // eps, the denominator, the causal method and its chunk size, and d_v change the backward, not
  // the features: a backward that differs from its forward in one of them reads the forward's
  // features and gives its own plain backward's bits.
  const CallInputs x;
  const SavedCallCase base;
  LinearSavedF saved;
  call_forward(x, base, saved);
  const std::pair<const char*, void (*)(SavedCallCase&)> changes[] = {
      {"eps", [](SavedCallCase& c) { c.options.eps = 1e-2; }},
      {"denominator", [](SavedCallCase& c) { c.options.denominator = false; }},
      {"method", [](SavedCallCase& c) { c.options.method = CausalMethod::Chunked; }},
      {"chunk_size",
       [](SavedCallCase& c) {
         c.options.method = CausalMethod::Chunked;
         c.options.chunk_size = 3;
       }},
      {"d_v", [](SavedCallCase& c) { c.d_v = 2; }},
  };
  for (const auto& [field, change] : changes) {
    INFO("field: " << std::string(field));
    SavedCallCase other = base;
    change(other);
    require_same_gradients(call_backward(x, other, &saved), call_backward(x, other, nullptr));
  }
}

TEST_CASE("saved features: with placement none the rope is not compared") {
  // The call uses no rope: a backward with none, or with a rope of another width or base, than
  // its forward had reads the forward's features and gives its own plain backward's bits.
  const CallInputs x;
  SavedCallCase base;
  no_placement(base);
  const std::pair<const char*, void (*)(SavedCallCase&)> changes[] = {
      {"rope unset", [](SavedCallCase& c) { c.has_rope = false; }},
      {"rope dim",
       [](SavedCallCase& c) {
         c.rope.dim = 6;
         c.rope.rotary_dim = 6;
       }},
      {"rope base", [](SavedCallCase& c) { c.rope.base = 500; }},
  };
  for (const bool forward_rope : {true, false}) {
    SavedCallCase forward = base;
    forward.has_rope = forward_rope;
    LinearSavedF saved;
    call_forward(x, forward, saved);
    for (const auto& [field, change] : changes) {
      INFO("forward has a rope: " << forward_rope << ", field: " << std::string(field));
      SavedCallCase other = base;
      change(other);
      require_same_gradients(call_backward(x, other, &saved), call_backward(x, other, nullptr));
    }
  }
}

TEST_CASE("saved features: a batched forward that throws leaves saved refused until refilled") {
  CallInputs x;
  const SavedCallCase c;
  LinearSavedF saved;
  call_forward(x, c, saved);
  REQUIRE_FALSE(saved.empty());
  // A forward refused by its checks leaves `saved` as it was: still read, the plain bits.
  SavedCallCase refused = c;
  refused.options.eps = -1;
  CHECK(refusal([&] { call_forward(x, refused, saved); }) ==
        "linear_attention: options.eps is -1 but expected a finite eps >= 0");
  CHECK_FALSE(saved.empty());
  require_same_gradients(call_backward(x, c, &saved), call_backward(x, c, nullptr));
  // Slice (b = 1, h = 0) holds q_lengths[1] = 6 rows: a NaN in row 7 is never read; one in row 3
  // is. The forward that finds it has begun refilling `saved`: it clears it, so that it reads as
  // empty, holds no memory, and the backward refuses it as it refuses an empty one, rather than
  // reading rows that were partly written.
  const Index slice_row = (1 * c.heads + 0) * c.n;
  const float kept = x.q(slice_row + 7, 1);
  x.q(slice_row + 7, 1) = std::numeric_limits<float>::quiet_NaN();
  call_forward(x, c, saved);
  CHECK_FALSE(saved.empty());
  x.q(slice_row + 7, 1) = kept;
  const float within = x.q(slice_row + 3, 1);
  x.q(slice_row + 3, 1) = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_AS(call_forward(x, c, saved), NonFiniteError);
  x.q(slice_row + 3, 1) = within;
  CHECK(saved.empty());
  CHECK(saved.bytes() == 0);
  CHECK(refusal([&] { call_backward(x, c, &saved); }) ==
        "linear_attention_backward: saved is empty; expected the LinearSaved that this call's "
        "forward filled");
  // A forward that succeeds fills it again: read, the plain bits.
  call_forward(x, c, saved);
  CHECK_FALSE(saved.empty());
  require_same_gradients(call_backward(x, c, &saved), call_backward(x, c, nullptr));
}

TEST_CASE("saved features: slices without queries, after keys none of them sees") {
  // q_offset 2: queries would see two keys before their own; a slice of length 0 has no query,
  // so its forward maps no key, while its backward would map those two: it must map them itself.
  const Index B = 2, H = 2, n = 6, n_k = 9, d = 4, d_v = 3;
  const auto map = make_map(FeatureMapKind::FavorPositive, d, 8, 5);
  const Rope rope(placement_rope(RopePlacement::NumeratorOnly, d, map->output_dim(), false));
  const LinearOptions options =
      linear_options(true, RopePlacement::NumeratorOnly, &rope, 1e-3, 2, 0);
  const MatrixF q = input<float>(B * H * n, d, 31), k = input<float>(B * H * n_k, d, 32),
                v = input<float>(B * H * n_k, d_v, 33), d_out = input<float>(B * H * n, d_v, 34);
  for (const std::vector<Index>& q_lengths : {std::vector<Index>{n, 0}, {0, n}, {0, 0}}) {
    CAPTURE(q_lengths[0]);
    CAPTURE(q_lengths[1]);
    const std::vector<Index> k_lengths{n_k, n_k};
    const auto in = [&](const MatrixF& x, Index rows, const std::vector<Index>& lengths) {
      return Heads<const float>{x.data(), B, H, rows, x.cols(), lengths.data()};
    };
    const auto out = [&](MatrixF& x, Index rows) {
      return Heads<float>{x.data(), B, H, rows, x.cols()};
    };
    MatrixF o = MatrixF::Zero(B * H * n, d_v), o_saving = o;
    LinearSavedF saved;
    linear_attention(in(q, n, q_lengths), in(k, n_k, k_lengths), in(v, n_k, k_lengths), out(o, n),
                     *map, options);
    linear_attention(in(q, n, q_lengths), in(k, n_k, k_lengths), in(v, n_k, k_lengths),
                     out(o_saving, n), *map, options, saved);
    require_same_bits(o_saving, o, "out");
    MatrixF dq(B * H * n, d), dk(B * H * n_k, d), dv(B * H * n_k, d_v);
    MatrixF sq = dq, sk = dk, sv = dv;
    linear_attention_backward(in(q, n, q_lengths), in(k, n_k, k_lengths), in(v, n_k, k_lengths),
                              in(d_out, n, q_lengths), out(dq, n), out(dk, n_k), out(dv, n_k), *map,
                              options);
    linear_attention_backward(in(q, n, q_lengths), in(k, n_k, k_lengths), in(v, n_k, k_lengths),
                              in(d_out, n, q_lengths), out(sq, n), out(sk, n_k), out(sv, n_k), *map,
                              options, saved);
    require_same_bits(sq, dq, "dq");
    require_same_bits(sk, dk, "dk");
    require_same_bits(sv, dv, "dv");
  }
}

TEST_CASE("saved features: the backward reads the forward's key features, not k") {
  // With other values of k than its forward's (the caller's promise broken on purpose), a backward
  // that reads the kept key rows gives another dq than the plain backward of those values: a
  // backward that silently mapped k again would give the same.
  const Shape s{40, 40, 4, 3};
  const auto map = make_map(FeatureMapKind::FavorPositive, s.d, 8, 3);
  const Rope rope(placement_rope(RopePlacement::NumeratorOnly, s.d, map->output_dim(), false));
  const MatrixD q = input<double>(s.n, s.d, 1), k = input<double>(s.n_k, s.d, 2),
                v = input<double>(s.n_k, s.d_v, 3), d_out = input<double>(s.n, s.d_v, 4);
  const MatrixD k_other = 1.5 * k;
  for (const bool causal : {false, true}) {
    CAPTURE(causal);
    const LinearOptions options =
        linear_options(causal, RopePlacement::NumeratorOnly, &rope, 1e-3, 0, 0);
    LinearSavedD saved;
    linear_attention(q, k, v, *map, options, saved);
    const auto got = linear_attention_backward(q, k_other, v, d_out, *map, options, saved);
    const auto plain = linear_attention_backward(q, k_other, v, d_out, *map, options);
    CHECK_FALSE((got.dq.array() == plain.dq.array()).all());
  }
}

TEST_CASE("saved features: a forward that finds a non-finite input leaves saved empty") {
  const auto map = make_map(FeatureMapKind::FavorPositive, 4, 8, 3);
  const Rope rope(placement_rope(RopePlacement::NumeratorOnly, 4, map->output_dim(), false));
  const LinearOptions options =
      linear_options(true, RopePlacement::NumeratorOnly, &rope, 1e-3, 0, 0);
  MatrixF q = input<float>(10, 4, 1);
  const MatrixF k = input<float>(10, 4, 2), v = input<float>(10, 3, 3);
  LinearSavedF saved;
  linear_attention(q, k, v, *map, options, saved);
  CHECK_FALSE(saved.empty());
  q(7, 1) = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_AS(linear_attention(q, k, v, *map, options, saved), NonFiniteError);
  CHECK(saved.empty());
}

TEST_CASE("saved features: an object refilled, moved, and read twice") {
  const auto map = make_map(FeatureMapKind::FavorPositive, 4, 8, 3);
  const Rope rope(placement_rope(RopePlacement::Full, 4, map->output_dim(), false));
  const LinearOptions options = linear_options(true, RopePlacement::Full, &rope, 1e-3, 0, 0);
  LinearSavedD saved;
  const MatrixD q1 = input<double>(20, 4, 1), q2 = input<double>(5, 4, 2),
                k2 = input<double>(5, 4, 3), v2 = input<double>(5, 2, 4),
                d_out2 = input<double>(5, 2, 5);
  linear_attention(q1, q1, input<double>(20, 2, 6), *map, options, saved);
  linear_attention(q2, k2, v2, *map, options, saved);  // replaces what it held
  CHECK(saved.bytes() == std::size_t(10) * (std::size_t(map->output_dim()) + 1) * sizeof(double));
  LinearSavedD moved = std::move(saved);
  const auto want = linear_attention_backward(q2, k2, v2, d_out2, *map, options);
  require_same_gradients(linear_attention_backward(q2, k2, v2, d_out2, *map, options, moved), want);
  require_same_gradients(linear_attention_backward(q2, k2, v2, d_out2, *map, options, moved), want);
  // The values of q and k are the caller's promise, not checked: the backward reads the kept
  // features, so with other values it is not the plain backward of those values (which shows that
  // it reads them rather than mapping q and k again).
  const MatrixD q3 = q2 * 1.5;
  const auto other = linear_attention_backward(q3, k2, v2, d_out2, *map, options, moved);
  CHECK_FALSE(
      (other.dq.array() == linear_attention_backward(q3, k2, v2, d_out2, *map, options).dq.array())
          .all());
}

}  // namespace
