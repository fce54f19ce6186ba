// The GPT composed with tensor and pipeline parallelism (examples/gpt/parallel.hpp) on threads
// ranks: for every mesh, the same losses as the plain unsharded reference (tests/gpt/
// reference.hpp: one process, no hooks, no mesh); the pipeline schedules' order; the TP and PP
// traffic against their formulas; a rank that fails stops the others with its cause.

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "common/catch_error.hpp"
#include "gpt/parallel.hpp"
#include "reference.hpp"

namespace {

using namespace gpt_test;
using gpt::pipeline_action;
using gpt::pipeline_schedule;

struct mesh_run {
  std::vector<double> losses;
  std::vector<gpt::parallel_result> ranks;
};

// Every rank's groups held at most what stage_memory_bound() allows (and the dense group held
// something: the figure is measured).
void check_memory(const mesh_run& run) {
  for (std::size_t r = 0; r < run.ranks.size(); ++r) {
    const auto& x = run.ranks[r];
    REQUIRE(x.transient_peak.size() == x.transient_bound.size());
    for (std::size_t g = 0; g < x.transient_peak.size(); ++g) {
      CAPTURE(r);
      CAPTURE(g);
      if (g == 0) CHECK(x.transient_peak[g] > 0);  // an unsharded experts' group may alias all it uses
      CHECK(x.transient_peak[g] <= x.transient_bound[g]);
    }
  }
}

template <class Group = full_f32>
mesh_run train_mesh(const gpt::run_options& o, const gpt::parallel_options& p, typename Group::options opts = {}) {
  const int n = p.mesh.pp * p.mesh.dp_replicate * p.mesh.dp_shard * p.mesh.tp;
  mesh_run out;
  out.ranks.resize(static_cast<std::size_t>(n));
  fsdp::threads::world{n}.run([&](fsdp::threads::communicator& comm) {
    auto r = gpt::train_parallel<Group>(comm, o, p, opts, test_corpus());
    if (comm.rank() == 0)
      for (const auto& s : r.steps) out.losses.push_back(s.loss);
    out.ranks[static_cast<std::size_t>(comm.rank())] = std::move(r);
  });
  return out;
}

}  // namespace

TEST_CASE("pipeline_order: every micro-batch's forward before its backward; 1F1B holds at most stages - s in flight") {
  for (auto sched : {pipeline_schedule::gpipe, pipeline_schedule::one_f_one_b})
    for (int stages = 1; stages <= 4; ++stages)
      for (int stage = 0; stage < stages; ++stage)
        for (int micro = 1; micro <= 6; ++micro) {
          CAPTURE(stages);
          CAPTURE(stage);
          CAPTURE(micro);
          const auto order = gpt::pipeline_order(sched, stage, stages, micro);
          REQUIRE(order.size() == static_cast<std::size_t>(2 * micro));
          std::vector<int> done(static_cast<std::size_t>(micro), 0);  // 0 none, 1 forward, 2 backward
          int in_flight = 0, most = 0, next_backward = 0;
          for (const pipeline_action& a : order) {
            auto& d = done[static_cast<std::size_t>(a.micro)];
            REQUIRE(d == (a.forward ? 0 : 1));
            d = a.forward ? 1 : 2;
            if (!a.forward) CHECK(a.micro == next_backward++);  // backwards in micro-batch order
            in_flight += a.forward ? 1 : -1;
            most = std::max(most, in_flight);
          }
          CHECK(order.back() == pipeline_action{false, micro - 1});  // gradients reduce after the last
          if (sched == pipeline_schedule::one_f_one_b) CHECK(most <= std::min(stages - stage, micro));
          else CHECK(most == micro);
        }
  // Megatron's 1F1B on 4 stages, 4 micro-batches, stage 1: two warm-up forwards.
  const auto s1 = gpt::pipeline_order(pipeline_schedule::one_f_one_b, 1, 4, 4);
  CHECK(s1 == std::vector<pipeline_action>{{true, 0}, {true, 1}, {true, 2}, {false, 0}, {true, 3}, {false, 1}, {false, 2}, {false, 3}});
}

TEST_CASE("gpt on a mesh: TP, PP, HSDP and recomputation match the plain reference (fp32)") {
  auto o = small_run(5);
  const auto ref = train_reference(o, test_corpus());
  REQUIRE(ref.losses.back() < ref.losses.front() - 0.3);
  REQUIRE(ref.clipped > 0);  // the global norm across TP ranks and stages is exercised
  struct run {
    std::string name;
    fsdp::mesh_shape mesh;
    int micro;
    pipeline_schedule schedule;
    bool recompute;
  };
  const auto f1b = pipeline_schedule::one_f_one_b, gpipe = pipeline_schedule::gpipe;
  for (const run& r : {run{"tp 2 x fsdp 2", {.dp_shard = 2, .tp = 2}, 1, f1b, false},
                       run{"tp 2 x hsdp 2x2", {.dp_replicate = 2, .dp_shard = 2, .tp = 2}, 1, f1b, false},
                       run{"pp 2 x fsdp 2, 1F1B, 3 micro-batches", {.pp = 2, .dp_shard = 2}, 3, f1b, false},
                       run{"pp 2 x fsdp 2, GPipe, 2 micro-batches", {.pp = 2, .dp_shard = 2}, 2, gpipe, false},
                       run{"tp 2 x pp 2 x fsdp 2, 1F1B", {.pp = 2, .dp_shard = 2, .tp = 2}, 2, f1b, false},
                       run{"tp 2 x pp 2 x fsdp 2, 1F1B, recomputed", {.pp = 2, .dp_shard = 2, .tp = 2}, 2, f1b, true},
                       run{"fsdp 4, recomputed", {.dp_shard = 4}, 1, f1b, true}}) {
    CAPTURE(r.name);
    auto ro = o;
    ro.micro_batches = r.micro;
    const auto got = train_mesh(ro, {.mesh = r.mesh, .schedule = r.schedule, .recompute = r.recompute});
    CHECK(max_abs_diff(ref.losses, got.losses) <= 1e-5);  // measured: 7.3e-7 to 8.5e-7
    check_memory(got);
  }
}

TEST_CASE("gpt on a mesh: clipping in the optimizers' pass gives the losses of a pass of its own, bit for bit") {
  auto o = small_run(4);
  const gpt::parallel_options p{.mesh = {.pp = 2, .dp_shard = 2, .tp = 2}};
  const auto fused = train_mesh(o, p);
  o.clip_in_optimizer = false;
  const auto separate = train_mesh(o, p);
  REQUIRE(fused.losses.size() == 4);
  CHECK(fused.losses == separate.losses);
  o.clip = 0;
  CHECK(train_mesh(o, p).losses != fused.losses);  // the clipping mattered
}

TEST_CASE("gpt on a mesh: experts on their own mesh (ep x the experts' shard group) match the plain reference") {
  auto o = small_run(5);
  o.model.experts = 4;
  o.model.top_k = 2;
  const auto ref = train_reference(o, test_corpus());  // one process: every expert local
  REQUIRE(ref.losses.back() < ref.losses.front() - 0.3);
  struct run {
    std::string name;
    fsdp::mesh_shape mesh;
    int micro;
  };
  for (const run& r : {run{"experts 4 on ep 2 x dp_shard 2 (dense over dp_shard 4)", {.dp_shard = 4, .ep = 2}, 1},
                       run{"experts 4 on ep 2, unsharded (dense over dp_shard 2)", {.dp_shard = 2, .ep = 2}, 1},
                       run{"experts 4 on ep 1, sharded over dp_shard 2 with the dense", {.dp_shard = 2}, 1},
                       run{"pp 2 x dp_shard 2, experts on ep 2, 2 micro-batches", {.pp = 2, .dp_shard = 2, .ep = 2}, 2}}) {
    CAPTURE(r.name);
    auto ro = o;
    ro.micro_batches = r.micro;
    const auto got = train_mesh(ro, {.mesh = r.mesh});
    CHECK(max_abs_diff(ref.losses, got.losses) <= 1e-5);  // measured: 7.3e-7 to 8.5e-7
    check_memory(got);
    if (r.mesh.ep > 1) {  // docs/design.md's ep line: four all-to-alls per MoE block and micro-batch
      const int dp = r.mesh.dp_shard, tokens = o.batch / dp / r.micro * o.model.seq, C = o.model.dim;
      const int cap = tokens * std::min(o.model.top_k, o.model.experts / r.mesh.ep);
      const std::uint64_t floats = static_cast<std::uint64_t>(1 + cap * (1 + C) + 3 * cap * C);
      const std::uint64_t blocks = static_cast<std::uint64_t>(o.model.layers / r.mesh.pp * r.micro * o.steps);
      for (const auto& rank : got.ranks) CHECK(rank.ep.all_to_all == blocks * floats * 4 * static_cast<std::uint64_t>(r.mesh.ep - 1));
    }
  }
}

TEST_CASE("gpt on a mesh: bf16 parameters give the losses of bf16 on one rank") {
  const auto o = small_run(4);
  const auto one = train_mesh<full_bf16>(o, {.mesh = {.dp_shard = 1}});
  for (const fsdp::mesh_shape m : {fsdp::mesh_shape{.dp_shard = 2, .tp = 2}, fsdp::mesh_shape{.pp = 2, .dp_shard = 2, .tp = 2}}) {
    CAPTURE(fsdp::to_string(m));
    auto ro = o;
    ro.micro_batches = 2;
    const auto got = train_mesh<full_bf16>(ro, {.mesh = m});
    // bf16 parameters round each update; the products' order differs with TP: the bf16 test's band.
    for (std::size_t s = 0; s < one.losses.size(); ++s) CHECK(std::abs(got.losses[s] - one.losses[s]) <= 0.02 * one.losses[s]);
  }
}

TEST_CASE("gpt on a mesh: the TP and PP traffic per step equal their formulas") {
  auto o = small_run(2);
  o.micro_batches = 2;
  const fsdp::mesh_shape shape{.pp = 2, .dp_shard = 2, .tp = 2};
  for (bool recompute : {false, true}) {
    CAPTURE(recompute);
    const auto got = train_mesh(o, {.mesh = shape, .recompute = recompute});
    const int dp = 2, rows = o.batch / dp / o.micro_batches, layers_per_stage = o.model.layers / shape.pp;
    const std::size_t activation = static_cast<std::size_t>(rows * o.model.seq * o.model.dim);  // floats per message
    // TP: per block and micro-batch two all-reduces forward, two backward, two more when recomputed.
    const std::uint64_t tp_per_step = static_cast<std::uint64_t>(layers_per_stage * o.micro_batches * (recompute ? 6 : 4)) *
                                      fsdp::traffic_counters::all_reduce_bytes(activation, fsdp::dtype::f32, shape.tp);
    // PP: stage 0 sends each micro-batch's activations up, stage 1 each gradient down.
    const std::uint64_t pp_per_step = static_cast<std::uint64_t>(o.micro_batches) * activation * sizeof(float);
    for (std::size_t r = 0; r < got.ranks.size(); ++r) {
      CAPTURE(r);
      // and the gradient norm's sum over the TP group: one f64 a step.
      const std::uint64_t norm = fsdp::traffic_counters::all_reduce_bytes(1, fsdp::dtype::f64, shape.tp);
      CHECK(got.ranks[r].tp.all_reduce == (tp_per_step + norm) * static_cast<std::uint64_t>(o.steps));
      CHECK(got.ranks[r].pp.send == pp_per_step * static_cast<std::uint64_t>(o.steps));
      CHECK(got.ranks[r].dp.total() > 0);
    }
  }
}

TEST_CASE("gpt on a mesh: a rank that fails mid-run stops every rank with its cause, within the timeout") {
  // Rank 3 throws after step 0: its TP peer then waits in a TP all-reduce, its data-parallel
  // peer in an all-gather, the previous stage's ranks in a recv (pp 2); each must end with the
  // cause, not hang.
  for (const fsdp::mesh_shape m : {fsdp::mesh_shape{.dp_shard = 2, .tp = 2}, fsdp::mesh_shape{.pp = 2, .dp_shard = 1, .tp = 2}}) {
    CAPTURE(fsdp::to_string(m));
    const auto o = small_run(3);
    const auto start = std::chrono::steady_clock::now();
    const fsdp::error e = fsdp_test::catch_error([&] {
      fsdp::threads::world{4, {.timeout = std::chrono::milliseconds(2000)}}.run([&](fsdp::threads::communicator& comm) {
        gpt::train_parallel<full_f32>(comm, o, {.mesh = m}, {}, test_corpus(), [&](const gpt::parallel_step& s) {
          if (comm.rank() == 3 && s.step == 0) throw fsdp::error(fsdp::errc::invalid_argument, "injected: rank 3 stops");
        });
      });
    });
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    CHECK(std::string(e.what()).find("injected: rank 3 stops") != std::string::npos);
    CHECK(took < 2.0);
  }
}

TEST_CASE("gpt on a mesh: bad shapes are refused naming the sizes") {
  const auto o = small_run(1);
  auto refused = [&](fsdp::mesh_shape m, int micro) {
    auto ro = o;
    ro.micro_batches = micro;
    return std::string(fsdp_test::catch_error([&] { train_mesh(ro, {.mesh = m}); }).what());
  };
  CHECK(refused({.dp_shard = 1, .tp = 4}, 1).find("--tp 4 must divide --heads 2") != std::string::npos);
  CHECK(refused({.pp = 4, .dp_shard = 1}, 1).find("--pp 4 stages need at least as many --layers (2)") != std::string::npos);
  CHECK(refused({.pp = 2, .dp_shard = 2}, 4).find("into 4 micro-batches") != std::string::npos);
  CHECK(refused({.dp_shard = 2, .ep = 2}, 1).find("--ep 2 needs --experts") != std::string::npos);
}
