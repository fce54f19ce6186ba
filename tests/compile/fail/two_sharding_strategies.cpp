// Must not compile: two ShardingStrategy arguments.
// Expected: "shard_group: more than one ShardingStrategy given"
#include <fsdp/fsdp.hpp>

void build(fsdp::threads::communicator& comm) {
  fsdp::shard_group<fsdp::buffer<float>, fsdp::full_shard, fsdp::no_shard> group{comm};
  (void)group;
}
