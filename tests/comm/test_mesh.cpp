// fsdp::mesh (comm/mesh.hpp) over thread ranks: each dimension's group holds the ranks the
// layout says (pp, dp_replicate, dp_shard, tp; TP innermost), a shard_group over dp() shards
// over dp_shard, the per-dimension traffic follows the formulas, and bad shapes are refused by
// name.
#include "fsdp/comm/mesh.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <span>
#include <string>
#include <vector>

#include "common/catch_error.hpp"
#include "fsdp/fsdp.hpp"

namespace {

using comm_t = fsdp::threads::communicator;

// The world ranks of `group`'s members, in group-rank order (gathered from each member).
std::vector<int> members(comm_t& group, int world_rank) {
  fsdp::host_queue q;
  std::vector<int> all(static_cast<std::size_t>(group.size()));
  group.all_gather(&world_rank, all.data(), 1, fsdp::dtype::i32, q).wait(group.timeout());
  return all;
}

struct seen {
  fsdp::mesh<comm_t>::coordinates at;
  std::vector<int> pp, dp, dp_replicate, dp_shard, tp;
};

}  // namespace

TEST_CASE("mesh: pp 2 x dp_replicate 2 x dp_shard 2 x tp 2 over 16 ranks, TP innermost") {
  std::vector<seen> s(16);
  fsdp::threads::world{16}.run([&](comm_t& world) {
    fsdp::mesh<comm_t> m{world, {.pp = 2, .dp_replicate = 2, .dp_shard = 2, .tp = 2}};
    const int r = world.rank();
    seen& me = s[static_cast<std::size_t>(r)];
    me.at = m.coords();
    me.pp = members(m.pp(), r), me.dp = members(m.dp(), r), me.dp_replicate = members(m.dp_replicate(), r);
    me.dp_shard = members(m.dp_shard(), r), me.tp = members(m.tp(), r);
  });
  // Rank 13 = ((1 * 2 + 1) * 2 + 0) * 2 + 1: stage 1, replica 1, shard 0, tp 1.
  const seen& x = s[13];
  CHECK(x.at.pp == 1);
  CHECK(x.at.dp_replicate == 1);
  CHECK(x.at.dp_shard == 0);
  CHECK(x.at.tp == 1);
  CHECK(x.tp == std::vector<int>{12, 13});
  CHECK(x.dp_shard == std::vector<int>{13, 15});
  CHECK(x.dp_replicate == std::vector<int>{9, 13});
  CHECK(x.dp == std::vector<int>{9, 11, 13, 15});
  CHECK(x.pp == std::vector<int>{5, 13});
  for (int r = 0; r < 16; ++r) {  // every rank is in its own groups, at its own coordinate
    const seen& y = s[static_cast<std::size_t>(r)];
    CHECK(y.tp[static_cast<std::size_t>(y.at.tp)] == r);
    CHECK(y.pp[static_cast<std::size_t>(y.at.pp)] == r);
    CHECK(y.dp_shard[static_cast<std::size_t>(y.at.dp_shard)] == r);
  }
}

TEST_CASE("mesh: experts' groups: ep consecutive dp_shard ranks, each expert sharded over the ranks of its ep index") {
  // 16 ranks: dp_replicate 2 x dp_shard 4 x tp 2, ep 2: dp_shard = 2 groups x ep 2.
  std::vector<std::vector<int>> ep(16), expert_dp(16);
  std::vector<fsdp::sharding> expert_sharding(16);
  fsdp::threads::world{16}.run([&](comm_t& world) {
    fsdp::mesh<comm_t> m{world, {.dp_replicate = 2, .dp_shard = 4, .tp = 2, .ep = 2}};
    const int r = world.rank();
    ep[static_cast<std::size_t>(r)] = members(m.ep(), r);
    expert_dp[static_cast<std::size_t>(r)] = members(m.expert_dp(), r);
    expert_sharding[static_cast<std::size_t>(r)] = m.expert_sharding();
  });
  // Rank 11 = ((0 * 2 + 1) * 4 + 1) * 2 + 1: replica 1, shard 1, tp 1.
  CHECK(ep[11] == std::vector<int>{9, 11});                  // shards 0 and 1 of replica 1, tp 1
  CHECK(expert_dp[11] == std::vector<int>{3, 7, 11, 15});  // shard index 1 or 3 (ep index 1), both replicas
  CHECK(expert_sharding[11].shard_size == 2);              // over dp_shard / ep, replicated across replicas
}

TEST_CASE("mesh: a shard_group over dp() shards over dp_shard and replicates over dp_replicate; traffic per dimension") {
  std::vector<int> shard_rank(8), shard_size(8), coord(8);
  std::vector<fsdp::traffic_counters> tp_traffic(8), dp_traffic(8);
  fsdp::threads::world{8}.run([&](comm_t& world) {
    fsdp::mesh<comm_t> m{world, {.dp_replicate = 2, .tp = 2}};  // dp_shard: the rest, 2
    CHECK(m.shape().dp_shard == 2);
    fsdp::buffer<float> w{64, "w"};
    fsdp::shard_group<fsdp::buffer<float>> group{m.dp(), {}, {.sharding = m.sharding()}};
    group.add_unit({&w});
    group.finalize(fsdp::init::per_shard([](const fsdp::param_slice&, std::span<float> v) { std::fill(v.begin(), v.end(), 1.0f); }));
    const auto r = static_cast<std::size_t>(world.rank());
    shard_rank[r] = group.shard_rank(), shard_size[r] = group.shard_size(), coord[r] = m.coords().dp_shard;
    fsdp::host_queue q;
    std::vector<float> act(10, 1.0f);
    m.tp().all_reduce(act.data(), act.data(), act.size(), fsdp::dtype::f32, fsdp::reduce_op::sum, q).wait(world.timeout());
    tp_traffic[r] = m.tp().traffic();
    dp_traffic[r] = group.traffic();
  });
  fsdp::traffic_counters tp_expect;
  tp_expect.add_all_reduce(10, fsdp::dtype::f32, 2);
  for (std::size_t r = 0; r < 8; ++r) {
    CAPTURE(r);
    CHECK(shard_size[r] == 2);
    CHECK(shard_rank[r] == coord[r]);
    CHECK(tp_traffic[r] == tp_expect);
    CHECK(dp_traffic[r].all_reduce == 0);  // nothing trained: the DP group sent only set-up traffic
  }
}

TEST_CASE("mesh: sizes that do not make the world, and TP groups across hosts, are refused by name") {
  fsdp::threads::world{8, {.ranks_per_host = 4}}.run([](comm_t& world) {
    const fsdp::error three = fsdp_test::catch_error([&] { fsdp::mesh<comm_t> m{world, {.tp = 3}}; });
    CHECK(three.code() == fsdp::errc::invalid_argument);
    CHECK(std::string(three.what()).find("mesh pp 1 x dp_replicate 1 x dp_shard 0 x tp 3 over 8 ranks: pp x dp_replicate x tp = 3 does not divide the world") != std::string::npos);
    const fsdp::error product = fsdp_test::catch_error([&] { fsdp::mesh<comm_t> m{world, {.pp = 2, .dp_shard = 2, .tp = 4}}; });
    CHECK(std::string(product.what()).find("the sizes multiply to 16, not the world's size") != std::string::npos);
    const fsdp::error ep = fsdp_test::catch_error([&] { fsdp::mesh<comm_t> m{world, {.dp_shard = 4, .tp = 2, .ep = 3}}; });
    CHECK(std::string(ep.what()).find("ep 3 does not divide dp_shard 4") != std::string::npos);
    const fsdp::error zero = fsdp_test::catch_error([&] { fsdp::mesh<comm_t> m{world, {.pp = 0}}; });
    CHECK(std::string(zero.what()).find("every size must be at least 1") != std::string::npos);
  });
  fsdp::threads::world{12, {.ranks_per_host = 4}}.run([](comm_t& world) {
    const fsdp::error across = fsdp_test::catch_error([&] { fsdp::mesh<comm_t> m{world, {.tp = 3}}; });
    CHECK(across.code() == fsdp::errc::invalid_argument);
    CHECK(std::string(across.what()).find("tp 3 puts TP groups across hosts of 4 ranks (3 hosts: [0 0 0 0 1 1 1 1 2 2 2 2]); a tp that divides 4") !=
          std::string::npos);
  });
}
