#pragma once
//! \file Liveness between MPI processes, apart from progress. Every process sends every other a
//! small beat each `period` on a private duplicate of MPI_COMM_WORLD and watches theirs; a peer
//! not heard from for `limit` (killed, stopped, or its host unreachable) is reported, whatever
//! the collective timeout, which stays for ranks that are alive but stuck. A live process beats
//! whatever its ranks compute: the engine thread (comm/mpi/engine.hpp) sends and takes the beats
//! in its rounds, which run at least every 20 ms. A process that ends cleanly says so (a last
//! beat "leaving"), and is watched no more.
//!
//! The defaults come from what a user must be able to tell apart: a process stopped for 8 s
//! (a debugger, a swapping host, a slow checkpoint write on a starved node) is alive; one killed
//! must be named within 15 s. 10 s of silence, judged every 100 ms from beats sent every second,
//! names it 10-11 s after its last beat. Cost: each process sends and receives size - 1 beats
//! of 4 bytes a second, and tests size - 1 receives every 100 ms (at 1,024 processes, about
//! 10,000 tests a second on the engine thread: microseconds each).

#include <mpi.h>

#include <chrono>
#include <cstddef>
#include <optional>
#include <vector>

#include "fsdp/core/timeout.hpp"

namespace fsdp::mpi {

//! How a process tells that a peer is gone: beats every `period`, a peer silent for `limit` is
//! reported. `limit` 0 turns the watch off (the collective timeout alone remains).
struct liveness {
  milliseconds period{1000};
  milliseconds limit{10000};
};

namespace detail {

//! A peer not heard from for `silent`.
struct silent_peer {
  int rank = 0;
  std::chrono::steady_clock::duration silent{};
};

class heartbeats {
 public:
  using clock = std::chrono::steady_clock;

  //! `channel`: the private communicator the beats travel on (a duplicate of MPI_COMM_WORLD,
  //! freed by close()). Collective only in that every process makes one.
  heartbeats(int rank, MPI_Comm channel, liveness l) : rank_(rank), channel_(channel), l_(l) {
    int size = 1;
    MPI_Comm_size(channel_, &size);
    const auto n = static_cast<std::size_t>(size);
    heard_.assign(n, clock::now());
    recv_.assign(n, MPI_REQUEST_NULL);
    beat_in_.assign(n, alive);
    gone_.assign(n, false);
    gone_[static_cast<std::size_t>(rank_)] = true;  // not watched: itself
  }

  //! In the engine's rounds, one thread at a time. Every `period` sends this process's beat;
  //! every 100 ms takes the peers' beats that arrived and returns the first peer silent for
  //! longer than the limit (or nothing).
  std::optional<silent_peer> tick(clock::time_point now) {
    if (l_.limit.count() <= 0 || now < next_check_) return std::nullopt;
    next_check_ = now + check_every;
    if (now >= next_beat_) {
      next_beat_ = now + l_.period;
      send_to_watched(alive);
    }
    std::optional<silent_peer> silent;
    for (std::size_t p = 0; p < gone_.size(); ++p) {
      if (gone_[p]) continue;
      take_beats(p, now);
      if (!gone_[p] && now - heard_[p] > l_.limit && !silent) silent = silent_peer{static_cast<int>(p), now - heard_[p]};
    }
    return silent;
  }

  //! Before MPI_Finalize, on a healthy process: tells the peers it is leaving, cancels the
  //! posted receives and frees the channel.
  void close() {
    send_to_watched(leaving);
    for (MPI_Request& r : recv_) {
      if (r == MPI_REQUEST_NULL) continue;
      MPI_Cancel(&r);
      MPI_Wait(&r, MPI_STATUS_IGNORE);
    }
    MPI_Comm_free(&channel_);
  }

 private:
  static constexpr int tag = 2;
  static constexpr int alive = 1;
  static constexpr int leaving = 0;
  static constexpr milliseconds check_every{100};

  // Beats are fire-and-forget (MPI_Request_free): 4 bytes go eagerly, and a dead peer's never
  // completes. The payload is a static constant, valid for as long as MPI needs it.
  void send_to_watched(const int& beat) {
    for (std::size_t p = 0; p < gone_.size(); ++p) {
      if (gone_[p]) continue;
      MPI_Request q = MPI_REQUEST_NULL;
      if (MPI_Isend(&beat, 1, MPI_INT, static_cast<int>(p), tag, channel_, &q) == MPI_SUCCESS) MPI_Request_free(&q);
    }
  }

  // Takes every beat from peer p that arrived (a process that was itself stopped finds them
  // queued, and so does not take its peers for dead).
  void take_beats(std::size_t p, clock::time_point now) {
    for (;;) {
      if (recv_[p] == MPI_REQUEST_NULL &&
          MPI_Irecv(&beat_in_[p], 1, MPI_INT, static_cast<int>(p), tag, channel_, &recv_[p]) != MPI_SUCCESS)
        return;
      int flag = 0;
      if (MPI_Test(&recv_[p], &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || !flag) return;
      heard_[p] = now;
      if (beat_in_[p] == leaving) {
        gone_[p] = true;
        return;
      }
    }
  }

  int rank_;
  MPI_Comm channel_;
  liveness l_;
  std::vector<clock::time_point> heard_;  // when each peer's last beat was taken
  std::vector<MPI_Request> recv_;         // the receive posted for each peer's next beat
  std::vector<int> beat_in_;              // where it lands
  std::vector<bool> gone_;                // left cleanly (or this process): not watched
  clock::time_point next_beat_{};
  clock::time_point next_check_{};
};

}  // namespace detail
}  // namespace fsdp::mpi
