#pragma once
//! \file The umbrella header: everything a framework needs to plug in.

#include "fsdp/core/error.hpp"         // defines: fsdp::error, errc
#include "fsdp/core/dtype.hpp"         // defines: dtype, bf16, f16, convert
#include "fsdp/core/layout.hpp"        // defines: flat_layout, padding_multiple
#include "fsdp/core/param_traits.hpp"  // defines: param_traits, parameter, buffer<T>
#include "fsdp/core/init.hpp"          // defines: init::broadcast_from, init::per_shard, param_slice
#include "fsdp/core/timeline.hpp"      // defines: timeline (Chrome / Perfetto traces)
#include "fsdp/core/timeout.hpp"       // defines: milliseconds, default_timeout
#include "fsdp/core/memory.hpp"        // defines: mem_kind, memory_stats
#include "fsdp/core/stop_signals.hpp"  // defines: stop_signals (SIGTERM, SIGINT, SIGUSR1 as a request to stop)
#include "fsdp/device/concepts.hpp"    // defines: device, queue, host_task_queue, event, device_buffer (concepts)
#include "fsdp/device/host.hpp"        // defines: host_device, host_queue, host_event, host_buffer
#include "fsdp/comm/concepts.hpp"      // defines: communicator concepts, reduce_op, traffic_counters
#include "fsdp/comm/topology.hpp"      // defines: topology, topology_of, knows_hosts
#include "fsdp/comm/threads.hpp"       // defines: threads::world, threads::communicator
#include "fsdp/comm/mesh.hpp"          // defines: mesh, mesh_shape (pp x dp_replicate x dp_shard x tp)
#include "fsdp/comm/quantized_gather.hpp" // defines: int8_all_gather, fp8_all_gather, quantized_all_gather
#include "fsdp/policy/sharding.hpp"    // defines: sharding, full_shard(), shard_grad_op(), hybrid_shard(S), hybrid_shard_per_host(), no_shard()
#include "fsdp/policy/mixed_precision.hpp"  // defines: mixed_precision, full_precision, precision_rules
#include "fsdp/policy/prefetch.hpp"    // defines: prefetch, no_prefetch()
#include "fsdp/policy/bucket.hpp"      // defines: per_unit, fixed_bytes
#include "fsdp/policy/collectives.hpp" // defines: custom_collectives
#include "fsdp/policy/offload.hpp"     // defines: offload, offload_all()
#include "fsdp/shard_group.hpp"        // defines: shard_group
#include "fsdp/optim/sgd.hpp"          // defines: sgd, sgd_options
#include "fsdp/optim/adamw.hpp"        // defines: adamw, adamw_options
#include "fsdp/optim/clip.hpp"         // defines: clip_grad_norm
#include "fsdp/optim/state.hpp"        // defines: optimizer_state
#include "fsdp/checkpoint/safetensors.hpp"  // defines: checkpoint::safetensors_writer, read_safetensors_header, read_bytes
#include "fsdp/checkpoint/sharded.hpp"      // defines: checkpoint::save, load, async_saver
#include "fsdp/checkpoint/full.hpp"         // defines: checkpoint::export_full, init::from_checkpoint
#include "fsdp/checkpoint/directory.hpp"    // defines: checkpoint::is_complete, latest, complete_checkpoint
#include "fsdp/checkpoint/index.hpp"        // defines: checkpoint::read_index, checkpoint_index
#include "fsdp/schedule/trace.hpp"       // defines: schedule::step_trace, unit_profile, hook_event, derive_events, bucket_layouts
#include "fsdp/schedule/cost_model.hpp"  // defines: schedule::cost_model, link_cost, h100_nvlink, h100_infiniband
#include "fsdp/schedule/calibrate.hpp"   // defines: schedule::calibrate, calibrate_options
#include "fsdp/schedule/choose_sharding.hpp"  // defines: schedule::measure_links, host_links, cost_for, choose_sharding
#include "fsdp/schedule/plan.hpp"        // defines: schedule::plan, prefetch_plan, per_unit_prefetch, from_policies, validate
#include "fsdp/schedule/simulator.hpp"   // defines: schedule::simulate, sim_result
#include "fsdp/schedule/planner.hpp"     // defines: schedule::greedy_plan, best_plan
#include "fsdp/schedule/auto_bucket.hpp" // defines: auto_bucket (plan_for: a plan for options.plan)
