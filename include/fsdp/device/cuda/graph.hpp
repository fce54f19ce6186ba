#pragma once
//! \file fsdp::cuda_graph: stream work captured once and launched again (device/cuda.hpp
//! includes it).

#if !defined(__CUDACC__)
#error "fsdp/device/cuda/graph.hpp needs nvcc: include fsdp/device/cuda.hpp from a CUDA source"
#endif

#include <cstddef>
#include <utility>

#include <cuda_runtime_api.h>

#include "fsdp/core/error.hpp"
#include "fsdp/device/cuda/waits.hpp"

namespace fsdp {

//! A CUDA graph: the work issued on a stream (and on the streams that wait on its events) while
//! a function runs, captured once and launched as often as wanted, without the host issuing each
//! kernel and collective again.
//!
//! For an fsdp step: once a plan is replayed (the first step has recorded the order, and every
//! issue point and reduction wait is fixed), the step's kernels, all-gathers, reduce-scatters
//! and cross-stream waits are the same every step, which is what capture needs. Capture the
//! forward, backward and optimizer step from the compute stream; the queues join the capture
//! through the events they wait on; NCCL collectives are capturable. What must hold: the step
//! allocates the same sizes in the same order (the device's pool gives graph-owned memory),
//! nothing in it synchronizes with the host, and parameter handles are read only inside the
//! captured region. Capture and relaunch of stream work passed on an H100 (tests/cuda/test_cuda.cu);
//! a whole shard_group step has not been captured (docs/gpu.md, "CUDA graphs").
//!
//!   auto graph = fsdp::cuda_graph::capture(stream, [&] { /* issue one step */ });
//!   for (int s = 0; s < steps; ++s) graph.launch(stream);
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
    detail::cuda_check(cudaGraphInstantiate(&g.exec_, graph, 0), "cudaGraphInstantiate");
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
