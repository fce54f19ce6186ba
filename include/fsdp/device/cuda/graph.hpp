#pragma once
//! \file fsdp::cuda_graph: stream work captured once and launched again (device/cuda.hpp
//! includes it).

#if !defined(__CUDACC__)
#error "fsdp/device/cuda/graph.hpp needs nvcc: include fsdp/device/cuda.hpp from a CUDA source"
#endif

#include <cstddef>
#include <string>
#include <utility>

#include <cuda_runtime_api.h>

#include "fsdp/core/error.hpp"
#include "fsdp/device/cuda/waits.hpp"

namespace fsdp {

//! A CUDA graph: the work issued on a stream (and on the streams that wait on its events) while
//! a function runs, captured once and launched as often as wanted, without the host issuing each
//! kernel and collective again.
//!
//! For an fsdp step, capture(device, step): once a plan is replayed (the first step has
//! recorded the order, and every issue point and reduction wait is fixed), the step's kernels,
//! all-gathers, reduce-scatters and cross-stream waits are the same every step, which is what
//! capture needs. It captures from the device's compute stream; the collectives' queues join the
//! capture through the compute events they wait on (shard_group's queues wait on compute before
//! each collective); NCCL collectives are capturable. A buffer the step allocates is a node of
//! the graph on the stream that uses it first and its free another (device/cuda/memory.hpp), so
//! the addresses the captured kernels read are the same at every launch and memory is reused as
//! in the eager step. What must hold: nothing in the step makes the host wait (fsdp refuses by
//! name: clipping's norm, refuse_nonfinite_grads, AdamW's bias corrections unless capturable, offload,
//! hpZ's copy), the step frees what it allocates (finish_backward reshards every bucket), and
//! the host code around it does not change what the step issues. A launch runs no host code:
//! optimizer step counts (but capturable AdamW's, kept on the device), the profiler and traffic
//! counters count the captured step once.
//! Capture and relaunch of stream work passed on an H100 (tests/cuda/test_cuda.cu); a whole
//! shard_group step has not run captured on a GPU yet (docs/gpu.md, "CUDA graphs").
//!
//!   auto graph = fsdp::cuda_graph::capture(gpu, [&] { /* forward, backward, opt.step(), zero_grad */ });
//!   for (int s = 0; s < steps; ++s) graph.launch(gpu.compute_stream());
class cuda_graph {
 public:
  //! Captures what `issue()` puts on `origin` (thread-local capture mode). Throws fsdp::error
  //! when capture fails, and rethrows what `issue` throws after ending the capture.
  template <class F>
  static cuda_graph capture(cudaStream_t origin, F&& issue) {
    detail::cuda_check(cudaStreamBeginCapture(origin, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture", errc::no_device);
    cudaGraph_t graph = nullptr;
    try {
      issue();
    } catch (...) {
      if (cudaStreamEndCapture(origin, &graph) == cudaSuccess && graph) (void)cudaGraphDestroy(graph);
      (void)cudaGetLastError();
      throw;
    }
    detail::cuda_check(cudaStreamEndCapture(origin, &graph), "cudaStreamEndCapture (a synchronizing call inside the capture?)");
    cuda_graph g;
    g.graph_ = graph;
    // Node priorities: the collectives' high-priority streams (shard_group's
    // collectives_high_priority) become their nodes' priority, which a launch ignores without it.
    detail::cuda_check(cudaGraphInstantiate(&g.exec_, graph, cudaGraphInstantiateFlagUseNodePriority), "cudaGraphInstantiate");
    return g;
  }
  //! capture(device.compute_stream(), issue), for a step of a shard_group on `device` (a
  //! cuda_device): also throws fsdp::error(errc::invalid_argument) when the captured work left
  //! buffers it allocated unfreed, which a second launch could not allocate again.
  template <class Device, class F>
    requires requires(const Device& d) {
      d.compute_stream();
      d.graph_allocations();
    }
  static cuda_graph capture(const Device& device, F&& issue) {
    const long before = device.graph_allocations();
    cuda_graph g = capture(device.compute_stream(), std::forward<F>(issue));
    if (const long left = device.graph_allocations() - before; left != 0)
      throw error(errc::invalid_argument, "cuda_graph::capture: the captured work left " + std::to_string(left) +
                                              " buffer(s) it allocated unfreed; a graph must free what it allocates (a shard_group step "
                                              "ends with finish_backward, or an optimizer's step(), which reshards every bucket)");
    return g;
  }
  cuda_graph(cuda_graph&& o) noexcept : graph_(std::exchange(o.graph_, nullptr)), exec_(std::exchange(o.exec_, nullptr)) {}
  cuda_graph& operator=(cuda_graph&& o) noexcept {
    std::swap(graph_, o.graph_);
    std::swap(exec_, o.exec_);
    return *this;
  }
  ~cuda_graph() {
    if (exec_) (void)cudaGraphExecDestroy(exec_);
    if (graph_) (void)cudaGraphDestroy(graph_);
  }
  //! Runs the captured work on `stream`, ordered after what was issued there before.
  void launch(cudaStream_t stream) const { detail::cuda_check(cudaGraphLaunch(exec_, stream), "cudaGraphLaunch"); }
  //! Nodes in the graph (kernels, copies, collectives, waits).
  std::size_t nodes() const {
    std::size_t n = 0;
    detail::cuda_check(cudaGraphGetNodes(graph_, nullptr, &n), "cudaGraphGetNodes");
    return n;
  }

 private:
  cuda_graph() = default;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace fsdp
