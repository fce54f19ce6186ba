// Frozen parameters (add_unit's `frozen`, FSDP2's requires_grad=False): gathered like the
// others, no gradient, no reduction, no optimizer state. Training matches the plain reference
// that never updates them, their values stay bit-identical, and the counters and the memory
// show what they no longer cost.
#include <doctest/doctest.h>

#include <numeric>
#include <string>
#include <vector>

#include "common/catch_error.hpp"
#include "common/mlp.hpp"

namespace {

using namespace fsdp_test;
using group = fsdp::shard_group<fsdp::buffer<float>>;

// Unit 0 all frozen (the embedding of a fine-tune), and unit 2's weight (a unit that mixes
// frozen and trainable parameters, the LoRA case).
const std::vector<std::pair<int, int>> frozen_set{{0, 0}, {0, 1}, {2, 0}};

train_config frozen_config(optimizer opt = optimizer::sgd) {
  train_config c;
  c.opt = opt;
  c.frozen = frozen_set;
  return c;
}

// Padded elements of unit u's trainable and frozen regions, from the rule in docs/design.md,
// apart from fsdp::flat_layout: each region packs its parameters in order, each on a multiple of
// 64 elements, and is padded to a multiple of lcm(world, 128); an empty region takes nothing.
std::pair<std::size_t, std::size_t> regions_of(std::size_t u, int world) {
  const std::size_t pad = std::lcm(static_cast<std::size_t>(world), std::size_t{128});
  std::size_t ends[2] = {0, 0};
  const auto sizes = param_sizes(shapes()[u]);
  for (std::size_t p = 0; p < sizes.size(); ++p) {
    std::size_t& end = ends[frozen_config().is_frozen(u, p) ? 1 : 0];
    end = (end + 63) / 64 * 64 + sizes[p];
  }
  return {(ends[0] + pad - 1) / pad * pad, (ends[1] + pad - 1) / pad * pad};
}

}  // namespace

TEST_CASE("frozen parameters: training matches the reference that never updates them; they stay bit-identical") {
  for (auto opt : {optimizer::sgd, optimizer::adamw}) {
    train_config cfg = frozen_config(opt);
    cfg.clip = opt == optimizer::adamw ? 0.5 : 0.0;  // the norm leaves the frozen parameters out
    const train_result ref = train_reference(cfg);
    struct run {
      int ranks;
      fsdp::sharding sharding;
    };
    for (const run& r : {run{2, fsdp::full_shard()}, run{4, fsdp::full_shard()}, run{4, fsdp::shard_grad_op()},
                         run{4, fsdp::hybrid_shard(2)}, run{2, fsdp::no_shard()}}) {
      CAPTURE(r.ranks);
      CAPTURE(to_string(r.sharding));
      CAPTURE(opt == optimizer::sgd ? "sgd" : "adamw");
      const train_result got = train_sharded<group>(r.ranks, cfg, {.sharding = r.sharding});
      CHECK(max_rel_diff(got, ref) <= 1e-5);
      for (std::size_t u = 0; u < ref.params.size(); ++u)
        for (std::size_t p = 0; p < ref.params[u].size(); ++p) {
          CAPTURE(u);
          CAPTURE(p);
          bool same = true;
          for (std::size_t i = 0; i < got.params[u][p].size(); ++i) same = same && got.params[u][p][i] == init_value(static_cast<int>(u), static_cast<int>(p), i);
          CHECK(same == cfg.is_frozen(u, p));  // frozen: every bit kept; trainable: moved
        }
    }
  }
}

TEST_CASE("frozen parameters: the gradient, reduce-scatter and optimizer state cover the trainable region only") {
  for (int n : {2, 4}) {
    CAPTURE(n);
    const auto s = static_cast<std::uint64_t>(n);
    std::uint64_t gather = 0, reduce = 0, persistent = 0;
    for (std::size_t u = 0; u < shapes().size(); ++u) {
      const auto [t, f] = regions_of(u, n);
      gather += 2 * (t + f) * 4 * (s - 1) / s;     // forward and backward gather both regions
      reduce += t * 4 * (s - 1) / s;               // only the trainable region is reduced
      persistent += (t + f) / s * 4 + 3 * t / s * 4;  // master shard; gradient shard, adamw's two moments
    }
    std::vector<fsdp::traffic_counters> sent(static_cast<std::size_t>(n));
    std::vector<std::size_t> held(static_cast<std::size_t>(n));
    fsdp::threads::world{n}.run([&](fsdp::threads::communicator& comm) {
      model<float> m;
      group g{comm};
      m.register_with(g, frozen_set);
      g.finalize(per_shard_init());
      fsdp::adamw opt{g, {}};
      const train_config cfg = frozen_config();
      const auto r = static_cast<std::size_t>(comm.rank());
      sent[r] = second_step_traffic(g, m, opt, cfg);
      held[r] = g.memory().persistent_live;
      CHECK(g.shard(0).numel == 0);  // unit 0 is all frozen: nothing for the optimizer
      CHECK(g.shard(2).numel == regions_of(2, n).first / s);
    });
    for (std::size_t r = 0; r < sent.size(); ++r) {
      CAPTURE(r);
      CHECK(sent[r].all_gather == gather);
      CHECK(sent[r].reduce_scatter == reduce);
      CHECK(held[r] == persistent);
    }
  }
}

TEST_CASE("frozen parameters: refused by name where they have no gradient, are not the unit's, or ranks disagree") {
  fsdp::threads::world{2}.run([&](fsdp::threads::communicator& comm) {
    model<float> m;
    group g{comm};
    fsdp::buffer<float> stranger(4, "stranger");
    const fsdp::error not_mine = catch_error([&] { g.add_unit({m.params[0][0].get()}, "u0", {&stranger}); });
    CHECK(not_mine.code() == fsdp::errc::invalid_argument);
    CHECK(std::string(not_mine.what()).find("a frozen parameter must be one of the unit's parameters") != std::string::npos);
    // Rank 1 freezes unit 1's bias, rank 0 does not.
    std::vector<std::pair<int, int>> mine = frozen_set;
    if (comm.rank() == 1) mine.emplace_back(1, 1);
    m.register_with(g, mine);
    const fsdp::error differ = catch_error([&] { g.finalize(per_shard_init()); });
    CHECK(differ.code() == fsdp::errc::mismatch);
    const std::string what = differ.what();
    CHECK(what.find("unit 1 parameter 1 ('u1.p1')") != std::string::npos);
    CHECK(what.find("11 elements of frozen f32") != std::string::npos);
  });
  fsdp::threads::world{2}.run([&](fsdp::threads::communicator& comm) {
    model<float> m;
    group g{comm};
    m.register_with(g, frozen_set);
    g.finalize(per_shard_init());
    sharded_step(g, m, frozen_config(), 0);
    g.finish_backward();
    const fsdp::error e = catch_error([&] { g.full_gradient(2, 0); });
    CHECK(e.code() == fsdp::errc::invalid_argument);
    CHECK(std::string(e.what()).find("the parameter is frozen, it has no gradient") != std::string::npos);
    CHECK(g.full_gradient(2, 1).size() == 31);  // its trainable neighbour has one
  });
}
