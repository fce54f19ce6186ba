// Must not compile: finalize takes init::broadcast_from or init::per_shard, not a bare fill.
// Expected: "shard_group::finalize: the argument must be fsdp::init::broadcast_from{root} or fsdp::init::per_shard(fill)"
#include <fsdp/fsdp.hpp>

void build(fsdp::threads::communicator& comm) {
  fsdp::shard_group<fsdp::buffer<float>> group{comm};
  group.finalize([](const fsdp::param_slice&, std::span<float>) {});
}
