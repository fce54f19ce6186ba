#pragma once
//! \file NCCL's zero-copy buffers for a cuda_device: registered_memory(comm) is a
//! cuda_memory_source (device/cuda/block_cache.hpp) whose blocks come from ncclMemAlloc (VMM
//! memory, which NCCL can export to its peers) and are registered with `comm` (ncclCommRegister,
//! NCCL's local registration). A collective whose buffers are all registered reads and writes
//! them directly instead of through NCCL's own staging buffers: fewer copies and channels within
//! a node, and NVLink SHARP and IB SHARP need it (NCCL's user guide, "User Buffer Registration").
//!
//!   model m(gpu);                                           // the model's own buffers: fsdp's pool
//!   gpu.use_memory(fsdp::nccl::registered_memory(comm));    // the group's buffers: registered
//!   fsdp::shard_group<...> group{comm, gpu};
//!
//! Every rank of the communicator must do the same: NCCL requires that all ranks pass registered
//! buffers to a collective, or none. Only `comm`'s collectives use the registrations (a split
//! communicator's would be its own). The source keeps the communicator's NCCL state alive until
//! its last block is deregistered: NCCL's own clean-up of registrations left at ncclCommDestroy
//! runs after it stopped its proxy threads, which deregistration talks to (NCCL 2.30.7,
//! init.cc's commFree), so a communicator destroyed before the device would take that path.
//! After an abort there is nothing to deregister (deregister_memory does nothing). Each block is
//! rounded up to the allocation granularity (2 MiB on current GPUs; ncclMemAlloc). With
//! NCCL_CUMEM_ENABLE=0, ncclMemAlloc gives cudaMalloc memory, which NCCL does not register.

#include <nccl.h>

#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "fsdp/comm/nccl/communicator.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/device/cuda.hpp"

namespace fsdp::nccl {

inline cuda_memory_source registered_memory(const communicator& comm) {
  if (!comm.s_) throw error(errc::invalid_argument, "nccl::registered_memory: the communicator was moved from");
  struct registrations {
    std::shared_ptr<detail::comm_state> comm;
    std::mutex m;
    std::unordered_map<void*, void*> handles;  // block -> its ncclCommRegister handle
  };
  auto r = std::make_shared<registrations>();
  r->comm = comm.s_;
  return {"NCCL registered memory (ncclMemAlloc, ncclCommRegister)",
          [r](std::size_t bytes) -> void* {
            void* p = nullptr;
            if (const ncclResult_t rc = ncclMemAlloc(&p, bytes); rc != ncclSuccess)
              throw error(errc::internal, "ncclMemAlloc of " + std::to_string(bytes) + " bytes: " + ncclGetErrorString(rc));
            void* h = nullptr;
            try {
              h = r->comm->register_memory(p, bytes);
              std::lock_guard lock(r->m);
              r->handles.emplace(p, h);
            } catch (...) {
              r->comm->deregister_memory(h);  // before the memory goes: a stale registration would match its next owner
              (void)ncclMemFree(p);
              throw;
            }
            return p;
          },
          [r](void* p) {
            void* h = nullptr;
            {
              std::lock_guard lock(r->m);
              if (const auto it = r->handles.find(p); it != r->handles.end()) {
                h = it->second;
                r->handles.erase(it);
              }
            }
            r->comm->deregister_memory(h);
            (void)ncclMemFree(p);
          }};
}

}  // namespace fsdp::nccl
