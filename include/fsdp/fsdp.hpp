#pragma once
//! \file The umbrella header: everything a framework needs to plug in.

#include "fsdp/core/error.hpp"         // defines: fsdp::error, errc
#include "fsdp/core/dtype.hpp"         // defines: dtype, bf16, f16, convert
#include "fsdp/core/layout.hpp"        // defines: flat_layout, padding_multiple
#include "fsdp/core/param_traits.hpp"  // defines: param_traits, parameter, buffer<T>
#include "fsdp/core/init.hpp"          // defines: init::broadcast_from, init::per_shard, param_slice
#include "fsdp/core/timeline.hpp"      // defines: timeline (Chrome / Perfetto traces)
#include "fsdp/device/host.hpp"        // defines: host_device, host_queue, host_event, memory_stats
#include "fsdp/comm/concepts.hpp"      // defines: communicator concepts, reduce_op, traffic_counters
#include "fsdp/comm/threads.hpp"       // defines: threads::world, threads::communicator
#include "fsdp/policy/sharding.hpp"    // defines: full_shard, hybrid_shard, no_shard
#include "fsdp/policy/mixed_precision.hpp"  // defines: mixed_precision, full_precision
#include "fsdp/policy/prefetch.hpp"    // defines: no_prefetch, prefetch
#include "fsdp/policy/bucket.hpp"      // defines: per_unit, fixed_bytes
#include "fsdp/shard_group.hpp"        // defines: shard_group
#include "fsdp/optim/sgd.hpp"          // defines: sgd, sgd_options
#include "fsdp/optim/adamw.hpp"        // defines: adamw, adamw_options
#include "fsdp/optim/clip.hpp"         // defines: clip_grad_norm
