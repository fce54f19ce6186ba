// Must not compile: a per_shard fill with the wrong signature (a vector, not a span of float).
// Expected: "init::per_shard: the fill must be callable as fill(const fsdp::param_slice&, std::span<float> out)"
#include <fsdp/fsdp.hpp>

#include <vector>

void build(fsdp::threads::communicator& comm) {
  fsdp::shard_group<fsdp::buffer<float>> group{comm};
  group.finalize(fsdp::init::per_shard([](const fsdp::param_slice&, std::vector<float>&) {}));
}
