// What a shard_group measures about a step: each unit's compute time (nested units excluded),
// the time blocked on communication, the spans it records into a timeline; and reshard_all
// after a forward-only pass. What one rank measures needs no peers: those cases run each rank
// alone on a fake_communicator.

#include <doctest/doctest.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/catch_error.hpp"
#include "common/fake_communicator.hpp"
#include "fsdp/fsdp.hpp"

namespace {

using namespace std::chrono_literals;
using group_t = fsdp::shard_group<fsdp::buffer<float>>;
using fake_t = fsdp::shard_group<fsdp::buffer<float>, fsdp_test::fake_communicator>;
const group_t::options no_prefetch{.prefetch = fsdp::no_prefetch()};

// Three units of one 1000-element parameter each; unit 0 has a quote in its name (the trace
// must escape it).
struct three_units {
  std::vector<std::unique_ptr<fsdp::buffer<float>>> params;
  three_units() {
    for (int u = 0; u < 3; ++u) params.push_back(std::make_unique<fsdp::buffer<float>>(1000, "w" + std::to_string(u)));
  }
  template <class Group>
  void add_to(Group& g) {
    g.add_unit({params[0].get()}, "emb\"edding");
    g.add_unit({params[1].get()}, "block0");
    g.add_unit({params[2].get()}, "block1");
    g.finalize(fsdp::init::per_shard([](const fsdp::param_slice&, std::span<float> out) { std::fill(out.begin(), out.end(), 0.5f); }));
  }
};

// A step shaped like the GPT program's: unit 0 stays in use around units 1 and 2 in both
// passes. Unit 0 itself computes for `outer` before and after the others; units 1 and 2 for
// `inner` each.
template <class Group>
void nested_step(Group& g, std::chrono::milliseconds outer, std::chrono::milliseconds inner) {
  {
    auto e = g.forward(0);
    std::this_thread::sleep_for(outer);
    for (int u : {1, 2}) {
      auto in_use = g.forward(u);
      std::this_thread::sleep_for(inner);
    }
    std::this_thread::sleep_for(outer);
  }
  {
    auto e = g.backward(0);
    for (int u : {2, 1}) {
      auto in_use = g.backward(u);
      std::this_thread::sleep_for(inner);
    }
  }
  g.finish_backward();
}

}  // namespace

TEST_CASE("timing: a unit's compute time excludes the units nested inside it") {
  for (int rank : {0, 1}) {
    fsdp_test::fake_communicator comm{rank, 2};
    three_units m;
    fake_t g{comm, {}, {.prefetch = fsdp::no_prefetch()}};
    m.add_to(g);
    nested_step(g, 20ms, 150ms);
    const auto t = g.profile().unit_timings();
    REQUIRE(t.size() == 3);
    // Unit 0 computed 2 x 20 ms in forward; with the nested 2 x 150 ms it would be >= 340 ms.
    CHECK(t[0].forward >= 40ms);
    CHECK(t[0].forward < 150ms);
    CHECK(t[1].forward >= 150ms);
    CHECK(t[2].backward >= 150ms);
    CHECK(t[0].backward < 150ms);
    CHECK(t[0].forward_runs == 1);
    CHECK(t[1].backward_runs == 1);
    g.profile().reset();
    CHECK(g.profile().unit_timings()[1].forward == std::chrono::nanoseconds{0});
    CHECK(g.profile().communication_wait() == std::chrono::nanoseconds{0});
  }
}

TEST_CASE("timing: time blocked on all-gathers is counted as communication wait") {
  // A modelled link of 60 ms per collective and no prefetch: every unit's gather is waited on
  // in full, 3 in forward and 3 in backward.
  const fsdp::threads::world_options opts{.link = {.alpha_s = 0.06, .beta_bytes_per_s = 1e12}};
  fsdp::threads::world{2, opts}.run([](fsdp::threads::communicator& comm) {
    three_units m;
    group_t g{comm, {}, no_prefetch};
    m.add_to(g);
    g.profile().reset();
    nested_step(g, 0ms, 0ms);
    CHECK(g.profile().communication_wait() >= 6 * 60ms);
  });
}

TEST_CASE("timeline: spans for compute, waits, all-gathers and reductions, as a Chrome trace") {
  fsdp::timeline tl;
  for (int rank : {0, 1}) {
    fsdp_test::fake_communicator comm{rank, 2};
    three_units m;
    fake_t g{comm, {}, {.prefetch = fsdp::no_prefetch()}};
    m.add_to(g);
    g.profile().record_timeline(&tl);
    nested_step(g, 1ms, 5ms);
    g.profile().record_timeline(nullptr);
    nested_step(g, 1ms, 5ms);  // not recorded
  }
  const auto spans = tl.spans();
  auto count = [&](int rank, fsdp::timeline::lane l, const std::string& name) {
    int n = 0;
    for (const auto& s : spans)
      if (s.rank == rank && s.where == l && s.name == name) {
        CHECK(s.end_ns >= s.begin_ns);
        ++n;
      }
    return n;
  };
  using lane = fsdp::timeline::lane;
  for (int r : {0, 1}) {
    CAPTURE(r);
    CHECK(count(r, lane::compute, "forward block0") == 1);
    CHECK(count(r, lane::compute, "backward block1") == 1);
    // Unit 0's forward is cut in two pieces by the nested units.
    CHECK(count(r, lane::compute, "forward emb\"edding") == 3);
    CHECK(count(r, lane::all_gather, "all_gather block1") == 2);  // forward and backward
    CHECK(count(r, lane::reduce, "reduce emb\"edding") == 1);
    CHECK(count(r, lane::reduce, "reduce block0") == 1);
  }
  const std::string doc = tl.chrome_trace();
  CHECK(doc.find("\"traceEvents\":[") != std::string::npos);
  CHECK(doc.find("\"name\":\"forward emb\\\"edding\"") != std::string::npos);
  CHECK(doc.find("\"thread_name\"") != std::string::npos);
  CHECK(doc.find("\"name\":\"rank 1\"") != std::string::npos);
}

TEST_CASE("reshard_all frees what a forward-only pass left gathered, and only between passes") {
  for (int rank : {0, 1}) {
    fsdp_test::fake_communicator comm{rank, 2};
    three_units m;
    fake_t g{comm, {}, {.sharding = fsdp::shard_grad_op()}};
    m.add_to(g);
    for (int u = 0; u < 3; ++u) {
      auto in_use = g.forward(u);
    }
    CHECK(g.memory().transient_live > 0);  // grad_op keeps gathered parameters for a backward
    g.reshard_all();
    CHECK(g.memory().transient_live == 0);
    // A training step afterwards records and runs normally.
    for (int u = 0; u < 3; ++u) {
      auto in_use = g.forward(u);
    }
    {
      auto in_use = g.backward(2);
      const auto e = fsdp_test::catch_error([&] { g.reshard_all(); });
      CHECK(e.code() == fsdp::errc::order);
    }
    for (int u : {1, 0}) {
      auto in_use = g.backward(u);
    }
    g.finish_backward();
    CHECK(g.forward_order().size() == 3);
    CHECK(g.backward_order().size() == 3);
  }
}

TEST_CASE("step_trace: the hook sequence of a step with nested units, and its compute, agreed over ranks") {
  fsdp::threads::world{2}.run([](fsdp::threads::communicator& comm) {
    three_units m;
    group_t g{comm, {}, no_prefetch};
    m.add_to(g);
    nested_step(g, 40ms, 60ms);
    g.profile().reset();
    nested_step(g, 40ms, 60ms);
    const auto t = g.step_trace();
    using e = fsdp::schedule::hook_event;
    auto shape = [](const std::vector<e>& v) {
      std::string s;
      for (const auto& x : v) s += (x.pre ? "+" : "-") + std::to_string(x.unit) + " ";
      return s;
    };
    CHECK(shape(t.forward_events) == "+0 +1 -1 +2 -2 -0 ");
    CHECK(shape(t.backward_events) == "+0 +2 -2 +1 -1 -0 ");
    // The compute before each hook: unit 0's 40 ms before +1 and before -0; each inner unit's
    // 60 ms before its post hook; nothing between -1 and +2.
    CHECK(t.forward_events[1].compute_s >= 0.04);
    CHECK(t.forward_events[2].compute_s >= 0.06);
    CHECK(t.forward_events[3].compute_s < 0.03);
    CHECK(t.forward_events[5].compute_s >= 0.04);
    CHECK(t.backward_events[2].compute_s >= 0.06);
    CHECK(t.units[0].forward_s >= 0.08);  // its two pieces
    CHECK(t.units[0].forward_s < 0.14);   // not the nested units' 120 ms
    CHECK_NOTHROW(fsdp::schedule::validate(t));
    // Every rank got the same (averaged) trace.
    std::vector<double> mine{t.forward_events[2].compute_s, t.units[1].backward_s}, all(4);
    fsdp::host_queue q;
    comm.all_gather(mine.data(), all.data(), 2, fsdp::dtype::f64, q).wait(comm.timeout());
    CHECK(all[0] == all[2]);
    CHECK(all[1] == all[3]);
  });
}
