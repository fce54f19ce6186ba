// Control for the build-failure tests: the same shape as the failing cases, with valid policies.
// It must compile, so that a broken command line cannot make the failing cases pass.
#include <fsdp/fsdp.hpp>

void build(fsdp::threads::communicator& comm) {
  fsdp::shard_group<fsdp::buffer<float>, fsdp::full_shard, fsdp::mixed_precision<fsdp::bf16, float, float>,
                    fsdp::no_prefetch, fsdp::per_unit>
      group{comm};
  (void)group;
}
