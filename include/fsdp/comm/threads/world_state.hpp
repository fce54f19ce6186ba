#pragma once
//! \file What the thread ranks of one world share: its options, its failure state, the groups
//! (the world and its splits), and per group the slots of the collectives in flight, where
//! the members leave their arguments for each other (comm/threads/rendezvous.hpp meets there).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
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

//! One collective in flight: the members' arguments and phase counters. A member's arguments
//! are written when it arrives; reset() readies a finished slot for the next collective.
struct slot {
  explicit slot(int n) : desc(n), send(n), recv(n), extra(n), token(n), arrived(n, false) {}
  void reset() {
    std::fill(arrived.begin(), arrived.end(), false);
    n_arrived = 0, abandoned = false, departed = 0;
    for (auto& p : phase) p = 0;
  }
  std::vector<collective> desc;
  std::vector<const void*> send;
  std::vector<void*> recv;
  std::vector<std::pair<int, int>> extra;  // split: (color, key)
  std::vector<void*> token;                // a device transport's per-member state (comm/threads/cuda_communicator.hpp)
  std::vector<bool> arrived;
  // Changed under the group's mutex; atomic so that a waiting member can poll it without it
  // (detail::spin_then_wait's peek: polling under the mutex contends with the member that
  // must take it to arrive).
  std::atomic<int> n_arrived{0};
  bool abandoned = false;  // a member gave up before every member arrived: nobody reads
  // Members past each data phase, and members gone: counted without the mutex (see
  // rendezvous::meet), as members finish their copies at nearly the same time and would
  // otherwise queue on it.
  std::atomic<int> phase[3] = {0, 0, 0};
  std::atomic<int> departed{0};
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
      : world(w), members(std::move(m)), label(std::move(l)), id(i) {}
  world_state* world;
  std::vector<int> members;  // world ranks, in group-rank order
  std::string label;
  std::uint64_t id;
  std::mutex m;
  std::condition_variable cv;
  std::atomic<int> phase_sleepers{0};  // members asleep on cv in a data phase (rendezvous::meet)
  std::map<std::uint64_t, slot> slots;
  std::map<std::tuple<int, int, std::uint64_t>, message> messages;  // (from, to, k), group ranks
  //! Finished slots kept for the next collectives: a slot is a map node and six vectors, seven
  //! allocations and frees per collective under the mutex, otherwise.
  std::vector<std::map<std::uint64_t, slot>::node_type> spare;
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
