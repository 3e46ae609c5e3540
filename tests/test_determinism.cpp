// Same inputs, same bits: every kernel's result must not depend on how its work falls onto the
// threads, on the thread count, or on where its buffers (ours or the caller's) sit in memory.
//
// How the tests force what a quiet machine would not show:
// - scheduling: other threads keep every core busy (BusyCores), so that the OpenMP threads are
//   preempted at varying points and dynamically scheduled tasks land on varying threads;
// - thread counts 1 to 4 (more threads than the two cores of the CI machine, on purpose);
// - our own allocations: blocks of varying sizes are allocated between two runs (HeapShuffle), so
//   that the kernels' internal buffers start at varying addresses;
// - the caller's buffers: inputs and outputs placed 4 to 48 bytes past a 64-byte boundary.
// The one documented exception: causal linear attention on a long single head splits the sequence
// into one segment per thread, so its bits are compared per thread count (attention.hpp).
#include <doctest/doctest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <linrope/linrope.hpp>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "reference/random.hpp"
#include "threads.hpp"

namespace {

using namespace linrope;
using linrope::testing::gaussian;
using linrope::testing::ThreadCount;

// One spinning thread per hardware thread, for its scope: the kernels' threads then share the
// cores with them and are preempted at arbitrary points.
class BusyCores {
 public:
  BusyCores() {
    const unsigned count = std::max(2u, std::thread::hardware_concurrency());
    for (unsigned t = 0; t < count; ++t)
      threads_.emplace_back([this, t] {
        volatile std::uint64_t x = t;
        while (!stop_.load(std::memory_order_relaxed)) x = x * 6364136223846793005ULL + 1;
      });
  }
  ~BusyCores() {
    stop_ = true;
    for (auto& t : threads_) t.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

// Allocates a few blocks of sizes that vary with `round` and keeps them until its end, so that
// whatever a kernel allocates next starts at another address (mod 64) than in the last round.
class HeapShuffle {
 public:
  explicit HeapShuffle(int round) {
    for (int b = 0; b < 4; ++b)
      blocks_.emplace_back(new char[std::size_t(8 + 24 * ((round + b) % 7))]);
  }

 private:
  std::vector<std::unique_ptr<char[]>> blocks_;
};

// The bytes of a result, for exact comparison (+0 and -0, or two NaN payloads, would differ).
template <class T>
std::vector<unsigned char> bytes_of(const T* data, Index count) {
  std::vector<unsigned char> b(std::size_t(count) * sizeof(T));
  std::memcpy(b.data(), data, b.size());
  return b;
}
template <class M>
std::vector<unsigned char> bytes_of(const M& m) {
  return bytes_of(m.data(), m.size());
}

// A copy of m's elements starting `offset` bytes past a 64-byte boundary.
template <class T>
class Placed {
 public:
  Placed(const Matrix<T>& m, std::size_t offset) : Placed(m.size(), offset) {
    std::memcpy(data_, m.data(), sizeof(T) * std::size_t(m.size()));
  }
  Placed(Index count, std::size_t offset) : storage_(sizeof(T) * std::size_t(count) + 128) {
    const auto base = reinterpret_cast<std::uintptr_t>(storage_.data());
    data_ = reinterpret_cast<T*>((base + 63) / 64 * 64 + offset);
  }
  T* data() const { return data_; }

 private:
  std::vector<unsigned char> storage_;
  T* data_;
};

// A kernel under test: runs once and returns its result's bytes.
using Kernel = std::function<std::vector<unsigned char>()>;

// Runs `kernel` `rounds` times for each thread count with every core busy and the heap shuffled,
// and checks each result against the first (one reference for all counts unless
// per_thread_count).
void check_reproducible(const Kernel& kernel, int rounds, bool per_thread_count = false) {
  std::vector<unsigned char> reference;
  {
    const ThreadCount one(1);
    reference = kernel();
  }
  const BusyCores busy;
  for (const int threads : {2, 3, 4}) {
    CAPTURE(threads);
    const ThreadCount count(threads);
    if (per_thread_count) reference = kernel();
    int differing = 0;
    for (int round = 0; round < rounds; ++round) {
      const HeapShuffle shuffle(round + threads);
      differing += kernel() != reference;
    }
    CHECK(differing == 0);
  }
}

template <class T>
Matrix<T> input(Index rows, Index cols, std::uint64_t seed, double scale = 1.0) {
  return (gaussian(rows, cols, seed) * scale).cast<T>();
}

// The bytes of a backward's dq, dk and dv, one after another.
template <class T>
std::vector<unsigned char> bytes_of(const AttentionGradients<T>& g) {
  std::vector<unsigned char> b = bytes_of(g.dq);
  for (const Matrix<T>* m : {&g.dk, &g.dv}) {
    const std::vector<unsigned char> more = bytes_of(*m);
    b.insert(b.end(), more.begin(), more.end());
  }
  return b;
}

}  // namespace

TEST_CASE("softmax_attention: the sliced causal key cache gives the same bits run after run") {
  // 20 queries against 2100 keys in blocks of 7: the keys are cut into two slices that run as
  // separate tasks and are merged, the shape that once changed its last bits with the timing.
  const Index n = 20, n_k = 2100, d = 16, d_v = 7;
  const Rope rope({.dim = d});
  const SoftmaxOptions options{.causal = true, .rope = &rope, .q_offset = 2080, .block_size = 7};
  const auto run_case = [&]<class T>(T) {
    const Matrix<T> q = input<T>(n, d, 21), k = input<T>(n_k, d, 22), v = input<T>(n_k, d_v, 23);
    check_reproducible([&] { return bytes_of(softmax_attention(q, k, v, options)); }, 200);
  };
  SUBCASE("double") { run_case(double{}); }
  SUBCASE("float") { run_case(float{}); }
}

namespace {

// The shapes the softmax forward and backward are swept over: several blocks of queries (and,
// from 1024 queries, several parts whose dk and dv the backward adds), a sliced key cache (few
// queries, many keys: the forward merges slices), an odd block size.
struct SoftmaxShape {
  Index n, n_k, q_offset, block_size;
  bool causal;
};
constexpr SoftmaxShape kSoftmaxShapes[] = {{300, 300, 0, 0, true},
                                           {300, 300, 0, 0, false},
                                           {5, 3000, 2995, 0, true},
                                           {37, 1500, 0, 13, false},
                                           {1100, 1100, 0, 0, true}};

// check(q, k, v, d_out, options) in double, then in float, for every shape: d = 16, d_v = 9, a
// rope.
template <class Check>
void for_each_softmax_shape(Check check) {
  const Index d = 16, d_v = 9;
  const Rope rope({.dim = d});
  for (const SoftmaxShape& s : kSoftmaxShapes) {
    CAPTURE(s.n);
    CAPTURE(s.n_k);
    CAPTURE(s.causal);
    const SoftmaxOptions options{
        .causal = s.causal, .rope = &rope, .q_offset = s.q_offset, .block_size = s.block_size};
    const MatrixD q = input<double>(s.n, d, 1), k = input<double>(s.n_k, d, 2),
                  v = input<double>(s.n_k, d_v, 3), d_out = input<double>(s.n, d_v, 4);
    check(q, k, v, d_out, options);
    check(MatrixF(q.cast<float>()), MatrixF(k.cast<float>()), MatrixF(v.cast<float>()),
          MatrixF(d_out.cast<float>()), options);
  }
}

}  // namespace

TEST_CASE("softmax_attention: same bits for any thread count, scheduling and heap state") {
  for_each_softmax_shape(
      [](const auto& q, const auto& k, const auto& v, const auto&, const SoftmaxOptions& options) {
        check_reproducible([&] { return bytes_of(softmax_attention(q, k, v, options)); }, 10);
      });
}

TEST_CASE("softmax_attention_backward: same bits for any thread count, scheduling and heap state") {
  for_each_softmax_shape([](const auto& q, const auto& k, const auto& v, const auto& d_out,
                            const SoftmaxOptions& options) {
    check_reproducible(
        [&] { return bytes_of(softmax_attention_backward(q, k, v, d_out, options)); }, 4);
  });
}

namespace {

struct LinearCase {
  FeatureMapKind kind;
  RopePlacement placement;
};

// Every map and placement, small enough to sweep: d = 16, FAVOR with 24 features.
std::vector<LinearCase> linear_cases() {
  std::vector<LinearCase> cases;
  for (const FeatureMapKind kind :
       {FeatureMapKind::EluPlusOne, FeatureMapKind::Relu, FeatureMapKind::FavorPositive,
        FeatureMapKind::FavorTrig, FeatureMapKind::FavorHyperbolic, FeatureMapKind::OnePlusCosine})
    for (const RopePlacement placement : {RopePlacement::None, RopePlacement::BeforeMap,
                                          RopePlacement::NumeratorOnly, RopePlacement::Full})
      cases.push_back({kind, placement});
  return cases;
}

struct LinearSetupForTest {
  std::unique_ptr<FeatureMap> map;
  std::unique_ptr<Rope> rope;
  LinearOptions options;
  LinearSetupForTest(const LinearCase& c, Index d, bool causal, CausalMethod method) {
    map = make_feature_map({.kind = c.kind, .input_dim = d, .num_features = 24, .seed = 5});
    if (c.placement == RopePlacement::BeforeMap)
      rope = std::make_unique<Rope>(RopeConfig{.dim = d});
    if (c.placement == RopePlacement::NumeratorOnly || c.placement == RopePlacement::Full) {
      const Index m = map->output_dim();
      rope = std::make_unique<Rope>(RopeConfig{.dim = m, .rotary_dim = m / 2 * 2});
    }
    options = {.causal = causal, .placement = c.placement, .rope = rope.get(), .method = method};
  }
};

}  // namespace

TEST_CASE(
    "linear_attention: same bits under varied scheduling and heap state, every map and "
    "placement") {
  // n = 1100: long enough that the non-causal form cuts its keys and queries into parts and the
  // causal forms cut the sequence into one segment per thread.
  const Index n = 1100, d = 16, d_v = 10;
  const MatrixD q = input<double>(n, d, 11, 1.5), k = input<double>(n, d, 12, 1.5),
                v = input<double>(n, d_v, 13);
  const MatrixF qf = q.cast<float>(), kf = k.cast<float>(), vf = v.cast<float>();
  for (const LinearCase& c : linear_cases())
    for (const bool causal : {false, true})
      for (const CausalMethod method : {CausalMethod::Scan, CausalMethod::Chunked}) {
        if (!causal && method == CausalMethod::Chunked) continue;
        const std::string map_name = to_string(c.kind), placement = to_string(c.placement);
        CAPTURE(map_name);
        CAPTURE(placement);
        CAPTURE(causal);
        CAPTURE(int(method));
        const LinearSetupForTest setup(c, d, causal, method);
        // Non-causal: one reference for every thread count. Causal: per thread count.
        check_reproducible(
            [&] { return bytes_of(linear_attention(qf, kf, vf, *setup.map, setup.options)); }, 3,
            causal);
        check_reproducible(
            [&] { return bytes_of(linear_attention(q, k, v, *setup.map, setup.options)); }, 1,
            causal);
      }
}

TEST_CASE(
    "linear_attention_backward: same bits under varied scheduling and heap state, every map and "
    "placement") {
  // n = 1100 as above: the non-causal backward cuts queries and keys into parts, the causal one
  // cuts the sequence into one segment per thread (so its bits may change with the thread count,
  // never with the timing).
  const Index n = 1100, d = 16, d_v = 10;
  const MatrixD q = input<double>(n, d, 21, 1.5), k = input<double>(n, d, 22, 1.5),
                v = input<double>(n, d_v, 23), d_out = input<double>(n, d_v, 24);
  const MatrixF qf = q.cast<float>(), kf = k.cast<float>(), vf = v.cast<float>(),
                gf = d_out.cast<float>();
  // Every placement with elu+1 and FAVOR+, every map with eq. 19: the backward's code paths, at
  // half the forward sweep's cost (the suite runs under sanitizers too).
  for (const LinearCase& c : linear_cases())
    for (const bool causal : {false, true}) {
      if (c.placement != RopePlacement::NumeratorOnly && c.kind != FeatureMapKind::EluPlusOne &&
          c.kind != FeatureMapKind::FavorPositive)
        continue;
      const std::string map_name = to_string(c.kind), placement = to_string(c.placement);
      CAPTURE(map_name);
      CAPTURE(placement);
      CAPTURE(causal);
      const LinearSetupForTest setup(c, d, causal, CausalMethod::Scan);
      check_reproducible(
          [&] {
            return bytes_of(linear_attention_backward(qf, kf, vf, gf, *setup.map, setup.options));
          },
          2, causal);
      check_reproducible(
          [&] {
            return bytes_of(linear_attention_backward(q, k, v, d_out, *setup.map, setup.options));
          },
          1, causal);
    }
}

TEST_CASE("batched attention: same bits under varied scheduling, equal to the single-head calls") {
  // Six slices, so that 2-4 threads take one slice each (serial kernels) while 1 thread runs each
  // slice with the whole team: both must give the single-head bits (non-causal linear and
  // softmax for any thread count; causal linear for one thread, where neither splits).
  const Index B = 2, H = 3, n = 700, d = 16, d_v = 8;
  const MatrixF q = input<float>(B * H * n, d, 31), k = input<float>(B * H * n, d, 32),
                v = input<float>(B * H * n, d_v, 33);
  const auto map = make_feature_map(
      {.kind = FeatureMapKind::FavorPositive, .input_dim = d, .num_features = 32, .seed = 9});
  const Rope rope({.dim = 32});
  const Rope softmax_rope({.dim = d});
  for (const bool causal : {false, true}) {
    CAPTURE(causal);
    const LinearOptions linear{.causal = causal, .rope = &rope};
    const SoftmaxOptions softmax{.causal = causal, .rope = &softmax_rope};
    const auto run_linear = [&] {
      MatrixF out(B * H * n, d_v);
      linear_attention(Heads<const float>{q.data(), B, H, n, d}, {k.data(), B, H, n, d},
                       {v.data(), B, H, n, d_v}, {out.data(), B, H, n, d_v}, *map, linear);
      return out;
    };
    const auto run_softmax = [&] {
      MatrixF out(B * H * n, d_v);
      softmax_attention(Heads<const float>{q.data(), B, H, n, d}, {k.data(), B, H, n, d},
                        {v.data(), B, H, n, d_v}, {out.data(), B, H, n, d_v}, softmax);
      return out;
    };
    check_reproducible([&] { return bytes_of(run_linear()); }, 5, causal);
    check_reproducible([&] { return bytes_of(run_softmax()); }, 5);
    const ThreadCount one(1);
    const MatrixF linear_out = run_linear(), softmax_out = run_softmax();
    for (Index s = 0; s < B * H; ++s) {
      CAPTURE(s);
      const auto rows = [&](const MatrixF& m) { return MatrixF(m.middleRows(s * n, n)); };
      CHECK(bytes_of(linear_attention(rows(q), rows(k), rows(v), *map, linear)) ==
            bytes_of(rows(linear_out)));
      CHECK(bytes_of(softmax_attention(rows(q), rows(k), rows(v), softmax)) ==
            bytes_of(rows(softmax_out)));
    }
  }
}

TEST_CASE(
    "batched softmax_attention_backward: same bits under varied scheduling, equal to the "
    "single-head calls") {
  // Six slices: 2-4 threads take one slice each (serial kernels), 1 thread runs each slice with
  // the whole team; both must give the single-head bits.
  const Index B = 2, H = 3, n = 300, d = 16, d_v = 8;
  const MatrixF q = input<float>(B * H * n, d, 31), k = input<float>(B * H * n, d, 32),
                v = input<float>(B * H * n, d_v, 33), d_out = input<float>(B * H * n, d_v, 34);
  const Rope rope({.dim = d});
  for (const bool causal : {false, true}) {
    CAPTURE(causal);
    const SoftmaxOptions options{.causal = causal, .rope = &rope};
    const auto run = [&] {
      AttentionGradients<float> g{MatrixF(B * H * n, d), MatrixF(B * H * n, d),
                                  MatrixF(B * H * n, d_v)};
      softmax_attention_backward(Heads<const float>{q.data(), B, H, n, d}, {k.data(), B, H, n, d},
                                 {v.data(), B, H, n, d_v}, {d_out.data(), B, H, n, d_v},
                                 {g.dq.data(), B, H, n, d}, {g.dk.data(), B, H, n, d},
                                 {g.dv.data(), B, H, n, d_v}, options);
      return g;
    };
    check_reproducible([&] { return bytes_of(run()); }, 3);
    const ThreadCount one(1);
    const AttentionGradients<float> batched = run();
    for (Index s = 0; s < B * H; ++s) {
      CAPTURE(s);
      const auto rows = [&](const MatrixF& m) { return MatrixF(m.middleRows(s * n, n)); };
      const auto single =
          softmax_attention_backward(rows(q), rows(k), rows(v), rows(d_out), options);
      CHECK(bytes_of(single.dq) == bytes_of(rows(batched.dq)));
      CHECK(bytes_of(single.dk) == bytes_of(rows(batched.dk)));
      CHECK(bytes_of(single.dv) == bytes_of(rows(batched.dv)));
    }
  }
}

namespace {

// Offsets from a 64-byte boundary at which the caller's buffers are placed (multiples of the
// element size: a double 4 bytes off would be a misaligned object).
template <class T>
std::vector<std::size_t> offsets() {
  if constexpr (sizeof(T) == 4) return {0, 4, 8, 16, 24, 32, 48};
  return {0, 8, 16, 24, 32, 48};
}

// Batched attention (the entry point that takes the caller's raw pointers) with q, k, v and out
// all placed `offset` bytes past a 64-byte boundary.
template <class T, class Call>
std::vector<unsigned char> placed_call(const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                                       Index heads, std::size_t offset, Call call) {
  const Placed<T> pq(q, offset), pk(k, offset), pv(v, offset), po(q.rows() * v.cols(), offset);
  const Index n = q.rows() / heads, n_k = k.rows() / heads;
  call(Heads<const T>{pq.data(), 1, heads, n, q.cols()},
       Heads<const T>{pk.data(), 1, heads, n_k, k.cols()},
       Heads<const T>{pv.data(), 1, heads, n_k, v.cols()},
       Heads<T>{po.data(), 1, heads, n, v.cols()});
  return bytes_of(po.data(), q.rows() * v.cols());
}

template <class T>
void check_offsets(const std::string& what,
                   const std::function<std::vector<unsigned char>(std::size_t)>& run) {
  const std::vector<unsigned char> reference = run(0);
  for (const std::size_t offset : offsets<T>()) {
    CAPTURE(what);
    CAPTURE(offset);
    CHECK(run(offset) == reference);
  }
}

template <class T>
void check_attention_offsets() {
  const Index heads = 2, n = 45, n_k = 2100, d = 13, d_v = 7;  // odd widths: rows start anywhere
  const Matrix<T> q = input<T>(heads * n, d, 41), k = input<T>(heads * n_k, d, 42),
                  v = input<T>(heads * n_k, d_v, 43);
  const SoftmaxOptions softmax{.causal = true, .q_offset = 2055, .block_size = 7};
  check_offsets<T>("softmax", [&](std::size_t offset) {
    return placed_call(q, k, v, heads, offset,
                       [&](auto... heads_views) { softmax_attention(heads_views..., softmax); });
  });
  for (const FeatureMapKind kind :
       {FeatureMapKind::EluPlusOne, FeatureMapKind::FavorPositive, FeatureMapKind::FavorTrig,
        FeatureMapKind::FavorHyperbolic, FeatureMapKind::OnePlusCosine})
    for (const bool causal : {false, true}) {
      const auto map = make_feature_map({.kind = kind, .input_dim = d, .num_features = 11});
      const Rope feature_rope({.dim = map->output_dim(), .rotary_dim = map->output_dim() / 2 * 2});
      const LinearOptions linear{.causal = causal, .rope = &feature_rope, .q_offset = n_k - n};
      const std::string map_name = to_string(kind);
      CAPTURE(map_name);
      CAPTURE(causal);
      check_offsets<T>("linear", [&](std::size_t offset) {
        return placed_call(q, k, v, heads, offset, [&](auto... heads_views) {
          linear_attention(heads_views..., *map, linear);
        });
      });
    }
}

// The bytes of placed dq, dk and dv (sizes given), one after another.
template <class T>
std::vector<unsigned char> gradient_bytes(const Placed<T>& dq, Index nq, const Placed<T>& dk,
                                          Index nk, const Placed<T>& dv, Index nv) {
  std::vector<unsigned char> b = bytes_of(dq.data(), nq);
  for (const auto& more : {bytes_of(dk.data(), nk), bytes_of(dv.data(), nv)})
    b.insert(b.end(), more.begin(), more.end());
  return b;
}

// The batched backward with every input and gradient buffer placed `offset` bytes past a 64-byte
// boundary; the gradients' bytes.
template <class T>
void check_backward_offsets() {
  const Index heads = 2, n = 45, n_k = 300, d = 13, d_v = 7;  // odd widths: rows start anywhere
  const Matrix<T> q = input<T>(heads * n, d, 44), k = input<T>(heads * n_k, d, 45),
                  v = input<T>(heads * n_k, d_v, 46), d_out = input<T>(heads * n, d_v, 47);
  const SoftmaxOptions options{.causal = true, .q_offset = 255, .block_size = 7};
  check_offsets<T>("softmax backward", [&](std::size_t offset) {
    const Placed<T> pq(q, offset), pk(k, offset), pv(v, offset), pg(d_out, offset),
        dq(q.size(), offset), dk(k.size(), offset), dv(v.size(), offset);
    softmax_attention_backward(
        Heads<const T>{pq.data(), 1, heads, n, d}, {pk.data(), 1, heads, n_k, d},
        {pv.data(), 1, heads, n_k, d_v}, {pg.data(), 1, heads, n, d_v}, {dq.data(), 1, heads, n, d},
        {dk.data(), 1, heads, n_k, d}, {dv.data(), 1, heads, n_k, d_v}, options);
    return gradient_bytes(dq, q.size(), dk, k.size(), dv, v.size());
  });
}

// The same for the linear backward (FAVOR+ eq. 19, causal: the kept features and the per-query
// terms live in scratch, the caller's rows anywhere).
template <class T>
void check_linear_backward_offsets() {
  const Index heads = 2, n = 45, n_k = 60, d = 13, d_v = 7;
  const Matrix<T> q = input<T>(heads * n, d, 54), k = input<T>(heads * n_k, d, 55),
                  v = input<T>(heads * n_k, d_v, 56), d_out = input<T>(heads * n, d_v, 57);
  const auto map = make_feature_map(
      {.kind = FeatureMapKind::FavorPositive, .input_dim = d, .num_features = 11, .seed = 3});
  const Rope features_rope({.dim = 11, .rotary_dim = 10});  // partial: 10 of the 11 features
  const LinearOptions options{.causal = true,
                              .placement = RopePlacement::NumeratorOnly,
                              .rope = &features_rope,
                              .q_offset = 20};
  check_offsets<T>("linear backward", [&](std::size_t offset) {
    const Placed<T> pq(q, offset), pk(k, offset), pv(v, offset), pg(d_out, offset),
        dq(q.size(), offset), dk(k.size(), offset), dv(v.size(), offset);
    linear_attention_backward(
        Heads<const T>{pq.data(), 1, heads, n, d}, {pk.data(), 1, heads, n_k, d},
        {pv.data(), 1, heads, n_k, d_v}, {pg.data(), 1, heads, n, d_v}, {dq.data(), 1, heads, n, d},
        {dk.data(), 1, heads, n_k, d}, {dv.data(), 1, heads, n_k, d_v}, *map, options);
    return gradient_bytes(dq, q.size(), dk, k.size(), dv, v.size());
  });
}

template <class T>
void check_map_and_rope_offsets() {
  const Index n = 9, d = 13;
  const Matrix<T> x = input<T>(n, d, 51, 2.0);
  using Strided = Eigen::Map<Matrix<T>>;
  for (const FeatureMapKind kind :
       {FeatureMapKind::EluPlusOne, FeatureMapKind::Relu, FeatureMapKind::FavorPositive,
        FeatureMapKind::FavorTrig, FeatureMapKind::FavorHyperbolic,
        FeatureMapKind::OnePlusCosine}) {
    const auto map = make_feature_map({.kind = kind, .input_dim = d, .num_features = 21});
    const Index m = map->output_dim();
    const std::string map_name = to_string(kind);
    CAPTURE(map_name);
    check_offsets<T>("FeatureMap::apply", [&](std::size_t offset) {
      const Placed<T> px(x, offset), pout(n * m, offset);
      map->apply(Strided(px.data(), n, d), Strided(pout.data(), n, m));
      return bytes_of(pout.data(), n * m);
    });
  }
  for (const RopeLayout layout : {RopeLayout::Interleaved, RopeLayout::Half}) {
    const Rope rope({.dim = d, .rotary_dim = 12, .layout = layout});
    check_offsets<T>("Rope::apply", [&](std::size_t offset) {
      const Placed<T> px(x, offset);
      rope.apply(Strided(px.data(), n, d), 70000);
      return bytes_of(px.data(), n * d);
    });
  }
}

}  // namespace

TEST_CASE("attention: the same bits wherever the caller's buffers sit (4 to 48 bytes off 64)") {
  SUBCASE("float") { check_attention_offsets<float>(); }
  SUBCASE("double") { check_attention_offsets<double>(); }
}

TEST_CASE("softmax_attention_backward: the same bits wherever the caller's buffers sit") {
  SUBCASE("float") { check_backward_offsets<float>(); }
  SUBCASE("double") { check_backward_offsets<double>(); }
}

TEST_CASE("linear_attention_backward: the same bits wherever the caller's buffers sit") {
  check_linear_backward_offsets<float>();
  check_linear_backward_offsets<double>();
}

TEST_CASE("feature maps and RoPE: the same bits wherever the caller's buffers sit") {
  SUBCASE("float") { check_map_and_rope_offsets<float>(); }
  SUBCASE("double") { check_map_and_rope_offsets<double>(); }
}
