// A rank that fails: rank 1 throws while the others wait in a collective with a 60 s timeout.
// Its shard_group, left by the exception, tells every rank (communicator::abort); the others
// must end with errc::peer_failure naming rank 1 within seconds, not at their timeout, and
// every rank's error must be printed before MPI_Abort ends the job.
#include <chrono>
#include <cstdio>
#include <stdexcept>

#include "fsdp/fsdp.hpp"
#include "fsdp/comm/mpi.hpp"

int main(int argc, char** argv) {
  fsdp::mpi::environment env(argc, argv);
  auto comm = env.world(std::chrono::milliseconds(60000));
  const auto start = std::chrono::steady_clock::now();
  const auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  try {
    fsdp::buffer<float> w(1000, "w");
    fsdp::shard_group<fsdp::buffer<float>, fsdp::mpi::communicator> group{comm};
    group.add_unit({&w});
    group.finalize(fsdp::init::broadcast_from{0});
    if (comm.rank() == 1) throw std::runtime_error("injected failure on rank 1");
    auto s = group.forward(0);
  } catch (const std::exception& e) {
    std::printf("rank %d after %.1f s: %s\n", comm.rank(), seconds(), e.what());
    std::fflush(stdout);
    return 3;
  }
  std::printf("rank %d: no error\n", comm.rank());
  return 0;
}
