// What a CUDA graph of a training step needs from shard_group, checked on the host (a GPU run
// captures one: tests/cuda/test_nccl_ranks.cu). A launch replays the captured step, so a steady
// step must issue the same allocations and collectives as the step before it, in the same
// order; every buffer a collective writes must be allocated for that collective's queue (where a
// capture puts its graph node, device/cuda/memory.hpp); and the step must free what it
// allocates. What must run on the host (AdamW's bias corrections unless capturable, the gradient
// norm, refuse_nonfinite_grads, SGD's first step with momentum) refuses inside a capture by name,
// and changes nothing.
#include <doctest/doctest.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/catch_error.hpp"
#include "common/fake_communicator.hpp"
#include "fsdp/fsdp.hpp"

namespace {

// The host device, watched: which allocations a step asks for (the stream of first use, the
// bytes) and its zero fills, and a capture it can be told it is in.
struct watched_device : fsdp::host_device {
  struct entry {
    std::string stream;  // "compute", a queue's name, or "zero" for a zero fill in compute order
    std::size_t bytes = 0;
    friend bool operator==(const entry&, const entry&) = default;
  };
  std::shared_ptr<std::vector<entry>> log = std::make_shared<std::vector<entry>>();
  std::shared_ptr<bool> in_capture = std::make_shared<bool>(false);

  buffer allocate_uninitialized(std::size_t bytes, fsdp::mem_kind kind) const {
    log->push_back({"compute", bytes});
    return allocate(bytes, kind);
  }
  buffer allocate_uninitialized(std::size_t bytes, fsdp::mem_kind kind, const queue& first_use) const {
    log->push_back({first_use.name(), bytes});
    return allocate(bytes, kind);
  }
  void zero_async(void* dst, std::size_t bytes) const {
    log->push_back({"zero", bytes});
    zero(dst, bytes);
  }
  bool capturing() const { return *in_capture; }
};
static_assert(fsdp::device<watched_device>);

using watched_comm = fsdp_test::basic_fake_communicator<watched_device>;

template <class P, class Precision>
struct model {
  watched_device dev;
  watched_comm comm;
  fsdp::shard_group<fsdp::buffer<P>, Precision, watched_comm> group;
  fsdp::buffer<P> w1{300, "w1"}, b1{7, "b1"}, w2{129, "w2"}, w3{1000, "w3"};
  std::vector<std::vector<fsdp::buffer<P>*>> units{{&w1, &b1}, {&w2}, {&w3}};

  // Rank 0 of `ranks`; `splits`: the colors of the splits the sharding makes (fake_communicator).
  model(fsdp::sharding s, int ranks, const std::vector<std::vector<int>>& splits)
      : comm(planned(ranks, splits)), group(comm, dev, {.sharding = s}) {
    for (const auto& u : units) group.add_unit(u);
    group.finalize(fsdp::init::per_shard([](const fsdp::param_slice& p, std::span<float> v) {
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.01f * static_cast<float>((p.offset + i) % 101);
    }));
  }
  static watched_comm planned(int ranks, const std::vector<std::vector<int>>& splits) {
    watched_comm c{0, ranks};
    for (const auto& colors : splits) c.plan_split(colors);
    return c;
  }
  void forward_backward() {
    for (int u = 0; u < 3; ++u) auto scope = group.forward(u);
    for (int u = 3; u-- > 0;) {
      auto scope = group.backward(u);
      for (fsdp::buffer<P>* q : units[static_cast<std::size_t>(u)])
        for (std::size_t i = 0; i < q->size(); ++i) q->grad()[i] = fsdp::convert<P>(fsdp::convert<float>(q->data()[i]) * 0.5f);
    }
  }
};

// One step's device work: its allocations and zero fills, its collectives, and the live bytes
// around it.
struct step_work {
  std::vector<watched_device::entry> allocations;
  std::vector<std::string> collectives;
  std::size_t live_before = 0, live_after = 0;
  std::size_t on(const std::string& stream) const {
    std::size_t n = 0;
    for (const auto& a : allocations) n += a.stream == stream;
    return n;
  }
};

template <class P, class Precision>
void check_steady_steps(fsdp::sharding s, int ranks, const std::vector<std::vector<int>>& splits) {
  model<P, Precision> m(s, ranks, splits);
  fsdp::sgd opt{m.group, {.lr = 0.1f, .momentum = 0.9f}};
  auto step = [&] {
    const std::size_t a0 = m.dev.log->size(), c0 = m.comm.calls().size();
    step_work w;
    w.live_before = m.dev.memory().live;
    m.forward_backward();
    opt.step();
    opt.zero_grad();
    w.live_after = m.dev.memory().live;
    w.allocations.assign(m.dev.log->begin() + static_cast<std::ptrdiff_t>(a0), m.dev.log->end());
    for (std::size_t i = c0; i < m.comm.calls().size(); ++i) w.collectives.push_back(m.comm.calls()[i].group + " " + m.comm.calls()[i].str());
    return w;
  };
  (void)step();  // the first step records the unit order; the second replays it
  const step_work second = step(), third = step();
  REQUIRE(!second.allocations.empty());
  REQUIRE(!second.collectives.empty());
  CHECK(second.allocations == third.allocations);
  CHECK(second.collectives == third.collectives);
  CHECK(second.live_after == second.live_before);  // the step frees what it allocates
  // Gathered buckets are allocated for the all-gather queue, one per all-gather (one region a
  // bucket: no frozen parameters); compute's own buffers (the gradients) are zeroed there, as is
  // every gradient shard by zero_grad(); the rest is the reduce-scatter queue's (cast, output).
  std::size_t gathers = 0;
  for (const std::string& c : second.collectives) gathers += c.find("all_gather") != std::string::npos;
  CHECK(second.on("all_gather") == gathers);
  CHECK(second.on("zero") == second.on("compute") + m.group.num_buckets());
  CHECK(second.on("all_gather") + second.on("compute") + second.on("zero") + second.on("reduce_scatter") == second.allocations.size());
}

}  // namespace

TEST_CASE("graph capture's preconditions: a steady step repeats the step before it, allocates for each collective's queue, frees it all") {
  SUBCASE("full_shard, f32 (the reduction writes into the gradient shard)") {
    check_steady_steps<float, fsdp::full_precision<float>>(fsdp::full_shard(), 2, {});
  }
  SUBCASE("full_shard, bf16 parameters, f32 reduction (a cast buffer and an output on the reduce-scatter queue)") {
    check_steady_steps<fsdp::bf16, fsdp::mixed_precision<fsdp::bf16, float, float>>(fsdp::full_shard(), 2, {});
  }
  SUBCASE("shard_grad_op, f32") { check_steady_steps<float, fsdp::full_precision<float>>(fsdp::shard_grad_op(), 2, {}); }
  SUBCASE("hybrid_shard(2) of 4 (reduce-scatter, then the replicas' all-reduce)") {
    check_steady_steps<float, fsdp::full_precision<float>>(fsdp::hybrid_shard(2), 4, {{0, 0, 1, 1}, {0, 1, 0, 1}});
  }
}

TEST_CASE("graph capture: AdamW's step (unless capturable), the gradient norm, refuse_nonfinite_grads and SGD's first step with momentum refuse inside a capture by name, changing nothing") {
  model<float, fsdp::full_precision<float>> m(fsdp::full_shard(), 2, {});
  fsdp::adamw adam{m.group, {.lr = 0.1f}};
  fsdp::sgd checked{m.group, {.lr = 0.1f, .refuse_nonfinite_grads = true}};
  fsdp::adamw checked_adam{m.group, {.lr = 0.1f, .refuse_nonfinite_grads = true, .capturable = true}};
  fsdp::sgd fresh{m.group, {.lr = 0.1f, .momentum = 0.9f}};  // its first step chooses how momentum starts
  m.forward_backward();
  adam.step();
  const std::vector<float> before = m.group.full_parameter(0, 0);
  m.forward_backward();
  *m.dev.in_capture = true;
  struct refusal {
    const char* who;
    std::function<void()> call;
  };
  for (const refusal& r : {refusal{"adamw: step()", [&] { adam.step(); }}, refusal{"grad_norm", [&] { (void)fsdp::grad_norm(m.group); }},
                           refusal{"clip_grad_norm", [&] { (void)fsdp::clip_grad_norm(m.group, 1.0); }},
                           refusal{"sgd: refuse_nonfinite_grads", [&] { checked.step(); }},
                           refusal{"adamw: refuse_nonfinite_grads", [&] { checked_adam.step(); }},
                           refusal{"sgd: its first step with momentum", [&] { fresh.step(); }}}) {
    CAPTURE(r.who);
    const fsdp::error e = fsdp_test::catch_error(r.call);
    CHECK(e.code() == fsdp::errc::invalid_argument);
    CHECK(std::string(e.what()).find(std::string(r.who) + " inside a CUDA graph capture: ") != std::string::npos);
  }
  *m.dev.in_capture = false;
  CHECK(adam.steps() == 1);
  CHECK(checked.steps() == 0);
  CHECK(checked_adam.steps() == 0);
  CHECK(fresh.steps() == 0);
  CHECK(m.group.full_parameter(0, 0) == before);
  adam.step();  // the backward pass refused above is still there to step
  CHECK(adam.steps() == 2);
  CHECK(m.group.full_parameter(0, 0) != before);

  // Capturable, its count and bias corrections are the device's: it steps inside a capture.
  fsdp::adamw capturable{m.group, {.lr = 0.1f, .capturable = true}};
  m.forward_backward();
  *m.dev.in_capture = true;
  capturable.step();
  *m.dev.in_capture = false;
  CHECK(capturable.steps() == 1);

  // Its learning rate is the device's too, written by set_lr between launches: inside a capture
  // set_lr would freeze its value into the graph, and a step after options().lr was changed
  // directly would read a stale copy; both refuse, changing nothing.
  m.forward_backward();
  const std::vector<float> stepped = m.group.full_parameter(0, 0);
  *m.dev.in_capture = true;
  const fsdp::error in_set = fsdp_test::catch_error([&] { capturable.set_lr(0.05f); });
  CHECK(in_set.code() == fsdp::errc::invalid_argument);
  CHECK(std::string(in_set.what()).find("adamw: set_lr() inside a CUDA graph capture: ") != std::string::npos);
  CHECK(capturable.options().lr == 0.1f);
  capturable.options().lr = 0.05f;
  const fsdp::error stale = fsdp_test::catch_error([&] { capturable.step(); });
  CHECK(stale.code() == fsdp::errc::invalid_argument);
  CHECK(std::string(stale.what()).find("adamw: step() after options().lr changed inside a CUDA graph capture: ") != std::string::npos);
  *m.dev.in_capture = false;
  CHECK(capturable.steps() == 1);
  CHECK(m.group.full_parameter(0, 0) == stepped);
  capturable.set_lr(0.05f);  // between launches: then the captured step reads it
  *m.dev.in_capture = true;
  capturable.step();
  *m.dev.in_capture = false;
  CHECK(capturable.steps() == 2);
  CHECK(m.group.full_parameter(0, 0) != stepped);
}
