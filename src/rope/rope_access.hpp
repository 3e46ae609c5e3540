// Private: the unchecked rotations the attention kernels call on rows they own (no shape or
// position checks beyond debug asserts: their callers have checked). Rope keeps them private.
#pragma once

#include <linrope/rope.hpp>
#include <span>

namespace linrope::detail {

// Which matrix a rotation applies: R (apply), R^-1 (rotation by -p theta, divided by the magnitude)
// or R^T (rotation by -p theta, times the magnitude: the gradient of apply).
enum class Turn { Apply, Inverse, Transpose };

struct RopeAccess {
  // `rows` rows of width rope.dim(), `stride` elements apart, row i at position first + i
  // (|position| <= 2^53), in place.
  template <class T>
  static void rotate_rows(const Rope& rope, T* x, Index rows, Index stride, Index first, Turn turn);
  // The same out of place: `to` = the rotation of `from` (both with row stride `stride`, not
  // overlapping), columns past the rotary width copied unchanged. Bitwise what copying `from` to
  // `to` and rotating `to` in place gives, in one pass.
  template <class T>
  static void rotate_rows(const Rope& rope, const T* from, T* to, Index rows, Index stride,
                          Index first, Turn turn);
  // Row i at positions[i] (packed sequences).
  template <class T>
  static void rotate_rows(const Rope& rope, T* x, Index rows, Index stride,
                          std::span<const Index> positions, Turn turn);
};

}  // namespace linrope::detail
