// Private: per-thread working memory that outlives a call, so that repeated calls allocate nothing.
//
// A linear-attention head needs a few feature blocks per call (up to 2 x 256 x 256 floats each).
// Allocated afresh, they cost page faults whenever the allocator returns large blocks to the
// system between calls (glibc above its mmap threshold): the scaling experiment, which sets that
// threshold to 256 KiB for its memory columns, measured FAVOR+ at n = 256 in 16 ms per call where
// bench_linear (default malloc) took about 1 ms. Scratch takes the blocks from a per-thread stack
// of buffers that grow as needed and are kept between calls, up to kKeptBytes each: after a
// thread's first call, nothing is allocated. A larger buffer (a caller's huge chunk_size, say) is
// released when the thread's outermost Scratch ends, so that one odd call does not pin its memory
// to the thread for the rest of the program, unless it was asked for with Lifetime::Thread: the
// backward passes keep a whole sequence's features (O(n m), tens of MB) and are called once per
// training step with the same shapes, and allocating those afresh cost ~10% of a causal FAVOR+
// backward in page faults and zeroing. Such a buffer stays with the thread, at its largest size,
// until the thread ends (what PyTorch's caching allocator does with its tensors).
#pragma once

#include <Eigen/Core>
#include <cstddef>
#include <linrope/types.hpp>
#include <vector>

namespace linrope::detail {

// `count` T's (64-byte aligned, contents unspecified) from this thread's scratch stack, valid until
// the Scratch is destroyed. A thread's Scratch objects must die in reverse order of creation, which
// scopes guarantee. Throws std::bad_alloc only when the stack has to grow.
// How long a Scratch's memory stays with its thread once the outermost Scratch is gone: released
// if large (Call), or kept at its largest size (Thread, `lasting` below).
enum class Lifetime { Call, Thread };

template <class T>
class Scratch {
 public:
  explicit Scratch(Index count, Lifetime lifetime = Lifetime::Call) {
    Stack& s = stack();
    if (s.buffers.size() <= s.depth) {
      s.buffers.emplace_back();
      s.lasting.push_back(0);
    }
    auto& buffer = s.buffers[s.depth];
    if (Index(buffer.size()) < count) buffer.resize(std::size_t(count));
    data_ = buffer.data();
    if (lifetime == Lifetime::Thread) s.lasting[s.depth] = 1;
    ++s.depth;  // only once nothing can throw any more
  }
  ~Scratch() {
    Stack& s = stack();
    if (--s.depth > 0) return;
    for (std::size_t i = 0; i < s.buffers.size(); ++i)
      if (!s.lasting[i] && s.buffers[i].capacity() * sizeof(T) > kKeptBytes) s.buffers[i] = {};
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  T* data() const { return data_; }

 private:
  // Largest buffer kept between calls: the linear kernels' feature blocks need at most 1 MiB
  // (512 rows x 256 features x 2 copies, float; twice that in double).
  static constexpr std::size_t kKeptBytes = std::size_t(4) << 20;
  struct Stack {
    // Moving the outer vector keeps every inner buffer where it is.
    std::vector<std::vector<T, Eigen::aligned_allocator<T>>> buffers;
    std::vector<char> lasting;  // per buffer: once asked for as lasting, never released
    std::size_t depth = 0;
  };
  static Stack& stack() {
    thread_local Stack s;
    return s;
  }
  T* data_ = nullptr;
};

}  // namespace linrope::detail
