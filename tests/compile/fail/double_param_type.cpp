// Must not compile: double is no shardable dtype (f32, bf16, f16); mixed_precision says so.
#include <fsdp/fsdp.hpp>

void build(fsdp::threads::communicator& comm) {
  fsdp::shard_group<fsdp::buffer<float>, fsdp::mixed_precision<double>> group{comm};
  (void)group;
}
