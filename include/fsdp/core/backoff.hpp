#pragma once
//! \file How a thread that polls for completion waits between polls: detail::backoff, used by
//! the CUDA device's waits (device/cuda.hpp), NCCL's non-blocking calls (comm/nccl.hpp) and the
//! MPI engine's progress loop (comm/mpi.hpp).

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <thread>

namespace fsdp::detail {

//! Waits between two polls: yields the core for the first `yields` polls, then sleeps `sleep`
//! per poll, and once `long_after` has passed since the first sleep, `long_sleep` per poll, until
//! reset().
//!
//! Why two phases. What is polled for (a kernel, a collective of a small bucket) often finishes
//! within microseconds, and a yield returns at once when no other thread wants the core, so
//! polling back to back first catches a short wait without adding latency. A wait that lasts
//! must not take a core from the other ranks' host threads (ranks are often more than cores):
//! a sleep between polls bounds what a waiting rank burns, at the price of noticing the
//! completion up to one sleep late.
//!
//! The two settings in use (the values each of these loops had before it used this class;
//! chosen by the reasoning above, not re-measured since):
//!   device_wait(): 200 yields, then 50 us. For the host waiting on a GPU: cudaEventQuery /
//!     cudaStreamQuery (device/cuda.hpp) and ncclCommGetAsyncError (comm/nccl.hpp). 200 yields
//!     cover a short kernel or collective; once the wait is long, a poll every 50 us costs a
//!     few percent of a core, and 50 us late is small next to the collectives waited on.
//!   mpi_progress(): 63 yields, then 20 us, and 1 ms once 100 ms have passed. For the MPI engine
//!     thread (comm/mpi.hpp), counted from its last completion: the 64th idle round and later
//!     sleep. Open MPI progresses only inside MPI calls, so the engine's sleep delays the
//!     collective itself, not only noticing its end; 20 us keeps that latency low while leaving
//!     the core to the ranks' compute. But a rank that waits for a stopped, slow or dead peer
//!     polled 20 us apart burnt 28% of a core (tests/faults: mpi_stop_short, a 1.5 s stop), for
//!     as long as the timeout (300 s by default). Past 100 ms without a completion the wait is
//!     for a peer, not for data in flight, so the engine polls every 1 ms (about 1% of a core),
//!     and a collective whose peer turns up after that pays at most about 1 ms per poll until it
//!     completes. device_wait() has no long phase: a GPU wait is for work already queued.
class backoff {
 public:
  //! What pause() did.
  enum class step : std::uint8_t { yield, sleep, long_sleep };

  constexpr backoff(unsigned yields, std::chrono::microseconds sleep) noexcept : backoff(yields, sleep, never, sleep) {}
  constexpr backoff(unsigned yields, std::chrono::microseconds sleep, std::chrono::milliseconds long_after,
                    std::chrono::microseconds long_sleep) noexcept
      : yields_(yields), sleep_(sleep), long_after_(long_after), long_sleep_(long_sleep) {}

  //! A host thread waiting on GPU work or an NCCL call (see the class comment).
  static constexpr backoff device_wait() noexcept { return {200, std::chrono::microseconds(50)}; }
  //! The MPI engine's progress loop (see the class comment).
  static constexpr backoff mpi_progress() noexcept {
    return {63, std::chrono::microseconds(20), std::chrono::milliseconds(100), std::chrono::microseconds(1000)};
  }

  //! Waits before the next poll: yields for the first `yields` calls since construction or
  //! reset(), sleeps from then on (the count saturates: it never wraps back to yielding), for
  //! `long_sleep` once `long_after` has passed since the first of those sleeps.
  step pause() {
    if (polls_ < yields_) {
      ++polls_;
      std::this_thread::yield();
      return step::yield;
    }
    const auto now = std::chrono::steady_clock::now();
    if (!sleeping_) sleeping_ = true, first_sleep_ = now;
    if (long_after_ != never && now - first_sleep_ >= long_after_) {
      std::this_thread::sleep_for(long_sleep_);
      return step::long_sleep;
    }
    std::this_thread::sleep_for(sleep_);
    return step::sleep;
  }
  //! Something completed: the next pauses yield again.
  void reset() noexcept { polls_ = 0, sleeping_ = false; }

  constexpr unsigned yields() const noexcept { return yields_; }
  constexpr std::chrono::microseconds sleep() const noexcept { return sleep_; }
  constexpr std::chrono::milliseconds long_after() const noexcept { return long_after_; }
  constexpr std::chrono::microseconds long_sleep() const noexcept { return long_sleep_; }

  //! long_after for a backoff without a long phase.
  static constexpr std::chrono::milliseconds never = std::chrono::milliseconds::max();

 private:
  unsigned yields_;
  std::chrono::microseconds sleep_;
  std::chrono::milliseconds long_after_;
  std::chrono::microseconds long_sleep_;
  unsigned polls_ = 0;  // pauses since construction or reset(), at most yields_
  bool sleeping_ = false;  // a sleep happened since construction or reset()
  std::chrono::steady_clock::time_point first_sleep_{};
};

//! How many times a host thread re-checks its condition, yielding the core in between, before it
//! sleeps on a condition variable: spin_then_wait() below. FSDP_SPIN_YIELDS overrides it
//! (0: sleep at once), for measuring.
//!
//! 128, from fsdp_bench on this 2-core VM (2026-11-25, docs/benchmarks.md), 0 -> 64 / 128 / 256 /
//! 1024 yields: a 64 KiB threads all-gather of 2 ranks ran 12x faster with any of them (0.30 ->
//! 3.1-4.1 GB/s), a 1 MiB one 8-10x; the one-rank step's wall time per unit fell from 37 us to
//! 17 (64), 12 (128) and 10 us (256); beyond 128 the gains were within the noise. train_gpt with
//! 4 thread ranks on the 2 cores (12 threads) trained 12-16% more tokens/s, 2 ranks the same.
inline unsigned handoff_yields() {
  static const unsigned n = [] {
    if (const char* s = std::getenv("FSDP_SPIN_YIELDS")) return static_cast<unsigned>(std::strtoul(s, nullptr, 10));
    return 128u;
  }();
  return n;
}

//! cv.wait_until(lock, deadline, ready), after re-checking `ready` up to handoff_yields() times
//! with the lock released and the core yielded in between. The host queues and the threads
//! backend hand work between threads through condition variables; a thread woken through one
//! pays a futex wake and a reschedule (tens of microseconds on this VM), while the peer or task
//! it waits for often turns up within a few microseconds. A yield returns at once when no other
//! thread wants the core, and gives it away when one does, so spinning this way costs little
//! when ranks outnumber cores.
template <class Pred>
bool spin_then_wait(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                    std::chrono::steady_clock::time_point deadline, Pred ready) {
  for (unsigned i = handoff_yields(); i > 0; --i) {
    if (ready()) return true;
    lock.unlock();
    std::this_thread::yield();
    lock.lock();
  }
  return cv.wait_until(lock, deadline, ready);
}

//! The same, but the spin polls `peek` with the lock released: a lock-free look (an atomic) at
//! what `ready` reads under the lock. Re-taking the lock at every poll contends with the thread
//! that must take it to make `ready` true, and on this VM a thread that finds a mutex held
//! sleeps on its futex, so the hand-off pays a wake-up after all. `ready` decides, under the
//! lock, before the spin and after it; `peek` only ends the spin early (a true peek with a false
//! `ready` goes on to the condition variable's wait).
template <class Pred, class Peek>
bool spin_then_wait(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                    std::chrono::steady_clock::time_point deadline, Pred ready, Peek peek) {
  if (ready()) return true;
  if (const unsigned yields = handoff_yields(); yields > 0) {
    lock.unlock();
    for (unsigned i = yields; i > 0 && !peek(); --i) std::this_thread::yield();
    lock.lock();
  }
  return cv.wait_until(lock, deadline, ready);
}

}  // namespace fsdp::detail
