// CachedBlock (src/common/block_cache.hpp): a freed block is reused by the next request it fits
// (at most twice the size asked for), blocks are 64-byte aligned, a moved block is freed once, and
// blocks that would pass the cache's cap are freed rather than kept. The cache is process-wide:
// each test case asks for sizes that no block of another case fits, whatever order they run in.
#include <doctest/doctest.h>

#include <cstdint>
#include <linrope/attention.hpp>
#include <utility>

#include "common/block_cache.hpp"

namespace {

using linrope::detail::CachedBlock;
using linrope::detail::kCachedBytes;

constexpr std::size_t kMiB = std::size_t(1) << 20;

TEST_CASE("block cache: a freed block is given to the next request it fits") {
  std::byte* first = nullptr;
  {
    const CachedBlock block(3 * kMiB);
    first = block.data();
    CHECK(block.size() >= 3 * kMiB);
    CHECK(reinterpret_cast<std::uintptr_t>(block.data()) % 64 == 0);
  }
  const CachedBlock again(2 * kMiB);  // 3 MiB is at most twice 2 MiB: reused
  CHECK(again.data() == first);
  CHECK(again.size() == 3 * kMiB);
}

TEST_CASE("block cache: a block more than twice the size asked for is left in the cache") {
  std::byte* big = nullptr;
  { big = CachedBlock(40 * kMiB).data(); }
  const CachedBlock small(16 * kMiB);
  CHECK(small.data() != big);
  CHECK(small.size() == 16 * kMiB);
  const CachedBlock large(25 * kMiB);  // 40 MiB fits 25 MiB: reused
  CHECK(large.data() == big);
  CHECK(large.size() == 40 * kMiB);
}

TEST_CASE("block cache: moves hand the block over, and an empty block holds nothing") {
  const CachedBlock none;
  CHECK(none.data() == nullptr);
  CHECK(none.size() == 0);
  CachedBlock a(100 * 1024);
  std::byte* data = a.data();
  CachedBlock b(std::move(a));
  CHECK(a.data() == nullptr);
  CHECK(b.data() == data);
  CachedBlock c;
  c = std::move(b);
  CHECK(c.data() == data);
  CHECK(b.data() == nullptr);
}

TEST_CASE("block cache: release_cached_memory frees what the cache holds") {
  { const CachedBlock block(7 * kMiB); }
  CHECK(linrope::release_cached_memory() >= 7 * kMiB);
  CHECK(linrope::release_cached_memory() == 0);
}

TEST_CASE("block cache: blocks past the cap are freed, not kept") {
  // Two blocks of more than half the cap: the second one freed cannot be kept; a request then
  // finds the first one only.
  const std::size_t half = kCachedBytes / 2 + kMiB;
  std::byte* two = nullptr;
  {
    const CachedBlock a(half), b(half);
    two = b.data();
  }  // b is freed first (kept), then a (past the cap: freed; the system may hand its address out)
  const CachedBlock again(half), fresh(half);
  CHECK(again.data() == two);
  CHECK(fresh.data() != two);  // the one kept block went to `again`
}

}  // namespace
