#pragma once
//! \file The `nccl` backend: one process (or thread) per GPU, collectives enqueued by NCCL on
//! the CUDA stream of the cuda_queue they are given.
//!
//! Bootstrap: every rank needs rank 0's ncclUniqueId. communicator::from_file_store() passes
//! it through a directory (comm/file_store.hpp); comm/nccl_mpi.hpp broadcasts it over MPI.
//! Communicators are created non-blocking (ncclConfig_t::blocking = 0), so that no NCCL call
//! can hang the host: a call that returns ncclInProgress is polled with ncclCommGetAsyncError
//! against the communicator's timeout.
//!
//! NCCL has no operation timeout. Every host-side wait on a collective's event (event.wait,
//! queue/device synchronize after waiting on it) polls the stream and ncclCommGetAsyncError
//! against a deadline; on an asynchronous error it aborts the communicator (ncclCommAbort, so
//! the kernels of this rank stop) and throws fsdp::error(errc::peer_failure); at the deadline
//! it aborts and throws errc::timeout, naming the collective. shard_group also aborts the
//! communicator when it is left by an exception, so peers fail at once instead of at their
//! own deadline.
//!
//! Arguments in host memory (shard_group_sum's double, a training loop's statistics) are
//! staged through device memory on the queue's stream; such a call then waits for itself
//! (bounded) and returns a completed event. Device memory takes the asynchronous path.
//!
//! Reductions are NCCL's own (ring or tree, chosen by NCCL): they add the ranks in another order
//! than the host backends' rank order (comm/rank_order_sum.hpp), so a run on NCCL agrees with
//! threads and mpi to rounding, not bit for bit.
//!
//! Groups: collectives issued while an nccl::group is alive are launched together when it ends
//! (ncclGroupStart / ncclGroupEnd), e.g. one reduce-scatter per bucket as a single launch. Their
//! events are recorded when the group ends; wait on them only after that.
//!
//!   fsdp::cuda_device gpu{local_rank};
//!   auto comm = fsdp::nccl::communicator::from_file_store(gpu, rank, world, fsdp::file_store{"/tmp/run42"});
//!   fsdp::shard_group<fsdp::buffer<float>, fsdp::nccl::communicator> group{comm, gpu};

#include <nccl.h>

#include <chrono>
#include <cstddef>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fsdp/comm/concepts.hpp"
#include "fsdp/comm/file_store.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/detail/backoff.hpp"
#include "fsdp/device/cuda.hpp"

namespace fsdp::nccl {

//! The id every rank of a new communicator must share (rank 0 creates it).
using unique_id = ncclUniqueId;

//! A fresh ncclUniqueId (on rank 0; hand it to the others). Needs no GPU.
inline unique_id make_unique_id() {
  unique_id id{};
  const ncclResult_t rc = ncclGetUniqueId(&id);
  if (rc != ncclSuccess) throw error(errc::internal, std::string("ncclGetUniqueId failed: ") + ncclGetErrorString(rc));
  return id;
}

namespace detail {

inline ncclDataType_t nccl_type(dtype t) {
  switch (t) {
    case dtype::f32: return ncclFloat32;
    case dtype::f64: return ncclFloat64;
    case dtype::bf16: return ncclBfloat16;
    case dtype::f16: return ncclFloat16;
    case dtype::i32: return ncclInt32;
    case dtype::i64: return ncclInt64;
    case dtype::u8: return ncclUint8;
  }
  return ncclUint8;
}

//! Non-blocking: no NCCL call may hang the host (see the file comment).
inline ncclConfig_t nonblocking_config() {
  ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
  c.blocking = 0;
  return c;
}

//! Polls ncclCommGetAsyncError until the communicator's pending non-blocking call settled.
//! Returns its result, or ncclInProgress when `timeout` passed first.
inline ncclResult_t poll_async(ncclComm_t c, milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  fsdp::detail::backoff idle = fsdp::detail::backoff::device_wait();
  for (;;) {
    ncclResult_t state = ncclInProgress;
    const ncclResult_t rc = ncclCommGetAsyncError(c, &state);
    if (rc != ncclSuccess) return rc;
    if (state != ncclInProgress) return state;
    if (std::chrono::steady_clock::now() > deadline) return ncclInProgress;
    idle.pause();
  }
}

//! What copies of a communicator's handle share: the ncclComm_t until it is destroyed or
//! aborted. It is the wait_watcher attached to the communicator's events.
class comm_state final : public fsdp::detail::wait_watcher {
 public:
  comm_state(ncclComm_t c, int rank, int size, int ordinal, milliseconds timeout)
      : comm_(c), rank_(rank), size_(size), ordinal_(ordinal), timeout_(timeout) {}
  comm_state(const comm_state&) = delete;
  comm_state& operator=(const comm_state&) = delete;
  //! Flushes and destroys the communicator (ncclCommFinalize, bounded by the timeout; a
  //! communicator that cannot finish in time is aborted instead).
  ~comm_state() override {
    std::lock_guard lock(m_);
    if (comm_) {
      const ncclResult_t rc = ncclCommFinalize(comm_);
      const bool flushed = (rc == ncclSuccess || rc == ncclInProgress) && poll_async(comm_, timeout_) == ncclSuccess;
      (void)(flushed ? ncclCommDestroy(comm_) : ncclCommAbort(comm_));
      comm_ = nullptr;
    }
    if (scratch_) (void)cudaFree(scratch_);
    if (side_) (void)cudaStreamDestroy(side_);
    (void)cudaGetLastError();
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  int ordinal() const noexcept { return ordinal_; }
  //! Sets rank and size once known (a split communicator, before it is shared).
  void identify(int rank, int size) noexcept {
    rank_ = rank;
    size_ = size;
  }
  milliseconds timeout() const noexcept { return timeout_; }

  //! The handle for a new call; throws errc::peer_failure once aborted.
  ncclComm_t handle(std::string_view what) {
    std::lock_guard lock(m_);
    if (!comm_) throw error(errc::peer_failure, std::string(what) + ": the NCCL communicator was aborted (" + reason_ + ")", {rank_});
    return comm_;
  }
  ncclComm_t native_handle() const noexcept {
    std::lock_guard lock(m_);
    return comm_;
  }

  //! Waits (bounded) for the pending non-blocking call `what` to settle; throws on failure.
  void settle(std::string_view what) {
    const ncclComm_t c = handle(what);
    const ncclResult_t r = poll_async(c, timeout_);
    if (r == ncclSuccess) return;
    if (r == ncclInProgress) {
      abort(std::string(what) + " timed out");
      throw error(errc::timeout, std::string(what) + ": not complete after " + std::to_string(timeout_.count()) +
                                     " ms; aborted the NCCL communicator (are all " + std::to_string(size_) +
                                     " ranks running, with the same id and the same collectives?)", {rank_});
    }
    fail(r, what);
  }

  //! Throws for a failed call: invalid arguments leave the communicator usable; any other
  //! failure aborts it.
  [[noreturn]] void fail(ncclResult_t rc, std::string_view what) {
    std::string text = std::string(what) + " failed: " + ncclGetErrorString(rc);
    {
      std::lock_guard lock(m_);
      if (comm_) {
        const char* last = ncclGetLastError(comm_);
        if (last && *last) text += std::string(" (") + last + ")";
      }
    }
    if (rc == ncclInvalidArgument || rc == ncclInvalidUsage) throw error(errc::invalid_argument, text, {rank_});
    abort(text);
    throw error(errc::peer_failure, text + "; aborted the NCCL communicator", {rank_});
  }

  // wait_watcher: an asynchronous error (a peer failed, a network error) ends the wait.
  void check(std::string_view what) override {
    std::string text;
    {
      std::lock_guard lock(m_);
      if (!comm_)
        throw error(errc::peer_failure, "waiting for " + std::string(what) + ": the NCCL communicator was aborted (" + reason_ + ")", {rank_});
      ncclResult_t state = ncclSuccess;
      const ncclResult_t rc = ncclCommGetAsyncError(comm_, &state);
      const ncclResult_t bad = rc != ncclSuccess ? rc : state;
      if (bad == ncclSuccess || bad == ncclInProgress) return;
      text = "waiting for " + std::string(what) + ": NCCL reported " + ncclGetErrorString(bad);
      const char* last = ncclGetLastError(comm_);
      if (last && *last) text += std::string(" (") + last + ")";
      abort_locked(text);
    }
    throw error(errc::peer_failure, text + "; aborted the NCCL communicator", {rank_});
  }
  std::string abort_on_timeout(std::string_view what) noexcept override {
    abort(std::string(what) + " timed out");
    return "aborted the NCCL communicator (rank " + std::to_string(rank_) + " of " + std::to_string(size_) +
           "; a peer is stuck, gone, or issued different collectives)";
  }

  //! ncclCommAbort: this rank's kernels of the communicator stop; later calls fail at once.
  void abort(std::string_view reason) noexcept {
    std::lock_guard lock(m_);
    abort_locked(reason);
  }
  bool aborted() const noexcept {
    std::lock_guard lock(m_);
    return comm_ == nullptr;
  }

  //! A device int and a private stream for barrier(), created on first use.
  std::pair<int*, cudaStream_t> barrier_resources() {
    std::lock_guard lock(m_);
    if (!side_) fsdp::detail::cuda_check(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking), "creating the barrier stream");
    if (!scratch_) fsdp::detail::cuda_check(cudaMalloc(&scratch_, sizeof(int)), "cudaMalloc for barrier");
    return {static_cast<int*>(scratch_), side_};
  }

 private:
  void abort_locked(std::string_view reason) noexcept {
    if (!comm_) return;
    (void)ncclCommAbort(comm_);
    comm_ = nullptr;
    reason_ = std::string(reason);
  }

  mutable std::mutex m_;
  ncclComm_t comm_ = nullptr;  // null once aborted
  std::string reason_;
  int rank_, size_, ordinal_;
  milliseconds timeout_;
  void* scratch_ = nullptr;
  cudaStream_t side_ = nullptr;
};

//! Collectives issued on this thread inside open nccl::group scopes, launched at the end of
//! the outermost one.
struct open_group {
  int depth = 0;
  std::vector<std::shared_ptr<comm_state>> comms;
  std::vector<std::pair<cuda_event, cudaStream_t>> events;
};
inline open_group& current_group() {
  thread_local open_group g;
  return g;
}

//! True for memory NCCL can use directly (device or managed); host memory gets staged.
inline bool device_accessible(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

}  // namespace detail

//! RAII: collectives issued on this thread while the guard lives are launched together at its
//! end (ncclGroupStart / ncclGroupEnd); nesting is allowed. Their events are valid after the
//! outermost group ended. end() (or the destructor, when no exception is unwinding) waits,
//! bounded, for NCCL to accept the group and throws on failure.
//!
//!   { fsdp::nccl::group g;
//!     for (auto& b : buckets) events.push_back(comm.reduce_scatter(b.grads, b.shard, b.n, t, op, q)); }
class group {
 public:
  group() {
    const ncclResult_t rc = ncclGroupStart();
    if (rc != ncclSuccess) throw error(errc::internal, std::string("ncclGroupStart failed: ") + ncclGetErrorString(rc));
    ++detail::current_group().depth;
  }
  group(const group&) = delete;
  group& operator=(const group&) = delete;
  ~group() noexcept(false) {
    if (ended_) return;
    if (std::uncaught_exceptions() > exceptions_) {
      try {
        end();
      } catch (...) {  // the exception already unwinding is the one to report
      }
    } else {
      end();
    }
  }

  //! Ends the group now: launches its collectives (when outermost) and records their events.
  void end() {
    if (ended_) return;
    ended_ = true;
    auto& g = detail::current_group();
    --g.depth;
    const ncclResult_t rc = ncclGroupEnd();
    const bool accepted = rc == ncclSuccess || rc == ncclInProgress;
    if (g.depth > 0) {  // an inner group: the outermost end launches
      if (!accepted) throw error(errc::internal, std::string("ncclGroupEnd (inner) failed: ") + ncclGetErrorString(rc));
      return;
    }
    auto comms = std::move(g.comms);
    auto events = std::move(g.events);
    g.comms.clear();
    g.events.clear();
    if (!accepted) {
      const std::string text = std::string("ncclGroupEnd failed: ") + ncclGetErrorString(rc);
      for (auto& c : comms) c->abort(text);
      throw error(errc::peer_failure, text + "; aborted the group's NCCL communicators");
    }
    for (std::size_t i = 0; i < comms.size(); ++i) {
      bool seen = false;
      for (std::size_t j = 0; j < i; ++j) seen = seen || comms[j] == comms[i];
      if (!seen) comms[i]->settle("a group of NCCL collectives");
    }
    for (auto& [e, stream] : events) e.record_on(stream);
  }

 private:
  bool ended_ = false;
  int exceptions_ = std::uncaught_exceptions();
};

//! One rank's handle on an NCCL communicator, for shard_group. Move-only; created by the
//! constructor (with a shared unique_id), from_file_store(), or split().
class communicator {
 public:
  using device_type = cuda_device;

  //! Collective over `size` ranks: joins the communicator named by `id` as `rank`, on `device`
  //! (made current). Every wait is bounded by `timeout`.
  communicator(const cuda_device& device, int rank, int size, const unique_id& id, milliseconds timeout = default_timeout())
      : rank_(rank), size_(size), timeout_(timeout) {
    if (size < 1 || rank < 0 || rank >= size)
      throw error(errc::invalid_argument, "nccl::communicator: rank " + std::to_string(rank) + " of " + std::to_string(size) +
                                              " ranks is not a valid rank");
    device.make_current();
    ncclConfig_t cfg = detail::nonblocking_config();
    ncclComm_t c = nullptr;
    const ncclResult_t rc = ncclCommInitRankConfig(&c, size, id, rank, &cfg);
    if (c == nullptr)
      throw error(errc::internal, std::string("ncclCommInitRankConfig failed: ") + ncclGetErrorString(rc), {rank});
    s_ = std::make_shared<detail::comm_state>(c, rank, size, device.ordinal(), timeout);
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

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  ncclComm_t native_handle() const noexcept { return s_ ? s_->native_handle() : nullptr; }
  milliseconds timeout() const noexcept { return timeout_; }
  traffic_counters traffic() const noexcept { return traffic_; }

  //! recv[r*count, (r+1)*count) = rank r's send; in place when send == recv + rank*count.
  cuda_event all_gather(const void* send, void* recv, std::size_t count, dtype t, cuda_queue& q) {
    const std::size_t bytes = count * size_of(t);
    traffic_.add_all_gather(count, t, size_);
    const ncclDataType_t type = detail::nccl_type(t);
    return run("all_gather", count, t, q, send, bytes, recv, bytes * us(size_),
               [=](const void* s, void* r, ncclComm_t c, cudaStream_t st) { return ncclAllGather(s, r, count, type, c, st); });
  }

  //! recv = op over ranks of send[rank*count, (rank+1)*count); in place when
  //! recv == send + rank*count, otherwise the buffers must not overlap.
  cuda_event reduce_scatter(const void* send, void* recv, std::size_t count, dtype t, reduce_op op, cuda_queue& q) {
    fsdp::detail::require_reducible(t, "reduce_scatter", rank_);
    const std::size_t bytes = count * size_of(t);
    const char* s = static_cast<const char*>(send);
    const char* r = static_cast<const char*>(recv);
    const bool in_place = r == s + bytes * us(rank_);
    if (!in_place && bytes && r < s + bytes * us(size_) && s < r + bytes)
      throw error(errc::invalid_argument, "reduce_scatter: send and receive buffers overlap (in place needs recv == send + rank*count)", {rank_});
    traffic_.add_reduce_scatter(count, t, size_);
    const ncclDataType_t type = detail::nccl_type(t);
    const ncclRedOp_t o = nccl_op(op);
    return run("reduce_scatter", count, t, q, send, bytes * us(size_), recv, bytes,
               [=](const void* sp, void* rp, ncclComm_t c, cudaStream_t st) { return ncclReduceScatter(sp, rp, count, type, o, c, st); });
  }

  //! recv = op over ranks of send; in place when send == recv.
  cuda_event all_reduce(const void* send, void* recv, std::size_t count, dtype t, reduce_op op, cuda_queue& q) {
    fsdp::detail::require_reducible(t, "all_reduce", rank_);
    const std::size_t bytes = count * size_of(t);
    traffic_.add_all_reduce(count, t, size_);
    const ncclDataType_t type = detail::nccl_type(t);
    const ncclRedOp_t o = nccl_op(op);
    return run("all_reduce", count, t, q, send, bytes, recv, bytes,
               [=](const void* sp, void* rp, ncclComm_t c, cudaStream_t st) { return ncclAllReduce(sp, rp, count, type, o, c, st); });
  }

  //! Every rank's buf = root's buf.
  cuda_event broadcast(void* buf, std::size_t count, dtype t, int root, cuda_queue& q) {
    if (root < 0 || root >= size_)
      throw error(errc::invalid_argument, "broadcast root " + std::to_string(root) + " is not a rank of a group of " +
                                              std::to_string(size_), {rank_});
    const std::size_t bytes = count * size_of(t);
    traffic_.add_broadcast(count, t, size_);
    const ncclDataType_t type = detail::nccl_type(t);
    return run("broadcast", count, t, q, buf, bytes, buf, bytes,
               [=](const void* sp, void* rp, ncclComm_t c, cudaStream_t st) { return ncclBroadcast(sp, rp, count, type, root, c, st); });
  }

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
    if (color < 0) throw error(errc::invalid_argument, "split color must be >= 0, got " + std::to_string(color), {rank_});
    no_group("split");
    auto& st = state("split");
    fsdp::detail::cuda_use(st.ordinal());
    ncclConfig_t cfg = detail::nonblocking_config();
    ncclComm_t out = nullptr;
    const ncclResult_t rc = ncclCommSplit(st.handle("split"), color, key, &out, &cfg);
    if (rc != ncclSuccess && rc != ncclInProgress) st.fail(rc, "ncclCommSplit");
    st.settle("ncclCommSplit");
    if (out == nullptr) throw error(errc::internal, "ncclCommSplit returned no communicator", {rank_});
    // The new communicator settles on its own: wait for it before asking its rank and size.
    auto child = std::make_shared<detail::comm_state>(out, rank_, size_, st.ordinal(), timeout_);
    child->settle("ncclCommSplit (new communicator)");
    int r = 0, n = 0;
    if (ncclCommUserRank(out, &r) != ncclSuccess || ncclCommCount(out, &n) != ncclSuccess)
      throw error(errc::internal, "ncclCommSplit: cannot read the new communicator's rank and size", {rank_});
    child->identify(r, n);
    return communicator(std::move(child), r, n, timeout_);
  }

  //! ncclCommAbort: this rank's collectives stop, and every later call or wait fails at once
  //! with errc::peer_failure naming `reason`. shard_group calls it when left by an exception.
  void abort(std::string_view reason) noexcept {
    if (s_) s_->abort(reason);
  }
  bool aborted() const noexcept { return !s_ || s_->aborted(); }

 private:
  communicator(std::shared_ptr<detail::comm_state> s, int rank, int size, milliseconds timeout)
      : s_(std::move(s)), rank_(rank), size_(size), timeout_(timeout) {}

  static std::size_t us(int n) noexcept { return static_cast<std::size_t>(n); }
  static ncclRedOp_t nccl_op(reduce_op op) noexcept { return op == reduce_op::avg ? ncclAvg : ncclSum; }

  detail::comm_state& state(std::string_view what) {
    if (!s_) throw error(errc::invalid_argument, std::string(what) + " on a moved-from nccl::communicator");
    return *s_;
  }
  static void no_group(const char* what) {
    if (detail::current_group().depth > 0)
      throw error(errc::invalid_argument, std::string(what) + " inside an nccl::group (it blocks; the group would defer it)");
  }

  // Issues call(send, recv, comm, stream) on q's stream and returns its event (see the file
  // comment for groups and host memory).
  template <class Call>
  cuda_event run(const char* kind, std::size_t count, dtype t, cuda_queue& q, const void* send, std::size_t send_bytes,
                 void* recv, std::size_t recv_bytes, Call call) {
    auto& st = state(kind);
    fsdp::detail::nvtx_range range(kind);
    fsdp::detail::cuda_use(st.ordinal());
    if (send_bytes && recv_bytes && !(detail::device_accessible(send) && detail::device_accessible(recv)))
      return staged(kind, count, t, q, send, send_bytes, recv, recv_bytes, call);
    return issue(fsdp::detail::describe(kind, count, t), q, [&](ncclComm_t c, cudaStream_t s) { return call(send, recv, c, s); });
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
  cuda_event staged(const char* kind, std::size_t count, dtype t, cuda_queue& q, const void* send, std::size_t send_bytes,
                    void* recv, std::size_t recv_bytes, Call call) {
    const std::string what = fsdp::detail::describe(kind, count, t) + " (host memory, staged)";
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
  int rank_ = 0;
  int size_ = 1;
  milliseconds timeout_{};
  traffic_counters traffic_{};
};

static_assert(full_communicator<communicator>);

}  // namespace fsdp::nccl
