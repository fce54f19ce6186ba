#pragma once
//! \file How long a wait may take: the duration type of every timeout in fsdp, and the bound used
//! when none is given. Shared by the devices (device/) and the communicators (comm/).

#include <chrono>
#include <cstdlib>

namespace fsdp {

//! The unit of every timeout.
using milliseconds = std::chrono::milliseconds;

//! The bound on every wait when none is given: FSDP_TIMEOUT_MS from the environment, else
//! 300 s (PyTorch's NCCL default is 10 minutes; a CPU run should fail sooner).
inline milliseconds default_timeout() {
  if (const char* s = std::getenv("FSDP_TIMEOUT_MS")) {
    char* end = nullptr;
    const long long v = std::strtoll(s, &end, 10);
    if (end != s && *end == '\0' && v > 0) return milliseconds(v);
  }
  return milliseconds(300'000);
}

}  // namespace fsdp
