// Must not compile: a type argument that models no policy kind.
// Expected: "... is not a MixedPrecision, BucketPolicy or Communicator"
#include <fsdp/fsdp.hpp>

struct prefetch_depth {  // looks like a knob, but prefetching is a value in the options
  int forward = 1;
};

void build(fsdp::threads::communicator& comm) {
  fsdp::shard_group<fsdp::buffer<float>, prefetch_depth> group{comm};
  (void)group;
}
