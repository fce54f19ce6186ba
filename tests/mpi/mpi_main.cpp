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
  int result = ctx.run();
  int worst = result;
  MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return worst;
}
