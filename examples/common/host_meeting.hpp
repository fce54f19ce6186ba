#pragma once
// examples/common/host_meeting.hpp: what the thread ranks of one process share on the host
// (common/nccl_thread_ranks.hpp): the first failure, and a barrier that a failure ends.
//
//   example::host_meeting meeting{4, 60s};
//   meeting.meet();                                   // every rank, as often as the others
//   meeting.fail(2, std::current_exception());        // rank 2 failed
//   meeting.rethrow_first();                          // after the ranks: the root cause
//
// Contract:
//   1. meet() returns once all `ranks` ranks have called it as often as this one (round k ends
//      when the k-th call of every rank has come), not before;
//   2. once fail() was called, every meet(), waiting or new, throws errc::peer_failure naming the
//      first failure's words; a meet() that waits longer than `timeout` throws errc::timeout;
//   3. fail(r, e) keeps the first failure: e, and "rank r failed: <e's what()>" as reason(); a
//      later one is a peer's failure it caused (a wait that watch_peers ended) or came after it;
//   4. rethrow_first() rethrows the first failure, and returns when none failed;
//   5. every member is safe to call from any thread.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <string>

#include <fsdp/core/error.hpp>

namespace example {

class host_meeting {
 public:
  host_meeting(int ranks, std::chrono::milliseconds timeout) : ranks_(static_cast<std::uint64_t>(ranks)), timeout_(timeout) {
    if (ranks < 1) throw fsdp::error(fsdp::errc::invalid_argument, "host_meeting: ranks must be >= 1, got " + std::to_string(ranks));
  }

  void meet() {
    std::unique_lock lock(m_);
    const std::uint64_t round_end = (arrived_ / ranks_ + 1) * ranks_;
    ++arrived_;
    cv_.notify_all();
    if (!cv_.wait_for(lock, timeout_, [&] { return arrived_ >= round_end || !reason_.empty(); }))
      throw fsdp::error(fsdp::errc::timeout, "meeting on the host: not every rank came within " + std::to_string(timeout_.count()) + " ms");
    if (!reason_.empty()) throw fsdp::error(fsdp::errc::peer_failure, "meeting on the host: " + reason_);
  }

  void fail(int rank, std::exception_ptr e) {
    std::string what = "an exception that is not a std::exception";
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      what = x.what();
    } catch (...) {
    }
    std::lock_guard lock(m_);
    if (first_) return;
    first_ = std::move(e);
    reason_ = "rank " + std::to_string(rank) + " failed: " + what;
    cv_.notify_all();
  }

  //! The first failure's words; empty while none failed.
  std::string reason() const {
    std::lock_guard lock(m_);
    return reason_;
  }

  void rethrow_first() const {
    std::lock_guard lock(m_);
    if (first_) std::rethrow_exception(first_);
  }

 private:
  mutable std::mutex m_;
  std::condition_variable cv_;
  const std::uint64_t ranks_;
  const std::chrono::milliseconds timeout_;
  std::uint64_t arrived_ = 0;  // meet() calls so far, every rank's
  std::string reason_;
  std::exception_ptr first_;  // the first failure: the root cause
};

}  // namespace example
