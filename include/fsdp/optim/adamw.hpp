#pragma once
//! \file Sharded AdamW (PyTorch's torch.optim.AdamW: decoupled weight decay, bias-corrected
//! moments), stepping only this rank's master shard; moments are sharded with it (ZeRO-1).

#include <cmath>
#include <cstddef>
#include <limits>
#include <string>
#include <vector>

#include "fsdp/core/config.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/memory.hpp"
#include "fsdp/detail/kernels.hpp"
#include "fsdp/device/concepts.hpp"
#include "fsdp/optim/clip.hpp"
#include "fsdp/optim/for_each_element.hpp"
#include "fsdp/optim/state.hpp"

namespace fsdp {

struct adamw_options {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 1e-2f;
  //! As sgd_options::refuse_nonfinite_grads: a nan or inf gradient throws errc::non_finite
  //! before step() changes anything (moments, step count, parameters).
  bool refuse_nonfinite_grads = false;
  //! The step count and the bias corrections kept in the device's memory and advanced by a
  //! kernel of the step (PyTorch's capturable=True), so that a step captured as a CUDA graph
  //! (device/cuda/graph.hpp) advances them at every launch. The same arithmetic as the host's,
  //! so the same bits. The learning rate too is read from the device's memory, where set_lr()
  //! writes it in compute order: a schedule that calls set_lr() between launches is followed
  //! (PyTorch's capturable AdamW with a tensor lr). steps() reads the count back (a wait for
  //! the device). Not with offloaded state.
  bool capturable = false;
  friend bool operator==(const adamw_options&, const adamw_options&) = default;
};

namespace detail {
//! Step t's scalars of the update (in the device's memory when capturable).
struct adamw_step_scalars {
  long long t = 0;
  float step_size = 0;  // lr / (1 - beta1^t)
  float bc2_sqrt = 0;   // sqrt(1 - beta2^t)
  float lr = 0;         // what set_lr() wrote last
};
//! One step further: the count and what the update needs from it, as step() computes them on
//! the host (std::pow of two floats is powf).
struct adamw_advance {
  adamw_step_scalars* s;
  float beta1, beta2;
  FSDP_HOST_DEVICE void operator()(std::size_t) const {
    s->t += 1;
    const float t = static_cast<float>(s->t);
    s->step_size = s->lr / (1.0f - powf(beta1, t));
    s->bc2_sqrt = sqrtf(1.0f - powf(beta2, t));
  }
};
//! set_lr()'s write into the device's memory: a kernel whose argument is the value, so the host
//! waits for nothing.
struct adamw_set_lr {
  adamw_step_scalars* s;
  float lr;
  FSDP_HOST_DEVICE void operator()(std::size_t) const { s->lr = lr; }
};

template <class M, class P>
struct adamw_op {
  M* p;
  P* low;  // the shard in the gathered dtype, written in this pass (null: not kept)
  const M* g;
  float* m;
  float* v;
  adamw_options o;
  float step_size;   // lr / (1 - beta1^t)
  float bc2_sqrt;    // sqrt(1 - beta2^t)
  float grad_scale;  // the gradient is read times this (step(grad_scale): clipping in this pass)
  const float* grad_scale_at;  // or times this, where clip_on_device left it (step(clip))
  const adamw_step_scalars* scalars;  // when capturable: step_size and bc2_sqrt read from here
  FSDP_HOST_DEVICE void operator()(std::size_t i) const {
    const float size = scalars ? scalars->step_size : step_size;
    const float bc2 = scalars ? scalars->bc2_sqrt : bc2_sqrt;
    const float lr = scalars ? scalars->lr : o.lr;
    float x = convert<float>(p[i]) * (1.0f - lr * o.weight_decay);
    const float gi = convert<float>(g[i]) * (grad_scale_at ? *grad_scale_at : grad_scale);
    m[i] = o.beta1 * m[i] + (1.0f - o.beta1) * gi;
    v[i] = o.beta2 * v[i] + (1.0f - o.beta2) * gi * gi;
    const float denom = sqrtf(v[i]) / bc2 + o.eps;
    x -= size * m[i] / denom;
    const M stepped = convert<M>(x);
    p[i] = stepped;
    if (low) low[i] = convert<P>(stepped);  // as the gather's cast of the master would
  }
};
}  // namespace detail

//! AdamW on a shard_group's shards; the moments are f32 and sharded like the parameters.
//!   fsdp::adamw opt{group, {.lr = 3e-4f, .weight_decay = 0.1f}};
template <class Group>
class adamw {
 public:
  using master_type = typename Group::master_type;
  using param_type = typename Group::param_type;

  //! Build it after group.finalize(): its moments are sized from the shards (errc::order before).
  adamw(Group& group, adamw_options opts) : group_(group), opts_(opts) {
    if (!group.finalized())
      throw error(errc::order,
                  "adamw: optimizer built before finalize (its moments are sized from the shards finalize makes; "
                  "build it after group.finalize(...))",
                  {group.rank()});
    if (!valid_lr(opts.lr) || !(opts.eps > 0.0f) || !(opts.weight_decay >= 0.0f) || !(opts.beta1 >= 0.0f) ||
        !(opts.beta1 < 1.0f) || !(opts.beta2 >= 0.0f) || !(opts.beta2 < 1.0f))
      throw error(errc::invalid_argument, "adamw: needs a finite lr >= 0, eps > 0, weight_decay >= 0, 0 <= beta < 1");
    for (std::size_t b = 0; b < group.num_buckets(); ++b) {
      const std::size_t bytes = group.shard(b).numel * sizeof(float);
      exp_avg_.push_back(group.device().allocate(bytes, group.shard(b).kind));
      exp_avg_sq_.push_back(group.device().allocate(bytes, group.shard(b).kind));
      if (opts.capturable && group.shard(b).kind == mem_kind::offloaded)
        throw error(errc::invalid_argument, "adamw: capturable keeps the step count in the device's memory, and offloaded shards step on the host",
                    {group.rank()});
    }
    if (opts.capturable) {
      scalars_ = group.device().allocate(sizeof(detail::adamw_step_scalars), mem_kind::persistent);
      write_lr();
    }
  }

  //! Ends the backward pass (group.finish_backward) and updates the local shards. The gradient
  //! is read times `grad_scale` (finite, >= 0), which clips in this pass:
  //! step(clip_coefficient(grad_norm(group), max_norm)) equals clip_grad_norm(group, max_norm)
  //! then step() bit for bit for an f32 master, one pass over the gradients fewer, and leaves
  //! the gradients unscaled (optim/clip.hpp).
  void step(float grad_scale = 1.0f) {
    detail::check_grad_scale(grad_scale, "adamw", group_.rank());
    update(grad_scale, nullptr);
  }
  //! step(clip_coefficient(grad_norm(group), max_norm)) with the factor read where
  //! clip_on_device(group, max_norm) left it (optim/clip.hpp): the same bits, no host wait.
  void step(const device_clip<typename Group::device_type>& clip) { update(1.0f, &clip); }
  void zero_grad() { group_.zero_grad(); }
  //! The learning rate of the next step() (>= 0): options().lr. Capturable, it is written into
  //! the device's memory too, in compute order, where a captured step reads it at every launch:
  //! call it between launches, as a schedule does (inside a capture it would be frozen into the
  //! graph: refused, errc::invalid_argument). A step() after options().lr was changed directly
  //! writes it the same way, outside a capture, and refuses inside one.
  void set_lr(float lr) {
    if (!valid_lr(lr))
      throw error(errc::invalid_argument, "adamw: set_lr needs a finite lr >= 0, got " + std::to_string(lr), {group_.rank()});
    if (scalars_)
      detail::refuse_in_capture(group_.device(), "adamw: set_lr()",
                                "the write would be part of the graph, setting this value at every launch; call set_lr() "
                                "between launches",
                                group_.rank());
    opts_.lr = lr;
    if (scalars_) write_lr();
  }
  //! Steps taken: the t of the bias corrections. set_steps restores it with the moments (a resume).
  //! Capturable: the count in the device's memory, which launches of a captured step advance.
  long steps() const {
    if (!scalars_) return steps_;
    detail::adamw_step_scalars s;
    group_.device().copy_to_host(&s, scalars_.data(), sizeof s);
    return static_cast<long>(s.t);
  }
  void set_steps(long t) {
    if (t < 0) throw error(errc::invalid_argument, "adamw: set_steps needs t >= 0, got " + std::to_string(t), {group_.rank()});
    steps_ = t;
    const detail::adamw_step_scalars s{.t = t, .lr = opts_.lr};
    if (scalars_) {
      group_.device().copy_from_host(scalars_.data(), &s, sizeof s);
      device_lr_ = opts_.lr;
    }
  }
  //! Bucket b's moments (optim/state.hpp): exp_avg and exp_avg_sq, f32, one per shard element.
  std::vector<optimizer_state> state(std::size_t b) {
    const std::size_t n = group_.shard(b).numel;
    return {{"exp_avg", exp_avg_.at(b).data(), dtype::f32, n}, {"exp_avg_sq", exp_avg_sq_.at(b).data(), dtype::f32, n}};
  }
  const adamw_options& options() const noexcept { return opts_; }
  adamw_options& options() noexcept { return opts_; }

 private:
  // step()'s work: the gradient read times `grad_scale`, or times clip's factor where it is.
  void update(float grad_scale, const device_clip<typename Group::device_type>* clip) {
    if (!opts_.capturable)
      detail::refuse_in_capture(group_.device(), "adamw: step()",
                                "its bias corrections come from the step count on the host, so every launch would repeat this "
                                "step's; build it with .capturable = true",
                                group_.rank());
    if (scalars_ && opts_.lr != device_lr_) {  // options().lr changed directly: the device's copy is stale
      detail::refuse_in_capture(group_.device(), "adamw: step() after options().lr changed",
                                "a captured step reads the learning rate set_lr() wrote into the device's memory; call "
                                "set_lr() before the capture",
                                group_.rank());
      write_lr();
    }
    detail::finish_backward_for_step(group_, opts_.refuse_nonfinite_grads, "adamw");
    ++steps_;
    const float bc1 = 1.0f - std::pow(opts_.beta1, static_cast<float>(steps_));
    const float bc2 = 1.0f - std::pow(opts_.beta2, static_cast<float>(steps_));
    auto* scalars = scalars_.template as<detail::adamw_step_scalars>();  // null unless capturable
    if (scalars) detail::for_each_index(group_.device().execution_policy(), 1, detail::adamw_advance{scalars, opts_.beta1, opts_.beta2});
    for (std::size_t b = 0; b < group_.num_buckets(); ++b) {
      const auto s = group_.shard(b);
      const auto [scale, scale_at] = detail::step_scale(grad_scale, clip, s.kind);
      detail::for_each_element(group_, s,
                               detail::adamw_op<master_type, param_type>{s.params, s.low_precision, s.grads, exp_avg_[b].template as<float>(),
                                                                         exp_avg_sq_[b].template as<float>(), opts_, opts_.lr / bc1,
                                                                         std::sqrt(bc2), scale, scale_at, scalars});
      if (s.low_precision) group_.low_precision_written(b);
    }
  }

  static bool valid_lr(float lr) { return lr >= 0.0f && lr <= std::numeric_limits<float>::max(); }  // finite, >= 0
  // Capturable: opts_.lr into the device's copy, in compute order.
  void write_lr() {
    detail::for_each_index(group_.device().execution_policy(), 1,
                           detail::adamw_set_lr{scalars_.template as<detail::adamw_step_scalars>(), opts_.lr});
    device_lr_ = opts_.lr;
  }

  Group& group_;
  adamw_options opts_;
  std::vector<typename Group::device_type::buffer> exp_avg_, exp_avg_sq_;
  typename Group::device_type::buffer scalars_;  // capturable: detail::adamw_step_scalars
  float device_lr_ = 0;                          // capturable: the lr last written there
  long steps_ = 0;
};

}  // namespace fsdp
