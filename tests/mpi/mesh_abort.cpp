// A rank that fails on a device mesh: on pp 2 x tp 2 (4 processes) rank 3 throws while its TP
// peer (rank 2) waits in an all-reduce on the TP group, its pipeline peer (rank 1) in a recv on
// the PP group, and rank 0 in an all-reduce with rank 1. Every survivor must end with
// errc::peer_failure naming rank 3 within seconds (the timeout is 60 s), as on one world.
#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <thread>
#include <vector>

#include "fsdp/comm/mesh.hpp"
#include "fsdp/comm/mpi.hpp"
#include "fsdp/fsdp.hpp"

int main(int argc, char** argv) {
  fsdp::mpi::environment env(argc, argv);
  auto world = env.world(std::chrono::milliseconds(60000));
  const auto start = std::chrono::steady_clock::now();
  const auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  try {
    fsdp::mesh<fsdp::mpi::communicator> mesh{world, {.pp = 2, .dp_shard = 1, .tp = 2}};
    fsdp::buffer<float> w(1000, "w");
    fsdp::shard_group<fsdp::buffer<float>, fsdp::mpi::communicator> group{mesh.dp()};
    group.add_unit({&w});
    group.finalize(fsdp::init::broadcast_from{0});
    std::vector<float> x(64, 1.0f);
    fsdp::host_queue q;
    const auto at = mesh.coords();
    // Rank 3 throws only once each survivor has told it (a small eager send) that it is entering
    // its wait: a barrier instead let a slow rank still be in the barrier when the failure came.
    float token = 1.0f;
    if (world.rank() == 3) {
      for (int peer = 0; peer < 3; ++peer) world.recv(&token, 1, fsdp::dtype::f32, peer, q).wait(world.timeout());
      std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the last sender reaches its wait
      throw std::runtime_error("injected failure on rank 3");
    }
    world.send(&token, 1, fsdp::dtype::f32, 3, q).wait(world.timeout());
    if (at.pp == 0 && at.tp == 1) mesh.pp().recv(x.data(), x.size(), fsdp::dtype::f32, 1, q).wait(world.timeout());
    else mesh.tp().all_reduce(x.data(), x.data(), x.size(), fsdp::dtype::f32, fsdp::reduce_op::sum, q).wait(world.timeout());
  } catch (const std::exception& e) {
    std::printf("rank %d after %.1f s: %s\n", world.rank(), seconds(), e.what());
    std::fflush(stdout);
    return 3;
  }
  std::printf("rank %d: no error\n", world.rank());
  return 0;
}
