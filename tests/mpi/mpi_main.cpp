// doctest main for tests that run as MPI processes (Debian's doctest has no doctest_mpi.h).
// Every rank runs every test case; rank 0 reports in full, the others only their failures;
// every rank exits with the worst result of all ranks.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "mpi_env.hpp"

namespace fsdp_test {
fsdp::mpi::environment* mpi_environment = nullptr;
}

int main(int argc, char** argv) {
  fsdp::mpi::environment env(argc, argv);
  fsdp_test::mpi_environment = &env;
  doctest::Context ctx(argc, argv);
  if (env.rank() != 0) ctx.setOption("minimal", true);
  const int result = ctx.run();
  // Through fsdp's communicator, so that only the engine thread calls MPI (a raw MPI call here,
  // beside the engine's polling, showed up under ThreadSanitizer as races inside Open MPI).
  double failures = result != 0 ? 1.0 : 0.0;
  {
    fsdp::mpi::communicator comm = env.world();
    fsdp::host_queue q;
    comm.all_reduce(&failures, &failures, 1, fsdp::dtype::f64, fsdp::reduce_op::sum, q).wait(comm.timeout());
  }
  return failures > 0 ? 1 : 0;
}
