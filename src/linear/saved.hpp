// Private: what a forward keeps for its backward (attention.hpp, LinearSaved): per (batch, head)
// slice the plain features and log scales of its query rows and key rows, in the form KeptFeatures
// holds them (linear_blocks.hpp), and what they depend on, which the backward checks.
#pragma once

#include <cstdint>
#include <linrope/attention.hpp>
#include <linrope/batched.hpp>
#include <string_view>
#include <vector>

#include "linear/linear_blocks.hpp"

namespace linrope::detail {

// One side's rows: plain [rows x m] and log scales [rows]; rows [0, given) hold the forward's.
template <class T>
struct SavedSide {
  Vector<T> plain;
  std::vector<double> log_scale;
  Index given = 0;

  void resize(Index rows, Index m) {
    plain.resize(rows * m);
    log_scale.resize(std::size_t(rows));
    given = 0;
  }
  std::size_t bytes() const { return sizeof(T) * plain.size() + sizeof(double) * log_scale.size(); }
};

template <class T>
struct SavedSlice {
  SavedSide<T> queries, keys;
};

// A backward's KeptFeatures over the forward's rows of `side` when they cover `needed` rows (else
// null: the backward maps the rows into its own scratch). The rows are only read: KeptFeatures
// never computes a given row.
template <class T>
struct SavedRows {
  SavedRows(const SavedSide<T>* side, Index needed)
      : use(side != nullptr && side->given >= needed),
        plain(use ? const_cast<T*>(side->plain.data()) : nullptr),
        log_scale(use ? const_cast<double*>(side->log_scale.data()) : nullptr),
        given(use ? side->given : 0) {}
  bool use;
  T* plain;
  double* log_scale;
  Index given;
};

// Everything the features depend on besides q and k themselves.
struct SavedCall {
  const FeatureMap* map = nullptr;
  std::uint64_t seed = 0;
  const Rope* rope = nullptr;
  RopePlacement placement = RopePlacement::None;
  bool causal = false;
  Index q_offset = 0, k_offset = 0, batch = 0, heads = 0, n = 0, n_k = 0, d = 0;
  std::vector<Index> q_lengths, k_lengths;  // rows within the lengths, per batch
  std::vector<double> decays;               // per head
};

template <class T>
struct SavedHeads {
  SavedCall call;
  std::vector<SavedSlice<T>> slices;  // b * heads + h
  bool complete = false;              // a forward filled it to the end
};

struct SavedAccess {
  // The object's contents for a forward to fill (kept allocations reused), marked incomplete.
  template <class T>
  static SavedHeads<T>& refill(LinearSaved<T>& saved) {
    if (!saved.data_) saved.data_ = std::make_unique<SavedHeads<T>>();
    saved.data_->complete = false;
    return *saved.data_;
  }
  template <class T>
  static const SavedHeads<T>* read(const LinearSaved<T>& saved) {
    return saved.data_ && saved.data_->complete ? saved.data_.get() : nullptr;
  }
};

template <class T>
SavedCall saved_call(const FeatureMap& map, const LinearOptions& options, Heads<const T> q,
                     Heads<const T> k);

// Throws std::invalid_argument naming `saved` when it is empty (null) or `now` differs from the
// call that filled it.
template <class T>
void check_saved(std::string_view fn, const SavedHeads<T>* saved, const SavedCall& now);

// The keys a causal forward maps: those up to the last query's own key, and all of them when it
// keeps its final state; a non-causal one maps every key.
inline Index mapped_keys(bool causal, bool final_state, Index n, Index n_k, Index q_offset,
                         Index k_offset) {
  if (!causal || final_state) return n_k;
  return n > 0 ? std::clamp(n + q_offset - k_offset, Index(0), n_k) : 0;
}

}  // namespace linrope::detail
