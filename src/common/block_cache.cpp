// The process-wide cache of CachedBlocks (block_cache.hpp).
#include "common/block_cache.hpp"

#include <map>
#include <mutex>
#include <new>
#include <utility>

namespace linrope::detail {
namespace {

constexpr std::align_val_t kAlignment{64};

struct Cache {
  std::mutex mutex;
  std::multimap<std::size_t, std::byte*> free;  // by size
  std::size_t bytes = 0;
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
    const auto fit = c.free.lower_bound(bytes);
    if (fit != c.free.end() && fit->first / 2 <= bytes) {
      size_ = fit->first;
      data_ = fit->second;
      c.bytes -= size_;
      c.free.erase(fit);
      return;
    }
  }
  data_ = static_cast<std::byte*>(::operator new(bytes, kAlignment));
  size_ = bytes;
}

CachedBlock::~CachedBlock() {
  if (data_ == nullptr) return;
  {
    Cache& c = cache();
    const std::lock_guard<std::mutex> lock(c.mutex);
    if (c.bytes + size_ <= kCachedBytes) {
      c.free.emplace(size_, data_);
      c.bytes += size_;
      return;
    }
  }
  ::operator delete(data_, kAlignment);
}

CachedBlock::CachedBlock(CachedBlock&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

CachedBlock& CachedBlock::operator=(CachedBlock&& other) noexcept {
  CachedBlock old(std::move(*this));
  data_ = std::exchange(other.data_, nullptr);
  size_ = std::exchange(other.size_, 0);
  return *this;
}

std::size_t release_cached_blocks() {
  Cache& c = cache();
  const std::lock_guard<std::mutex> lock(c.mutex);
  const std::size_t freed = c.bytes;
  for (const auto& [size, data] : c.free) ::operator delete(data, kAlignment);
  c.free.clear();
  c.bytes = 0;
  return freed;
}

}  // namespace linrope::detail
