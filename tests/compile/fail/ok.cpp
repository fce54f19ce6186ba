// Control for the build-failure tests: the same shape as the failing cases, with valid
// arguments. It must compile, so that a broken command line cannot make the failing cases pass.
#include <fsdp/fsdp.hpp>

void build(fsdp::threads::communicator& comm) {
  fsdp::shard_group<fsdp::buffer<float>, fsdp::mixed_precision<fsdp::bf16, float, float>, fsdp::per_unit> group{
      comm, {}, {.sharding = fsdp::hybrid_shard(2), .prefetch = fsdp::no_prefetch()}};
  group.finalize(fsdp::init::per_shard([](const fsdp::param_slice&, std::span<float>) {}));
  group.finalize(fsdp::init::broadcast_from{0});
}
