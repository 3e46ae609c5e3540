// linrope: single-head attention — exact softmax (the baseline) and O(n) linear attention with the
// four RoPE placements that the research compares.
//
// Shapes, for every function here: q [n x d], k [n_k x d], v [n_k x d_v] -> out [n x d_v].
// Row i of q sits at position q_offset + i, row j of k and v at k_offset + j; causal keeps the keys
// with k_offset + j <= q_offset + i. A query with no admissible key gets a zero row.
#pragma once

#include <limits>
#include <linrope/feature_maps.hpp>
#include <linrope/rope.hpp>
#include <linrope/types.hpp>
#include <memory>
#include <span>
#include <string_view>

namespace linrope {

struct SoftmaxOptions {
  bool causal = false;
  double scale = 0;            // 0 means 1 / sqrt(d)
  const Rope* rope = nullptr;  // applied to q and k (width d) at their positions
  Index q_offset = 0, k_offset = 0;
  Index block_size = 0;  // keys per streamed block; 0 chooses
};

// Exact softmax attention:
//   o_i = sum_j softmax_j(scale * <R_i q_i, R_j k_j>) v_j
// Streams blocks of keys with an online softmax (running max and running sum): O(n n_k d) time,
// O((n + n_k) d) memory; nothing n x n is ever stored. Parallel over blocks of queries.
// Reproducible: the same inputs give the same bits for any number of threads, however the work
// falls onto them, and wherever the buffers sit (see "Reproducibility" below). d = 0 is accepted
// (every score is 0, so each row is the mean of the admissible v rows). Throws
// std::invalid_argument on shape mismatch, non-finite inputs, a rope of width other than d, a
// non-finite or negative scale, block_size < 0, or positions beyond +-2^53.
MatrixF softmax_attention(const MatrixF& q, const MatrixF& k, const MatrixF& v,
                          const SoftmaxOptions& options = {});
MatrixD softmax_attention(const MatrixD& q, const MatrixD& k, const MatrixD& v,
                          const SoftmaxOptions& options = {});

// Where RoPE enters linear attention (phi_i = phi(q_i), psi_j = phi(k_j), R = RoPE):
//   None           num <phi_i, psi_j>                          den sum_j <phi_i, psi_j>
//   BeforeMap      num <phi(R_i q_i), phi(R_j k_j)>            den the same kernel, summed
//                  (rope width d)
//   NumeratorOnly  num <R_i phi_i, R_j psi_j>  (RoFormer eq. 19; rope width m = map.output_dim())
//                  den sum_j <phi_i, psi_j>: unrotated, so positive for non-negative maps
//   Full           num <R_i phi_i, R_j psi_j>                  den sum_j <R_i phi_i, R_j psi_j>
//                  (may reach zero or go negative)
// With LinearOptions::denominator false, o_i = sum_j num_ij v_j (no den): None, BeforeMap and
// NumeratorOnly (= Full) remain.
enum class RopePlacement { None, BeforeMap, NumeratorOnly, Full };

// How a causal linear attention is computed; all agree to rounding.
//   Chunked: quadratic (masked GEMMs) inside chunks of chunk_size rows, running state between them.
//            A call of at most 3 queries and 3 keys (a stream's step) runs as Scan: it is faster.
//   Scan:    the recurrence, one token at a time (the RNN view of Katharopoulos et al.), with the
//            state swept in cache-sized strips by blocks of 64 queries. The default: it does no
//            masked products and was the faster at every shape measured (bench/RESULTS.md,
//            0.7-0.9x Chunked's time with and without AVX-512).
enum class CausalMethod { Chunked, Scan };

struct LinearOptions {
  bool causal = false;
  RopePlacement placement = RopePlacement::NumeratorOnly;
  const Rope* rope = nullptr;
  double eps = 1e-6;  // o_i = num_i / (den_i + eps); eps >= 0
  Index q_offset = 0, k_offset = 0;
  CausalMethod method = CausalMethod::Scan;
  Index chunk_size = 64;  // Chunked only
  // false: no denominator, o_i = num_i, as most linear models in use now compute it (TransNormer's
  // NormAttention, RetNet, GLA; they normalise the output instead, e.g. an RMSNorm per head, which
  // linrope.torch.MultiheadAttention adds). eps is then unused. NumeratorOnly and Full are then
  // one function: NumeratorOnly is the one kept, Full is refused.
  bool denominator = true;
  // Decay (RetNet's retention, TransNormerLLM's Lightning attention): causal only, the state is
  // multiplied by g = decay at every position, S_t = g S_{t-1} + psi_t v_t^T, so that with
  // p_i = q_offset + i, p_j = k_offset + j and w_ij = g^(p_i - p_j)
  //   o_i = sum_{j<=i} w_ij <num_i, num_j> v_j / (sum_{j<=i} w_ij <den_i, den_j> + eps)
  // for every placement, and the numerator alone without a denominator. g in (0, 1]; 1, the
  // default, is no decay (and runs exactly the code without one). Long sequences stay finite: g^n
  // is never formed, log g enters the stabiliser's log scales (docs/DESIGN.md, "Decay").
  double decay = 1.0;
  // One g per head for the batched calls: empty means `decay` for every head, else exactly H
  // values, head h taking head_decays[h]; the single-head calls and the stream take none or one.
  // Read during the call (the stream keeps its one value, not the span).
  std::span<const double> head_decays = {};
};

// Statistics of den_i over the query rows, on the unstabilised scale and without eps.
// `threshold` is an input: below_threshold counts |den_i| < threshold.
// A row that attends to no key (possible with offsets, or n_k and n of different lengths) has no
// denominator: its output is zero, and it is counted in count and no_keys only. A row that does
// attend but whose divisor den_i + eps is exactly 0 or not finite (0 / 0 with eps = 0, a `full`
// denominator that cancels to 0, an overflow) is also written as a zero row: it is counted in
// zero_divisor as well as in min, nonpositive and below_threshold as its den_i says. A call without
// a denominator (LinearOptions::denominator false) counts rows in count and no_keys only.
struct DenominatorStats {
  double min = 0;  // smallest den_i over the rows that attend to a key (0 if none does)
  Index nonpositive = 0;
  Index below_threshold = 0;
  double threshold = 1e-3;
  Index count = 0;         // how many query rows were seen, no_keys included
  Index no_keys = 0;       // rows that attend to no key (zero output, no den_i)
  Index zero_divisor = 0;  // rows written as zeros because den_i + eps was 0 or not finite
};

// Reproducibility. For a given build, the same inputs and options give the same bits run after
// run: no result depends on thread timing, on which thread ran which task, or on the addresses of
// the caller's buffers or of our own scratch (tests/test_determinism.cpp forces all three). Every
// cut of the work into tasks depends on the shapes only, so softmax attention, non-causal linear
// attention, the feature maps and RoPE also give the same bits for any number of threads. The one
// exception: a causal linear attention on a single head long enough to split (n >= 2 x max(256,
// 4 x L), L = 64 for the scan and chunk_size for the chunked form: 512 by default) runs one
// segment of the sequence per thread, each
// from a prefix state summed by blocks, so its last bits depend on the thread count (never on
// the timing). Cutting by length alone would cost the single-thread and batched paths a second
// pass over the keys (about +50% work for FAVOR+ eq. 19), which is why it is not done. Results
// differ between builds (AVX-512 or not, another compiler), as any floating-point code does.
// The backward passes follow the same rules: every gradient is the same bits run after run, and
// for any thread count too, except the causal linear backward on a single head long enough to
// split (n >= 512, the scan's rule), which likewise runs one segment per thread, cut as the
// forward's scan cuts it.

// Linear attention, O((n + n_k) m d_v) time and O(m d_v) extra memory besides the features;
// never an n x n matrix:
//   o_i = num_i / (den_i + eps), with num and den from the placement table above.
// Non-causal: S = sum_j (R_j psi_j) v_j^T [m x d_v], z = sum_j psi_j, then one pass over queries.
// Exp-based maps are stabilised (per-row shifts for queries, a running maximum over past keys for
// keys) so that large inputs give finite outputs and a causal output never depends on a later key;
// the shifts are undone exactly in eps and in the statistics.
// Throws std::invalid_argument on shape mismatch, non-finite inputs, eps < 0 or not finite,
// a placement other than None without a rope, or a rope whose width does not fit the placement
// (d for BeforeMap, map.output_dim() for NumeratorOnly and Full), chunk_size < 1, a decay outside
// (0, 1] or NaN, a decay < 1 on a non-causal call (it would weight later keys by g^(negative),
// without bound: RetNet's decay is a causal recurrence), or head_decays of more than one value
// (the batched calls: other than H).
MatrixF linear_attention(const MatrixF& q, const MatrixF& k, const MatrixF& v,
                         const FeatureMap& map, const LinearOptions& options = {},
                         DenominatorStats* stats = nullptr);
MatrixD linear_attention(const MatrixD& q, const MatrixD& k, const MatrixD& v,
                         const FeatureMap& map, const LinearOptions& options = {},
                         DenominatorStats* stats = nullptr);

// Gradients (docs/DESIGN.md, "Gradients"): for L = sum(d_out * out), the exact dL/dq, dL/dk, dL/dv
// of the function the forward computes, with the rope, the map's W and every option held fixed (o =
// num / (den + eps) on the unstabilised scale; the stabilisers' shifts are constants). A causal
// gradient never depends on a later key. Memory O(n): nothing n x n is stored (softmax keeps two
// numbers per query row, the linear forms O(n m) features and O(m d_v) states). Rows of the
// forward's zero outputs (a query with no admissible key; den + eps == 0) get zero gradients. The
// causal linear backward has one form whatever the forward's method (the chunked form and the scan
// compute one function): the scan's, a forward sweep for dq and a reverse sweep for dk and dv
// (Katharopoulos et al. 2020, sec. 3.3, with the denominator and the stabilisers in the gradient),
// each a recurrence whose state is streamed from L1 in strips, no masked products. Throws
// std::invalid_argument as the forward does, and when d_out is not [n x d_v] or holds a non-finite
// value.
template <class T>
struct AttentionGradients {
  Matrix<T> dq, dk, dv;  // the shapes of q, k and v
};
AttentionGradients<float> softmax_attention_backward(const MatrixF& q, const MatrixF& k,
                                                     const MatrixF& v, const MatrixF& d_out,
                                                     const SoftmaxOptions& options = {});
AttentionGradients<double> softmax_attention_backward(const MatrixD& q, const MatrixD& k,
                                                      const MatrixD& v, const MatrixD& d_out,
                                                      const SoftmaxOptions& options = {});
AttentionGradients<float> linear_attention_backward(const MatrixF& q, const MatrixF& k,
                                                    const MatrixF& v, const MatrixF& d_out,
                                                    const FeatureMap& map,
                                                    const LinearOptions& options = {});
AttentionGradients<double> linear_attention_backward(const MatrixD& q, const MatrixD& k,
                                                     const MatrixD& v, const MatrixD& d_out,
                                                     const FeatureMap& map,
                                                     const LinearOptions& options = {});

// State in, state out (docs/DESIGN.md, "State in, state out"). Causal linear attention is a
// recurrence over a state that sums what the keys so far contribute (Katharopoulos et al. 2020,
// sec. 3.4): a sequence cut into parts and run part by part, each part from the state the parts
// before it left, gives what one call on the whole gives (to rounding). That is how a long sequence
// is spread over processes (linrope.torch.distributed) or fed in pieces.
//   S = sum_j exp(c_j - log_scale) num_j v_j^T   [m x d_v]   num_j: the key's numerator-side
//                                                            features (R_j psi~_j for
//                                                            numerator_only and full)
//   z = sum_j exp(c_j - log_scale) den_j         [m]         den_j: its denominator-side ones
//                                                            (unrotated psi~_j for numerator_only)
// psi_j = exp(c_j) psi~_j are the key's features with their stabiliser shift c_j (0 for maps that
// need none: elu+1, relu, 1+cos), and log_scale is the largest c_j so far, so every entry stays
// finite for large inputs: the sums themselves are exp(log_scale) S and exp(log_scale) z. The empty
// state (no key yet) has log_scale = -inf; its S and z are then ignored and may be of size 0.
// With a decay g (LinearOptions::decay), a state is the decayed sum at a position t, the position
// of the last key it holds: exp(log_scale) S = sum_j g^(t - p_j) num_j v_j^T and likewise z, so
// that the next key (at t + 1) continues the recurrence S_{t+1} = g S_t + ... . A call leaves the
// state at t = k_offset + n_k - 1 (its last key, within the lengths for batched calls; with no
// key, the state it was given) and reads its initial state as the state at t = k_offset - 1: the
// part after n tokens again has q_offset = k_offset = n. S and z are the same numbers as without a
// decay; log_scale alone carries the g^(t - p_j), so a state's gradient (LinearStateGradient)
// means what it means without one.
template <class T>
struct LinearAttentionState {
  Matrix<T> S;
  Vector<T> z;
  double log_scale = -std::numeric_limits<double>::infinity();
};
using LinearAttentionStateF = LinearAttentionState<float>;
using LinearAttentionStateD = LinearAttentionState<double>;

// dL/dS and dL/dz of a LinearAttentionState, its log_scale held fixed. The scale is a stabiliser,
// not a variable: a loss that reads the state only through the sums exp(log_scale) (S, z), as a
// call that starts from it does, gets its exact gradient this way. Of size 0: zero.
template <class T>
struct LinearStateGradient {
  Matrix<T> dS;  // [m x d_v]
  Vector<T> dz;  // [m]
};

// Causal linear attention continued from `state`: query i sees everything in `state` plus the
// keys j with k_offset + j <= q_offset + i. On return `state` holds its old contents plus every
// key of k (all n_k of them, including keys that no query of this call sees). Positions are the
// caller's to continue: a part that follows n earlier tokens has q_offset = k_offset = n.
// options.causal must be true. Throws std::invalid_argument as linear_attention does, and when
// options.causal is false, or state is not empty and S is not [m x d_v], z not [m] (m =
// map.output_dim(), d_v = v's columns), log_scale is +inf or NaN, or S or z hold a non-finite
// value; `state` is then unchanged. Also when a non-finite input is found (state then holds
// unspecified values).
MatrixF linear_attention(const MatrixF& q, const MatrixF& k, const MatrixF& v,
                         const FeatureMap& map, const LinearOptions& options,
                         LinearAttentionStateF& state, DenominatorStats* stats = nullptr);
MatrixD linear_attention(const MatrixD& q, const MatrixD& k, const MatrixD& v,
                         const FeatureMap& map, const LinearOptions& options,
                         LinearAttentionStateD& state, DenominatorStats* stats = nullptr);

// The gradients of the call above, for L = sum(d_out * out) + <d_final.dS, S_final> +
// <d_final.dz, z_final> (S_final, z_final: the state the call leaves): dq, dk, dv, and, if
// d_initial is given, dL/dS and dL/dz of `initial_state` (the state the forward started from),
// written into it at [m x d_v] and [m]. Chaining parts backward: a part's d_initial is the
// d_final of the part before it (both at the scale of the state between them). Throws as
// linear_attention_backward and the forward above do, and when d_final is neither of size 0 nor
// [m x d_v] and [m], or holds a non-finite value.
AttentionGradients<float> linear_attention_backward(
    const MatrixF& q, const MatrixF& k, const MatrixF& v, const MatrixF& d_out,
    const FeatureMap& map, const LinearOptions& options, const LinearAttentionStateF& initial_state,
    const LinearStateGradient<float>& d_final, LinearStateGradient<float>* d_initial = nullptr);
AttentionGradients<double> linear_attention_backward(
    const MatrixD& q, const MatrixD& k, const MatrixD& v, const MatrixD& d_out,
    const FeatureMap& map, const LinearOptions& options, const LinearAttentionStateD& initial_state,
    const LinearStateGradient<double>& d_final, LinearStateGradient<double>* d_initial = nullptr);

// What a forward keeps for its backward (docs/DESIGN.md, "Saved features"): the plain features
// and stabiliser log scales of every query row and every key row it computed, per (batch, head)
// slice, so that the backward maps nothing again (FAVOR+ at m = 256: two d x m GEMMs and 2m exps a
// token of the backward's work). Its memory is O((n + n_k) m) per slice, alive from the forward
// to the backward (bytes(); the block holding it may be up to twice that). A forward that takes
// one fills it, replacing what it held (a call refused by its checks leaves it as it was; one that
// finds a non-finite input, or throws otherwise once it has begun, leaves it empty, its memory
// freed); a backward that takes one only reads it, so several
// backwards may read one object at once, and gives the same gradients as without it, the same
// bits (tests/test_saved_features.cpp). The backward checks that `saved` comes from a forward of
// the same shapes, lengths, positions, placement, decays, map configuration (kind, m, seed: a
// redraw changes it) and rope configuration, and throws std::invalid_argument naming `saved`
// otherwise, or when it is empty; a map or rope made alike (another object) is accepted, as it
// computes the same features. It cannot check that q and k hold the same values as in the
// forward: that is the caller's promise. A causal backward with a final-state gradient after a
// forward that kept no final state maps the keys past the last query's horizon from k (the
// forward never mapped them). Opaque and move-only.
namespace detail {
template <class T>
struct SavedHeads;
struct SavedAccess;
}  // namespace detail
template <class T>
class LinearSaved {
 public:
  LinearSaved();
  ~LinearSaved();
  LinearSaved(LinearSaved&&) noexcept;
  LinearSaved& operator=(LinearSaved&&) noexcept;
  LinearSaved(const LinearSaved&) = delete;
  LinearSaved& operator=(const LinearSaved&) = delete;

  bool empty() const;         // true until a forward fills it, and after clear()
  std::size_t bytes() const;  // the memory its features take
  void clear();               // frees it

 private:
  friend struct detail::SavedAccess;
  std::unique_ptr<detail::SavedHeads<T>> data_;
};
using LinearSavedF = LinearSaved<float>;
using LinearSavedD = LinearSaved<double>;

// A LinearSaved's memory, once it is destroyed or refilled at another size, is kept for the next
// one (up to 1 GiB of freed blocks, process-wide, the oldest given up first when a newer one
// needs the room: a training loop makes one every step, and fresh pages cost a fault each); so
// are the Python module's large output arrays, the softmax kernels' scratch and the rows the
// batched calls gather from BNHD views. This frees what is kept and returns its size in bytes.
std::size_t release_cached_memory();

// linear_attention and its backward as above, the forward filling `saved` and the backward
// reading it (the batched calls and the stateful ones: batched.hpp).
MatrixF linear_attention(const MatrixF& q, const MatrixF& k, const MatrixF& v,
                         const FeatureMap& map, const LinearOptions& options, LinearSavedF& saved,
                         DenominatorStats* stats = nullptr);
MatrixD linear_attention(const MatrixD& q, const MatrixD& k, const MatrixD& v,
                         const FeatureMap& map, const LinearOptions& options, LinearSavedD& saved,
                         DenominatorStats* stats = nullptr);
AttentionGradients<float> linear_attention_backward(const MatrixF& q, const MatrixF& k,
                                                    const MatrixF& v, const MatrixF& d_out,
                                                    const FeatureMap& map,
                                                    const LinearOptions& options,
                                                    const LinearSavedF& saved);
AttentionGradients<double> linear_attention_backward(const MatrixD& q, const MatrixD& k,
                                                     const MatrixD& v, const MatrixD& d_out,
                                                     const FeatureMap& map,
                                                     const LinearOptions& options,
                                                     const LinearSavedD& saved);

// Causal linear attention as a stream, for autoregressive decoding: each call appends t tokens
// (q, k, v rows at the next t positions, starting at options.q_offset == options.k_offset) and
// returns their outputs, each attending to every token so far including itself. Memory is
// O(m d_v) whatever the length. The concatenated outputs equal one causal linear_attention call.
// options.causal is ignored (always causal); q_offset and k_offset must be equal.
// The stream keeps references to `map` and to options.rope (not copies): both must outlive it.
// Redrawing the map (FeatureMap::redraw) while the stream holds tokens mixes two feature spaces,
// the state's keys under the old W and new queries under the new one: call reset() after a
// redraw.
template <class T>
class LinearAttentionStream {
 public:
  LinearAttentionStream(const FeatureMap& map, Index value_dim, const LinearOptions& options = {});
  ~LinearAttentionStream();
  LinearAttentionStream(LinearAttentionStream&&) noexcept;
  LinearAttentionStream& operator=(LinearAttentionStream&&) noexcept;

  // q [t x d], k [t x d], v [t x d_v] -> [t x d_v]; t may be 1.
  Matrix<T> step(const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                 DenominatorStats* stats = nullptr);
  Index position() const;  // position of the next token
  void reset();            // back to an empty state at options.q_offset

 private:
  struct State;
  std::unique_ptr<State> state_;
};
using LinearAttentionStreamF = LinearAttentionStream<float>;
using LinearAttentionStreamD = LinearAttentionStream<double>;

const char* to_string(RopePlacement placement);  // "none", "before_map", "numerator_only", "full"
RopePlacement rope_placement_from_string(std::string_view name);
const char* to_string(CausalMethod method);  // "chunked", "scan"
CausalMethod causal_method_from_string(std::string_view name);

}  // namespace linrope
