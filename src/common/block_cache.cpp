// The process-wide cache of CachedBlocks (block_cache.hpp).
#include "common/block_cache.hpp"

#include <cstdint>
#include <map>
#include <mutex>
#include <new>
#include <utility>

namespace linrope::detail {
namespace {

constexpr std::align_val_t kAlignment{64};

// The kept blocks, indexed by size (a request takes the smallest that fits) and by age (a block
// given back to a full cache evicts the oldest first: blocks of sizes no longer asked for, after a
// change of shape, leave instead of keeping the new ones out).
struct Cache {
  struct Kept {
    std::uint64_t age;
    std::byte* data;
  };
  using BySize = std::multimap<std::size_t, Kept>;
  std::mutex mutex;
  BySize by_size;
  std::map<std::uint64_t, BySize::iterator> by_age;
  std::uint64_t next_age = 0;
  std::size_t bytes = 0;

  void erase(BySize::iterator kept) {
    bytes -= kept->first;
    by_age.erase(kept->second.age);
    by_size.erase(kept);
  }
};

// Never destroyed: blocks may be given back while static objects are being destroyed.
Cache& cache() {
  static Cache* const instance = new Cache;
  return *instance;
}

}  // namespace

CachedBlock::CachedBlock(std::size_t bytes) {
  if (bytes == 0) return;
  {
    Cache& c = cache();
    const std::lock_guard<std::mutex> lock(c.mutex);
    const auto fit = c.by_size.lower_bound(bytes);
    if (fit != c.by_size.end() && fit->first / 2 <= bytes) {
      size_ = fit->first;
      data_ = fit->second.data;
      c.erase(fit);
      return;
    }
  }
  data_ = static_cast<std::byte*>(::operator new(bytes, kAlignment));
  size_ = bytes;
}

CachedBlock::~CachedBlock() {
  if (data_ == nullptr) return;
  if (size_ <= kCachedBytes) {
    Cache& c = cache();
    const std::lock_guard<std::mutex> lock(c.mutex);
    while (c.bytes + size_ > kCachedBytes) {  // the oldest kept blocks make room
      const auto oldest = c.by_age.begin()->second;
      ::operator delete(oldest->second.data, kAlignment);
      c.erase(oldest);
    }
    try {
      const auto kept = c.by_size.emplace(size_, Cache::Kept{c.next_age, data_});
      try {
        c.by_age.emplace(c.next_age, kept);
      } catch (...) {
        c.by_size.erase(kept);
        throw;
      }
      ++c.next_age;
      c.bytes += size_;
      return;
    } catch (const std::bad_alloc&) {  // no memory for the index: free the block instead
    }
  }
  ::operator delete(data_, kAlignment);
}

CachedBlock::CachedBlock(CachedBlock&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

CachedBlock& CachedBlock::operator=(CachedBlock&& other) noexcept {
  if (this == &other) return *this;
  CachedBlock old(std::move(*this));
  data_ = std::exchange(other.data_, nullptr);
  size_ = std::exchange(other.size_, 0);
  return *this;
}

std::size_t release_cached_blocks() {
  Cache& c = cache();
  const std::lock_guard<std::mutex> lock(c.mutex);
  const std::size_t freed = c.bytes;
  for (const auto& [size, kept] : c.by_size) ::operator delete(kept.data, kAlignment);
  c.by_size.clear();
  c.by_age.clear();
  c.bytes = 0;
  return freed;
}

}  // namespace linrope::detail
