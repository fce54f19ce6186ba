// Must not compile: two MixedPrecision arguments.
// Expected: "shard_group: more than one MixedPrecision given"
#include <fsdp/fsdp.hpp>

void build(fsdp::threads::communicator& comm) {
  fsdp::shard_group<fsdp::buffer<float>, fsdp::full_precision<float>, fsdp::mixed_precision<float, float, float>> group{comm};
  (void)group;
}
