#pragma once
//! \file One thread rank's communicator (the threads backend: N ranks as threads of one process,
//! collectives through shared memory). Each collective is enqueued on a host_queue; when it
//! runs, the ranks' queue threads meet at the rendezvous (comm/threads/rendezvous.hpp: matched
//! by issue order, bounded by the world's timeout, with its failure model), check that they
//! issued the same collective, copy or reduce straight between each other's buffers
//! (comm/threads/data_phases.hpp), and leave together; then the link model, when the world has
//! one, holds the rank's link (comm/threads/link_model.hpp).
//!
//! Example (from tests/comm/test_threads.cpp):
//!   fsdp::threads::world{4}.run([](fsdp::threads::communicator& comm) {
//!     fsdp::host_queue q;
//!     std::vector<float> x(4, float(comm.rank())), all(16);
//!     comm.all_gather(x.data(), all.data(), 4, fsdp::dtype::f32, q).wait(comm.timeout());
//!   });

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "fsdp/comm/concepts.hpp"
#include "fsdp/comm/front.hpp"
#include "fsdp/comm/threads/data_phases.hpp"
#include "fsdp/comm/threads/rendezvous.hpp"
#include "fsdp/comm/topology.hpp"
#include "fsdp/device/host.hpp"

namespace fsdp::threads {

class world;
class cuda_communicator;  // comm/threads/cuda_communicator.hpp: the same rendezvous, data moved by the GPU

//! One rank's handle on a group of thread ranks. Move-only: the issue-order counter that
//! matches collectives across ranks lives here. Its collectives (all_gather, reduce_scatter,
//! all_reduce, broadcast, all_to_all, send and recv) are collective_methods' (comm/front.hpp),
//! issued by issue().
class communicator : public fsdp::detail::collective_methods<communicator, host_queue, host_event> {
 public:
  using device_type = host_device;

  communicator(communicator&&) noexcept = default;
  communicator& operator=(communicator&&) noexcept = default;

  int rank() const noexcept { return rv_.rank(); }
  int size() const noexcept { return rv_.size(); }
  //! This rank's index in the world (the process of threads).
  int world_rank() const noexcept { return rv_.world_rank(); }
  detail::group_state* native_handle() const noexcept { return &rv_.group(); }
  milliseconds timeout() const noexcept { return rv_.timeout(); }
  //! The world's link model (world_options::link).
  link_model link() const noexcept { return rv_.world().opts.link; }
  traffic_counters traffic() const noexcept { return front_.traffic(); }
  //! The host of each rank of the group (world_options::ranks_per_host).
  std::span<const int> hosts() const noexcept { return front_.hosts(); }

  //! Ends every rank's pending and future waits with errc::peer_failure, citing `why`. For a
  //! rank that must leave (it is unwinding an exception) while peers may wait on it.
  //! Fails the world: every rank's pending and next collective ends in peer_failure with
  //! "rank W failed: why", W this rank's world rank (as MPI's engine says it).
  void abort(const std::string& why) { rv_.world().fail(nullptr, "rank " + std::to_string(world_rank()) + " failed: " + why); }

  //! Blocks until every rank of the group has arrived (bounded by timeout()).
  void barrier() { run(rv_.take_seq(), {detail::collective_kind::barrier}, nullptr, nullptr, {}); }

  //! Blocking: ranks with equal color form a new communicator, ordered by (key, rank).
  communicator split(int color, int key) {
    if (color < 0) throw error(errc::invalid_argument, "split color must be >= 0, got " + std::to_string(color), {world_rank()});
    const std::uint64_t seq = rv_.take_seq();
    std::vector<int> members;
    const detail::group_state& g = rv_.group();
    run(seq, {detail::collective_kind::split}, nullptr, nullptr, {color, key}, [&](detail::slot& s) {
      std::vector<std::tuple<int, int, int>> mine;  // key, group rank, world rank
      for (std::size_t j = 0; j < s.n; ++j)
        if (s.args[j].extra.first == color) mine.emplace_back(s.args[j].extra.second, static_cast<int>(j), g.members[j]);
      std::sort(mine.begin(), mine.end());
      for (auto& [k, gr, wr] : mine) members.push_back(wr);
    });
    auto split_group = rv_.world().split_group(g, seq, color, members);
    const int me = static_cast<int>(std::find(members.begin(), members.end(), world_rank()) - members.begin());
    return communicator(std::move(split_group), me);
  }

 private:
  friend class world;
  friend class cuda_communicator;
  friend class fsdp::detail::collective_methods<communicator, host_queue, host_event>;
  communicator(std::shared_ptr<detail::group_state> g, int rank) : rv_(std::move(g), rank) {
    const int per_host = rv_.world().opts.ranks_per_host;
    std::vector<int> hosts;
    for (int w : rv_.group().members) hosts.push_back(per_host > 0 ? w / per_host : 0);
    front_ = fsdp::detail::collective_front(rank, std::move(hosts), world_rank());
    front_.record(world_rank(), rv_.group().members);
  }

  // Every collective: the front (checks, liveness, traffic), then a task on `q` that runs it.
  host_event issue(const detail::collective& c, const void* send, void* recv, host_queue& q) {
    const auto rec = front_.admit(c, send, recv, [&] { rv_.ensure_alive(c); });
    if (c.point_to_point()) {  // only the two ranks meet (rendezvous::exchange)
      const std::uint64_t k = rv_.take_message(c);
      q.enqueue([this, c, send, recv, k, rec] { rec.around([&] { rv_.exchange(c, k, send, recv); }); }, run_on::queue_or_waiter);
      return q.record();
    }
    const std::uint64_t seq = rv_.take_seq();
    // A collective depends only on its peers and is bounded by the world's timeout, so a thread
    // that waits for it may run it (run_on::queue_or_waiter): on a queue_wake::on_wait queue,
    // issue-and-wait then costs no hand-off to the queue's thread and back.
    q.enqueue([this, c, send, recv, seq, rec] { rec.around([&] { run(seq, c, send, recv, {}); }); }, run_on::queue_or_waiter);
    return q.record();
  }

  // Runs one collective on the calling thread: meet, the host's data phases (after `body`,
  // which split uses to read the members' colors), leave, then the link model's time.
  template <class Body = void (*)(detail::slot&)>
  void run(std::uint64_t seq, const detail::collective& c, const void* send, void* recv, std::pair<int, int> extra,
           Body&& body = [](detail::slot&) {}) {
    // The link model's bound (read only when the world has one: the clock costs a small collective).
    const auto deadline = link().enabled() ? std::chrono::steady_clock::now() + timeout() : std::chrono::steady_clock::time_point{};
    const int n = size(), me = rank();
    rv_.meet(seq, c, send, recv, extra, nullptr, [&](detail::slot& s, auto&& phase) {
      body(s);
      detail::copy_on_host(s, c, me, n, recv, phase);
    });
    rv_.occupy_link(c, seq, deadline);
  }

  detail::rendezvous rv_;
  fsdp::detail::collective_front front_;
};

static_assert(full_communicator<communicator>);
static_assert(knows_hosts<communicator>);
static_assert(can_all_to_all<communicator> && can_send_recv<communicator>);

}  // namespace fsdp::threads
