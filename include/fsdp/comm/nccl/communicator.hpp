#pragma once
//! \file One rank's NCCL communicator: collectives enqueued by NCCL on the CUDA stream of the
//! cuda_queue they are given, behind the shared front (comm/front.hpp); buffers in host memory
//! staged through device memory (comm/nccl.hpp says when and how).

#include <nccl.h>

#include <cstddef>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fsdp/comm/concepts.hpp"
#include "fsdp/comm/file_store.hpp"
#include "fsdp/comm/front.hpp"
#include "fsdp/comm/nccl/comm_state.hpp"
#include "fsdp/comm/nccl/group.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/device/cuda.hpp"

namespace fsdp::nccl {

class communicator;
inline cuda_memory_source registered_memory(const communicator& comm);  // comm/nccl/registered_memory.hpp

//! One rank's handle on an NCCL communicator, for shard_group. Move-only; created by the
//! constructor (with a shared unique_id), from_file_store(), or split(). Its collectives are
//! collective_methods' (comm/front.hpp), issued by issue(): all_gather in place when
//! send == recv + rank*count; reduce_scatter in place when recv == send + rank*count, otherwise
//! on buffers that do not overlap; all_reduce in place when send == recv; all_to_all as a send
//! and a receive per peer in one NCCL group; send and recv as ncclSend / ncclRecv.
class communicator : public fsdp::detail::collective_methods<communicator, cuda_queue, cuda_event> {
 public:
  using device_type = cuda_device;

  //! Collective over `size` ranks: joins the communicator named by `id` as `rank`, on `device`
  //! (made current). Every wait is bounded by `timeout`. `max_ctas` > 0 caps the thread blocks
  //! (channels) each of its collectives runs (ncclConfig_t::maxCTAs; NCCL_MAX_CTAS overrides it):
  //! ranks sharing a GPU (NCCL 2.30+) need their blocks resident together. 0: NCCL's choice.
  communicator(const cuda_device& device, int rank, int size, const unique_id& id, milliseconds timeout = default_timeout(),
               int max_ctas = 0)
      : timeout_(timeout) {
    if (size < 1 || rank < 0 || rank >= size)
      throw error(errc::invalid_argument, "nccl::communicator: rank " + std::to_string(rank) + " of " + std::to_string(size) +
                                              " ranks is not a valid rank");
    if (max_ctas < 0) throw error(errc::invalid_argument, "nccl::communicator: max_ctas must be >= 0 (0: NCCL's choice), got " + std::to_string(max_ctas));
    device.make_current();
    ncclConfig_t cfg = detail::nonblocking_config();
    if (max_ctas > 0) cfg.maxCTAs = max_ctas;
    ncclComm_t c = nullptr;
    const ncclResult_t rc = ncclCommInitRankConfig(&c, size, id, rank, &cfg);
    if (c == nullptr)
      throw error(errc::internal, std::string("ncclCommInitRankConfig failed: ") + ncclGetErrorString(rc), {rank});
    s_ = std::make_shared<detail::comm_state>(c, rank, size, device.ordinal(), timeout);
    front_ = one_host(rank, size);
    const std::string what = "ncclCommInitRankConfig (rank " + std::to_string(rank) + " of " + std::to_string(size) + ")";
    if (rc != ncclSuccess && rc != ncclInProgress) s_->fail(rc, what);
    s_->settle(what);
  }

  //! Collective: rank 0 creates the id and writes it to `store` under `key`; the others read
  //! it (polling up to `timeout`). Once every rank has joined, rank 0 removes the key again.
  static communicator from_file_store(const cuda_device& device, int rank, int size, const file_store& store,
                                      milliseconds timeout = default_timeout(), std::string_view key = "nccl_id") {
    unique_id id{};
    if (rank == 0) {
      id = make_unique_id();
      store.set(key, std::as_bytes(std::span(&id, 1)));
    } else {
      const std::vector<std::byte> v = store.get(key, timeout);
      if (v.size() != sizeof(id))
        throw error(errc::invalid_argument, "file store '" + store.path(key).string() + "' holds " + std::to_string(v.size()) +
                                                " bytes, not an ncclUniqueId (" + std::to_string(sizeof(id)) + " bytes)", {rank});
      std::memcpy(&id, v.data(), sizeof(id));
    }
    communicator c(device, rank, size, id, timeout);
    if (rank == 0) store.remove(key);  // used up: a later run must not pick up a stale id
    return c;
  }

  communicator(communicator&&) noexcept = default;
  communicator& operator=(communicator&&) noexcept = default;

  int rank() const noexcept { return front_.rank(); }
  int size() const noexcept { return front_.size(); }
  ncclComm_t native_handle() const noexcept { return s_ ? s_->native_handle() : nullptr; }
  milliseconds timeout() const noexcept { return timeout_; }
  traffic_counters traffic() const noexcept { return front_.traffic(); }

  //! Blocking (bounded by timeout()): an all-reduce of one int on a private stream.
  void barrier() {
    no_group("barrier");
    auto& st = state("barrier");
    fsdp::detail::cuda_use(st.ordinal());
    const auto [scratch, stream] = st.barrier_resources();
    const ncclResult_t rc = ncclAllReduce(scratch, scratch, 1, ncclInt32, ncclSum, st.handle("barrier"), stream);
    if (rc == ncclInProgress) st.settle("barrier");
    else if (rc != ncclSuccess) st.fail(rc, "barrier");
    fsdp::detail::cuda_poll([s = stream] { return cudaStreamQuery(s); }, timeout_, "barrier", {s_});
  }

  //! Blocking: ranks with equal color form a new communicator, ordered by (key, rank).
  communicator split(int color, int key) {
    if (color < 0) throw error(errc::invalid_argument, "split color must be >= 0, got " + std::to_string(color), {rank()});
    no_group("split");
    auto& st = state("split");
    fsdp::detail::cuda_use(st.ordinal());
    ncclComm_t out = nullptr;
    // No config: the new communicator inherits this one's (NCCL's docs), non-blocking and its
    // max_ctas; a fresh config would lift the cap on the thread blocks of ranks sharing a GPU.
    const ncclResult_t rc = ncclCommSplit(st.handle("split"), color, key, &out, nullptr);
    if (rc != ncclSuccess && rc != ncclInProgress) st.fail(rc, "ncclCommSplit");
    st.settle("ncclCommSplit");
    if (out == nullptr) throw error(errc::internal, "ncclCommSplit returned no communicator", {rank()});
    // The new communicator settles on its own: wait for it before asking its rank and size.
    auto child = std::make_shared<detail::comm_state>(out, rank(), size(), st.ordinal(), timeout_);
    child->watch(st.watcher());
    child->settle("ncclCommSplit (new communicator)");
    int r = 0, n = 0;
    if (ncclCommUserRank(out, &r) != ncclSuccess || ncclCommCount(out, &n) != ncclSuccess)
      throw error(errc::internal, "ncclCommSplit: cannot read the new communicator's rank and size", {rank()});
    child->identify(r, n);
    return communicator(std::move(child), r, n, timeout_);
  }

  //! ncclCommAbort: this rank's collectives stop, and every later call or wait fails at once
  //! with errc::peer_failure naming `reason`. shard_group calls it when left by an exception.
  void abort(std::string_view reason) noexcept {
    if (s_) s_->abort(reason);
  }
  bool aborted() const noexcept { return !s_ || s_->aborted(); }

  //! Asks `gone` in every wait (and passes it to split()s): once it returns a reason, the wait
  //! aborts the communicator and throws errc::peer_failure with it. from_mpi() sets the MPI
  //! backend's heartbeats (comm/mpi/heartbeats.hpp) here. Before the first collective.
  void watch_peers(std::function<std::string()> gone) { state("watch_peers").watch(std::move(gone)); }

 private:
  friend cuda_memory_source registered_memory(const communicator& comm);
  friend class fsdp::detail::collective_methods<communicator, cuda_queue, cuda_event>;
  using collective = fsdp::detail::collective;
  using kind = fsdp::detail::collective_kind;

  communicator(std::shared_ptr<detail::comm_state> s, int rank, int size, milliseconds timeout)
      : s_(std::move(s)), timeout_(timeout), front_(one_host(rank, size)) {}

  // NCCL tells no hosts here: the front counts every peer as on this host.
  static fsdp::detail::collective_front one_host(int rank, int size) {
    return {rank, std::vector<int>(static_cast<std::size_t>(size), 0), rank};
  }

  static std::size_t us(int n) noexcept { return static_cast<std::size_t>(n); }

  detail::comm_state& state(std::string_view what) {
    if (!s_) throw error(errc::invalid_argument, std::string(what) + " on a moved-from nccl::communicator");
    return *s_;
  }
  static void no_group(const char* what) {
    if (detail::current_group().depth > 0)
      throw error(errc::invalid_argument, std::string(what) + " inside an nccl::group (it blocks; the group would defer it)");
  }

  // Every collective: NCCL's call for its kind, run().
  cuda_event issue(const collective& c, const void* send, void* recv, cuda_queue& q) {
    const std::size_t count = c.count, bytes = count * size_of(c.type);
    const ncclDataType_t type = detail::nccl_type(c.type);
    const ncclRedOp_t op = c.op == reduce_op::avg ? ncclAvg : ncclSum;
    switch (c.kind) {
      case kind::all_gather:
        return run(c, q, send, recv, [=](const void* s, void* r, ncclComm_t comm, cudaStream_t st) {
          return ncclAllGather(s, r, count, type, comm, st);
        });
      case kind::reduce_scatter: {
        const char* s = static_cast<const char*>(send);
        const char* r = static_cast<const char*>(recv);
        if (r != s + bytes * us(rank()) && bytes && r < s + bytes * us(size()) && s < r + bytes)
          throw error(errc::invalid_argument, "reduce_scatter: send and receive buffers overlap (in place needs recv == send + rank*count)", {rank()});
        return run(c, q, send, recv, [=](const void* sp, void* rp, ncclComm_t comm, cudaStream_t st) {
          return ncclReduceScatter(sp, rp, count, type, op, comm, st);
        });
      }
      case kind::all_reduce:
        return run(c, q, send, recv, [=](const void* sp, void* rp, ncclComm_t comm, cudaStream_t st) {
          return ncclAllReduce(sp, rp, count, type, op, comm, st);
        });
      case kind::broadcast:
        return run(c, q, send, recv, [=, root = c.root](const void* sp, void* rp, ncclComm_t comm, cudaStream_t st) {
          return ncclBroadcast(sp, rp, count, type, root, comm, st);
        });
      case kind::all_to_all:  // NCCL's idiom: a send and a receive per peer in one group
        return run(c, q, send, recv, [=, n = size()](const void* sp, void* rp, ncclComm_t comm, cudaStream_t st) {
          ncclResult_t rc = ncclGroupStart();
          for (int j = 0; j < n && rc == ncclSuccess; ++j) {
            rc = ncclSend(static_cast<const char*>(sp) + us(j) * bytes, count, type, j, comm, st);
            if (rc == ncclSuccess) rc = ncclRecv(static_cast<char*>(rp) + us(j) * bytes, count, type, j, comm, st);
          }
          const ncclResult_t end = ncclGroupEnd();
          return rc != ncclSuccess ? rc : end;
        });
      case kind::send:
        return run(c, q, send, recv, [=, peer = c.root](const void* sp, void*, ncclComm_t comm, cudaStream_t st) {
          return ncclSend(sp, count, type, peer, comm, st);
        });
      case kind::recv:
        return run(c, q, send, recv, [=, peer = c.root](const void*, void* rp, ncclComm_t comm, cudaStream_t st) {
          return ncclRecv(rp, count, type, peer, comm, st);
        });
      case kind::barrier:
      case kind::split: break;
    }
    throw error(errc::internal, c.str() + " is not issued through issue()", {rank()});
  }

  // The front (checks, the communicator not aborted, traffic: comm/front.hpp), then
  // call(send, recv, comm, stream) on q's stream, through staging when a buffer is in host
  // memory (device_resident's rule); returns its event (see the file comment for groups).
  template <class Call>
  cuda_event run(const collective& c, cuda_queue& q, const void* send, void* recv, Call call) {
    const std::string what = c.str();
    auto& st = state(what);
    front_.admit(c, send, recv, [&] { (void)st.handle(what); });
    fsdp::detail::nvtx_range range(to_string(c.kind));
    fsdp::detail::cuda_use(st.ordinal());
    const auto [send_bytes, recv_bytes] = c.buffer_bytes(size());
    // Inside a CUDA graph capture nothing is staged (staging waits on the host), and a buffer the
    // graph allocates is not asked about: its memory is mapped only when the graph is launched.
    const bool stage = !fsdp::detail::capturing(q.native_handle()) &&
                       ((send_bytes && !fsdp::detail::device_resident(send)) || (recv_bytes && !fsdp::detail::device_resident(recv)));
    if (stage) return staged(what, q, send, send_bytes, recv, recv_bytes, call);
    return issue(what, q, [&](ncclComm_t comm, cudaStream_t s) { return call(send, recv, comm, s); });
  }

  template <class Call>
  cuda_event issue(const std::string& what, cuda_queue& q, Call call) {
    auto& st = state(what);
    const cudaStream_t stream = q.native_handle();
    q.watch(s_);
    const ncclResult_t rc = call(st.handle(what), stream);
    auto& g = detail::current_group();
    if (g.depth > 0) {
      if (rc != ncclSuccess && rc != ncclInProgress) st.fail(rc, what);
      cuda_event e = cuda_event::create();  // recorded when the group ends
      e.attach(s_);
      g.comms.push_back(s_);
      g.events.emplace_back(e, stream);
      return e;
    }
    if (rc == ncclInProgress)
      st.settle(what);  // non-blocking: the kernel is enqueued once the call settled
    else if (rc != ncclSuccess)
      st.fail(rc, what);
    cuda_event e = q.record();
    e.attach(s_);
    return e;
  }

  // Host memory: copy in, run, wait (bounded), copy out, all on q's stream.
  template <class Call>
  cuda_event staged(const std::string& collective_name, cuda_queue& q, const void* send, std::size_t send_bytes, void* recv,
                    std::size_t recv_bytes, Call call) {
    const std::string what = collective_name + " (host memory, staged)";
    no_group(what.c_str());
    const cudaStream_t stream = q.native_handle();
    const char* s = static_cast<const char*>(send);
    char* r = static_cast<char*>(recv);
    // In place (send inside recv): stage recv whole and keep send's offset in it.
    const bool inside = s >= r && s + send_bytes <= r + recv_bytes;
    void* tmp = nullptr;
    fsdp::detail::cuda_check(cudaMallocAsync(&tmp, recv_bytes + (inside ? 0 : send_bytes), stream), what + ": cudaMallocAsync");
    char* drecv = static_cast<char*>(tmp);
    const char* dsend = inside ? drecv + (s - r) : drecv + recv_bytes;
    auto free_tmp = [&] {
      if (cudaFreeAsync(tmp, stream) != cudaSuccess) (void)cudaGetLastError();
    };
    try {
      if (inside)
        fsdp::detail::cuda_check(cudaMemcpyAsync(drecv, r, recv_bytes, cudaMemcpyHostToDevice, stream), what + ": copy in");
      else
        fsdp::detail::cuda_check(cudaMemcpyAsync(const_cast<char*>(dsend), s, send_bytes, cudaMemcpyHostToDevice, stream),
                                 what + ": copy in");
      issue(what, q, [&](ncclComm_t c, cudaStream_t st) { return call(dsend, drecv, c, st); }).wait(timeout_, what);
      fsdp::detail::cuda_check(cudaMemcpyAsync(r, drecv, recv_bytes, cudaMemcpyDeviceToHost, stream), what + ": copy out");
      q.synchronize(timeout_);
    } catch (...) {
      free_tmp();
      throw;
    }
    free_tmp();
    return {};
  }

  std::shared_ptr<detail::comm_state> s_;
  milliseconds timeout_{};
  fsdp::detail::collective_front front_;
};

static_assert(full_communicator<communicator>);
static_assert(can_all_to_all<communicator> && can_send_recv<communicator>);


}  // namespace fsdp::nccl
