// options::keep_low_precision_shard: each rank keeps its shard in the gathered dtype too, which the
// optimizers write in their own pass and the all-gather reads instead of casting the master.
// Training is bit-identical to casting at every gather, the kept copy costs exactly its bytes,
// and the gather reads the copy the optimizer wrote, or casts again after any other write.
#include <doctest/doctest.h>

#include <numeric>
#include <vector>

#include "common/mlp.hpp"

namespace {

using namespace fsdp_test;
using group = fsdp::shard_group<fsdp::buffer<fsdp::bf16>, fsdp::mixed_precision<fsdp::bf16, float, float>>;

bool same(const train_result& a, const train_result& b) { return a.losses == b.losses && a.params == b.params; }

}  // namespace

TEST_CASE("keep_low_precision_shard: the same losses and parameters bit for bit as casting at every gather") {
  struct run {
    int ranks;
    fsdp::sharding sharding;
  };
  for (optimizer opt : {optimizer::sgd, optimizer::adamw}) {
    train_config cfg;
    cfg.opt = opt;
    cfg.steps = 6;
    cfg.clip = opt == optimizer::adamw ? 0.5 : 0.0;  // the norm reads shard views too
    for (const run& r : {run{2, fsdp::full_shard()}, run{4, fsdp::shard_grad_op()}, run{4, fsdp::hybrid_shard(2)},
                         run{2, fsdp::no_shard()}, run{1, fsdp::full_shard()}}) {
      CAPTURE(opt == optimizer::sgd ? "sgd" : "adamw");
      CAPTURE(r.ranks);
      CAPTURE(to_string(r.sharding));
      const train_result cast = train_sharded<group>(r.ranks, cfg, {.sharding = r.sharding});
      const train_result kept = train_sharded<group>(r.ranks, cfg, {.sharding = r.sharding, .keep_low_precision_shard = true});
      CHECK(same(kept, cast));
      CHECK(cast.losses.back() < cast.losses.front());  // it trained
    }
  }
  // Frozen parameters (cast again at every gather: a view could have written them) and offloaded
  // state (the copy in host memory, written by the host's optimizer pass).
  train_config frozen;
  frozen.opt = optimizer::adamw;
  frozen.steps = 6;
  frozen.frozen = {{0, 0}, {2, 0}};
  CHECK(same(train_sharded<group>(2, frozen, {.keep_low_precision_shard = true}), train_sharded<group>(2, frozen)));
  train_config plain;
  plain.steps = 6;
  CHECK(same(train_sharded<group>(2, plain, {.offload = fsdp::offload{.units = {1}}, .keep_low_precision_shard = true}),
             train_sharded<group>(2, plain, {.offload = fsdp::offload{.units = {1}}})));
}

TEST_CASE("keep_low_precision_shard: the copy costs its bytes, in the state's memory, and the step's trace counts them") {
  fsdp::threads::world{2}.run([](fsdp::threads::communicator& comm) {
    struct held {
      fsdp::memory_stats memory;
      std::size_t device = 0, host = 0;  // the shards' bytes in bf16, on the device and offloaded
      bool traced = false;               // step_trace().low_precision_shard
    };
    auto run = [&](bool keep) {
      model<fsdp::bf16> m;
      group g{comm, {}, {.offload = fsdp::offload{.units = {1}}, .keep_low_precision_shard = keep}};
      m.register_with(g);
      g.finalize(per_shard_init());
      held h{g.memory()};
      for (std::size_t b = 0; b < g.num_buckets(); ++b)
        (g.shard(b).kind == fsdp::mem_kind::offloaded ? h.host : h.device) += g.layout(b).shard_numel() * sizeof(fsdp::bf16);
      sharded_step(g, m, train_config{}, 0);  // a step records the order step_trace needs
      g.finish_backward();
      h.traced = g.step_trace().low_precision_shard;
      return h;
    };
    const held off = run(false), on = run(true);
    CHECK(on.device > 0);
    CHECK(on.host > 0);
    CHECK(on.memory.persistent_live - off.memory.persistent_live == on.device);
    CHECK(on.memory.offloaded_live - off.memory.offloaded_live == on.host);
    CHECK_FALSE(off.traced);
    CHECK(on.traced);
  });
}

TEST_CASE("keep_low_precision_shard: the gather reads the copy an optimizer wrote, and casts again after any other write") {
  fsdp::threads::world{2}.run([](fsdp::threads::communicator& comm) {
    fsdp::buffer<fsdp::bf16> w(512, "w");
    group g{comm, {}, {.keep_low_precision_shard = true}};
    g.add_unit({&w});
    g.finalize(fsdp::init::per_shard([](const fsdp::param_slice&, std::span<float> out) { std::fill(out.begin(), out.end(), 1.0f); }));
    // This rank's first element, where the gathered buffer holds it.
    const std::size_t at = g.layout(0).position(g.shard_rank(), 0);
    auto gathered = [&] {
      auto scope = g.forward(0);
      return fsdp::convert<float>(w.data()[at]);
    };
    CHECK(gathered() == 1.0f);

    // An optimizer's pass: the master and its copy written together, then low_precision_written.
    auto s = g.shard(0);
    REQUIRE(s.low_precision != nullptr);
    s.params[0] = 3.0f;
    s.low_precision[0] = fsdp::convert<fsdp::bf16>(7.0f);  // not the master's cast: shows which one is read
    g.low_precision_written(0);
    CHECK(gathered() == 7.0f);  // the copy, as it is
    CHECK(gathered() == 7.0f);  // and again: nothing cast it since

    // Any other write through a view: the next gather casts the master again.
    g.shard(0).params[0] = 5.0f;
    CHECK(gathered() == 5.0f);
  });
}
