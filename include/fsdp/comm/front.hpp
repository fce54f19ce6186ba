#pragma once
//! \file The front every backend's collectives share: their public signatures, what one rank
//! asked for (a `collective`), the checks no backend can skip, its name in errors, and the
//! traffic it counts. A backend's communicator derives from `collective_methods` (which turns
//! each call of the vocabulary, comm/concepts.hpp, into a `collective`) and holds a
//! `collective_front` (its rank, the hosts of its group's ranks, its counters); its one
//! issue(c, send, recv, queue) calls admit(), then moves the data its own way. So a new
//! collective is written once here and once in each backend's issue().
//!
//!   class communicator : public fsdp::detail::collective_methods<communicator, host_queue, host_event> {
//!     host_event issue(const detail::collective& c, const void* send, void* recv, host_queue& q) {
//!       front_.admit(c, send, recv, [&] { ensure_alive(c); });   // throws for bad input or a failed group
//!       return enqueue(c, send, recv, q);
//!     }
//!   };

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/comm/concepts.hpp"
#include "fsdp/comm/topology.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp::detail {

enum class collective_kind : std::uint8_t { all_gather, reduce_scatter, all_reduce, broadcast, all_to_all, send, recv, barrier, split };

inline const char* to_string(collective_kind k) {
  switch (k) {
    case collective_kind::all_gather: return "all_gather";
    case collective_kind::reduce_scatter: return "reduce_scatter";
    case collective_kind::all_reduce: return "all_reduce";
    case collective_kind::broadcast: return "broadcast";
    case collective_kind::all_to_all: return "all_to_all";
    case collective_kind::send: return "send";
    case collective_kind::recv: return "recv";
    case collective_kind::barrier: return "barrier";
    case collective_kind::split: return "split";
  }
  return "?";
}

//! What one rank asked for; every rank of a collective must ask for the same (a send and its
//! recv: the same count and dtype). `count` is the elements per rank as the concepts
//! (comm/concepts.hpp) define them; `op` matters for the reductions, `root` for broadcast, and
//! `root` is the peer of a send or recv.
struct collective {
  collective_kind kind = collective_kind::barrier;
  std::size_t count = 0;
  dtype type = dtype::u8;
  reduce_op op = reduce_op::sum;
  int root = 0;
  friend bool operator==(const collective&, const collective&) = default;

  bool reduces() const noexcept { return kind == collective_kind::reduce_scatter || kind == collective_kind::all_reduce; }
  bool moves_data() const noexcept { return kind != collective_kind::barrier && kind != collective_kind::split; }
  bool point_to_point() const noexcept { return kind == collective_kind::send || kind == collective_kind::recv; }

  //! "reduce_scatter of 1024 f32 (avg)", "broadcast of 8 u8 from root 0", "barrier": how every
  //! backend names a collective in its errors.
  std::string str() const {
    std::string s = to_string(kind);
    if (!moves_data()) return s;
    s += " of " + std::to_string(count) + " " + std::string(fsdp::to_string(type));
    if (reduces()) s += std::string(" (") + fsdp::to_string(op) + ")";
    if (kind == collective_kind::broadcast) s += " from root " + std::to_string(root);
    if (kind == collective_kind::send) s += " to rank " + std::to_string(root);
    if (kind == collective_kind::recv) s += " from rank " + std::to_string(root);
    return s;
  }

  //! The bytes of this rank's send and receive buffers over a group of `n` ranks (the layouts of
  //! comm/concepts.hpp): what a backend stages when they are not where its transport reads.
  std::pair<std::size_t, std::size_t> buffer_bytes(int n) const noexcept {
    const std::size_t one = count * size_of(type), all = one * static_cast<std::size_t>(n);
    switch (kind) {
      case collective_kind::all_gather: return {one, all};
      case collective_kind::reduce_scatter: return {all, one};
      case collective_kind::all_reduce:
      case collective_kind::broadcast: return {one, one};
      case collective_kind::all_to_all: return {all, all};
      case collective_kind::send: return {one, 0};
      case collective_kind::recv: return {0, one};
      case collective_kind::barrier:
      case collective_kind::split: return {0, 0};
    }
    return {0, 0};
  }

  //! Bytes one rank sends in it over a group of `n` ranks: traffic_counters' formulas (the link
  //! model of the threads backend charges them). barrier and split move no data.
  std::uint64_t sent_bytes(int n) const noexcept {
    switch (kind) {
      case collective_kind::all_gather: return traffic_counters::all_gather_bytes(count, type, n);
      case collective_kind::reduce_scatter: return traffic_counters::reduce_scatter_bytes(count, type, n);
      case collective_kind::all_reduce: return traffic_counters::all_reduce_bytes(count, type, n);
      case collective_kind::broadcast: return traffic_counters::broadcast_bytes(count, type, n);
      case collective_kind::all_to_all: return traffic_counters::all_to_all_bytes(count, type, n);
      case collective_kind::send: return count * size_of(type);
      case collective_kind::recv:
      case collective_kind::barrier:
      case collective_kind::split: return 0;
    }
    return 0;
  }
};

//! The collectives of comm/concepts.hpp, each as a `collective` handed to the backend's
//! issue(c, send, recv, queue) (CRTP: `Backend` derives from this and befriends it). broadcast
//! passes its buffer as both send and recv; send() has no recv buffer and recv() no send buffer.
template <class Backend, class Queue, class Event>
class collective_methods {
 public:
  Event all_gather(const void* send, void* recv, std::size_t count, dtype t, Queue& q) {
    return self().issue({collective_kind::all_gather, count, t}, send, recv, q);
  }
  Event reduce_scatter(const void* send, void* recv, std::size_t count, dtype t, reduce_op op, Queue& q) {
    return self().issue({collective_kind::reduce_scatter, count, t, op}, send, recv, q);
  }
  Event all_reduce(const void* send, void* recv, std::size_t count, dtype t, reduce_op op, Queue& q) {
    return self().issue({collective_kind::all_reduce, count, t, op}, send, recv, q);
  }
  Event broadcast(void* buf, std::size_t count, dtype t, int root, Queue& q) {
    return self().issue({collective_kind::broadcast, count, t, reduce_op::sum, root}, buf, buf, q);
  }
  Event all_to_all(const void* send, void* recv, std::size_t count, dtype t, Queue& q) {
    return self().issue({collective_kind::all_to_all, count, t}, send, recv, q);
  }
  Event send(const void* buf, std::size_t count, dtype t, int peer, Queue& q) {
    return self().issue({collective_kind::send, count, t, reduce_op::sum, peer}, buf, nullptr, q);
  }
  Event recv(void* buf, std::size_t count, dtype t, int peer, Queue& q) {
    return self().issue({collective_kind::recv, count, t, reduce_op::sum, peer}, nullptr, buf, q);
  }

 private:
  Backend& self() noexcept { return static_cast<Backend&>(*this); }
};

//! A rank's place in its group as every communicator keeps it: its rank, the host of each rank
//! of the group (comm/topology.hpp), and the traffic it sent. Its contract:
//!   1. admit(c, alive) is the door of every collective: it throws fsdp::error for what no
//!      backend accepts (a sum of a type that cannot be summed: errc::unsupported_dtype; a
//!      broadcast root outside the group, a send or recv peer outside it or this rank itself,
//!      overlapping all_to_all buffers: errc::invalid_argument), then calls alive(), the
//!      backend's own check that its group has not failed (which throws), then counts c's bytes;
//!   2. nothing refused is counted; errors name `error_rank` (the rank a user knows: the world
//!      rank for thread ranks);
//!   3. traffic() is what admitted collectives sent, with the share to other hosts in inter_host.
class collective_front {
 public:
  collective_front() = default;
  //! This rank (`rank`) of a group whose rank r runs on host `hosts[r]`.
  collective_front(int rank, std::vector<int> hosts, int error_rank)
      : rank_(rank), error_rank_(error_rank), hosts_(renumber_hosts(hosts)), remote_peers_(topology{hosts_}.remote_peers(rank)) {}

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return static_cast<int>(hosts_.size()); }
  //! The host of each rank of the group, numbered 0, 1, ... in rank order.
  std::span<const int> hosts() const noexcept { return hosts_; }
  traffic_counters traffic() const noexcept { return traffic_; }

  template <class Alive>
  void admit(const collective& c, const void* send, const void* recv, Alive&& alive) {
    if (c.reduces() && !is_reducible(c.type))
      throw error(errc::unsupported_dtype, std::string(to_string(c.kind)) + " cannot reduce " + std::string(fsdp::to_string(c.type)) +
                                               " (reducible: f32, bf16, f16, f64)", {error_rank_});
    if (c.kind == collective_kind::broadcast && (c.root < 0 || c.root >= size()))
      throw error(errc::invalid_argument, "broadcast root " + std::to_string(c.root) + " is not a rank of a group of " +
                                              std::to_string(size()), {error_rank_});
    if (c.point_to_point() && (c.root < 0 || c.root >= size() || c.root == rank_))
      throw error(errc::invalid_argument, c.str() + ": the peer must be another rank of this group of " + std::to_string(size()) +
                                              " (this is rank " + std::to_string(rank_) + ")", {error_rank_});
    if (c.kind == collective_kind::all_to_all && overlap(send, recv, c.buffer_bytes(size()).first))
      throw error(errc::invalid_argument, c.str() + ": the send and receive buffers overlap", {error_rank_});
    alive();
    count(c);
  }

 private:
  void count(const collective& c) noexcept {
    const int n = size();
    switch (c.kind) {
      case collective_kind::all_gather: traffic_.add_all_gather(c.count, c.type, n, remote_peers_); break;
      case collective_kind::reduce_scatter: traffic_.add_reduce_scatter(c.count, c.type, n, remote_peers_); break;
      case collective_kind::all_reduce: traffic_.add_all_reduce(c.count, c.type, n, remote_peers_); break;
      case collective_kind::broadcast: traffic_.add_broadcast(c.count, c.type, n, remote_peers_); break;
      case collective_kind::all_to_all: traffic_.add_all_to_all(c.count, c.type, n, remote_peers_); break;
      case collective_kind::send:
        traffic_.add_send(c.count, c.type, hosts_[static_cast<std::size_t>(c.root)] != hosts_[static_cast<std::size_t>(rank_)]);
        break;
      case collective_kind::recv: traffic_.add_recv(); break;
      case collective_kind::barrier:
      case collective_kind::split: break;
    }
  }
  static bool overlap(const void* a, const void* b, std::size_t bytes) noexcept {
    const auto* x = static_cast<const char*>(a);
    const auto* y = static_cast<const char*>(b);
    return bytes && x < y + bytes && y < x + bytes;
  }

  int rank_ = 0;
  int error_rank_ = 0;
  std::vector<int> hosts_{0};
  int remote_peers_ = 0;
  traffic_counters traffic_{};
};

}  // namespace fsdp::detail
