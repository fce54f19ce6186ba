#pragma once
//! \file Sharded SGD with momentum and weight decay (PyTorch's torch.optim.SGD, dampening 0),
//! stepping only this rank's master shard. Written with Thrust: the same kernel runs on the
//! host device and on CUDA.

#include <cstddef>
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

struct sgd_options {
  float lr = 1e-2f;
  float momentum = 0.0f;
  float weight_decay = 0.0f;  //!< L2 penalty added to the gradient (coupled, as torch SGD)
  bool nesterov = false;
  //! step() throws errc::non_finite, naming the parameter and element, when a gradient is nan or
  //! inf, before it changes any parameter or state (retry once the gradient is fixed).
  //! Collective, a scan of the gradients and a small all-reduce, hence off by default.
  bool refuse_nonfinite_grads = false;
  friend bool operator==(const sgd_options&, const sgd_options&) = default;
};

namespace detail {
template <class M, class P>
struct sgd_op {
  M* p;
  P* low;  // the shard in the gathered dtype, written in this pass (null: not kept)
  const M* g;
  M* buf;  // null without momentum
  sgd_options o;
  bool first;
  float grad_scale;  // the gradient is read times this (step(grad_scale): clipping in this pass)
  const float* grad_scale_at;  // or times this, where clip_on_device left it (step(clip))
  FSDP_HOST_DEVICE void operator()(std::size_t i) const {
    float d = convert<float>(g[i]) * (grad_scale_at ? *grad_scale_at : grad_scale) + o.weight_decay * convert<float>(p[i]);
    if (buf) {
      const float b = first ? d : o.momentum * convert<float>(buf[i]) + d;
      buf[i] = convert<M>(b);
      d = o.nesterov ? d + o.momentum * b : b;
    }
    const M stepped = convert<M>(convert<float>(p[i]) - o.lr * d);
    p[i] = stepped;
    if (low) low[i] = convert<P>(stepped);  // as the gather's cast of the master would
  }
};
}  // namespace detail

//! SGD on a shard_group's shards.
//!   fsdp::sgd opt{group, {.lr = 0.1f, .momentum = 0.9f}};
//!   ... backward ...; opt.step(); opt.zero_grad();
template <class Group>
class sgd {
 public:
  using master_type = typename Group::master_type;

  //! Build it after group.finalize(): its momentum is sized from the shards (errc::order before).
  sgd(Group& group, sgd_options opts) : group_(group), opts_(opts) {
    if (!group.finalized())
      throw error(errc::order,
                  "sgd: optimizer built before finalize (its momentum buffers are sized from the shards finalize makes; "
                  "build it after group.finalize(...))",
                  {group.rank()});
    if (!(opts.lr >= 0.0f) || !(opts.momentum >= 0.0f) || !(opts.weight_decay >= 0.0f))
      throw error(errc::invalid_argument, "sgd: lr, momentum and weight_decay must be >= 0");
    if (opts.nesterov && opts.momentum == 0.0f)
      throw error(errc::invalid_argument, "sgd: nesterov needs momentum > 0");
    if (opts.momentum != 0.0f)
      for (std::size_t b = 0; b < group.num_buckets(); ++b)
        momentum_.push_back(group.device().allocate(group.shard(b).numel * sizeof(master_type), group.shard(b).kind));
  }

  //! Ends the backward pass (group.finish_backward) and updates the local shards, reading the
  //! gradient times `grad_scale` (as adamw::step: clipping in this pass).
  void step(float grad_scale = 1.0f) {
    detail::check_grad_scale(grad_scale, "sgd", group_.rank());
    update(grad_scale, nullptr);
  }
  //! step(clip_coefficient(grad_norm(group), max_norm)) with the factor read where
  //! clip_on_device(group, max_norm) left it (optim/clip.hpp): the same bits, no host wait.
  void step(const device_clip<typename Group::device_type>& clip) { update(1.0f, &clip); }
  void zero_grad() { group_.zero_grad(); }
  //! Steps taken (the first one starts the momentum from the gradient, as torch does);
  //! set_steps restores it with the momentum (a resume).
  long steps() const noexcept { return steps_; }
  void set_steps(long t) {
    if (t < 0) throw error(errc::invalid_argument, "sgd: set_steps needs t >= 0, got " + std::to_string(t), {group_.rank()});
    steps_ = t;
  }
  //! Bucket b's momentum_buffer (optim/state.hpp) in the master dtype; none without momentum.
  std::vector<optimizer_state> state(std::size_t b) {
    if (momentum_.empty()) return {};
    return {{"momentum_buffer", momentum_.at(b).data(), dtype_of<master_type>, group_.shard(b).numel}};
  }
  const sgd_options& options() const noexcept { return opts_; }
  sgd_options& options() noexcept { return opts_; }  //!< e.g. to change lr between steps

 private:
  // step()'s work: the gradient read times `grad_scale`, or times clip's factor where it is.
  void update(float grad_scale, const device_clip<typename Group::device_type>* clip) {
    // The first step starts the momentum from the gradient, chosen on the host: captured, every
    // launch would start it afresh.
    if (steps_ == 0 && !momentum_.empty())
      detail::refuse_in_capture(group_.device(), "sgd: its first step with momentum",
                                "every launch would start the momentum afresh (take the first step eagerly)", group_.rank());
    detail::finish_backward_for_step(group_, opts_.refuse_nonfinite_grads, "sgd");
    for (std::size_t b = 0; b < group_.num_buckets(); ++b) {
      const auto s = group_.shard(b);
      master_type* buf = momentum_.empty() ? nullptr : momentum_[b].template as<master_type>();
      const auto [scale, scale_at] = detail::step_scale(grad_scale, clip, s.kind);
      detail::for_each_element(group_, s, detail::sgd_op<master_type, typename Group::param_type>{
                                              s.params, s.low_precision, s.grads, buf, opts_, steps_ == 0, scale, scale_at});
      if (s.low_precision) group_.low_precision_written(b);
    }
    ++steps_;
  }

  Group& group_;
  sgd_options opts_;
  std::vector<typename Group::device_type::buffer> momentum_;
  long steps_ = 0;
};

}  // namespace fsdp
