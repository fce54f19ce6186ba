#pragma once
#include "fsdp/comm/mpi.hpp"

namespace fsdp_test {
extern fsdp::mpi::environment* mpi_environment;
// A fresh world communicator for one test (20 s timeout: a test that fails on one rank makes
// the others fail in bounded time).
inline fsdp::mpi::communicator mpi_world(std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  return mpi_environment->world(timeout);
}
}  // namespace fsdp_test
