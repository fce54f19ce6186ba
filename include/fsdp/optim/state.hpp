#pragma once
//! \file What an optimizer holds per bucket shard, named as torch's optimizers name it, so that a
//! checkpoint can save and restore it: adamw's "exp_avg" and "exp_avg_sq" (f32), sgd's
//! "momentum_buffer" (the master dtype), plus the step count ("step").

#include <cstddef>
#include <string_view>

#include "fsdp/core/dtype.hpp"

namespace fsdp {

//! One per-element state of one bucket's shard, in the group's device memory: `numel`
//! elements of `type` at `data` (as many as the bucket's shard of master parameters).
struct optimizer_state {
  std::string_view name;
  void* data;
  dtype type;
  std::size_t numel;
};

}  // namespace fsdp
