// Must not compile: a policy argument that models no policy kind.
// Expected: "... is not a ShardingStrategy, MixedPrecision, Prefetch, BucketPolicy or Communicator"
#include <fsdp/fsdp.hpp>

struct prefetch_depth {  // looks like a knob, but is no Prefetch (no forward_depth() etc.)
  int forward = 1;
};

void build(fsdp::threads::communicator& comm) {
  fsdp::shard_group<fsdp::buffer<float>, fsdp::full_shard, prefetch_depth> group{comm};
  (void)group;
}
