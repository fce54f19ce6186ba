#pragma once
//! \file The communicator vocabulary: a base concept and one capability concept per collective
//! (as CCCL's multi-GPU layer does). Backends are sibling folders (comm/threads/, comm/mpi/,
//! comm/nccl/) behind one front (comm/front.hpp) and their umbrella headers (comm/threads.hpp, ...).
//!
//! All collectives are asynchronous: they are enqueued on a queue of the communicator's device
//! (a CUDA stream for NCCL, a host_queue for the host backends) and return that queue's event
//! for their completion. Every rank must issue the same collectives in the same order.

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>

#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/timeout.hpp"  // default_timeout(), milliseconds: the bound on every wait

namespace fsdp {

//! How reduce_scatter and all_reduce combine the ranks' inputs.
enum class reduce_op : std::uint8_t { sum, avg };

constexpr const char* to_string(reduce_op op) noexcept { return op == reduce_op::sum ? "sum" : "avg"; }

//! Bytes this rank sent, per collective kind, as the ring algorithms move them (what NCCL's
//! bus-bandwidth figures assume): for a group of n ranks and m bytes of output per rank,
//! all_gather and reduce_scatter send m(n-1)/n (with m the full gathered / scattered size),
//! all_reduce 2m(n-1)/n, broadcast m(n-1)/n; all_to_all sends its n-1 blocks for the peers,
//! m(n-1)/n; send() its message (a recv() sends nothing).
//!
//! inter_host is the part of total() sent to ranks on other hosts (comm/topology.hpp): a
//! collective's bytes are split evenly over the n-1 peers (as a direct exchange sends them),
//! and the share of the peers on other hosts counts. That is exact for groups inside one host
//! (0) or with one rank per host (all of it), and for the MPI backend's reduce-scatter (an
//! all-to-all); a ring or tree that passes data through a host sends less across hosts.
struct traffic_counters {
  std::uint64_t all_gather = 0;
  std::uint64_t reduce_scatter = 0;
  std::uint64_t all_reduce = 0;
  std::uint64_t broadcast = 0;
  std::uint64_t collectives = 0;  //!< number of collectives issued (any kind, sends and receives too)
  std::uint64_t inter_host = 0;   //!< of total(): bytes sent to ranks on other hosts
  std::uint64_t all_to_all = 0;
  std::uint64_t send = 0;         //!< point to point: the messages this rank sent

  std::uint64_t total() const noexcept { return all_gather + reduce_scatter + all_reduce + broadcast + all_to_all + send; }

  //! The bytes one rank sends in one collective (the formulas above), for `count` elements of
  //! `t` per rank in a group of `n` ranks. The one place they are written: the add_* helpers
  //! count them and the threads backend's link model charges them.
  static std::uint64_t all_gather_bytes(std::size_t count, dtype t, int n) noexcept { return count * size_of(t) * (us(n) - 1); }
  static std::uint64_t reduce_scatter_bytes(std::size_t count, dtype t, int n) noexcept { return count * size_of(t) * (us(n) - 1); }
  static std::uint64_t all_reduce_bytes(std::size_t count, dtype t, int n) noexcept { return 2 * count * size_of(t) * (us(n) - 1) / us(n); }
  static std::uint64_t broadcast_bytes(std::size_t count, dtype t, int n) noexcept { return count * size_of(t) * (us(n) - 1) / us(n); }
  static std::uint64_t all_to_all_bytes(std::size_t count, dtype t, int n) noexcept { return count * size_of(t) * (us(n) - 1); }

  // Counting helpers for backends: `count` elements of `t` per rank, a group of `n` ranks of
  // which `remote` are on other hosts than this one.
  void add_all_gather(std::size_t count, dtype t, int n, int remote = 0) noexcept {
    add(all_gather, all_gather_bytes(count, t, n), n, remote);
  }
  void add_reduce_scatter(std::size_t count, dtype t, int n, int remote = 0) noexcept {
    add(reduce_scatter, reduce_scatter_bytes(count, t, n), n, remote);
  }
  void add_all_reduce(std::size_t count, dtype t, int n, int remote = 0) noexcept {
    add(all_reduce, all_reduce_bytes(count, t, n), n, remote);
  }
  void add_broadcast(std::size_t count, dtype t, int n, int remote = 0) noexcept {
    add(broadcast, broadcast_bytes(count, t, n), n, remote);
  }
  void add_all_to_all(std::size_t count, dtype t, int n, int remote = 0) noexcept {
    add(all_to_all, all_to_all_bytes(count, t, n), n, remote);
  }
  //! A send of `count` elements to one peer, on another host when `remote_peer`.
  void add_send(std::size_t count, dtype t, bool remote_peer) noexcept {
    send += count * size_of(t);
    ++collectives;
    if (remote_peer) inter_host += count * size_of(t);
  }
  //! A receive: counted as issued; its bytes are the sender's.
  void add_recv() noexcept { ++collectives; }
  friend traffic_counters operator+(traffic_counters a, const traffic_counters& b) noexcept {
    a.all_gather += b.all_gather;
    a.reduce_scatter += b.reduce_scatter;
    a.all_reduce += b.all_reduce;
    a.broadcast += b.broadcast;
    a.collectives += b.collectives;
    a.inter_host += b.inter_host;
    a.all_to_all += b.all_to_all;
    a.send += b.send;
    return a;
  }
  friend traffic_counters operator-(traffic_counters a, const traffic_counters& b) noexcept {
    a.all_gather -= b.all_gather;
    a.reduce_scatter -= b.reduce_scatter;
    a.all_reduce -= b.all_reduce;
    a.broadcast -= b.broadcast;
    a.collectives -= b.collectives;
    a.inter_host -= b.inter_host;
    a.all_to_all -= b.all_to_all;
    a.send -= b.send;
    return a;
  }
  friend bool operator==(const traffic_counters&, const traffic_counters&) = default;

 private:
  static std::uint64_t us(int n) noexcept { return static_cast<std::uint64_t>(n); }
  void add(std::uint64_t& counter, std::uint64_t bytes, int n, int remote) noexcept {
    counter += bytes;
    ++collectives;
    if (remote > 0 && n > 1) inter_host += bytes * us(remote) / (us(n) - 1);
  }
};

//! Communicator: (1) rank() and size() of this rank in its group; (2) native_handle() of the
//! backend; (3) device_type, the device whose queues its collectives are enqueued on;
//! (4) timeout() that bounds every wait; (5) traffic() counters of what this rank sent.
template <class C>
concept communicator = requires(C& c, const C& cc) {
  typename C::device_type;
  { cc.rank() } -> std::convertible_to<int>;
  { cc.size() } -> std::convertible_to<int>;
  c.native_handle();
  { cc.timeout() } -> std::convertible_to<std::chrono::milliseconds>;
  { cc.traffic() } -> std::convertible_to<traffic_counters>;
};

template <class C>
using queue_of = typename C::device_type::queue;
template <class C>
using event_of = typename C::device_type::event;

//! all_gather(send, recv, count, dtype, queue): recv[r*count, (r+1)*count) = rank r's send.
//! In place when send == recv + rank*count.
template <class C>
concept can_all_gather = communicator<C> &&
    requires(C& c, const void* s, void* r, std::size_t n, dtype t, queue_of<C>& q) {
      { c.all_gather(s, r, n, t, q) } -> std::same_as<event_of<C>>;
    };

//! reduce_scatter(send, recv, count, dtype, op, queue): recv = op over ranks of
//! send[rank*count, (rank+1)*count). `send` holds size()*count elements.
template <class C>
concept can_reduce_scatter = communicator<C> &&
    requires(C& c, const void* s, void* r, std::size_t n, dtype t, reduce_op op, queue_of<C>& q) {
      { c.reduce_scatter(s, r, n, t, op, q) } -> std::same_as<event_of<C>>;
    };

//! all_reduce(send, recv, count, dtype, op, queue): recv = op over ranks of send. In place
//! when send == recv.
template <class C>
concept can_all_reduce = communicator<C> &&
    requires(C& c, const void* s, void* r, std::size_t n, dtype t, reduce_op op, queue_of<C>& q) {
      { c.all_reduce(s, r, n, t, op, q) } -> std::same_as<event_of<C>>;
    };

//! broadcast(buf, count, dtype, root, queue): every rank's buf = root's buf.
template <class C>
concept can_broadcast = communicator<C> &&
    requires(C& c, void* b, std::size_t n, dtype t, int root, queue_of<C>& q) {
      { c.broadcast(b, n, t, root, q) } -> std::same_as<event_of<C>>;
    };

//! all_to_all(send, recv, count, dtype, queue): recv[j*count, (j+1)*count) = rank j's
//! send[rank*count, (rank+1)*count) (each rank's block j goes to rank j; MoE's token dispatch).
//! The buffers must not overlap.
template <class C>
concept can_all_to_all = communicator<C> &&
    requires(C& c, const void* s, void* r, std::size_t n, dtype t, queue_of<C>& q) {
      { c.all_to_all(s, r, n, t, q) } -> std::same_as<event_of<C>>;
    };

//! send(buf, count, dtype, peer, queue) and recv(buf, count, dtype, peer, queue): point to
//! point (a pipeline's activations). The k-th send from rank a to rank b matches b's k-th recv
//! from a, and both must name the same count and dtype; the other ranks take no part. They are
//! bounded by timeout() like the collectives, and fail the same way.
template <class C>
concept can_send_recv = communicator<C> &&
    requires(C& c, const void* s, void* r, std::size_t n, dtype t, int peer, queue_of<C>& q) {
      { c.send(s, n, t, peer, q) } -> std::same_as<event_of<C>>;
      { c.recv(r, n, t, peer, q) } -> std::same_as<event_of<C>>;
    };

//! split(color, key): blocking; ranks with the same color form a new communicator, ranked by
//! key (then by rank). barrier(): blocking.
template <class C>
concept can_split = communicator<C> && requires(C& c, int color, int key) {
  { c.split(color, key) } -> std::same_as<C>;
  c.barrier();
};

//! A communicator that has everything shard_group needs.
template <class C>
concept full_communicator = can_all_gather<C> && can_reduce_scatter<C> && can_all_reduce<C> &&
                            can_broadcast<C> && can_split<C>;

}  // namespace fsdp
