// Offload (policy/offload.hpp): chosen buckets keep their master shard, gradient shard and
// optimizer state in host memory (mem_kind::offloaded), stepped on the host. On the host device
// training is bit-identical to no offload, and the memory counters show exactly which bytes
// moved out of the device's budget.
#include <doctest/doctest.h>

#include <filesystem>
#include <string>
#include <unistd.h>
#include <vector>

#include "common/catch_error.hpp"
#include "common/mlp.hpp"
#include "fsdp/checkpoint/sharded.hpp"

namespace {

using namespace fsdp_test;
using group = fsdp::shard_group<fsdp::buffer<float>>;

struct held_memory {
  std::size_t device = 0, offloaded = 0, transient_peak = 0, bound = 0;
  std::vector<fsdp::mem_kind> kinds;
  std::vector<std::size_t> shard_numel;  // per bucket, the master shard's elements
};

// Two AdamW steps on 4 ranks, full sharding; rank 0's memory after them.
held_memory after_two_steps(const fsdp::offload& off) {
  held_memory out;
  fsdp::threads::world{4}.run([&](fsdp::threads::communicator& comm) {
    model<float> m;
    group g{comm, {}, {.offload = off}};
    m.register_with(g);
    g.finalize(per_shard_init());
    fsdp::adamw opt{g, {}};
    for (int step = 0; step < 2; ++step) {
      g.device().reset_peak_memory();
      sharded_step(g, m, train_config{}, step);
      opt.step();
      opt.zero_grad();
    }
    if (comm.rank() != 0) return;
    out.device = g.memory().persistent_live;
    out.offloaded = g.memory().offloaded_live;
    out.transient_peak = g.memory().transient_peak;
    out.bound = g.transient_memory_bound().backward;
    for (std::size_t b = 0; b < g.num_buckets(); ++b) {
      out.kinds.push_back(g.shard(b).kind);
      out.shard_numel.push_back(g.layout(b).shard_numel());
    }
  });
  return out;
}

}  // namespace

TEST_CASE("offload: training is bit-identical to the state on the device (some buckets, all; full, hybrid with held sums)") {
  for (auto opt : {optimizer::sgd, optimizer::adamw}) {
    train_config cfg;
    cfg.opt = opt;
    for (const fsdp::offload& off : {fsdp::offload{.units = {0, 2}}, fsdp::offload_all()}) {
      CAPTURE(off.every_unit);
      CHECK(max_rel_diff(train_sharded<group>(4, cfg, {.offload = off}), train_sharded<group>(4, cfg)) == 0.0);
      train_config micro = cfg;  // hybrid 2x2, 3 micro-batches, the replicas' all-reduce on the last: held sums offloaded too
      micro.micro_batches = 3;
      micro.sync_each_micro_batch = true;
      micro.all_reduce_last_only = true;
      const fsdp::sharding h = fsdp::hybrid_shard(2);
      CHECK(max_rel_diff(train_sharded<group>(4, micro, {.sharding = h, .offload = off}), train_sharded<group>(4, micro, {.sharding = h})) == 0.0);
    }
  }
}

TEST_CASE("offload: the offloaded buckets' master, gradient and AdamW state leave the device's budget, byte for byte") {
  const held_memory none = after_two_steps({});
  const held_memory some = after_two_steps({.units = {0, 2}});
  const held_memory all = after_two_steps(fsdp::offload_all());
  // Per bucket: master and gradient shards (f32) and AdamW's two f32 moments, 4 floats an element.
  std::size_t moved = 0, total = 0;
  for (std::size_t b = 0; b < none.shard_numel.size(); ++b) {
    const std::size_t bytes = 4 * none.shard_numel[b] * sizeof(float);
    total += bytes;
    if (b == 0 || b == 2) moved += bytes;
    CHECK(some.kinds[b] == (b == 0 || b == 2 ? fsdp::mem_kind::offloaded : fsdp::mem_kind::persistent));
  }
  CHECK(none.device == total);
  CHECK(none.offloaded == 0);
  CHECK(some.offloaded == moved);
  CHECK(some.device == total - moved);
  CHECK(all.offloaded == total);
  CHECK(all.device == 0);
  // The gathered working set stays on the device: the same bound (the peak itself moves with
  // how many reductions are in flight, 5376-6400 B here with or without offload).
  CHECK(some.bound == none.bound);
  CHECK(all.bound == none.bound);
  CHECK(some.transient_peak <= some.bound);
  CHECK(all.transient_peak <= all.bound);
  CHECK(all.transient_peak > 0);
}

TEST_CASE("offload: a checkpoint saved from offloaded state loads into a group that keeps it on the device") {
  const auto dir = std::filesystem::temp_directory_path() / ("fsdp_offload_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::vector<std::vector<float>> saved, loaded;
  auto run = [&](const fsdp::offload& off, bool save, std::vector<std::vector<float>>& out) {
    fsdp::threads::world{2}.run([&](fsdp::threads::communicator& comm) {
      model<float> m;
      group g{comm, {}, {.offload = off}};
      m.register_with(g);
      g.finalize(per_shard_init());
      fsdp::adamw opt{g, {}};
      if (save) {
        sharded_step(g, m, train_config{}, 0);
        opt.step();
        opt.zero_grad();
        fsdp::checkpoint::save(g, dir, opt);
      } else {
        fsdp::checkpoint::load(g, dir, opt);
      }
      sharded_step(g, m, train_config{}, 1);  // one more step: the moments came back too
      opt.step();
      std::vector<std::vector<float>> full;
      for (int u = 0; u < g.num_units(); ++u) full.push_back(g.full_parameter(u, 0));
      if (comm.rank() == 0) out = full;
    });
  };
  run(fsdp::offload_all(), true, saved);
  run({}, false, loaded);
  CHECK(saved == loaded);
  std::filesystem::remove_all(dir);
}

TEST_CASE("capturable AdamW over offloaded shards is refused by name when it is built") {
  // Its step count lives in device memory for a graph's launches; an offloaded shard steps on the host.
  fsdp::threads::world{1}.run([&](fsdp::threads::communicator& comm) {
    model<float> m;
    group g{comm, {}, {.offload = fsdp::offload_all()}};
    m.register_with(g);
    g.finalize(per_shard_init());
    check_error([&] { fsdp::adamw opt{g, {.capturable = true}}; }, fsdp::errc::invalid_argument,
                "adamw: capturable keeps the step count in the device's memory, and offloaded shards step on the host");
  });
}
