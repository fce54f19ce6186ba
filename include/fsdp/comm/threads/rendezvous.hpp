#pragma once
//! \file The rendezvous of the threads backend, one member's side of it: a collective's members
//! (thread ranks of one group) meet in a slot matched by issue order, check that they issued the
//! same collective, move the data between each other's buffers in phases, and leave together.
//! Both devices' transports use it: the host's copies (comm/threads/data_phases.hpp) and the
//! CUDA streams' (comm/threads/cuda_communicator.hpp).
//!
//! Failure model: every wait is bounded by the world's timeout. A rank that throws, times out
//! or returns from its function early aborts the world: every other rank's pending and future
//! waits end at once with fsdp::error(errc::peer_failure), and world::run rethrows the first
//! failure. One exception keeps memory safe: once every member has arrived at a collective,
//! each reads (and for all_reduce writes) the others' buffers, so no member may leave and let
//! its caller free a buffer a peer still uses. The data phases therefore run to the end even
//! when the world aborts meanwhile (they wait on nothing but the peers' copies, bounded by a
//! timeout of their own), and a member that gives up before every member arrived withdraws
//! from the collective, so that a late peer fails instead of reading its buffers.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

#include "fsdp/comm/threads/world_state.hpp"
#include "fsdp/core/backoff.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp::threads::detail {

//! A deadline `timeout` after the first time it is asked for: a wait that ends while it still
//! spins never reads the clock (perf put clock reads at a fifth of a one-rank collective's own
//! cost on this VM), and one that sleeps is bounded from then on.
class lazy_deadline {
 public:
  explicit lazy_deadline(milliseconds timeout) : timeout_(timeout) {}
  std::chrono::steady_clock::time_point at() {
    if (!at_) at_ = std::chrono::steady_clock::now() + timeout_;
    return *at_;
  }

 private:
  milliseconds timeout_;
  std::optional<std::chrono::steady_clock::time_point> at_;
};

//! One member's handle on its group's rendezvous: the group's shared state, its rank in the
//! group, and the issue-order counter that matches collectives across the members.
class rendezvous {
 public:
  rendezvous(std::shared_ptr<group_state> g, int rank) : g_(std::move(g)), rank_(rank) {}

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return static_cast<int>(g_->members.size()); }
  //! This member's index in the world (the process of threads).
  int world_rank() const noexcept { return g_->members[static_cast<std::size_t>(rank_)]; }
  group_state& group() const noexcept { return *g_; }
  world_state& world() const noexcept { return *g_->world; }
  milliseconds timeout() const noexcept { return g_->world->opts.timeout; }
  //! The issue-order number of the next collective (taken when it is issued).
  std::uint64_t take_seq() noexcept { return next_seq_++; }
  //! The number of the next message of send or recv `c` to or from its peer (taken when issued).
  std::uint64_t take_message(const collective& c) {
    std::vector<std::uint64_t>& k = c.kind == collective_kind::send ? sent_ : received_;
    k.resize(static_cast<std::size_t>(size()));
    return k[static_cast<std::size_t>(c.root)]++;
  }

  //! Nothing is issued (or counted) once the world has failed.
  void ensure_alive(const collective& d) const {
    if (g_->world->aborted) throw peer_failure_error(d, next_seq_);
  }

  error peer_failure_error(const collective& d, std::uint64_t seq) const {
    return error(errc::peer_failure,
                 "stopped " + d.str() + " #" + std::to_string(seq) + " on " + g_->label +
                     " because another rank failed: " + g_->world->reason(),
                 {world_rank()});
  }

  //! Makes `e` the world's failure (its peers stop) and throws it.
  [[noreturn]] void fail(const error& e) const {
    g_->world->fail(std::make_exception_ptr(e), e.what());
    throw e;
  }

  //! Arrive (with this member's arguments and `token`), wait for every member (bounded; see
  //! wait_for_arrival), check that all issued the same collective, then data(slot, phase), then
  //! leave. data moves the bytes and calls phase(k) for k = 0, 1, 2 in turn: phase(k) returns
  //! once every member has called it (bounded by a timeout of its own, not ended by an abort:
  //! see wait_for_phase).
  //!
  //! No mutex on the way: members meet in the group's slot for `seq` (world_state.hpp's ring),
  //! each writes its arguments there and then counts itself in the slot's atomic `arrival`, and
  //! a member that waits spins, then sleeps on the group's condition variable (await). With the
  //! slot in a mutex-guarded map, two members arriving at once made one sleep on the mutex's
  //! futex, microseconds on this VM for a 64 KiB collective that moves in one
  //! (docs/benchmarks.md, "The rendezvous without a mutex").
  template <class Data>
  void meet(std::uint64_t seq, const collective& d, const void* send, void* recv, std::pair<int, int> extra, void* token,
            Data&& data) {
    lazy_deadline deadline{timeout()};
    const int n = size();
    const auto me = static_cast<std::size_t>(rank_);
    slot& s = g_->ring[seq % ring_size];
    wait_for_slot(s, d, seq, deadline);
    slot::arguments& mine = s.args[me];
    mine.desc = d, mine.send = send, mine.recv = recv, mine.extra = extra, mine.token = token;
    mine.arrived_at.store(seq, std::memory_order_relaxed);
    // Publishes the arguments above (every member's increment is in the release sequence the
    // last one's reader acquires).
    const int before = s.arrival.fetch_add(1);
    if (before + 1 == n) wake_sleepers();
    wait_for_arrival(s, d, seq, before, deadline);

    for (std::size_t j = 0; j < s.n; ++j) {
      if (!(s.args[j].desc == s.args[0].desc)) {
        const std::string msg = "collective #" + std::to_string(seq) + " on " + g_->label + ": rank " +
                                std::to_string(g_->members[0]) + " issued " + s.args[0].desc.str() + " but rank " +
                                std::to_string(g_->members[j]) + " issued " + s.args[j].desc.str();
        leave(s, seq);
        throw error(errc::mismatch, msg, {world_rank()});
      }
    }
    // From here on every member reads or writes its peers' buffers: the phases end only when
    // all have passed them (bounded by a timeout of their own, from the first sleep in them),
    // even if the world aborts.
    lazy_deadline data_deadline{timeout()};
    auto phase = [&](int k) {
      if (s.phase[k].fetch_add(1) + 1 == n) wake_sleepers();
      wait_for_phase(d, seq, data_deadline, [&] { return s.phase[k].load() == n; });
    };
    data(s, phase);
    leave(s, seq);
  }

  //! One side of point-to-point message k (a send of `data`, or a recv into `into`): waits for
  //! the other side (bounded, failing as wait_for_arrival does), checks that both name the same
  //! count and dtype (errc::mismatch), then the receiver copies and the sender waits for that
  //! copy (bounded by a timeout of its own, not ended by an abort: the sender's caller may free
  //! its buffer once this returns). The link model does not charge messages.
  void exchange(const collective& c, std::uint64_t k, const void* data, void* into) {
    const bool sending = c.kind == collective_kind::send;
    const int peer = c.root;
    const auto key = sending ? std::tuple{rank_, peer, k} : std::tuple{peer, rank_, k};
    const std::string what = c.str() + " (message #" + std::to_string(k) + ") on " + g_->label;
    world_state& w = *g_->world;
    const auto deadline = std::chrono::steady_clock::now() + timeout();
    std::unique_lock lock(g_->m);
    message& m = g_->messages[key];
    if (sending) {
      m.sent = c, m.data = data, m.has_sender = true;
    } else {
      m.asked = c, m.into = into, m.has_receiver = true;
    }
    g_->cv.notify_all();
    const int peer_world = g_->members[static_cast<std::size_t>(peer)];
    auto both = [&] { return m.has_sender && m.has_receiver && !m.abandoned; };
    auto gone = [&] { return w.exited[static_cast<std::size_t>(peer_world)].load(); };
    fsdp::detail::spin_then_wait(g_->cv, lock, deadline, [&] { return both() || w.aborted || m.abandoned || gone(); });
    if (!both()) {
      m.abandoned = true;
      g_->cv.notify_all();
      const bool aborted = w.aborted, exited = gone();
      depart(m, key);
      lock.unlock();
      if (aborted) throw error(errc::peer_failure, "stopped " + what + " because another rank failed: " + w.reason(), {world_rank()});
      if (exited) fail(error(errc::peer_failure, what + ": rank " + std::to_string(peer_world) + " returned without joining it", {world_rank()}));
      fail(error(errc::timeout, what + ": no progress after " + std::to_string(timeout().count()) + " ms waiting for rank " +
                                    std::to_string(peer_world), {world_rank()}));
    }
    if (m.sent.count != m.asked.count || m.sent.type != m.asked.type) {
      const std::string msg = what + ": rank " + std::to_string(g_->members[static_cast<std::size_t>(std::get<0>(key))]) + " sent " +
                              std::to_string(m.sent.count) + " " + std::string(fsdp::to_string(m.sent.type)) + " but rank " +
                              std::to_string(g_->members[static_cast<std::size_t>(std::get<1>(key))]) + " receives " +
                              std::to_string(m.asked.count) + " " + std::string(fsdp::to_string(m.asked.type));
      depart(m, key);
      throw error(errc::mismatch, msg, {world_rank()});
    }
    if (!sending) {
      const void* src = m.data;
      lock.unlock();  // the copy touches only the two buffers
      if (c.count) std::memcpy(into, src, c.count * size_of(c.type));
      lock.lock();
      m.copied = true;
      g_->cv.notify_all();
    } else if (!g_->cv.wait_until(lock, std::chrono::steady_clock::now() + timeout(), [&] { return m.copied; })) {
      depart(m, key);
      lock.unlock();
      fail(error(errc::timeout, what + ": the receiver stalled while copying", {world_rank()}));
    }
    depart(m, key);
  }

  //! The link model (comm/threads/link_model.hpp): the data has moved, now this rank's link
  //! carries it. The link is shared by all of this rank's queues and communicators, so a
  //! collective starts on it only when the previous one is done, in the order they get here.
  //! The running thread then sleeps until the modelled end, on the group's condition variable
  //! because an abort notifies it.
  void occupy_link(const collective& d, std::uint64_t seq, std::chrono::steady_clock::time_point deadline) {
    using clock = std::chrono::steady_clock;
    using seconds_d = std::chrono::duration<double>;
    world_state& w = *g_->world;
    const link_model& link = w.opts.link;
    if (!link.enabled()) return;
    const std::uint64_t bytes = d.sent_bytes(size());
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
    if (past_deadline)
      fail(error(errc::timeout,
                 d.str() + " #" + std::to_string(seq) + " on " + g_->label + ": the link model needs " + format_g(busy_s) +
                     " s for " + std::to_string(bytes) + " bytes after " + format_g(queued_s) +
                     " s of earlier collectives on the link, past the timeout of " + std::to_string(timeout().count()) + " ms",
                 {world_rank()}));
  }

 private:
  // This side is done with message `key` (the group's mutex held): the second to go erases it.
  // A message abandoned by one side stays until the other comes (which then fails at once).
  void depart(message& m, const std::tuple<int, int, std::uint64_t>& key) {
    if (++m.departed == 2) g_->messages.erase(key);
  }

  // Waits until done() (an atomic's load) or stop(): polls up to handoff_yields() times with
  // the core yielded in between, then sleeps on the group's condition variable, which
  // wake_sleepers() and the world's failures and exits notify, until the deadline. Returns done().
  template <class Done, class Stop>
  bool await(lazy_deadline& deadline, Done done, Stop stop) {
    for (unsigned i = fsdp::detail::handoff_yields(); i > 0; --i) {
      if (done()) return true;
      if (stop()) return false;
      std::this_thread::yield();
    }
    // Counted before the predicate is checked under the mutex, and the wakers change what it
    // reads before they look at the count (both sequentially consistent): either this member
    // sees the change, or the waker sees it counted and notifies under the mutex, which this
    // member holds until it sleeps.
    std::unique_lock lock(g_->m);
    ++g_->sleepers;
    g_->cv.wait_until(lock, deadline.at(), [&] { return done() || stop(); });
    --g_->sleepers;
    return done();
  }
  // Wakes the members asleep in await(), if any (see there why this is enough).
  void wake_sleepers() {
    if (g_->sleepers.load() == 0) return;
    std::lock_guard lock(g_->m);
    g_->cv.notify_all();
  }

  // Waits until slot `s` serves collective `seq`, that is until every member has left
  // collective seq - ring_size (world_state.hpp, ring_size). Nothing is published yet, so
  // failing here needs no withdrawal.
  void wait_for_slot(slot& s, const collective& d, std::uint64_t seq, lazy_deadline& deadline) {
    auto ready = [&] { return s.serves.load(std::memory_order_acquire) == seq; };
    if (ready()) return;
    world_state& w = *g_->world;
    if (await(deadline, ready, [&] { return w.aborted.load(); })) return;
    if (w.aborted) throw peer_failure_error(d, seq);
    fail(error(errc::timeout, d.str() + " #" + std::to_string(seq) + " on " + g_->label + ": no progress after " +
                                  std::to_string(timeout().count()) + " ms waiting for every rank to leave collective #" +
                                  std::to_string(seq - ring_size) + " (at most " + std::to_string(ring_size) +
                                  " collectives of a group are met at once)",
                              {world_rank()}));
  }

  // Waits until every member has arrived at slot `s` (this one counted itself when `arrival`
  // was `before`), or the world aborts, a missing member has exited, a peer withdrew, or the
  // deadline passes. Then, unless every member has arrived by then, this member withdraws (the
  // slot's withdrawn bit: a member that arrives later fails too instead of reading this
  // member's buffers, which its caller may free now) and throws.
  void wait_for_arrival(slot& s, const collective& d, std::uint64_t seq, int before, lazy_deadline& deadline) {
    world_state& w = *g_->world;
    const int n = size();
    auto missing = [&](bool exited_only) {  // the members that have not arrived (only those that exited)
      std::string who;
      for (std::size_t j = 0; j < s.n; ++j)
        if (s.args[j].arrived_at.load() != seq && (!exited_only || w.exited[static_cast<std::size_t>(g_->members[j])]))
          who.append(who.empty() ? "" : ", ").append(std::to_string(g_->members[j]));
      return who;
    };
    auto exited_missing = [&] {
      for (std::size_t j = 0; j < s.n; ++j)
        if (s.args[j].arrived_at.load() != seq && w.exited[static_cast<std::size_t>(g_->members[j])]) return true;
      return false;
    };
    bool i_withdrew = false;
    if (!(before & slot::withdrawn)) {
      auto all_here = [&] { return s.arrival.load() == n; };
      auto give_up = [&] { return w.aborted || s.arrival.load() >= slot::withdrawn || exited_missing(); };
      if (before + 1 == n || await(deadline, all_here, give_up)) return;
      int v = s.arrival.load();
      while (!(v & slot::withdrawn) && v < n && !s.arrival.compare_exchange_weak(v, v | slot::withdrawn)) {
      }
      // Once every member is here, every member goes on to the data phases, even if the world
      // failed since: each will read the others' buffers.
      if (v == n) return;
      i_withdrew = !(v & slot::withdrawn);
    }
    if (!i_withdrew) {  // a peer withdrew, and fails the world if nothing had before
      await(deadline, [&] { return w.aborted.load(); }, [] { return false; });
      throw peer_failure_error(d, seq);
    }
    if (w.aborted) throw peer_failure_error(d, seq);
    const std::string what = d.str() + " #" + std::to_string(seq) + " on " + g_->label;
    if (const std::string gone = missing(true); !gone.empty())
      fail(error(errc::peer_failure, what + ": rank(s) " + gone + " returned without joining it", {world_rank()}));
    fail(error(errc::timeout, what + ": no progress after " + std::to_string(timeout().count()) + " ms waiting for rank(s) " + missing(false),
               {world_rank()}));
  }

  // Waits until pred() (an atomic's load), a data phase's end: every member has arrived and
  // reads or writes its peers' buffers until it reaches the phase, so this wait does not end when
  // the world aborts (leaving would let this rank's caller free a buffer a peer still reads). It
  // waits on nothing but the peers' copies; at the deadline it throws errc::timeout.
  template <class Pred>
  void wait_for_phase(const collective& d, std::uint64_t seq, lazy_deadline& deadline, Pred pred) {
    if (await(deadline, pred, [] { return false; })) return;
    fail(error(errc::timeout,
               d.str() + " #" + std::to_string(seq) + " on " + g_->label + ": no progress after " +
                   std::to_string(timeout().count()) + " ms (peers stalled inside the collective)",
               {world_rank()}));
  }

  // This member is done with slot `s`; the last to leave readies it for collective
  // seq + ring_size and wakes a member that waits for it.
  void leave(slot& s, std::uint64_t seq) {
    if (s.departed.fetch_add(1) + 1 != size()) return;
    s.reset();
    s.serves.store(seq + ring_size, std::memory_order_release);
    wake_sleepers();
  }

  std::shared_ptr<group_state> g_;
  int rank_ = 0;
  std::uint64_t next_seq_ = 0;
  std::vector<std::uint64_t> sent_, received_;  // per peer: messages issued so far
};

}  // namespace fsdp::threads::detail
