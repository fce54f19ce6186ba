#pragma once
//! \file nccl::group: collectives issued on a thread while the guard lives are launched together
//! at its end (ncclGroupStart / ncclGroupEnd), e.g. one reduce-scatter per bucket as a single
//! launch. Their events are recorded when the group ends; wait on them only after that.

#include <nccl.h>

#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/comm/nccl/comm_state.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/device/cuda.hpp"

namespace fsdp::nccl {

namespace detail {

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

}  // namespace fsdp::nccl
