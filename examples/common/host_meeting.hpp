#pragma once
// examples/common/host_meeting.hpp: what the thread ranks of one process share on the host
// (common/nccl_thread_ranks.hpp): the first failure's words, and a barrier that a failure ends.
//
//   example::host_meeting meeting{4, 60s};
//   meeting.meet();                                   // every rank, as often as the others
//   bool echo = meeting.fail(e.what(), "rank 2 failed: " + std::string(e.what()));
//
// Contract:
//   1. meet() returns once all `ranks` ranks have called it as often as this one (round k ends
//      when the k-th call of every rank has come), not before;
//   2. once fail() was called, every meet(), waiting or new, throws errc::peer_failure naming the
//      first failure's words; a meet() that waits longer than `timeout` throws errc::timeout;
//   3. fail(what, words) keeps the first failure's `words`, and returns whether `what` repeats
//      them (an echo: a peer's failure caused by the first), never for the first itself;
//   4. every member is safe to call from any thread.

#include <chrono>
#include <condition_variable>
#include <cstdint>
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

  bool fail(const std::string& what, const std::string& words) {
    std::lock_guard lock(m_);
    const bool echo = !reason_.empty() && what.find(reason_) != std::string::npos;
    if (reason_.empty()) reason_ = words;
    cv_.notify_all();
    return echo;
  }

  //! The first failure's words; empty while none failed.
  std::string reason() const {
    std::lock_guard lock(m_);
    return reason_;
  }

 private:
  mutable std::mutex m_;
  std::condition_variable cv_;
  const std::uint64_t ranks_;
  const std::chrono::milliseconds timeout_;
  std::uint64_t arrived_ = 0;  // meet() calls so far, every rank's
  std::string reason_;
};

}  // namespace example
