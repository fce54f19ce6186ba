#pragma once
//! \file One MPI process's communicator. Its collectives are MPI operations run by the engine
//! (comm/mpi/engine.hpp) in issue order; a collective enqueued on a host_queue hands them over
//! when the queue reaches it and waits for them.
//!
//! Reductions sum in rank order (comm/rank_order_sum.hpp), so that they equal the threads
//! backend's bit for bit: MPI's own reduce-scatter and all-reduce pick a ring, a tree or
//! recursive halving by size and rank count, and each adds in another order. A reduce_scatter is
//! an MPI_Ialltoall (rank r receives every rank's block r, into a scratch buffer as large as the
//! send buffer, held while the collective runs) followed by the sum on this rank; an all_reduce
//! is the same on 1/n of the elements (MPI_Ialltoallv) followed by an MPI_Iallgatherv of the
//! sums. Each rank sends what the ring formulas of traffic_counters count. reduce_scatter always
//! uses distinct send and receive buffers, as NCCL's layout for an in-place reduce-scatter is
//! not MPI's.

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/comm/concepts.hpp"
#include "fsdp/comm/front.hpp"
#include "fsdp/comm/mpi/engine.hpp"
#include "fsdp/comm/rank_order_sum.hpp"
#include "fsdp/comm/topology.hpp"
#include "fsdp/device/host.hpp"

namespace fsdp::mpi {

class environment;

//! One process's handle on an MPI communicator, for shard_group. Move-only (like
//! threads::communicator); created by environment::world() and split(). Its collectives are
//! collective_methods' (comm/front.hpp), issued by issue().
class communicator : public fsdp::detail::collective_methods<communicator, host_queue, host_event> {
 public:
  using device_type = host_device;

  communicator(communicator&& o) noexcept
      : engine_(o.engine_), comm_(std::exchange(o.comm_, MPI_COMM_NULL)), timeout_(o.timeout_),
        world_hosts_(std::move(o.world_hosts_)), front_(std::move(o.front_)) {}
  communicator& operator=(communicator&& o) noexcept {
    if (this != &o) {
      release();
      engine_ = o.engine_;
      comm_ = std::exchange(o.comm_, MPI_COMM_NULL);
      timeout_ = o.timeout_;
      world_hosts_ = std::move(o.world_hosts_);
      front_ = std::move(o.front_);
    }
    return *this;
  }
  //! Frees the MPI communicator (through the engine, after what was issued on it). Must run
  //! before the environment ends. After a failure it is left to MPI_Abort.
  ~communicator() { release(); }

  int rank() const noexcept { return front_.rank(); }
  int size() const noexcept { return front_.size(); }
  MPI_Comm native_handle() const noexcept { return comm_; }
  milliseconds timeout() const noexcept { return timeout_; }
  traffic_counters traffic() const noexcept { return front_.traffic(); }
  //! The host of each rank of the group (shared-memory domains, numbered in rank order).
  std::span<const int> hosts() const noexcept { return front_.hosts(); }

  //! Tells every rank that this one failed: their collectives in flight or queued end at once
  //! with errc::peer_failure "rank <r> failed: <why>" (shard_group calls this when it is left by
  //! an exception). This rank's own collectives fail too; the job then ends with MPI_Abort in
  //! environment's destructor. Returns once the notices were sent (at most about 1 s).
  void abort(const std::string& why) { engine_->abort(why); }

  //! Why this process's MPI backend broke (a peer's failure, a peer that stopped answering, a
  //! timeout), or empty while it is healthy: for another backend's waits (nccl::from_mpi). The
  //! function is valid while the environment lives.
  std::function<std::string()> failure_probe() const {
    return [e = engine_] { return e->broken() ? e->broken_reason() : std::string(); };
  }

  //! Blocking (bounded by timeout()).
  void barrier() {
    const MPI_Comm mc = comm_;
    run_blocking("barrier", [=](MPI_Request* r) { return MPI_Ibarrier(mc, r); });
  }

  //! Blocking: ranks with equal color form a new communicator, ordered by (key, rank).
  communicator split(int color, int key) {
    if (color < 0) throw error(errc::invalid_argument, "split color must be >= 0, got " + std::to_string(color), {rank()});
    MPI_Comm out = MPI_COMM_NULL;
    std::vector<int> members;
    const MPI_Comm mc = comm_;
    // MPI_Comm_split blocks the engine thread until every rank calls it, and a blocked engine
    // sends no heartbeats: a rank still busy elsewhere would take the waiting ones for dead.
    // The polled barrier first makes the blocking part wait only for ranks already there.
    barrier();
    run_blocking("split", [=, &out, &members](MPI_Request*) {
      const int rc = MPI_Comm_split(mc, color, key, &out);
      if (rc == MPI_SUCCESS) {
        MPI_Comm_set_errhandler(out, MPI_ERRORS_RETURN);
        members = world_ranks_of(out);
      }
      return rc;
    });
    return communicator(engine_, out, timeout_, world_hosts_, members);
  }

 private:
  friend class environment;
  friend class fsdp::detail::collective_methods<communicator, host_queue, host_event>;
  using collective = fsdp::detail::collective;
  using kind = fsdp::detail::collective_kind;

  //! `members`: the world rank of each rank of `c` (world_ranks_of, in an engine round).
  communicator(detail::engine* e, MPI_Comm c, milliseconds timeout, std::shared_ptr<const std::vector<int>> world_hosts,
               const std::vector<int>& members)
      : engine_(e), comm_(c), timeout_(timeout), world_hosts_(std::move(world_hosts)) {
    int rank = 0;
    MPI_Comm_rank(c, &rank);  // a local query: safe from any thread once initialised
    std::vector<int> hosts;
    for (int w : members) hosts.push_back((*world_hosts_)[static_cast<std::size_t>(w)]);
    front_ = fsdp::detail::collective_front(rank, std::move(hosts), rank);
    front_.record(members[static_cast<std::size_t>(rank)], members);
  }

  //! The world rank of each rank of `c`. In an engine round (it allocates MPI groups).
  static std::vector<int> world_ranks_of(MPI_Comm c) {
    MPI_Group mine = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
    int n = 0;
    MPI_Comm_size(c, &n);
    MPI_Comm_group(c, &mine);
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    std::vector<int> ranks(static_cast<std::size_t>(n)), in_world(ranks.size());
    for (int r = 0; r < n; ++r) ranks[static_cast<std::size_t>(r)] = r;
    MPI_Group_translate_ranks(mine, n, ranks.data(), world, in_world.data());
    MPI_Group_free(&mine);
    MPI_Group_free(&world);
    return in_world;
  }

  void release() noexcept {
    if (comm_ == MPI_COMM_NULL) return;
    const MPI_Comm c = std::exchange(comm_, MPI_COMM_NULL);
    if (engine_->broken()) return;
    try {
      run_blocking("comm_free", [cc = c](MPI_Request*) mutable { return MPI_Comm_free(&cc); });
    } catch (...) {  // a failure already being reported elsewhere; MPI_Abort ends the job
    }
  }

  //! One MPI operation of a collective: start() issues it, finish() runs once it completed.
  struct step {
    std::string what;
    std::function<int(MPI_Request*)> start;
    std::function<void(const MPI_Status&)> finish = {};
    std::size_t bytes = 0;  // what this rank receives (the fast path's limit: engine::run())
  };

  // Every collective: MPI's own limits (distinct reduce_scatter buffers; the largest buffer
  // must fit MPI's int count), the front (comm/front.hpp, whose liveness check refuses a
  // collective once the engine broke), then its MPI operations, enqueued on `q`.
  host_event issue(const collective& c, const void* send, void* recv, host_queue& q) {
    const auto [send_bytes, recv_bytes] = c.buffer_bytes(size());
    const char* s = static_cast<const char*>(send);
    const char* r = static_cast<const char*>(recv);
    if (c.kind == kind::reduce_scatter && r < s + send_bytes && s < r + recv_bytes)
      throw error(errc::invalid_argument, "reduce_scatter needs distinct send and receive buffers on MPI", {rank()});
    const bool per_rank_blocks = c.kind == kind::reduce_scatter || c.kind == kind::all_to_all;
    const std::size_t elements = per_rank_blocks ? c.count * static_cast<std::size_t>(size()) : c.count;
    if (elements > static_cast<std::size_t>(INT_MAX))
      throw error(errc::invalid_argument, c.str() + ": " + std::to_string(elements) +
                                              " elements exceed MPI's int count; use smaller buckets", {rank()});
    const auto rec = front_.admit(c, send, recv, [&] {
      if (engine_->broken())
        throw error(errc::peer_failure, c.str() + ": not issued because an earlier collective failed: " + engine_->broken_reason(),
                    {rank()});
    });
    switch (c.kind) {
      case kind::all_gather: return enqueue(q, all_gather_steps(c, send, recv), rec);
      case kind::reduce_scatter: return enqueue(q, reduce_scatter_steps(c, send, recv), rec);
      case kind::all_reduce: return enqueue(q, all_reduce_steps(c, send, recv), rec);
      case kind::broadcast: return enqueue(q, broadcast_steps(c, recv), rec);
      case kind::all_to_all: return enqueue(q, all_to_all_steps(c, send, recv), rec);
      case kind::send:
      case kind::recv: return enqueue(q, point_to_point_steps(c, send, recv), rec);
      case kind::barrier:
      case kind::split: break;
    }
    throw error(errc::internal, c.str() + " is not issued through issue()", {rank()});
  }

  std::vector<step> all_gather_steps(const collective& c, const void* send, void* recv) const {
    const std::size_t count = c.count;
    const dtype t = c.type;
    const int n = static_cast<int>(count);
    const bool in_place = send == static_cast<const char*>(recv) + static_cast<std::size_t>(rank()) * count * size_of(t);
    const MPI_Datatype type = detail::mpi_type(t);
    const MPI_Comm mc = comm_;
    return {{c.str(), [=](MPI_Request* r) {
      return in_place ? MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, recv, n, type, mc, r)
                      : MPI_Iallgather(send, n, type, recv, n, type, mc, r);
    }, {}, count * size_of(t) * static_cast<std::size_t>(size())}};
  }

  std::vector<step> reduce_scatter_steps(const collective& c, const void* send, void* recv) const {
    const std::size_t count = c.count, bytes = count * size_of(c.type);
    const dtype t = c.type;
    const reduce_op op = c.op;
    const int ranks = size(), n = static_cast<int>(count);
    const MPI_Datatype type = detail::mpi_type(t);
    const MPI_Comm mc = comm_;
    // Every rank's block `rank` lands in `blocks` (allocated when the collective starts, freed
    // when it ends), then is summed here in rank order.
    auto blocks = std::make_shared<std::vector<std::byte>>();
    return {{c.str(),
                        [=](MPI_Request* req) {
                          blocks->resize(bytes * static_cast<std::size_t>(ranks));
                          return MPI_Ialltoall(send, n, type, blocks->data(), n, type, mc, req);
                        },
                        [=](const MPI_Status&) {
                          sum_blocks(recv, blocks->data(), ranks, count, t, op);
                          std::vector<std::byte>().swap(*blocks);
                        },
                        bytes * static_cast<std::size_t>(ranks)}};
  }

  std::vector<step> all_reduce_steps(const collective& c, const void* send, void* recv) const {
    const std::size_t count = c.count;
    const dtype t = c.type;
    const reduce_op op = c.op;
    const MPI_Datatype type = detail::mpi_type(t);
    const MPI_Comm mc = comm_;
    const int ranks = size(), me = rank();
    // Rank j sums elements [displs[j], displs[j] + counts[j]) (the threads backend's split:
    // ceil(count / n) each, the last ones shorter or empty), then every rank gathers the sums.
    struct split {
      std::vector<int> counts, displs, mine_counts, mine_displs;
      std::vector<std::byte> blocks;
    };
    auto p = std::make_shared<split>();
    const std::size_t chunk = (count + static_cast<std::size_t>(ranks) - 1) / static_cast<std::size_t>(ranks);
    for (int j = 0; j < ranks; ++j) {
      const std::size_t b = std::min(count, static_cast<std::size_t>(j) * chunk), e = std::min(count, b + chunk);
      p->counts.push_back(static_cast<int>(e - b));
      p->displs.push_back(static_cast<int>(b));
    }
    const int mine = p->counts[static_cast<std::size_t>(me)];
    for (int j = 0; j < ranks; ++j) {
      p->mine_counts.push_back(mine);
      p->mine_displs.push_back(j * mine);
    }
    const std::size_t elem = size_of(t);
    char* out = static_cast<char*>(recv);
    const std::string what = c.str();
    return {{what + " (sum of this rank's part)",
                        [=](MPI_Request* req) {
                          p->blocks.resize(static_cast<std::size_t>(mine) * elem * static_cast<std::size_t>(ranks));
                          return MPI_Ialltoallv(send, p->counts.data(), p->displs.data(), type, p->blocks.data(),
                                                p->mine_counts.data(), p->mine_displs.data(), type, mc, req);
                        },
                        [=](const MPI_Status&) {
                          sum_blocks(out + static_cast<std::size_t>(p->displs[static_cast<std::size_t>(me)]) * elem, p->blocks.data(),
                                     ranks, static_cast<std::size_t>(mine), t, op);
                          std::vector<std::byte>().swap(p->blocks);
                        },
                        static_cast<std::size_t>(mine) * elem * static_cast<std::size_t>(ranks)},
                       {what + " (gather of the sums)",
                        [=](MPI_Request* req) {
                          return MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, recv, p->counts.data(), p->displs.data(),
                                                 type, mc, req);
                        },
                        {},
                        count * elem}};
  }

  std::vector<step> broadcast_steps(const collective& c, void* buf) const {
    const int n = static_cast<int>(c.count), root = c.root;
    const MPI_Datatype type = detail::mpi_type(c.type);
    const MPI_Comm mc = comm_;
    return {{c.str(), [=](MPI_Request* r) { return MPI_Ibcast(buf, n, type, root, mc, r); }, {}, c.count * size_of(c.type)}};
  }

  // recv = the sum in rank order of `ranks` consecutive blocks of `count` elements.
  static void sum_blocks(void* recv, const std::byte* blocks, int ranks, std::size_t count, dtype t, reduce_op op) {
    std::vector<const void*> src(static_cast<std::size_t>(ranks));
    for (std::size_t j = 0; j < src.size(); ++j) src[j] = blocks + j * count * size_of(t);
    fsdp::detail::sum_in_rank_order(recv, src.data(), ranks, count, t, op);
  }

  std::vector<step> all_to_all_steps(const collective& c, const void* send, void* recv) const {
    const int n = static_cast<int>(c.count);
    const MPI_Datatype type = detail::mpi_type(c.type);
    const MPI_Comm mc = comm_;
    return {{c.str(), [=](MPI_Request* r) { return MPI_Ialltoall(send, n, type, recv, n, type, mc, r); }, {},
             c.count * size_of(c.type) * static_cast<std::size_t>(size())}};
  }

  // A message on this communicator's own tag: MPI keeps messages of one sender, tag and
  // communicator in order, which is the k-th send to k-th recv matching of comm/concepts.hpp.
  std::vector<step> point_to_point_steps(const collective& c, const void* send, void* recv) const {
    constexpr int tag = 0;
    const int n = static_cast<int>(c.count), peer = c.root;
    const MPI_Datatype type = detail::mpi_type(c.type);
    const MPI_Comm mc = comm_;
    if (c.kind == kind::send)
      return {{c.str(), [=](MPI_Request* r) { return MPI_Isend(send, n, type, peer, tag, mc, r); }, {}, 0}};
    // A shorter message completes quietly in MPI: the receive checks what it got.
    const std::string what = c.str();
    return {{what, [=](MPI_Request* r) { return MPI_Irecv(recv, n, type, peer, tag, mc, r); },
             [=](const MPI_Status& st) {
               int got = 0;
               MPI_Get_count(&st, type, &got);
               if (got != n)
                 throw error(errc::mismatch, what + ": rank " + std::to_string(peer) + " sent " + std::to_string(got) +
                                                 " elements, not " + std::to_string(n));
             },
             c.count * size_of(c.type)}};
  }

  detail::op make_op(std::uint64_t seq, step st) {
    detail::op o;
    o.seq = seq;
    o.what = std::move(st.what) + " #" + std::to_string(seq);
    o.start = std::move(st.start);
    o.finish = std::move(st.finish);
    o.bytes = st.bytes;
    o.timeout = timeout_;
    return o;
  }

  // A collective as one or more MPI operations (all_reduce has two), numbered now in issue
  // order and handed to the engine one after the other when the queue reaches them.
  host_event enqueue(host_queue& q, std::vector<step> steps, flight_recorder::token rec) {
    const std::uint64_t first = engine_->reserve(steps.size());
    auto ops = std::make_shared<std::vector<detail::op>>();
    for (std::size_t i = 0; i < steps.size(); ++i) ops->push_back(make_op(first + i, std::move(steps[i])));
    detail::engine* e = engine_;
    const milliseconds wait = timeout_ * 2 + milliseconds(1000);
    // The task waits only for the engine and is bounded, so a thread that waits for the
    // collective may run it (run_on::queue_or_waiter; on a queue_wake::on_wait queue).
    q.enqueue(
        [e, ops, wait, rec] {
          rec.around([&] {
            for (detail::op& o : *ops) {
              const std::string what = o.what;
              e->run(std::move(o), wait, what);
            }
          });
        },
        run_on::queue_or_waiter);
    return q.record();
  }

  void run_blocking(const char* what, std::function<int(MPI_Request*)> start) {
    detail::op o = make_op(engine_->reserve(1), {what, std::move(start)});
    const std::string name = o.what;
    engine_->run(std::move(o), timeout_ * 2 + milliseconds(1000), name);
  }

  detail::engine* engine_ = nullptr;
  MPI_Comm comm_ = MPI_COMM_NULL;
  milliseconds timeout_{};
  std::shared_ptr<const std::vector<int>> world_hosts_;  // the host of every world rank
  fsdp::detail::collective_front front_;
};

static_assert(full_communicator<communicator>);
static_assert(knows_hosts<communicator>);
static_assert(can_all_to_all<communicator> && can_send_recv<communicator>);

}  // namespace fsdp::mpi
