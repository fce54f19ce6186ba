// A process that leaves early: the last rank returns (and finalizes) while the others wait in
// a collective. They must end with a clear fsdp error within their timeout, not hang.
#include <cstdio>

#include "fsdp/fsdp.hpp"
#include "fsdp/comm/mpi.hpp"

int main(int argc, char** argv) {
  fsdp::mpi::environment env(argc, argv);
  auto comm = env.world(std::chrono::milliseconds(3000));
  fsdp::buffer<float> w(1000, "w");
  fsdp::shard_group<fsdp::buffer<float>, fsdp::mpi::communicator> group{comm};
  group.add_unit({&w});
  group.finalize(fsdp::init::broadcast_from{0});
  if (comm.rank() == comm.size() - 1) {
    std::printf("rank %d leaves early\n", comm.rank());
    return 0;
  }
  try {
    auto s = group.forward(0);
  } catch (const fsdp::error& e) {
    std::printf("rank %d: %s\n", comm.rank(), e.what());
    std::fflush(stdout);
    return 3;
  }
  std::printf("rank %d: no error\n", comm.rank());
  return 0;
}
