#pragma once
//! \file How a thread that polls for completion waits between polls: detail::backoff, used by
//! the CUDA device's waits (device/cuda.hpp), NCCL's non-blocking calls (comm/nccl.hpp) and the
//! MPI engine's progress loop (comm/mpi.hpp).

#include <chrono>
#include <cstdint>
#include <thread>

namespace fsdp::detail {

//! Waits between two polls: yields the core for the first `yields` polls, then sleeps `sleep`
//! per poll, until reset().
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
//!   mpi_progress(): 63 yields, then 20 us. For the MPI engine thread (comm/mpi.hpp), counted
//!     from its last completion: the 64th idle round and later sleep. Open MPI progresses only
//!     inside MPI calls, so the engine's sleep delays the collective itself, not only noticing
//!     its end; 20 us keeps that latency low while leaving the core to the ranks' compute.
class backoff {
 public:
  //! What pause() did.
  enum class step : std::uint8_t { yield, sleep };

  constexpr backoff(unsigned yields, std::chrono::microseconds sleep) noexcept : yields_(yields), sleep_(sleep) {}

  //! A host thread waiting on GPU work or an NCCL call (see the class comment).
  static constexpr backoff device_wait() noexcept { return {200, std::chrono::microseconds(50)}; }
  //! The MPI engine's progress loop (see the class comment).
  static constexpr backoff mpi_progress() noexcept { return {63, std::chrono::microseconds(20)}; }

  //! Waits before the next poll: yields for the first `yields` calls since construction or
  //! reset(), sleeps from then on (the count saturates: it never wraps back to yielding).
  step pause() {
    if (polls_ < yields_) {
      ++polls_;
      std::this_thread::yield();
      return step::yield;
    }
    std::this_thread::sleep_for(sleep_);
    return step::sleep;
  }
  //! Something completed: the next pauses yield again.
  void reset() noexcept { polls_ = 0; }

  constexpr unsigned yields() const noexcept { return yields_; }
  constexpr std::chrono::microseconds sleep() const noexcept { return sleep_; }

 private:
  unsigned yields_;
  std::chrono::microseconds sleep_;
  unsigned polls_ = 0;  // pauses since construction or reset(), at most yields_
};

}  // namespace fsdp::detail
