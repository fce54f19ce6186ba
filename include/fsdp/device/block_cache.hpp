#pragma once
//! \file Device memory from an allocator outside fsdp: a memory_source's blocks, kept after their
//! buffers are freed and handed out again in stream order, as fsdp's CUDA pool reuses its blocks
//! (device/cuda.hpp). The CUDA device uses it for cuda_device::use_memory
//! (device/cuda/block_cache.hpp says why: NCCL's registered buffers); the bookkeeping is here,
//! without CUDA, so that the host tests check it.
//!
//! Contract of block_cache<Marks>:
//!  1. take(bytes) hands out a block of exactly `bytes` whose last release has completed, else a
//!     new one from the source; never a block in use, never one whose release is pending.
//!  2. give(p, stream) marks p's release at the current end of `stream` (Marks::record); the
//!     block is reusable once that mark completes. Released where no mark can be recorded (a
//!     stream being captured into a graph, or a failed record), the block is retired: never
//!     handed out again, returned to the source with the cache.
//!  3. Nothing waits in take() or give(): marks are asked (Marks::done), never waited for.
//!  4. The destructor returns every block to the source once its release has completed (or it
//!     was retired), waiting at most `teardown` for all of them together; a block whose release
//!     has not completed by then is left to the source unreturned, since work still queued may
//!     read it. A block still handed out goes back at once (none on a device, whose buffers keep
//!     the cache alive).
//!  5. take() and give() may be called from several threads.
//!
//! Marks (static members): `stream`, `mark` (a default value means none); create() -> mark;
//! record(mark&, stream) -> bool (false: not recorded); capturing(stream) -> bool; done(mark) ->
//! bool (throws fsdp::error when it cannot tell); wait(mark, milliseconds) -> bool (done within
//! the time); destroy(mark). All but done() noexcept: give() and the destructor call them.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <functional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/core/error.hpp"
#include "fsdp/core/timeout.hpp"

namespace fsdp {

//! An allocator of device memory (cuda_device::use_memory).
struct memory_source {
  std::string name;                                   // names the source in errors
  std::function<void*(std::size_t bytes)> allocate;   // at least `bytes`; throws fsdp::error when it cannot
  std::function<void(void* block)> free;              // takes back what allocate returned; must not throw
};

//! What a memory_source has given a cache: its blocks (in use, free or retired) and the bytes
//! asked for them, beyond the live bytes a device counts (a source may round each block up).
struct memory_held {
  std::size_t blocks = 0, bytes = 0;
};

namespace detail {

template <class Marks>
class block_cache {
  static_assert(noexcept(Marks::create()) && noexcept(Marks::capturing(std::declval<typename Marks::stream>())) &&
                    noexcept(Marks::record(std::declval<typename Marks::mark&>(), std::declval<typename Marks::stream>())) &&
                    noexcept(Marks::wait(std::declval<typename Marks::mark>(), milliseconds{})) &&
                    noexcept(Marks::destroy(std::declval<typename Marks::mark>())),
                "block_cache: a Marks' create, capturing, record, wait and destroy must be noexcept (give() and the destructor call them)");

 public:
  using stream = typename Marks::stream;
  using mark = typename Marks::mark;

  explicit block_cache(memory_source source, milliseconds teardown = default_timeout()) : source_(std::move(source)), teardown_(teardown) {
    if (!source_.allocate || !source_.free)
      throw error(errc::invalid_argument, "the memory source '" + source_.name + "' needs both allocate and free");
  }
  block_cache(const block_cache&) = delete;
  block_cache& operator=(const block_cache&) = delete;
  ~block_cache() {  // contract 4
    const auto deadline = std::chrono::steady_clock::now() + teardown_;
    for (block& b : blocks_) {
      bool done = b.released == mark{} || b.retired;
      if (!done) {
        const auto left = std::chrono::duration_cast<milliseconds>(deadline - std::chrono::steady_clock::now());
        done = Marks::wait(b.released, std::max(left, milliseconds{0}));
      }
      if (b.released != mark{}) Marks::destroy(b.released);
      if (done) source_.free(b.ptr);
    }
  }

  const std::string& name() const noexcept { return source_.name; }

  memory_held holding() const {
    std::lock_guard lock(m_);
    memory_held h{blocks_.size(), 0};
    for (const block& b : blocks_) h.bytes += b.bytes;
    return h;
  }

  void* take(std::size_t bytes) {  // contracts 1 and 3
    std::lock_guard lock(m_);
    for (block& b : blocks_) {
      if (b.live || b.retired || b.bytes != bytes || !Marks::done(b.released)) continue;
      b.live = true;
      return b.ptr;
    }
    void* p = source_.allocate(bytes);
    if (!p) throw error(errc::internal, "the memory source '" + source_.name + "' returned no memory for " + std::to_string(bytes) + " bytes");
    try {
      blocks_.push_back({p, bytes});
    } catch (...) {
      source_.free(p);
      throw;
    }
    return p;
  }

  void give(void* p, stream after) noexcept {  // contract 2
    std::lock_guard lock(m_);
    for (block& b : blocks_) {
      if (b.ptr != p) continue;
      b.live = false;
      if (Marks::capturing(after)) {
        b.retired = true;
        return;
      }
      if (b.released == mark{}) b.released = Marks::create();
      if (b.released == mark{} || !Marks::record(b.released, after)) b.retired = true;
      return;
    }
  }

 private:
  struct block {
    void* ptr = nullptr;
    std::size_t bytes = 0;
    bool live = true;
    bool retired = false;
    mark released{};  // recorded at the block's last release
  };
  memory_source source_;
  milliseconds teardown_;
  mutable std::mutex m_;
  std::vector<block> blocks_;  // every block the source gave (a step's buffers: tens)
};

}  // namespace detail
}  // namespace fsdp
