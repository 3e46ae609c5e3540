// Private: the library's non-finite policy, in one place.
//
// Every public call refuses a non-finite q, k, v (and a backward's d_out, a feature map's x) with
// std::invalid_argument naming the first offending argument in argument order (and, in the
// [B,H,n,d] calls, the slice), its row and its column. Rows past a slice's valid length are never
// read and never checked. How a call finds the value depends on what an extra pass over memory
// costs next to the call's own work:
// - Linear attention, forward and backward, single-head and batched: lazily. Its kernels read each
//   block of their inputs once and are memory-bound for the cheap maps (an up-front scan was 14% of
//   elu+1's forward at n = 16384 and 8% of its causal backward), so they check each block as they
//   read it, while it is in cache, and raise a NonFiniteFlag (LinearSetup::nonfinite). They still
//   finish, with unspecified outputs; the entry point then names the argument with name_nonfinite
//   and throws, so nothing unspecified is returned. Every row within the lengths is checked,
//   including keys that no query sees (past the horizon of a causal call).
// - Softmax attention, feature maps, LinearAttentionStream: up front (require_finite), before any
//   work. Softmax's work is O(n^2 d), next to which the O(n d) scan is nothing; a feature map's is
//   O(n d m); and a stream must not absorb a bad token into its state before refusing it: the
//   stream stays usable after the error.
#pragma once

#include <atomic>
#include <string_view>

#include "common/check.hpp"

namespace linrope::detail {

// Raised by a kernel that read a non-finite value. Atomic: the threads of one head may raise it
// together.
class NonFiniteFlag {
 public:
  template <class M>
  void check(const M& block) {
    if (!all_finite(block)) raised_.store(true, std::memory_order_relaxed);
  }
  bool raised() const { return raised_.load(std::memory_order_relaxed); }

 private:
  std::atomic<bool> raised_{false};
};

// require_finite on each (name, matrix) pair in turn: throws naming the first non-finite one.
inline void require_finite_each(std::string_view) {}
template <class M, class... Rest>
void require_finite_each(std::string_view function, std::string_view name, const M& m,
                         const Rest&... rest) {
  require_finite(function, name, m);
  require_finite_each(function, rest...);
}

// After a kernel raised `flag`: throws naming the first non-finite argument among the (name,
// matrix) pairs, in the order given (the call's argument order). Does nothing if the flag is
// down.
template <class... NamedMatrices>
void name_nonfinite(const NonFiniteFlag& flag, std::string_view function,
                    const NamedMatrices&... named) {
  if (flag.raised()) require_finite_each(function, named...);
}

}  // namespace linrope::detail
