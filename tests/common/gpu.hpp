#pragma once
// For the CUDA tests (nvcc): whether this machine has a usable GPU. Without one (the build
// machines and CI) the GPU cases skip (doctest::skip(!has_gpu)) and the no-device cases run.

#include <cuda_runtime_api.h>

#include <string>

namespace fsdp_test {

inline bool gpu_available() {
  int n = 0;
  const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  (void)cudaGetLastError();  // a failed query must not show up in the next CUDA call
  return ok;
}
inline const bool has_gpu = gpu_available();

inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace fsdp_test
