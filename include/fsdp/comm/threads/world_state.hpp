#pragma once
//! \file What the thread ranks of one world share: its options, its failure state, the groups
//! (the world and its splits), and per group the slots of the collectives in flight, where
//! the members leave their arguments for each other (comm/threads/rendezvous.hpp meets there).

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "fsdp/comm/front.hpp"
#include "fsdp/comm/threads/link_model.hpp"
#include "fsdp/core/timeout.hpp"

namespace fsdp::threads {

struct world_options {
  milliseconds timeout = default_timeout();  //!< bound on every wait
  link_model link{};                         //!< modelled link per rank (default: none)
  //! Ranks per simulated host (0: all on one): world ranks 0..k-1 are host 0, k..2k-1 host 1,
  //! ... It shapes hosts() (comm/topology.hpp), hence the inter-host traffic count and
  //! hybrid_shard_per_host(); the link model is the same for every pair of ranks.
  int ranks_per_host = 0;
};

namespace detail {

using fsdp::detail::collective;
using fsdp::detail::collective_kind;

//! How many consecutive collectives of a group can be met at once: collective `seq` meets in
//! slot seq % ring_size, and a member that reaches it waits until every member has left
//! collective seq - ring_size. Each queue runs its collectives in issue order, so only a rank
//! whose queues are more than ring_size collectives apart ever waits there (shard_group's
//! queues are apart by about its prefetch depth and the reductions not yet run).
inline constexpr std::uint64_t ring_size = 16;

//! The meeting place of one collective at a time (ring_size of them per group, reused in turn):
//! the members' arguments and the counters they synchronize on, all atomics or written before
//! an atomic publishes them, so that members meet without a mutex (rendezvous::meet).
struct alignas(64) slot {
  static constexpr std::uint64_t no_collective = ~std::uint64_t{0};
  //! One member's arguments, on cache lines of its own: written by that member alone, before
  //! it counts itself in `arrival`, and read by its peers once `arrival` counts every member.
  struct alignas(64) arguments {
    collective desc;
    const void* send = nullptr;
    void* recv = nullptr;
    std::pair<int, int> extra;         // split: (color, key)
    void* token = nullptr;             // a device transport's state (comm/threads/cuda_communicator.hpp)
    //! The last collective this member arrived at (read by a member that gives up, to name
    //! who is missing). A number rather than a flag, so that readying the slot for its next
    //! collective does not write every member's line.
    std::atomic<std::uint64_t> arrived_at{no_collective};
  };

  //! The member count `n` and the first collective this slot serves.
  void init(int members, std::uint64_t first) {
    n = static_cast<std::size_t>(members);
    args = std::make_unique<arguments[]>(n);
    serves = first;
  }
  //! Readies the slot for its next collective (by the last member to leave the current one).
  void reset() {
    arrival.store(0, std::memory_order_relaxed), departed.store(0, std::memory_order_relaxed);
    for (auto& p : phase) p.store(0, std::memory_order_relaxed);
  }
  //! The withdrawn bit of `arrival`: a member gave up before every member arrived, so nobody
  //! reads the members' buffers (below it, the count of members that have arrived).
  static constexpr int withdrawn = 1 << 30;

  std::size_t n = 0;
  std::unique_ptr<arguments[]> args;  // per member
  // The counters every member changes, on a line apart from what is only read (above) and
  // from the next slot (the slot is aligned), so that a change does not evict those too.
  alignas(64) std::atomic<std::uint64_t> serves{0};  // the collective this slot is for now
  std::atomic<int> arrival{0};           // members arrived, plus `withdrawn`
  std::atomic<int> phase[3] = {0, 0, 0};  // members past each data phase
  std::atomic<int> departed{0};          // members gone
};

//! One point-to-point message in flight: the k-th send from one member to another, met by that
//! member's k-th recv from it (comm/threads/rendezvous.hpp, exchange). Guarded by the group's mutex.
struct message {
  collective sent, asked;           // what the sender and the receiver issued
  const void* data = nullptr;       // the sender's buffer
  void* into = nullptr;             // the receiver's buffer
  bool has_sender = false, has_receiver = false;
  bool abandoned = false;           // a side gave up before the other came: nobody reads
  bool copied = false;              // the receiver is done with the sender's buffer
  int departed = 0;
};

struct world_state;

//! The shared state of one communicator group (the world, or a split of it).
struct group_state {
  group_state(world_state* w, std::vector<int> m, std::string l, std::uint64_t i)
      : world(w), members(std::move(m)), label(std::move(l)), id(i) {
    for (std::uint64_t k = 0; k < ring_size; ++k) ring[k].init(static_cast<int>(members.size()), k);
  }
  world_state* world;
  std::vector<int> members;  // world ranks, in group-rank order
  std::string label;
  std::uint64_t id;
  std::mutex m;  // guards `messages`, and is the lock of `cv`
  std::condition_variable cv;
  //! Members asleep on cv waiting for a slot's counter (rendezvous::await): a member that
  //! changes one takes the mutex to wake them only when this is nonzero.
  std::atomic<int> sleepers{0};
  std::array<slot, ring_size> ring;  // collective seq meets in ring[seq % ring_size]
  std::map<std::tuple<int, int, std::uint64_t>, message> messages;  // (from, to, k), group ranks
};

struct world_state {
  world_state(int n, world_options o)
      : size(n), opts(o), exited(static_cast<std::size_t>(n)), link_free_at(static_cast<std::size_t>(n)) {
    for (auto& e : exited) e = false;
  }
  int size;
  world_options opts;
  std::atomic<bool> aborted{false};
  std::vector<std::atomic<bool>> exited;
  // The link model's one link per world rank: when it is next free. Its own mutex, because
  // every rank's queues reserve it and the world mutex is for rarer events.
  std::mutex link_m;
  std::vector<std::chrono::steady_clock::time_point> link_free_at;  // guarded by link_m
  std::mutex m;  // guards what follows
  std::exception_ptr first_failure;  // the root cause
  std::exception_ptr first_echo;     // the first peer_failure, kept in case no root cause shows
  std::string abort_reason;
  std::vector<std::shared_ptr<group_state>> groups;
  std::map<std::tuple<std::uint64_t, std::uint64_t, int>, std::shared_ptr<group_state>> splits;

  std::shared_ptr<group_state> make_group(std::vector<int> members, std::string label) {
    std::lock_guard lock(m);
    auto g = std::make_shared<group_state>(this, std::move(members), std::move(label), groups.size());
    groups.push_back(g);
    return g;
  }
  //! The group for (parent, split sequence, color); the first member to ask creates it.
  std::shared_ptr<group_state> split_group(const group_state& parent, std::uint64_t seq, int color,
                                           const std::vector<int>& members) {
    std::lock_guard lock(m);
    auto& g = splits[{parent.id, seq, color}];
    if (!g) {
      g = std::make_shared<group_state>(this, members, parent.label + "/split" + std::to_string(seq) +
                                                          ":color" + std::to_string(color),
                                        groups.size());
      groups.push_back(g);
    }
    return g;
  }
  std::string reason() {
    std::lock_guard lock(m);
    return abort_reason;
  }
  //! Records a failure and wakes every waiter of every group. An `echo` (a rank that stopped
  //! because another failed) never hides the root cause; a null `e` only aborts.
  void fail(std::exception_ptr e, const std::string& why, bool echo = false) {
    {
      std::lock_guard lock(m);
      std::exception_ptr& first = echo ? first_echo : first_failure;
      if (e && !first) first = std::move(e);
      if (abort_reason.empty() || (!echo && e && first == e)) abort_reason = why;
      aborted = true;
    }
    wake_all();
  }
  void mark_exited(int rank) {
    exited[static_cast<std::size_t>(rank)] = true;
    wake_all();
  }

 private:
  void wake_all() {
    std::vector<std::shared_ptr<group_state>> gs;
    {
      std::lock_guard lock(m);
      gs = groups;
    }
    for (auto& g : gs) {
      std::lock_guard lock(g->m);
      g->cv.notify_all();
    }
  }
};

}  // namespace detail
}  // namespace fsdp::threads
