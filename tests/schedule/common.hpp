#pragma once
// Small traces for the schedule tests.

#include <cstddef>
#include <string>
#include <vector>

#include "fsdp/schedule/trace.hpp"

namespace sched_test {

// `n` units of one parameter of `numel` elements each, equal compute, registration order.
inline fsdp::schedule::step_trace equal_units(int n, std::size_t numel, double fwd, double bwd, int world, int shard) {
  fsdp::schedule::step_trace t;
  // The name appended: "u" + std::to_string(u) hits GCC 12's false -Wrestrict at -O3 (GCC bugs
  // 105329, 105651).
  for (int u = 0; u < n; ++u) t.units.push_back({std::string("u").append(std::to_string(u)), {numel}, fwd, bwd});
  fsdp::schedule::use_registration_order(t);
  t.world_size = world;
  t.shard_size = shard;
  return t;
}

// Compute of a GPT-shaped step, seconds (see nested_units).
struct nested_times {
  double embed = 1, block_fwd = 3, head = 2;            // forward
  double loss = 0.5, head_bwd = 2, block_bwd = 4, embed_bwd = 1;  // backward
};

// A GPT-shaped step (examples/gpt/model.hpp, forward_backward): unit 0, the embedding whose
// table is also the tied head, stays in use around units 1..blocks, each of one parameter of
// `numel` elements. Forward: pre 0, embedding, each block pre / compute / post, head, post 0.
// Backward: the loss, pre 0, head backward, the blocks in reverse, embedding backward, post 0.
// Unit times are the units' totals (unit 0: embedding + head).
inline fsdp::schedule::step_trace nested_units(int blocks, std::size_t numel, int world, int shard, nested_times c = {}) {
  using fsdp::schedule::hook_event;
  fsdp::schedule::step_trace t = equal_units(blocks + 1, numel, c.block_fwd, c.block_bwd, world, shard);
  t.units[0].forward_s = c.embed + c.head;
  t.units[0].backward_s = c.head_bwd + c.embed_bwd;
  t.backward_order = {0};
  for (int u = blocks; u >= 1; --u) t.backward_order.push_back(u);
  t.forward_events = {{0, true, 0}};
  for (int u = 1; u <= blocks; ++u) {
    t.forward_events.push_back({u, true, u == 1 ? c.embed : 0});
    t.forward_events.push_back({u, false, c.block_fwd});
  }
  t.forward_events.push_back({0, false, c.head});
  t.backward_events = {{0, true, c.loss}};
  for (int u = blocks; u >= 1; --u) {
    t.backward_events.push_back({u, true, u == blocks ? c.head_bwd : 0});
    t.backward_events.push_back({u, false, c.block_bwd});
  }
  t.backward_events.push_back({0, false, c.embed_bwd});
  return t;
}

}  // namespace sched_test
