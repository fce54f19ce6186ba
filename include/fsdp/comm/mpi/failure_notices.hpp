#pragma once
//! \file Failing fast between MPI processes: each process keeps a receive posted on a private
//! duplicate of MPI_COMM_WORLD; a process that fails sends its error text to every other there,
//! so that theirs fail within milliseconds instead of at their timeout (comm/mpi.hpp). The
//! engine (comm/mpi/engine.hpp) owns one and calls it in its rounds, one thread at a time.

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace fsdp::mpi::detail {

//! A peer's notice: which rank sent it, and its message; `relayed` when the message is about
//! another rank (one that stopped answering: comm/mpi/heartbeats.hpp), not the sender's own failure.
struct peer_notice {
  int rank = 0;
  std::string text;
  bool relayed = false;
};

class failure_notices {
 public:
  //! `channel` is the private communicator (a duplicate of MPI_COMM_WORLD, freed by close()).
  failure_notices(int rank, MPI_Comm channel) : rank_(rank), channel_(channel) {}

  //! True once this process sent its notice or received a peer's: there is nothing more to say.
  bool settled() const noexcept { return settled_; }
  //! True once a peer's notice arrived.
  bool received() const noexcept { return received_; }

  //! Sends `why` (its first KiB) to every other rank and waits, bounded, until the sends
  //! complete; `relayed` when it is about another rank. Only the first call (or none, after a
  //! peer's notice) sends.
  void send(const std::string& why, bool relayed = false) {
    if (settled_) return;
    settled_ = true;
    int size = 1;
    MPI_Comm_size(channel_, &size);
    const std::string text = (relayed ? relay_mark : std::string()) + why.substr(0, text_bytes - 2);
    std::vector<MPI_Request> sends;
    for (int r = 0; r < size; ++r) {
      if (r == rank_) continue;
      MPI_Request q = MPI_REQUEST_NULL;
      if (MPI_Isend(text.data(), static_cast<int>(text.size()), MPI_CHAR, r, tag, channel_, &q) == MPI_SUCCESS)
        sends.push_back(q);
    }
    // A peer that is alive takes the notice at once (its receive is posted); a dead one never
    // does. 1 s covers the first on a loaded machine without hanging on the second.
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    int done = 0;
    while (!sends.empty() && std::chrono::steady_clock::now() < until) {
      if (MPI_Testall(static_cast<int>(sends.size()), sends.data(), &done, MPI_STATUSES_IGNORE) != MPI_SUCCESS || done) break;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  //! Posts the receive for a peer's notice, or tests it: the notice, the first time it is there.
  std::optional<peer_notice> poll() {
    if (recv_ == MPI_REQUEST_NULL) {
      if (!received_) MPI_Irecv(text_, text_bytes, MPI_CHAR, MPI_ANY_SOURCE, tag, channel_, &recv_);
      return std::nullopt;
    }
    int flag = 0;
    MPI_Status st;
    if (MPI_Test(&recv_, &flag, &st) != MPI_SUCCESS || !flag) return std::nullopt;
    received_ = true;
    settled_ = true;  // the failed rank told everyone; this one has nothing to add
    int len = 0;
    MPI_Get_count(&st, MPI_CHAR, &len);
    std::string text(text_, static_cast<std::size_t>(std::max(len, 0)));
    const bool relayed = text.starts_with(relay_mark);
    return peer_notice{st.MPI_SOURCE, relayed ? text.substr(1) : std::move(text), relayed};
  }

  //! Before MPI_Finalize, on a healthy process: cancels the posted receive (MPI_Finalize needs
  //! none left) and frees the channel.
  void close() {
    if (recv_ != MPI_REQUEST_NULL) {
      MPI_Cancel(&recv_);
      MPI_Wait(&recv_, MPI_STATUS_IGNORE);
    }
    MPI_Comm_free(&channel_);
  }

 private:
  static constexpr int tag = 1;
  static constexpr int text_bytes = 1024;  // a message's first KiB: enough to name the cause
  static constexpr char relay_mark[] = "\x01";  // leads a relayed notice's text

  int rank_;
  MPI_Comm channel_;
  MPI_Request recv_ = MPI_REQUEST_NULL;  // the posted receive
  char text_[text_bytes] = {};
  std::atomic<bool> settled_{false};  // read by the engine thread's idle wait too
  bool received_ = false;
};

}  // namespace fsdp::mpi::detail
