#pragma once
//! \file The `threads` backend: N ranks as threads of one process, collectives through shared
//! memory. Each collective is enqueued on a host_queue; when it runs, the ranks' queue threads
//! meet at a rendezvous (matched by issue order), check that they issued the same collective,
//! copy or reduce straight between each other's buffers, and leave together.
//!
//! Failure model: every wait is bounded by the world's timeout. A rank that throws, times out
//! or returns from its function early aborts the world: every other rank's pending and future
//! waits end at once with fsdp::error(errc::peer_failure), and world::run rethrows the first
//! failure. One exception keeps memory safe: once every member has arrived at a collective,
//! each reads (and for all_reduce writes) the others' buffers, so no member may leave and let
//! its caller free a buffer a peer still uses. The data phases therefore run to the end even
//! when the world aborts meanwhile (they wait on nothing but the peers' copies, bounded by a
//! timeout of their own), and a member that gives up before every member arrived withdraws
//! from the collective, so that a late peer fails instead of reading its buffers. Reductions
//! add ranks in rank order in float (double for f64), the order of comm/rank_order_sum.hpp,
//! so results do not depend on thread timing and equal the mpi backend's bit for bit.
//!
//! Link model (world_options::link, off by default): shared memory makes communication nearly
//! free, so overlap of compute and communication cannot be seen. With a latency alpha and a
//! bandwidth beta, each collective occupies a link of every member rank for
//! alpha + bytes / beta seconds, where bytes is what that rank sends under the ring formulas of
//! traffic_counters (barrier and split: alpha alone). Each rank has one link, shared by all its
//! communicators (the world and its splits) and queues: once a collective's data has moved, it
//! takes the link at max(now, when the link is next free) and the thread that ran it (a queue's
//! thread; the caller for barrier and split) sleeps until the modelled end before its event
//! completes. So collectives of one rank serialize on its link in the order they reach it, and the
//! compute thread is not slowed. The sleep ends at once with errc::peer_failure if the world
//! aborts, and with errc::timeout if the modelled end passes the collective's timeout.
//!
//! Example (from tests/comm/test_threads.cpp):
//!   fsdp::threads::world{4}.run([](fsdp::threads::communicator& comm) {
//!     fsdp::host_queue q;
//!     std::vector<float> x(4, float(comm.rank())), all(16);
//!     comm.all_gather(x.data(), all.data(), 4, fsdp::dtype::f32, q).wait(comm.timeout());
//!   });
//! With a link model (from tests/comm/test_link.cpp), the same all_gather of 4 f32 per rank sends
//! 48 bytes from each rank and its event completes no sooner than 0.01 + 48 / 1e3 s after issue:
//!   fsdp::threads::world{4, {.link = {.alpha_s = 0.01, .beta_bytes_per_s = 1e3}}}.run(...);

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <system_error>
#include <thread>
#include <tuple>
#include <vector>

#include "fsdp/comm/concepts.hpp"
#include "fsdp/comm/rank_order_sum.hpp"
#include "fsdp/comm/topology.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/detail/backoff.hpp"
#include "fsdp/device/host.hpp"

namespace fsdp::threads {

namespace detail {
//! A double as printf's %g writes it ("0.01", "1.25e+10", "nan"): std::to_string's fixed six
//! decimals would print a 5 us latency as "0.000005".
inline std::string format_g(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}
}  // namespace detail

//! A modelled network link per rank: each collective holds it for alpha + bytes / beta
//! seconds, with bytes what the rank sends (see the file comment). beta = 0 disables the model
//! (the default; alpha is then ignored), and collectives take only the time their copies take.
//! For a latency-only link, give a beta far above the bytes moved. Example:
//!   fsdp::threads::world{4, {.link = {.alpha_s = 5e-6, .beta_bytes_per_s = 12.5e9}}}  // ~100 Gb/s
struct link_model {
  double alpha_s = 0;           //!< latency per collective, seconds (finite, >= 0)
  double beta_bytes_per_s = 0;  //!< bandwidth, bytes per second (finite, >= 0; 0 = no model)

  //! True when collectives are charged link time (beta > 0).
  bool enabled() const noexcept { return beta_bytes_per_s > 0; }
  //! Seconds the link is busy with a collective in which this rank sends `bytes`:
  //! alpha + bytes / beta; 0 when the model is disabled.
  double seconds(std::uint64_t bytes) const noexcept {
    return enabled() ? alpha_s + static_cast<double>(bytes) / beta_bytes_per_s : 0.0;
  }
  friend bool operator==(const link_model&, const link_model&) = default;
};

//! "link_model{.alpha_s = 0.01, .beta_bytes_per_s = 1000}"
inline std::string to_string(const link_model& l) {
  return "link_model{.alpha_s = " + detail::format_g(l.alpha_s) +
         ", .beta_bytes_per_s = " + detail::format_g(l.beta_bytes_per_s) + "}";
}

struct world_options {
  milliseconds timeout = default_timeout();  //!< bound on every wait
  link_model link{};                         //!< modelled link per rank (default: none)
  //! Ranks per simulated host (0: all on one): world ranks 0..k-1 are host 0, k..2k-1 host 1,
  //! ... It shapes hosts() (comm/topology.hpp), hence the inter-host traffic count and
  //! hybrid_shard_per_host(); the link model is the same for every pair of ranks.
  int ranks_per_host = 0;
};

namespace detail {

enum class op_kind : std::uint8_t { all_gather, reduce_scatter, all_reduce, broadcast, barrier, split };

inline const char* to_string(op_kind k) {
  switch (k) {
    case op_kind::all_gather: return "all_gather";
    case op_kind::reduce_scatter: return "reduce_scatter";
    case op_kind::all_reduce: return "all_reduce";
    case op_kind::broadcast: return "broadcast";
    case op_kind::barrier: return "barrier";
    case op_kind::split: return "split";
  }
  return "?";
}

//! What one rank asked for; all ranks of a collective must agree.
struct op_desc {
  op_kind kind = op_kind::barrier;
  std::size_t count = 0;
  dtype type = dtype::u8;
  reduce_op op = reduce_op::sum;
  int root = 0;
  friend bool operator==(const op_desc&, const op_desc&) = default;
  std::string str() const {
    std::string s = to_string(kind);
    if (kind == op_kind::barrier || kind == op_kind::split) return s;
    s += " of " + std::to_string(count) + " " + std::string(fsdp::to_string(type));
    if (kind == op_kind::reduce_scatter || kind == op_kind::all_reduce)
      s += std::string(" (") + fsdp::to_string(op) + ")";
    if (kind == op_kind::broadcast) s += " from root " + std::to_string(root);
    return s;
  }
};

//! Bytes this rank sends in `d` over a group of `n` ranks, by traffic_counters' formulas; the
//! link model charges them. barrier and split move no data.
inline std::uint64_t sent_bytes(const op_desc& d, int n) noexcept {
  switch (d.kind) {
    case op_kind::all_gather: return traffic_counters::all_gather_bytes(d.count, d.type, n);
    case op_kind::reduce_scatter: return traffic_counters::reduce_scatter_bytes(d.count, d.type, n);
    case op_kind::all_reduce: return traffic_counters::all_reduce_bytes(d.count, d.type, n);
    case op_kind::broadcast: return traffic_counters::broadcast_bytes(d.count, d.type, n);
    case op_kind::barrier:
    case op_kind::split: return 0;
  }
  return 0;
}

struct world_state;

//! One collective in flight: the members' arguments and phase counters. A member's arguments
//! are written when it arrives; reset() readies a finished slot for the next collective.
struct slot {
  explicit slot(int n) : desc(n), send(n), recv(n), extra(n), token(n), arrived(n, false) {}
  void reset() {
    std::fill(arrived.begin(), arrived.end(), false);
    n_arrived = 0, abandoned = false, departed = 0;
    for (auto& p : phase) p = 0;
  }
  std::vector<op_desc> desc;
  std::vector<const void*> send;
  std::vector<void*> recv;
  std::vector<std::pair<int, int>> extra;  // split: (color, key)
  std::vector<void*> token;                // a device transport's per-member state (comm/threads_cuda.hpp)
  std::vector<bool> arrived;
  // Changed under the group's mutex; atomic so that a waiting member can poll it without it
  // (detail::spin_then_wait's peek: polling under the mutex contends with the member that
  // must take it to arrive).
  std::atomic<int> n_arrived{0};
  bool abandoned = false;  // a member gave up before every member arrived: nobody reads
  // Members past each data phase, and members gone: counted without the mutex (see
  // communicator::meet), as members finish their copies at nearly the same time and would
  // otherwise queue on it.
  std::atomic<int> phase[3] = {0, 0, 0};
  std::atomic<int> departed{0};
};

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
  std::atomic<int> phase_sleepers{0};  // members asleep on cv in a data phase (meet)
  std::map<std::uint64_t, slot> slots;
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
    std::vector<std::shared_ptr<group_state>> gs;
    {
      std::lock_guard lock(m);
      std::exception_ptr& slot = echo ? first_echo : first_failure;
      if (e && !slot) slot = std::move(e);
      if (abort_reason.empty() || (!echo && e && slot == e)) abort_reason = why;
      aborted = true;
      gs = groups;
    }
    for (auto& g : gs) {
      std::lock_guard lock(g->m);
      g->cv.notify_all();
    }
  }
  void mark_exited(int rank) {
    exited[static_cast<std::size_t>(rank)] = true;
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

class world;
class cuda_communicator;  // comm/threads_cuda.hpp: the same rendezvous, data moved by the GPU

//! One rank's handle on a group of thread ranks. Move-only: the issue-order counter that
//! matches collectives across ranks lives here.
class communicator {
 public:
  using device_type = host_device;

  communicator(communicator&&) noexcept = default;
  communicator& operator=(communicator&&) noexcept = default;

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return static_cast<int>(g_->members.size()); }
  //! This rank's index in the world (the process of threads).
  int world_rank() const noexcept { return g_->members[static_cast<std::size_t>(rank_)]; }
  detail::group_state* native_handle() const noexcept { return g_.get(); }
  milliseconds timeout() const noexcept { return g_->world->opts.timeout; }
  //! The world's link model (world_options::link).
  link_model link() const noexcept { return g_->world->opts.link; }
  traffic_counters traffic() const noexcept { return traffic_; }
  //! The host of each rank of the group (world_options::ranks_per_host).
  std::span<const int> hosts() const noexcept { return hosts_; }

  host_event all_gather(const void* send, void* recv, std::size_t count, dtype t, host_queue& q) {
    const detail::op_desc d{detail::op_kind::all_gather, count, t};
    ensure_alive(d);
    traffic_.add_all_gather(count, t, size(), remote_peers_);
    return enqueue(d, send, recv, q);
  }

  host_event reduce_scatter(const void* send, void* recv, std::size_t count, dtype t, reduce_op op,
                            host_queue& q) {
    fsdp::detail::require_reducible(t, "reduce_scatter", world_rank());
    const detail::op_desc d{detail::op_kind::reduce_scatter, count, t, op};
    ensure_alive(d);
    traffic_.add_reduce_scatter(count, t, size(), remote_peers_);
    return enqueue(d, send, recv, q);
  }

  host_event all_reduce(const void* send, void* recv, std::size_t count, dtype t, reduce_op op,
                        host_queue& q) {
    fsdp::detail::require_reducible(t, "all_reduce", world_rank());
    const detail::op_desc d{detail::op_kind::all_reduce, count, t, op};
    ensure_alive(d);
    traffic_.add_all_reduce(count, t, size(), remote_peers_);
    return enqueue(d, send, recv, q);
  }

  host_event broadcast(void* buf, std::size_t count, dtype t, int root, host_queue& q) {
    if (root < 0 || root >= size())
      throw error(errc::invalid_argument, "broadcast root " + std::to_string(root) +
                                              " is not a rank of a group of " + std::to_string(size()),
                  {world_rank()});
    const detail::op_desc d{detail::op_kind::broadcast, count, t, reduce_op::sum, root};
    ensure_alive(d);
    traffic_.add_broadcast(count, t, size(), remote_peers_);
    return enqueue(d, buf, buf, q);
  }

  //! Ends every rank's pending and future waits with errc::peer_failure, citing `why`. For a
  //! rank that must leave (it is unwinding an exception) while peers may wait on it.
  void abort(const std::string& why) { g_->world->fail(nullptr, why); }

  //! Blocks until every rank of the group has arrived (bounded by timeout()).
  void barrier() { rendezvous(next_seq_++, {detail::op_kind::barrier}, nullptr, nullptr, {}); }

  //! Blocking: ranks with equal color form a new communicator, ordered by (key, rank).
  communicator split(int color, int key) {
    if (color < 0)
      throw error(errc::invalid_argument, "split color must be >= 0, got " + std::to_string(color),
                  {world_rank()});
    const std::uint64_t seq = next_seq_++;
    std::vector<int> members;
    rendezvous(seq, {detail::op_kind::split}, nullptr, nullptr, {color, key},
               [&](detail::slot& s) {
                 std::vector<std::tuple<int, int, int>> mine;  // key, group rank, world rank
                 for (std::size_t j = 0; j < s.extra.size(); ++j)
                   if (s.extra[j].first == color)
                     mine.emplace_back(s.extra[j].second, static_cast<int>(j), g_->members[j]);
                 std::sort(mine.begin(), mine.end());
                 for (auto& [k, gr, wr] : mine) members.push_back(wr);
               });
    auto g = g_->world->split_group(*g_, seq, color, members);
    const int me = static_cast<int>(std::find(members.begin(), members.end(), world_rank()) -
                                     members.begin());
    return communicator(std::move(g), me);
  }

 private:
  friend class world;
  friend class cuda_communicator;
  communicator(std::shared_ptr<detail::group_state> g, int rank) : g_(std::move(g)), rank_(rank) {
    const int per_host = g_->world->opts.ranks_per_host;
    for (int w : g_->members) hosts_.push_back(per_host > 0 ? w / per_host : 0);
    hosts_ = fsdp::detail::renumber_hosts(hosts_);
    remote_peers_ = topology{hosts_}.remote_peers(rank_);
  }


  // Nothing is issued (or counted) once the world has failed.
  void ensure_alive(const detail::op_desc& d) const {
    if (g_->world->aborted) throw peer_failure_error(d, next_seq_);
  }

  host_event enqueue(detail::op_desc d, const void* send, void* recv, host_queue& q) {
    const std::uint64_t seq = next_seq_++;
    // A collective depends only on its peers and is bounded by the world's timeout, so a thread
    // that waits for it may run it (run_on::queue_or_waiter): on a queue_wake::on_wait queue,
    // issue-and-wait then costs no hand-off to the queue's thread and back.
    q.enqueue([this, g = g_, d, send, recv, seq] { rendezvous(seq, d, send, recv, {}); }, run_on::queue_or_waiter);
    return q.record();
  }

  error peer_failure_error(const detail::op_desc& d, std::uint64_t seq) const {
    return error(errc::peer_failure,
                 "stopped " + d.str() + " #" + std::to_string(seq) + " on " + g_->label +
                     " because another rank failed: " + g_->world->reason(),
                 {world_rank()});
  }

  // Waits (holding `lock`) until every member has arrived at slot `s`, or the world aborts, a
  // missing member has exited, or the deadline passes. In the last three cases this rank
  // withdraws (the slot is marked abandoned, so a member that arrives later fails too instead
  // of reading this rank's buffers, which its caller may free now) and throws.
  void wait_for_arrival(std::unique_lock<std::mutex>& lock, detail::slot& s, const detail::op_desc& d,
                        std::uint64_t seq, std::chrono::steady_clock::time_point deadline) {
    detail::world_state& w = *g_->world;
    const int n = size();
    auto all_here = [&] { return s.n_arrived == n && !s.abandoned; };
    // Members that have not arrived (only those that have exited, if `exited_only`).
    auto missing = [&](bool exited_only = false) {
      std::string who;
      for (std::size_t j = 0; j < s.arrived.size(); ++j)
        if (!s.arrived[j] && (!exited_only || w.exited[static_cast<std::size_t>(g_->members[j])]))
          who.append(who.empty() ? "" : ", ").append(std::to_string(g_->members[j]));
      return who;
    };
    auto exited_missing = [&] {
      for (std::size_t j = 0; j < s.arrived.size(); ++j)
        if (!s.arrived[j] && w.exited[static_cast<std::size_t>(g_->members[j])]) return true;
      return false;
    };
    fsdp::detail::spin_then_wait(g_->cv, lock, deadline, [&] { return all_here() || w.aborted || exited_missing(); },
                                 [&] { return s.n_arrived.load() == n || w.aborted; });
    // Once every member is here, every member goes on to the data phases, even if the world
    // failed since: each will read the others' buffers.
    if (all_here()) return;
    s.abandoned = true;
    g_->cv.notify_all();
    const std::string what = d.str() + " #" + std::to_string(seq) + " on " + g_->label;
    if (w.aborted) {
      lock.unlock();
      throw peer_failure_error(d, seq);
    }
    if (exited_missing()) {
      error e(errc::peer_failure, what + ": rank(s) " + missing(true) + " returned without joining it",
              {world_rank()});
      lock.unlock();
      w.fail(std::make_exception_ptr(e), e.what());
      throw e;
    }
    error e(errc::timeout,
            what + ": no progress after " + std::to_string(timeout().count()) + " ms waiting for rank(s) " + missing(),
            {world_rank()});
    lock.unlock();
    w.fail(std::make_exception_ptr(e), e.what());
    throw e;
  }

  // Waits until pred() (an atomic's load), a data phase's end: every member has arrived and
  // reads or writes its peers' buffers until it reaches the phase, so this wait does not end when
  // the world aborts (leaving would let this rank's caller free a buffer a peer still reads). It
  // waits on nothing but the peers' copies; at the deadline it throws errc::timeout.
  template <class Pred>
  void wait_for_phase(const detail::op_desc& d, std::uint64_t seq, std::chrono::steady_clock::time_point deadline,
                      Pred pred) {
    for (unsigned i = fsdp::detail::handoff_yields(); i > 0; --i) {
      if (pred()) return;
      std::this_thread::yield();
    }
    std::unique_lock lock(g_->m);
    ++g_->phase_sleepers;
    const bool passed = g_->cv.wait_until(lock, deadline, pred);
    --g_->phase_sleepers;
    if (passed) return;
    error e(errc::timeout,
            d.str() + " #" + std::to_string(seq) + " on " + g_->label + ": no progress after " +
                std::to_string(timeout().count()) + " ms (peers stalled inside the collective)",
            {world_rank()});
    lock.unlock();
    g_->world->fail(std::make_exception_ptr(e), e.what());
    throw e;
  }

  // Runs one collective on the calling thread: arrive, check, the host's data phases, leave,
  // then the link model's time.
  template <class Body = void (*)(detail::slot&)>
  void rendezvous(std::uint64_t seq, detail::op_desc d, const void* send, void* recv,
                  std::pair<int, int> extra, Body&& body = [](detail::slot&) {}) {
    const auto deadline = std::chrono::steady_clock::now() + timeout();
    meet(seq, d, send, recv, extra, nullptr, [&](detail::slot& s, auto&& phase) {
      body(s);
      copy_on_host(s, d, recv, phase);
    });
    occupy_link(d, seq, deadline);
  }

  // The rendezvous of every transport: arrive (with this member's arguments and `token`), wait
  // for every member (bounded; see wait_for_arrival), check that all issued the same
  // collective, then data(slot, phase) without the lock, then leave. data moves the bytes and
  // calls phase(k) for k = 0, 1, 2 in turn: phase(k) returns once every member has called it
  // (bounded by a timeout of its own, not ended by an abort: see wait_for_phase).
  template <class Data>
  void meet(std::uint64_t seq, detail::op_desc d, const void* send, void* recv, std::pair<int, int> extra,
            void* token, Data&& data) {
    const auto deadline = std::chrono::steady_clock::now() + timeout();
    const int n = size();
    const auto me = static_cast<std::size_t>(rank_);
    std::unique_lock lock(g_->m);
    auto it = g_->slots.find(seq);
    if (it == g_->slots.end()) {
      if (g_->spare.empty()) {
        it = g_->slots.try_emplace(seq, n).first;
      } else {
        auto node = std::move(g_->spare.back());
        g_->spare.pop_back();
        node.key() = seq;
        node.mapped().reset();
        it = g_->slots.insert(std::move(node)).position;
      }
    }
    detail::slot& s = it->second;
    s.desc[me] = d;
    s.send[me] = send;
    s.recv[me] = recv;
    s.extra[me] = extra;
    s.token[me] = token;
    s.arrived[me] = true;
    ++s.n_arrived;
    g_->cv.notify_all();
    wait_for_arrival(lock, s, d, seq, deadline);

    for (int j = 0; j < n; ++j) {
      if (!(s.desc[static_cast<std::size_t>(j)] == s.desc[0])) {
        const std::string msg = "collective #" + std::to_string(seq) + " on " + g_->label +
                                ": rank " + std::to_string(g_->members[0]) + " issued " +
                                s.desc[0].str() + " but rank " +
                                std::to_string(g_->members[static_cast<std::size_t>(j)]) +
                                " issued " + s.desc[static_cast<std::size_t>(j)].str();
        leave(s, seq, true);
        throw error(errc::mismatch, msg, {world_rank()});
      }
    }
    // From here on every member reads or writes its peers' buffers: the phases end only when
    // all have passed them (bounded by a timeout of their own from now), even if the world aborts.
    // A phase is counted without the mutex; the mutex is taken to wake members that sleep in a
    // phase, of which there are none while the spin lasts. (Both counters are sequentially
    // consistent: a member that goes to sleep counts itself before it checks the phase, and one
    // that passes the phase checks for sleepers after, so one of the two sees the other.)
    const auto data_deadline = std::chrono::steady_clock::now() + timeout();
    auto phase = [&](int k) {
      ++s.phase[k];
      if (g_->phase_sleepers.load() > 0) {
        std::lock_guard relock(g_->m);
        g_->cv.notify_all();
      }
      wait_for_phase(d, seq, data_deadline, [&] { return s.phase[k].load() == n; });
    };
    lock.unlock();  // data phases touch only what this rank owns or reads
    data(s, phase);
    leave(s, seq, false);
  }

  // The host's data phases: each member copies or reduces straight between the buffers.
  template <class Phase>
  void copy_on_host(detail::slot& s, const detail::op_desc& d, void* recv, Phase& phase) {
    const int n = size();
    const auto me = static_cast<std::size_t>(rank_);
    std::vector<std::byte> sum;
    switch (d.kind) {
      case detail::op_kind::all_gather: {
        const std::size_t bytes = d.count * size_of(d.type);
        for (int j = 0; j < n; ++j) {
          auto* dst = static_cast<char*>(recv) + static_cast<std::size_t>(j) * bytes;
          const void* src = s.send[static_cast<std::size_t>(j)];
          if (src != dst && bytes) std::memcpy(dst, src, bytes);
        }
        phase(0);  // peers have read my send buffer
        break;
      }
      case detail::op_kind::reduce_scatter: {
        // Summed straight into recv when no peer reads it (the usual case, in place included);
        // otherwise into a scratch buffer, written once everyone has read every send buffer.
        const std::size_t elem = size_of(d.type);
        const bool direct = read_by_me_only(s, recv, d.count * elem, me * d.count * elem, d.count * elem * static_cast<std::size_t>(n));
        reduce(s, d, me * d.count, d.count, direct ? recv : scratch(sum, d.count * elem));
        phase(0);  // everyone has read every send buffer: safe to write (even in place)
        if (!direct && !sum.empty()) std::memcpy(recv, sum.data(), sum.size());
        break;
      }
      case detail::op_kind::all_reduce: {
        // Rank r reduces chunk r into its own recv buffer (or scratch, as above), then copies it
        // into every peer's recv buffer.
        const std::size_t elem = size_of(d.type);
        const auto [b, e] = all_reduce_chunk(d.count, n, rank_);
        char* mine = static_cast<char*>(recv) + b * elem;
        const bool direct = read_by_me_only(s, mine, (e - b) * elem, b * elem, d.count * elem);
        void* reduced = direct ? mine : scratch(sum, (e - b) * elem);
        reduce(s, d, b, e - b, reduced);
        phase(0);
        for (int j = 0; j < n && e > b; ++j) {
          char* dst = static_cast<char*>(s.recv[static_cast<std::size_t>(j)]) + b * elem;
          if (dst != reduced) std::memcpy(dst, reduced, (e - b) * elem);
        }
        phase(1);  // every chunk of my recv buffer has been written
        break;
      }
      case detail::op_kind::broadcast: {
        const void* src = s.send[static_cast<std::size_t>(d.root)];
        if (rank_ != d.root && d.count) std::memcpy(recv, src, d.count * size_of(d.type));
        phase(0);
        break;
      }
      case detail::op_kind::barrier:
      case detail::op_kind::split:
        break;
    }
  }

  // The elements [begin, end) of an all_reduce of `count` that rank r reduces: chunks of
  // ceil(count / n), the last ones shorter or empty.
  static std::pair<std::size_t, std::size_t> all_reduce_chunk(std::size_t count, int n, int r) {
    const std::size_t chunk = (count + static_cast<std::size_t>(n) - 1) / static_cast<std::size_t>(n);
    const std::size_t b = std::min(count, static_cast<std::size_t>(r) * chunk);
    return {b, std::min(count, b + chunk)};
  }

  // The link model: the data has moved, now this rank's link carries it. The link is shared by
  // all of this rank's queues and communicators, so a collective starts on it only when the
  // previous one is done, in the order they get here. The running thread then sleeps until the
  // modelled end, on the group's condition variable because an abort notifies it.
  void occupy_link(const detail::op_desc& d, std::uint64_t seq, std::chrono::steady_clock::time_point deadline) {
    using clock = std::chrono::steady_clock;
    using seconds_d = std::chrono::duration<double>;
    detail::world_state& w = *g_->world;
    const link_model& link = w.opts.link;
    if (!link.enabled()) return;
    const std::uint64_t bytes = detail::sent_bytes(d, size());
    const double busy_s = link.seconds(bytes);
    const auto now = clock::now();
    double queued_s = 0;  // how long the link is still busy with earlier collectives
    bool past_deadline = false;
    clock::time_point end;
    {
      std::lock_guard lock(w.link_m);
      clock::time_point& free_at = w.link_free_at[static_cast<std::size_t>(world_rank())];
      const clock::time_point start = std::max(now, free_at);
      queued_s = seconds_d(start - now).count();
      // Compared in double first: a tiny beta gives a time no time_point can hold.
      past_deadline = queued_s + busy_s > seconds_d(deadline - now).count();
      end = past_deadline ? deadline : start + std::chrono::duration_cast<clock::duration>(seconds_d(busy_s));
      free_at = end;
    }
    std::unique_lock lock(g_->m);
    const bool aborted = g_->cv.wait_until(lock, end, [&] { return w.aborted.load(); });
    lock.unlock();
    if (aborted) throw peer_failure_error(d, seq);
    if (past_deadline) {
      error e(errc::timeout,
              d.str() + " #" + std::to_string(seq) + " on " + g_->label + ": the link model needs " +
                  detail::format_g(busy_s) + " s for " + std::to_string(bytes) + " bytes after " +
                  detail::format_g(queued_s) + " s of earlier collectives on the link, past the timeout of " +
                  std::to_string(timeout().count()) + " ms",
              {world_rank()});
      w.fail(std::make_exception_ptr(e), e.what());
      throw e;
    }
  }

  // This member is done with slot `s`; the last to leave recycles it, taking the group's mutex
  // unless the caller holds it already (`locked`).
  void leave(detail::slot& s, std::uint64_t seq, bool locked) {
    // A few spares cover the collectives a rank can have in flight at once (one per queue).
    constexpr std::size_t max_spare = 4;
    if (++s.departed != size()) return;
    std::unique_lock lock(g_->m, std::defer_lock);
    if (!locked) lock.lock();
    auto node = g_->slots.extract(seq);
    if (g_->spare.size() < max_spare) g_->spare.push_back(std::move(node));
  }

  // out = the sum over ranks of send[j][offset, offset + count), in rank order
  // (comm/rank_order_sum.hpp: the order the mpi backend uses too), scaled for avg.
  void reduce(const detail::slot& s, const detail::op_desc& d, std::size_t offset, std::size_t count, void* out) const {
    const std::size_t elem = size_of(d.type);
    std::vector<const void*> src(s.send.size());
    for (std::size_t j = 0; j < src.size(); ++j) src[j] = static_cast<const char*>(s.send[j]) + offset * elem;
    fsdp::detail::sum_in_rank_order(out, src.data(), size(), count, d.type, d.op);
  }
  static void* scratch(std::vector<std::byte>& buffer, std::size_t bytes) {
    buffer.resize(bytes);
    return buffer.data();
  }

  // Whether this rank may write [dst, dst + bytes) while its peers still read the send buffers:
  // every send buffer (`send_bytes` long) may overlap it only inside this rank's own part of
  // that buffer, [mine, mine + bytes), which no peer reads (each reads only its own part). An
  // exact alias of that part is fine: the rank-order sum reads each block before writing it.
  bool read_by_me_only(const detail::slot& s, const void* dst, std::size_t bytes, std::size_t mine,
                       std::size_t send_bytes) const {
    const auto at = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p); };
    const std::uintptr_t d0 = at(dst), d1 = d0 + bytes;
    for (const void* p : s.send) {
      const std::uintptr_t s0 = at(p), s1 = s0 + send_bytes;
      if (d1 <= s0 || s1 <= d0) continue;  // apart
      if (d0 != s0 + mine) return false;   // overlaps a part some peer reads
    }
    return true;
  }

  std::shared_ptr<detail::group_state> g_;
  int rank_ = 0;
  std::uint64_t next_seq_ = 0;
  traffic_counters traffic_{};
  std::vector<int> hosts_;
  int remote_peers_ = 0;
};

static_assert(full_communicator<communicator>);
static_assert(knows_hosts<communicator>);

//! Runs a function on N thread ranks and joins them.
//!   fsdp::threads::world{4}.run([&](fsdp::threads::communicator& comm) { ... });
//! run() returns when every rank has returned, and rethrows the first failure (the root
//! cause, not the peer failures it caused on other ranks).
class world {
 public:
  explicit world(int size, world_options opts = {}) : size_(size), opts_(opts) {
    if (size < 1) throw error(errc::invalid_argument, "a world needs at least 1 rank, got " + std::to_string(size));
    if (opts.timeout <= milliseconds(0)) throw error(errc::invalid_argument, "world timeout must be positive");
    if (opts.ranks_per_host < 0)
      throw error(errc::invalid_argument,
                  "world_options::ranks_per_host must be >= 0 (0: one host), got " + std::to_string(opts.ranks_per_host));
    const link_model& l = opts.link;
    if (!std::isfinite(l.alpha_s) || l.alpha_s < 0)
      throw error(errc::invalid_argument,
                  "world_options::link.alpha_s must be finite and >= 0 seconds, got " + detail::format_g(l.alpha_s));
    if (!std::isfinite(l.beta_bytes_per_s) || l.beta_bytes_per_s < 0)
      throw error(errc::invalid_argument,
                  "world_options::link.beta_bytes_per_s must be finite and >= 0 (0 disables the link model), got " +
                      detail::format_g(l.beta_bytes_per_s));
  }
  int size() const noexcept { return size_; }

  template <class F>
  void run(F&& fn) const {
    auto state = std::make_shared<detail::world_state>(size_, opts_);
    std::vector<int> all(static_cast<std::size_t>(size_));
    for (int r = 0; r < size_; ++r) all[static_cast<std::size_t>(r)] = r;
    auto root = state->make_group(all, "world");
    std::vector<std::thread> threads;
    threads.reserve(static_cast<std::size_t>(size_));
    for (int r = 0; r < size_; ++r) {
      try {
        threads.emplace_back([&, r] {
        try {
          communicator comm(root, r);
          fn(comm);
        } catch (const error& e) {
          state->fail(std::current_exception(), "rank " + std::to_string(r) + " failed: " + e.what(),
                      e.code() == errc::peer_failure);
        } catch (const std::exception& e) {
          state->fail(std::current_exception(), "rank " + std::to_string(r) + " failed: " + e.what());
        } catch (...) {
          state->fail(std::current_exception(), "rank " + std::to_string(r) + " failed");
        }
        state->mark_exited(r);
        });
      } catch (const std::system_error& e) {
        // No thread for rank r (a thread or memory limit): the ranks already running must not be
        // left joinable (std::terminate) nor wait for ranks that never start. Fail the world,
        // count the missing ranks as gone (their peers stop at once), join, throw the cause.
        const error failure(errc::invalid_argument, "a world of " + std::to_string(size_) +
                                                        " ranks: could not start the thread of rank " + std::to_string(r) +
                                                        " (" + e.what() + "); ask for fewer ranks or raise the thread limit");
        state->fail(std::make_exception_ptr(failure), failure.what());
        for (int q = r; q < size_; ++q) state->mark_exited(q);
        break;
      }
    }
    for (auto& t : threads) t.join();
    if (state->first_failure) std::rethrow_exception(state->first_failure);
    if (state->first_echo) std::rethrow_exception(state->first_echo);
  }

 private:
  int size_;
  world_options opts_;
};

}  // namespace fsdp::threads
