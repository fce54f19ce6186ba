#pragma once
// For the CUDA tests: counts the CUDA runtime calls that make the host wait for the GPU or that
// allocate or free outside a stream's order (cudaMalloc and cudaFree wait for the whole device),
// whoever makes them (fsdp, Thrust, the test), through CUPTI's callback API, which sees every
// runtime call of the process. fsdp's own bounded waits poll cudaStreamQuery/cudaEventQuery
// instead of calling a synchronize; fsdp::cuda_host_waits() counts those. Only one CUPTI
// subscriber can exist per process: make one counter and read it around the code measured.

#include <cupti.h>

#include <atomic>
#include <string>

#include "fsdp/core/error.hpp"

namespace fsdp_test {

class cuda_api_counter {
 public:
  cuda_api_counter() {
    if (cuptiSubscribe(&sub_, reinterpret_cast<CUpti_CallbackFunc>(&on_call), this) != CUPTI_SUCCESS)
      throw fsdp::error(fsdp::errc::internal, "cuptiSubscribe failed (another CUPTI subscriber, or no CUPTI)");
    if (cuptiEnableDomain(1, sub_, CUPTI_CB_DOMAIN_RUNTIME_API) != CUPTI_SUCCESS)
      throw fsdp::error(fsdp::errc::internal, "cuptiEnableDomain(runtime API) failed");
  }
  cuda_api_counter(const cuda_api_counter&) = delete;
  cuda_api_counter& operator=(const cuda_api_counter&) = delete;
  ~cuda_api_counter() { (void)cuptiUnsubscribe(sub_); }

  //! cudaStreamSynchronize, cudaEventSynchronize, cudaDeviceSynchronize and the blocking cudaMemcpy.
  long synchronizations() const { return syncs_.load(); }
  //! cudaMalloc, cudaFree, cudaMallocHost, cudaHostAlloc, cudaFreeHost (not the stream-ordered
  //! cudaMallocAsync/cudaFreeAsync).
  long allocations() const { return allocs_.load(); }

 private:
  static void CUPTIAPI on_call(void* self, CUpti_CallbackDomain domain, CUpti_CallbackId id, const CUpti_CallbackData* info) {
    if (domain != CUPTI_CB_DOMAIN_RUNTIME_API || info->callbackSite != CUPTI_API_ENTER) return;
    auto* c = static_cast<cuda_api_counter*>(self);
    switch (id) {
      case CUPTI_RUNTIME_TRACE_CBID_cudaStreamSynchronize_v3020:
      case CUPTI_RUNTIME_TRACE_CBID_cudaEventSynchronize_v3020:
      case CUPTI_RUNTIME_TRACE_CBID_cudaDeviceSynchronize_v3020:
      case CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy_v3020: ++c->syncs_; break;
      case CUPTI_RUNTIME_TRACE_CBID_cudaMalloc_v3020:
      case CUPTI_RUNTIME_TRACE_CBID_cudaFree_v3020:
      case CUPTI_RUNTIME_TRACE_CBID_cudaMallocHost_v3020:
      case CUPTI_RUNTIME_TRACE_CBID_cudaHostAlloc_v3020:
      case CUPTI_RUNTIME_TRACE_CBID_cudaFreeHost_v3020: ++c->allocs_; break;
      default: break;
    }
  }

  CUpti_SubscriberHandle sub_ = nullptr;
  std::atomic<long> syncs_{0}, allocs_{0};
};

}  // namespace fsdp_test
