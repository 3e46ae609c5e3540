// Private: blocks of memory kept between uses, process-wide. A LinearSaved's features live
// from a forward to its backward, and a training loop makes a new one every step: allocated afresh,
// their tens of MB cost a page fault per 4 KiB every step (glibc returns blocks this large to the
// system), measured at 6x the forward's own time through linrope.torch (bench/RESULTS.md, "Saved
// features"). A CachedBlock comes from the cache when a free block fits (at most twice the size
// asked for) and goes back to it when destroyed, as PyTorch's caching allocator does with its
// tensors. The cache holds at most kCachedBytes: a block given back to a full cache evicts the
// oldest kept blocks until it fits (a block larger than the cap is freed).
#pragma once

#include <cstddef>
#include <linrope/types.hpp>

namespace linrope::detail {

inline constexpr std::size_t kCachedBytes = std::size_t(1) << 30;

class CachedBlock {
 public:
  CachedBlock() = default;
  // At least `bytes` bytes, 64-byte aligned, contents unspecified. Throws std::bad_alloc.
  explicit CachedBlock(std::size_t bytes);
  ~CachedBlock();
  CachedBlock(CachedBlock&& other) noexcept;
  CachedBlock& operator=(CachedBlock&& other) noexcept;
  CachedBlock(const CachedBlock&) = delete;
  CachedBlock& operator=(const CachedBlock&) = delete;

  std::byte* data() const { return data_; }
  std::size_t size() const { return size_; }

 private:
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

// `count` values of T in a CachedBlock, uninitialised: a kernel's per-call scratch of megabytes
// (softmax's rotated keys and its backward's strips and partial dk, dv), which allocated afresh
// page-faulted on every call: at d = 128, n = 4096, 45% of the softmax backward's time; and the
// rows a batched call gathers from a BNHD slice (heads.hpp).
template <class T>
class CachedArray {
 public:
  explicit CachedArray(Index count) : block_(std::size_t(count) * sizeof(T)) {}
  T* get() const { return reinterpret_cast<T*>(block_.data()); }

 private:
  CachedBlock block_;
};

// Frees every block the cache holds; returns how many bytes that was.
std::size_t release_cached_blocks();

}  // namespace linrope::detail
