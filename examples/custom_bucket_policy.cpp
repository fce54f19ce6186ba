// custom_bucket_policy: a user-written BucketPolicy, in full.
//
// A BucketPolicy is a small struct with one function, assign(), that maps each unit to a bucket
// of consecutive units (fsdp/policy/bucket.hpp lists the requirements). This one pairs units
// up: (0, 1), (2, 3), ... so each all-gather and reduce-scatter moves two units at once. The
// program registers six layers on two thread ranks and prints the buckets fsdp formed, the
// bytes one training step sent and the collectives it issued, next to the per-unit default.

#include <cstdio>
#include <memory>
#include <vector>

#include <fsdp/fsdp.hpp>

// The policy. Its fields are the runtime values (here: how many units share a bucket).
struct groups_of {
  int units = 2;
  std::vector<int> assign(const fsdp::bucket_request& r) const {
    std::vector<int> bucket(r.unit_bytes.size());
    for (std::size_t u = 0; u < bucket.size(); ++u) bucket[u] = static_cast<int>(u) / units;
    return bucket;
  }
};
static_assert(fsdp::bucket_policy<groups_of>);  // checked at compile time, like fsdp's own

template <class Group>
void one_step(const char* label, typename Group::options opts) {
  fsdp::threads::world{2}.run([&](fsdp::threads::communicator& comm) {
    std::vector<std::unique_ptr<fsdp::buffer<float>>> params;
    Group group{comm, {}, opts};
    for (int u = 0; u < 6; ++u) {
      params.push_back(std::make_unique<fsdp::buffer<float>>(1000 + 100 * u));
      group.add_unit({params.back().get()});
    }
    group.finalize(fsdp::init::per_shard([](const fsdp::param_slice&, std::span<float> v) {
      for (float& x : v) x = 0.01f;
    }));
    const auto before = group.traffic();
    for (int u = 0; u < 6; ++u) auto s = group.forward(u);
    for (int u = 6; u-- > 0;) {
      auto s = group.backward(u);
      for (float& g : params[static_cast<std::size_t>(u)]->grads()) g += 1.0f;
    }
    group.finish_backward();
    const auto sent = group.traffic() - before;
    if (comm.rank() == 0) {
      std::printf("%-22s buckets:", label);
      for (std::size_t b = 0; b < group.num_buckets(); ++b) std::printf(" %zu", group.layout(b).padded_numel());
      std::printf(" elements   one step: %llu bytes sent, %llu collectives\n",
                  static_cast<unsigned long long>(sent.total()), static_cast<unsigned long long>(sent.collectives));
    }
  });
}

int main() {
  one_step<fsdp::shard_group<fsdp::buffer<float>>>("per_unit (default)", {});
  one_step<fsdp::shard_group<fsdp::buffer<float>, groups_of>>("groups_of{.units = 2}", {.bucket = {.units = 2}});
  one_step<fsdp::shard_group<fsdp::buffer<float>, groups_of>>("groups_of{.units = 3}", {.bucket = {.units = 3}});
}
