// CachedBlock (src/common/block_cache.hpp): a freed block is reused by the next request it fits
// (at most twice the size asked for), blocks are 64-byte aligned, a moved block is freed once, the
// cache's byte count is exact, and a block given back to a full cache evicts the oldest kept ones
// (a block larger than the cap is freed). The cache is process-wide: each test case starts by
// emptying it, and asks for sizes that no block of another case fits.
#include <doctest/doctest.h>

#include <cstdint>
#include <linrope/attention.hpp>
#include <set>
#include <utility>
#include <vector>

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

TEST_CASE("block cache: release_cached_memory frees exactly what the cache holds") {
  linrope::release_cached_memory();
  { const CachedBlock block(7 * kMiB); }
  { const CachedBlock taken_and_back(5 * kMiB); }  // takes the 7 MiB block and gives it back
  { const CachedBlock other(3 * kMiB); }           // too small for it: a block of its own
  CHECK(linrope::release_cached_memory() == 10 * kMiB);
  CHECK(linrope::release_cached_memory() == 0);
}

TEST_CASE("block cache: a block given back to a full cache evicts the oldest kept blocks") {
  linrope::release_cached_memory();
  // Ten blocks of a tenth of the cap fill it; a block of 3/10 given back then evicts the oldest
  // three (the first ones given back), and the newest seven stay.
  const std::size_t tenth = kCachedBytes / 10;
  std::set<std::byte*> newest;
  {
    std::vector<CachedBlock> blocks;
    for (int i = 0; i < 10; ++i) blocks.emplace_back(tenth);
    for (int i = 3; i < 10; ++i) newest.insert(blocks[std::size_t(i)].data());
  }  // given back in order 0, 1, ..., 9
  std::byte* large = nullptr;
  { large = CachedBlock(3 * tenth).data(); }  // not from the cache (no block fits); kept
  {
    std::vector<CachedBlock> taken;
    std::set<std::byte*> seen;
    for (int i = 0; i < 7; ++i) seen.insert(taken.emplace_back(tenth).data());
    CHECK(seen == newest);
  }
  const CachedBlock again(3 * tenth);
  CHECK(again.data() == large);
  CHECK(linrope::release_cached_memory() == 7 * tenth);
  // A block larger than the cap is never kept, and evicts nothing.
  { const CachedBlock small(kMiB); }
  { const CachedBlock huge(kCachedBytes + kMiB); }
  CHECK(linrope::release_cached_memory() == kMiB);
}

TEST_CASE("block cache: the newest block freed is kept when two do not fit") {
  linrope::release_cached_memory();
  // Two blocks of more than half the cap: b is given back first (kept), then a, which evicts b.
  const std::size_t half = kCachedBytes / 2 + kMiB;
  std::byte* kept = nullptr;
  {
    const CachedBlock a(half), b(half);
    kept = a.data();
  }
  const CachedBlock again(half);
  CHECK(again.data() == kept);
  CHECK(linrope::release_cached_memory() == 0);  // `again` holds the only kept block
}

}  // namespace
