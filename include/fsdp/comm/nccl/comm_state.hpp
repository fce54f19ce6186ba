#pragma once
//! \file One NCCL communicator's shared state (comm_state: the ncclComm_t until it is destroyed
//! or aborted, and the wait_watcher its events carry), the unique id that bootstraps it, and the
//! polling of NCCL's non-blocking calls (comm/nccl.hpp says why every call is non-blocking).

#include <nccl.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

#include "fsdp/core/backoff.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
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
//! Returns its result, or ncclInProgress when `timeout` passed first, or when `gone` (asked
//! between polls, where given) returned a reason, which it then leaves in `*why`.
inline ncclResult_t poll_async(ncclComm_t c, milliseconds timeout, const std::function<std::string()>& gone = {},
                               std::string* why = nullptr) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  fsdp::detail::backoff idle = fsdp::detail::backoff::device_wait();
  for (;;) {
    ncclResult_t state = ncclInProgress;
    const ncclResult_t rc = ncclCommGetAsyncError(c, &state);
    if (rc != ncclSuccess) return rc;
    if (state != ncclInProgress) return state;
    if (gone && why) {
      if (*why = gone(); !why->empty()) return ncclInProgress;
    }
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

  //! A side channel's word on the peers (empty while all live; else why not), asked in every
  //! wait: NCCL itself does not notice a peer that died inside a collective over NVLink or
  //! shared memory, its kernels spin. Set before the communicator is shared.
  using peer_watch = std::function<std::string()>;
  void watch(peer_watch w) { watch_ = std::move(w); }
  const peer_watch& watcher() const noexcept { return watch_; }

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

  //! Waits (bounded) for the pending non-blocking call `what` to settle; throws on failure. A
  //! collective's call settles once NCCL connected its peers: the side channel (watch) is asked
  //! meanwhile, so a peer known gone ends the wait at once.
  void settle(std::string_view what) {
    const ncclComm_t c = handle(what);
    std::string gone;
    const ncclResult_t r = poll_async(c, timeout_, watch_, &gone);
    if (!gone.empty()) {
      const std::string text = std::string(what) + ": " + gone;
      abort(text);
      throw error(errc::peer_failure, text + "; aborted the NCCL communicator", {rank_});
    }
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
      if (watch_) {
        if (std::string gone = watch_(); !gone.empty()) {
          text = "waiting for " + std::string(what) + ": " + gone;
          abort_locked(text);
          throw error(errc::peer_failure, text + "; aborted the NCCL communicator", {rank_});
        }
      }
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

  //! ncclCommRegister of `bytes` at `p` for zero-copy collectives (comm/nccl/registered_memory.hpp);
  //! the handle for deregister. Throws errc::peer_failure once aborted.
  void* register_memory(void* p, std::size_t bytes) {
    std::lock_guard lock(m_);
    if (!comm_) throw error(errc::peer_failure, "ncclCommRegister: the NCCL communicator was aborted (" + reason_ + ")", {rank_});
    void* h = nullptr;
    const ncclResult_t rc = ncclCommRegister(comm_, p, bytes, &h);
    if (rc != ncclSuccess)
      throw error(errc::internal, "ncclCommRegister of " + std::to_string(bytes) + " bytes: " + ncclGetErrorString(rc), {rank_});
    return h;
  }
  //! ncclCommDeregister; nothing once aborted (ncclCommAbort dropped every registration).
  void deregister_memory(void* handle) noexcept {
    std::lock_guard lock(m_);
    if (comm_ && handle) (void)ncclCommDeregister(comm_, handle);
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
  peer_watch watch_;
  int rank_, size_, ordinal_;
  milliseconds timeout_;
  void* scratch_ = nullptr;
  cudaStream_t side_ = nullptr;
};

}  // namespace detail
}  // namespace fsdp::nccl
