// Private: what a forward keeps for its backward (attention.hpp, LinearSaved): per (batch, head)
// slice the plain features and log scales of its query rows and key rows, in the form KeptFeatures
// holds them (linear_blocks.hpp), and what they depend on, which the backward checks.
#pragma once

#include <cstdint>
#include <linrope/attention.hpp>
#include <linrope/batched.hpp>
#include <string_view>
#include <vector>

#include "common/block_cache.hpp"
#include "linear/linear_blocks.hpp"

namespace linrope::detail {

// One side's rows: plain [rows x m] and log scales [rows], in the SavedHeads' block; rows
// [0, given) hold the forward's.
template <class T>
struct SavedSide {
  T* plain = nullptr;
  double* log_scale = nullptr;
  Index rows = 0, given = 0;
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
        plain(use ? side->plain : nullptr),
        log_scale(use ? side->log_scale : nullptr),
        given(use ? side->given : 0) {}
  // The KeptFeatures' capacity: the forward's rows, or `scratch` rows of the backward's own.
  Index capacity(Index scratch) const { return use ? given : scratch; }

  bool use;
  T* plain;
  double* log_scale;
  Index given;
};

// Everything the features depend on besides q and k themselves: the map's and the rope's
// configurations (which determine W and the angles: two objects made alike compute the same
// features, and a redraw changes the seed), not their addresses.
struct SavedCall {
  FeatureMapConfig map;
  bool has_rope = false;
  RopeConfig rope;
  RopePlacement placement = RopePlacement::None;
  bool causal = false;
  Index q_offset = 0, k_offset = 0, batch = 0, heads = 0, n = 0, n_k = 0, d = 0, m = 0;
  std::vector<Index> q_lengths, k_lengths;  // rows within the lengths, per batch
  std::vector<double> decays;               // per head
};

template <class T>
struct SavedHeads {
  SavedCall call;
  std::vector<SavedSlice<T>> slices;  // b * heads + h
  bool complete = false;              // a forward filled it to the end
  CachedBlock memory;                 // every slice's rows

  // Slice s gets query_rows[s] and key_rows[s] rows of m features, in `memory` (kept when it
  // holds them, else exchanged for a block from the cache).
  void lay_out(const std::vector<Index>& query_rows, const std::vector<Index>& key_rows, Index m) {
    const auto padded = [](std::size_t bytes) { return (bytes + 63) / 64 * 64; };
    const auto side_bytes = [&](Index rows) {
      return padded(sizeof(T) * std::size_t(rows * m)) + padded(sizeof(double) * std::size_t(rows));
    };
    std::size_t total = 0;
    for (std::size_t s = 0; s < query_rows.size(); ++s)
      total += side_bytes(query_rows[s]) + side_bytes(key_rows[s]);
    if (memory.size() < total || memory.size() / 2 > total) memory = CachedBlock(total);
    slices.resize(query_rows.size());
    std::byte* at = memory.data();
    const auto carve = [&](SavedSide<T>& side, Index rows) {
      side.rows = rows;
      side.given = 0;
      side.plain = reinterpret_cast<T*>(at);
      at += padded(sizeof(T) * std::size_t(rows * m));
      side.log_scale = reinterpret_cast<double*>(at);
      at += padded(sizeof(double) * std::size_t(rows));
    };
    for (std::size_t s = 0; s < slices.size(); ++s) {
      carve(slices[s].queries, query_rows[s]);
      carve(slices[s].keys, key_rows[s]);
    }
  }
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
  return !causal || final_state ? n_k : causal_horizon(n, n_k, q_offset, k_offset);
}

}  // namespace linrope::detail
