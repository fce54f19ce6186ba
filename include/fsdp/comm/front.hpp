#pragma once
//! \file The front every backend's collectives share: their public signatures, the checks no
//! backend can skip, the traffic it counts, and its entry in the flight recorder
//! (comm/flight_recorder.hpp). A backend's communicator derives from `collective_methods` (which turns
//! each call of the vocabulary, comm/concepts.hpp, into a `collective`) and holds a
//! `collective_front` (its rank, the hosts of its group's ranks, its counters); its one
//! issue(c, send, recv, queue) calls admit(), then moves the data its own way. So a new
//! collective is written once here and once in each backend's issue().
//!
//!   class communicator : public fsdp::detail::collective_methods<communicator, host_queue, host_event> {
//!     host_event issue(const detail::collective& c, const void* send, void* recv, host_queue& q) {
//!       auto rec = front_.admit(c, send, recv, [&] { ensure_alive(c); });   // throws for bad input or a failed group
//!       return enqueue(c, send, recv, q, rec);   // rec.started(), rec.finished(ok) around the work
//!     }
//!   };

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/comm/collective.hpp"
#include "fsdp/comm/concepts.hpp"
#include "fsdp/comm/flight_recorder.hpp"
#include "fsdp/comm/topology.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp::detail {

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
//!   3. traffic() is what admitted collectives sent, with the share to other hosts in inter_host;
//!   4. after record(world_rank, members), admit() records each admitted collective in that
//!      rank's flight recorder and returns its token, which the backend marks started and
//!      finished; before, the token is null (marks do nothing).
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

  //! Records this group's collectives in the flight recorder of `world_rank`; `members` are
  //! the group's world ranks in rank order.
  void record(int world_rank, std::vector<int> members) {
    members_ = std::move(members);
    recorder_ = &flight_recorder::of(world_rank);
    stream_ = recorder_->open_stream(members_);
  }

  template <class Alive>
  flight_recorder::token admit(const collective& c, const void* send, const void* recv, Alive&& alive) {
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
    return recorder_ ? recorder_->issue(stream_, c, rank_, members_) : flight_recorder::token{};
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
  flight_recorder* recorder_ = nullptr;  // the recorders live as long as the process
  int stream_ = 0;
  std::vector<int> members_;
};

}  // namespace fsdp::detail
