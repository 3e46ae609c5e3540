// Linear attention: argument checks and dispatch for the single-head calls; placement names.
#include <array>
#include <cmath>
#include <linrope/attention.hpp>
#include <linrope/batched.hpp>
#include <string>

#include "common/check.hpp"
#include "common/enum_names.hpp"
#include "linear/linear_checks.hpp"
#include "linear/linear_kernel.hpp"
#include "linear/state_views.hpp"

namespace linrope {
namespace detail {

namespace {

// A decay g: in (0, 1], and 1 on a non-causal call.
void check_decay(std::string_view fn, std::string_view name, double decay, bool causal) {
  if (!(decay > 0 && decay <= 1))
    throw_invalid(fn, name, " is ", decay, " but expected a decay in (0, 1] (1: none)");
  if (decay < 1 && !causal)
    throw_invalid(fn, name, " is ", decay,
                  " but options.causal is false: a decay is causal only (RetNet's recurrence "
                  "S_t = g S_{t-1} + ...); a non-causal sum would weight later keys by g^(negative "
                  "distance), which grows without bound");
}

}  // namespace

void check_linear_setup(std::string_view fn, const FeatureMap& map, const LinearOptions& options,
                        Index d, Index heads) {
  if (d != map.input_dim())
    throw_invalid(fn, "q has d = ", d, " but map.input_dim() is ", map.input_dim());
  if (!std::isfinite(options.eps) || options.eps < 0)
    throw_invalid(fn, "options.eps is ", options.eps, " but expected a finite eps >= 0");
  if (options.chunk_size < 1)
    throw_invalid(fn, "options.chunk_size is ", options.chunk_size, " but expected >= 1");
  const int placement = static_cast<int>(options.placement);
  if (placement < 0 || placement > static_cast<int>(RopePlacement::Full))
    throw_invalid(fn, "options.placement is ", placement,
                  " but expected a RopePlacement (0 none, 1 before_map, 2 numerator_only, 3 full)");
  const int method = static_cast<int>(options.method);
  if (options.method != CausalMethod::Chunked && options.method != CausalMethod::Scan)
    throw_invalid(fn, "options.method is ", method,
                  " but expected a CausalMethod (0 Chunked, 1 Scan)");
  check_decay(fn, "options.decay", options.decay, options.causal);
  const Index decays = Index(options.head_decays.size());
  if (decays != 0 && decays != heads)
    throw_invalid(fn, "options.head_decays has ", decays, " values but expected ", heads,
                  heads == 1 ? " (a single head) or none" : " (one per head) or none");
  for (Index h = 0; h < decays; ++h)
    check_decay(fn, "options.head_decays[" + std::to_string(h) + "]",
                options.head_decays[std::size_t(h)], options.causal);
  if (!options.denominator && options.placement == RopePlacement::Full)
    throw_invalid(fn,
                  "options.placement is full with options.denominator false; without a "
                  "denominator full and numerator_only are one function: use numerator_only");
  if (options.placement == RopePlacement::None) return;
  const bool before_map = options.placement == RopePlacement::BeforeMap;
  const Index width = before_map ? d : map.output_dim();
  const char* what = before_map ? "d" : "m = map.output_dim()";
  if (options.rope == nullptr)
    throw_invalid(fn, "options.rope is null but placement ", to_string(options.placement),
                  " needs a rope of width ", what, " = ", width);
  if (options.rope->dim() != width)
    throw_invalid(fn, "options.rope has dim ", options.rope->dim(), " but placement ",
                  to_string(options.placement), " needs width ", what, " = ", width);
}

PlacementPlan plan_placement(const LinearOptions& options) {
  const RopePlacement placement = options.placement;
  PlacementPlan plan;
  plan.rotate_input = placement == RopePlacement::BeforeMap;
  plan.rotate_features =
      placement == RopePlacement::NumeratorOnly || placement == RopePlacement::Full;
  plan.separate_denominator = placement == RopePlacement::NumeratorOnly && options.denominator;
  return plan;
}

}  // namespace detail

namespace {

template <class T>
Matrix<T> linear_single(const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                        const FeatureMap& map, const LinearOptions& options,
                        DenominatorStats* stats) {
  constexpr std::string_view fn = "linear_attention";
  detail::check_single_inputs(fn, q, k, v);
  detail::check_linear_setup(fn, map, options, q.cols(), 1);
  detail::require_positions(fn, "options.q_offset", options.q_offset, q.rows());
  detail::require_positions(fn, "options.k_offset", options.k_offset, k.rows());
  // Non-finite inputs are found by the kernel as it reads them (common/nonfinite.hpp).
  detail::NonFiniteFlag nonfinite;
  const detail::LinearSetup setup(map, options, q.cols(), v.cols(), &nonfinite);
  Matrix<T> out(q.rows(), v.cols());
  detail::DenominatorTally tally(stats ? stats->threshold : 0.0);
  detail::DenominatorTally* tally_ptr = stats ? &tally : nullptr;
  const detail::LinearHead<T> head{q.data(), k.data(), v.data(),         out.data(),
                                   q.rows(), k.rows(), options.q_offset, options.k_offset};
  if (options.causal) {
    detail::LinearState<T> state;
    state.reset(setup.m, setup.d_v);
    detail::linear_causal(head, setup, state, detail::FinalState::Discarded, tally_ptr,
                          detail::Threads::Parallel);
  } else {
    detail::linear_noncausal(head, setup, tally_ptr, detail::Threads::Parallel);
  }
  detail::name_nonfinite(nonfinite, fn, "q", q, "k", k, "v", v);
  if (stats) tally.store(*stats);
  return out;
}

// The stateful single-head call, as a one-slice batched call (linear_batched.cpp).
template <class T>
Matrix<T> linear_single_continued(const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                                  const FeatureMap& map, const LinearOptions& options,
                                  LinearAttentionState<T>& state, DenominatorStats* stats) {
  constexpr std::string_view fn = "linear_attention";
  detail::check_single_inputs(fn, q, k, v);
  const Index m = map.output_dim(), d_v = v.cols();
  detail::check_state(fn, "state", state, m, d_v);
  Matrix<T> out(q.rows(), d_v);
  LinearAttentionState<T> next{Matrix<T>(m, d_v), Vector<T>(m)};
  const auto input = [](const Matrix<T>& x) {
    return Heads<const T>{x.data(), 1, 1, x.rows(), x.cols()};
  };
  linear_attention(input(q), input(k), input(v), Heads<T>{out.data(), 1, 1, out.rows(), d_v}, map,
                   options, detail::state_view(state),
                   HeadStates<T>{next.S.data(), next.z.data(), &next.log_scale, 1, 1, m, d_v},
                   stats);
  state = std::move(next);
  return out;
}

// The single-head call that keeps its features, as a one-slice batched call (linear_batched.cpp).
template <class T>
Matrix<T> linear_single_saving(const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                               const FeatureMap& map, const LinearOptions& options,
                               LinearSaved<T>& saved, DenominatorStats* stats) {
  detail::check_single_inputs("linear_attention", q, k, v);
  Matrix<T> out(q.rows(), v.cols());
  const auto input = [](const Matrix<T>& x) {
    return Heads<const T>{x.data(), 1, 1, x.rows(), x.cols()};
  };
  linear_attention(input(q), input(k), input(v), Heads<T>{out.data(), 1, 1, out.rows(), v.cols()},
                   map, options, saved, stats);
  return out;
}

constexpr std::array<const char*, 4> kPlacementNames = {"none", "before_map", "numerator_only",
                                                        "full"};
constexpr std::array<const char*, 2> kMethodNames = {"chunked", "scan"};

}  // namespace

MatrixF linear_attention(const MatrixF& q, const MatrixF& k, const MatrixF& v,
                         const FeatureMap& map, const LinearOptions& options,
                         DenominatorStats* stats) {
  return linear_single(q, k, v, map, options, stats);
}
MatrixD linear_attention(const MatrixD& q, const MatrixD& k, const MatrixD& v,
                         const FeatureMap& map, const LinearOptions& options,
                         DenominatorStats* stats) {
  return linear_single(q, k, v, map, options, stats);
}

MatrixF linear_attention(const MatrixF& q, const MatrixF& k, const MatrixF& v,
                         const FeatureMap& map, const LinearOptions& options,
                         LinearAttentionStateF& state, DenominatorStats* stats) {
  return linear_single_continued(q, k, v, map, options, state, stats);
}
MatrixD linear_attention(const MatrixD& q, const MatrixD& k, const MatrixD& v,
                         const FeatureMap& map, const LinearOptions& options,
                         LinearAttentionStateD& state, DenominatorStats* stats) {
  return linear_single_continued(q, k, v, map, options, state, stats);
}

MatrixF linear_attention(const MatrixF& q, const MatrixF& k, const MatrixF& v,
                         const FeatureMap& map, const LinearOptions& options, LinearSavedF& saved,
                         DenominatorStats* stats) {
  return linear_single_saving(q, k, v, map, options, saved, stats);
}
MatrixD linear_attention(const MatrixD& q, const MatrixD& k, const MatrixD& v,
                         const FeatureMap& map, const LinearOptions& options, LinearSavedD& saved,
                         DenominatorStats* stats) {
  return linear_single_saving(q, k, v, map, options, saved, stats);
}

const char* to_string(RopePlacement placement) {
  return detail::enum_name(placement, kPlacementNames, "RopePlacement");
}
RopePlacement rope_placement_from_string(std::string_view name) {
  return detail::enum_from_name<RopePlacement>(name, kPlacementNames, "rope_placement_from_string",
                                               "placement");
}

const char* to_string(CausalMethod method) {
  return detail::enum_name(method, kMethodNames, "CausalMethod");
}
CausalMethod causal_method_from_string(std::string_view name) {
  return detail::enum_from_name<CausalMethod>(name, kMethodNames, "causal_method_from_string",
                                              "method");
}

}  // namespace linrope
