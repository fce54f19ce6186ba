// The fake communicator of tests/common on its own: what it records and counts, its data rule,
// its planned splits and its failures on cue; then a shard_group's error path on it.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "common/catch_error.hpp"
#include "common/fake_communicator.hpp"
#include "fsdp/fsdp.hpp"

using fsdp_test::fail_how;
using fsdp_test::fake_communicator;
using fsdp_test::fake_op;

TEST_CASE("fake communicator: every call recorded in order, counted as the real backends count it") {
  fake_communicator comm{1, 4, fsdp_test::hosts_in_runs(4, 2)};  // rank 1 of 2 hosts of 2: two remote peers
  fsdp::host_queue q;
  std::vector<float> buf(16, 1.0f), out(4);
  comm.all_gather(buf.data() + 4, buf.data(), 4, fsdp::dtype::f32, q).wait(comm.timeout());
  comm.reduce_scatter(buf.data(), out.data(), 4, fsdp::dtype::f32, fsdp::reduce_op::avg, q).wait(comm.timeout());
  comm.all_reduce(out.data(), out.data(), 4, fsdp::dtype::f32, fsdp::reduce_op::sum, q).wait(comm.timeout());
  comm.broadcast(out.data(), 2, fsdp::dtype::f32, 3, q).wait(comm.timeout());
  comm.barrier();
  fsdp::traffic_counters expect;
  expect.add_all_gather(4, fsdp::dtype::f32, 4, 2);
  expect.add_reduce_scatter(4, fsdp::dtype::f32, 4, 2);
  expect.add_all_reduce(4, fsdp::dtype::f32, 4, 2);
  expect.add_broadcast(2, fsdp::dtype::f32, 4, 2);
  CHECK(comm.traffic() == expect);
  CHECK(comm.traffic().inter_host == comm.traffic().total() / 3 * 2);
  const auto& c = comm.calls();
  REQUIRE(c.size() == 5);
  CHECK(c[0].kind == fake_op::all_gather);
  CHECK(c[1].kind == fake_op::reduce_scatter);
  CHECK(c[1].op == fsdp::reduce_op::avg);
  CHECK(c[2].op == fsdp::reduce_op::sum);
  CHECK(c[3].kind == fake_op::broadcast);
  CHECK(c[3].root == 3);
  CHECK(c[3].count == 2);
  CHECK(c[4].kind == fake_op::barrier);
  CHECK(c[0].group == "world");
  CHECK(comm.hosts().size() == 4);
}

TEST_CASE("fake communicator: every peer holds what this rank holds") {
  fake_communicator comm{2, 3};
  fsdp::host_queue q;
  const auto wait = [&](fsdp::host_event e) { e.wait(comm.timeout()); };
  std::vector<float> mine{1, 2}, all(6, 0.0f);
  wait(comm.all_gather(mine.data(), all.data(), 2, fsdp::dtype::f32, q));
  CHECK(all == std::vector<float>{1, 2, 1, 2, 1, 2});
  std::vector<float> send{1, 2, 3, 4, 5, 6}, block(2);
  wait(comm.reduce_scatter(send.data(), block.data(), 2, fsdp::dtype::f32, fsdp::reduce_op::sum, q));
  CHECK(block == std::vector<float>{15, 18});  // rank 2's block, from 3 ranks
  wait(comm.reduce_scatter(send.data(), block.data(), 2, fsdp::dtype::f32, fsdp::reduce_op::avg, q));
  CHECK(block == std::vector<float>{5, 6});
  std::vector<fsdp::bf16> h{fsdp::convert<fsdp::bf16>(0.5f)};
  wait(comm.all_reduce(h.data(), h.data(), 1, fsdp::dtype::bf16, fsdp::reduce_op::sum, q));
  CHECK(fsdp::convert<float>(h[0]) == 1.5f);
  wait(comm.broadcast(send.data(), 6, fsdp::dtype::f32, 0, q));
  CHECK(send == std::vector<float>{1, 2, 3, 4, 5, 6});
  const auto e = fsdp_test::catch_error([&] { comm.all_reduce(send.data(), send.data(), 1, fsdp::dtype::i32, fsdp::reduce_op::sum, q); });
  CHECK(e.code() == fsdp::errc::unsupported_dtype);
}

TEST_CASE("fake communicator: splits follow the planned colors; an unplanned split or another color is refused") {
  fake_communicator world{3, 4, fsdp_test::hosts_in_runs(4, 2)};
  world.plan_split({0, 0, 1, 1});
  world.plan_split({0, 1, 0, 1});
  fake_communicator shard = world.split(1, 3);
  fake_communicator replica = world.split(1, 3);
  CHECK(shard.size() == 2);
  CHECK(shard.rank() == 1);
  CHECK(std::vector<int>(shard.hosts().begin(), shard.hosts().end()) == std::vector<int>{0, 0});  // renumbered
  CHECK(replica.size() == 2);
  CHECK(replica.rank() == 1);
  CHECK(std::vector<int>(replica.hosts().begin(), replica.hosts().end()) == std::vector<int>{0, 1});
  fsdp::host_queue q;
  float x = 1.0f;
  replica.all_reduce(&x, &x, 1, fsdp::dtype::f32, fsdp::reduce_op::sum, q).wait(replica.timeout());
  CHECK(replica.traffic().inter_host == replica.traffic().total());
  CHECK(shard.traffic().total() == 0);
  REQUIRE(world.calls().size() == 3);  // shared by the world and its splits
  CHECK(world.calls()[1].color == 1);
  CHECK(world.calls()[2].group == "world/split1:color1");
  CHECK(fsdp_test::catch_error([&] { (void)world.split(0, 3); }).code() == fsdp::errc::invalid_argument);
  world.plan_split({0, 0, 0, 0});
  const auto e = fsdp_test::catch_error([&] { (void)world.split(1, 3); });
  CHECK(std::string(e.what()).find("rank 3 passes color 1, not the plan's") != std::string::npos);
}

TEST_CASE("fake communicator: a call fails on cue, on issue or through its event; after abort every call fails") {
  fake_communicator comm{0, 2};
  fsdp::host_queue q;
  std::vector<float> x(4, 1.0f);
  comm.fail_at(1, fsdp::errc::mismatch);
  comm.fail_next(fake_op::all_reduce, fsdp::errc::timeout, fail_how::on_completion);
  comm.all_gather(x.data(), x.data(), 2, fsdp::dtype::f32, q).wait(comm.timeout());  // call 0
  auto e = fsdp_test::catch_error([&] { comm.all_gather(x.data(), x.data(), 2, fsdp::dtype::f32, q); });
  CHECK(e.code() == fsdp::errc::mismatch);
  CHECK(std::string(e.what()).find("all_gather #1 on world failed on cue") != std::string::npos);
  CHECK(comm.traffic().collectives == 1);  // a call that failed on issue sent nothing
  fsdp::host_event done = comm.all_reduce(x.data(), x.data(), 4, fsdp::dtype::f32, fsdp::reduce_op::sum, q);
  CHECK(fsdp_test::catch_error([&] { done.wait(comm.timeout()); }).code() == fsdp::errc::timeout);
  CHECK_NOTHROW(comm.barrier());  // each cue fires once
  comm.abort("rank 0 gave up");
  REQUIRE(comm.aborted().has_value());
  e = fsdp_test::catch_error([&] { comm.barrier(); });
  CHECK(e.code() == fsdp::errc::peer_failure);
  CHECK(std::string(e.what()).find("rank 0 gave up") != std::string::npos);
}

TEST_CASE("fake communicator: a shard_group's gather that fails throws from the hook, and leaving aborts the group") {
  fake_communicator comm{1, 2};
  fsdp::buffer<float> w(100, "w");
  comm.fail_at(2, fsdp::errc::peer_failure, fail_how::on_completion);  // after finalize's two all-gathers
  std::string what;
  try {
    fsdp::shard_group<fsdp::buffer<float>, fake_communicator> g{comm};
    g.add_unit({&w});
    g.finalize(fsdp::init::per_shard([](const fsdp::param_slice&, std::span<float> v) { std::fill(v.begin(), v.end(), 1.0f); }));
    auto in_use = g.forward(0);
  } catch (const fsdp::error& e) {
    what = e.what();
    CHECK(e.code() == fsdp::errc::peer_failure);
  }
  CHECK(what.find("all_gather #2 on world failed on cue") != std::string::npos);
  REQUIRE(comm.aborted().has_value());
  CHECK(*comm.aborted() == "an exception left its shard_group (as rank 1 of 2)");
}
