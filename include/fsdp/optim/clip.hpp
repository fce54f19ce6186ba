#pragma once
//! \file Global gradient-norm clipping across all shards (torch.nn.utils.clip_grad_norm_).

#include <cmath>
#include <cstddef>
#include <string>
#include <utility>

#include "fsdp/core/error.hpp"
#include "fsdp/detail/kernels.hpp"
#include "fsdp/device/concepts.hpp"
#if defined(__CUDACC__)
#include "fsdp/detail/cuda_norm.hpp"
#endif

namespace fsdp::detail {
//! On a CUDA device (detail/cuda_norm.hpp, nvcc only): the shard group's sum of squares, read
//! back, or left in the device's memory.
template <class Group>
double cuda_global_sum_of_squares(Group& group);
template <class Group>
void cuda_global_sum_of_squares_into(Group& group, double* total);
}  // namespace fsdp::detail

namespace fsdp {

struct clip_options {
  //! Throw errc::non_finite when the norm is nan or inf (torch's error_if_nonfinite), instead
  //! of returning it with the gradients left as they are.
  bool error_if_nonfinite = false;
};

namespace detail {
//! clip_coefficient's arithmetic, on the host or on the device: the same bits on both (IEEE
//! double division and square root).
FSDP_HOST_DEVICE inline float clip_factor(double norm, double max_norm) {
  const double coef = max_norm / (norm + 1e-6);
  return coef < 1.0 ? static_cast<float>(coef) : 1.0f;
}
//! What clip_on_device leaves where the gradients are.
struct clip_values {
  double norm;   // the sum of squares, then its square root
  float factor;  // clip_factor(norm, max_norm)
};
//! One element: the norm from the sum of squares, and the factor.
struct finish_clip {
  clip_values* v;
  double max_norm;
  FSDP_HOST_DEVICE void operator()(std::size_t) const {
    v->norm = sqrt(v->norm);
    v->factor = clip_factor(v->norm, max_norm);
  }
};

//! The shard group's sum of squares of every gradient shard, on a device whose memory the host
//! reads (the host device).
template <class Group>
double host_global_sum_of_squares(Group& group) {
  double sum = 0.0;
  for (std::size_t b = 0; b < group.num_buckets(); ++b) {
    const auto s = group.shard(b);
    sum += sum_of_squares(group.device().execution_policy(), s.grads, s.numel);
  }
  return group.shard_group_sum(sum);
}

//! grad_norm() for `who` (the name its error gives).
template <class Group>
double grad_norm_for(Group& group, clip_options o, const char* who) {
  refuse_in_capture(group.device(), who, "it returns the norm to the host, which captured work cannot wait for", group.rank());
  group.finish_backward();
  double sum = 0.0;
  if constexpr (requires { group.device().compute_stream(); }) {
    sum = cuda_global_sum_of_squares(group);  // on the GPU, one host wait (detail/cuda_norm.hpp)
  } else {
    sum = host_global_sum_of_squares(group);
  }
  const double norm = std::sqrt(sum);
  if (!std::isfinite(norm) && o.error_if_nonfinite)
    throw error(errc::non_finite, std::string(who) + ": the gradient norm is " + std::to_string(norm) +
                                      " (a gradient holds nan or inf); nothing was scaled", {group.rank(), -1, {}});
  return norm;
}
}  // namespace detail

//! Collective. Ends the backward pass and returns the L2 norm of the whole averaged gradient
//! (every shard of every bucket: a sum over the shard group), scaling nothing: with
//! clip_coefficient(), the factor an optimizer's step(grad_scale) clips by in its own pass.
//!
//! A gradient holding nan or inf makes the norm nan or inf on every rank alike; with
//! .error_if_nonfinite every rank then throws fsdp::error(errc::non_finite).
template <class Group>
double grad_norm(Group& group, clip_options o = {}) {
  return detail::grad_norm_for(group, o, "grad_norm");
}

//! The factor clip_grad_norm scales the gradient by: max_norm / (norm + 1e-6) when the norm
//! exceeds max_norm, else 1 (also for a norm that is nan or inf: nothing is scaled then).
inline float clip_coefficient(double norm, double max_norm) {
  if (!(max_norm > 0.0)) throw error(errc::invalid_argument, "clip_grad_norm: max_norm must be > 0");
  return detail::clip_factor(norm, max_norm);
}

//! A step's gradient norm and clip factor where the gradients are (clip_on_device): in the
//! device's memory on a GPU, where an optimizer's step(clip) reads the factor in its pass.
template <class Device>
class device_clip {
 public:
  device_clip(Device device, typename Device::buffer values) : device_(std::move(device)), values_(std::move(values)) {}
  //! Where step(clip) reads the factor.
  const float* factor() const noexcept { return &values_.template as<detail::clip_values>()->factor; }
  //! The norm before clipping, read back: on a GPU a wait for the device, so ask only when needed.
  double norm() const { return read().norm; }
  //! The factor, read back (as norm(); an optimizer reads it so for offloaded shards).
  float factor_on_host() const { return read().factor; }

 private:
  detail::clip_values read() const {
    detail::clip_values v{};
    device_.copy_to_host(&v, values_.data(), sizeof v);
    return v;
  }
  Device device_;
  typename Device::buffer values_;
};

namespace detail {
//! What an optimizer's pass over a shard in `kind` memory reads the gradient times: `grad_scale`,
//! or clip's factor where it is (the pointer), or, for an offloaded shard, which steps on the
//! host, the factor read back.
template <class Device>
std::pair<float, const float*> step_scale(float grad_scale, const device_clip<Device>* clip, mem_kind kind) {
  if (!clip) return {grad_scale, nullptr};
  if (kind == mem_kind::offloaded) return {clip->factor_on_host(), nullptr};
  return {1.0f, clip->factor()};
}
}  // namespace detail

//! Collective. What opt.step(clip_coefficient(grad_norm(group), max_norm)) clips by, computed
//! where the gradients are and left there: on a GPU no host wait (the norm is summed and
//! all-reduced in device memory, the factor made by a one-element kernel), so a step that
//! clips can be captured as a CUDA graph. opt.step(clip_on_device(group, max_norm)) gives the
//! same bits; clip.norm() reads the norm when the caller wants it. A nan or inf norm gives the
//! factor 1 (as clip_coefficient; there is nothing to throw from on the device).
template <class Group>
device_clip<typename Group::device_type> clip_on_device(Group& group, double max_norm) {
  if (!(max_norm > 0.0)) throw error(errc::invalid_argument, "clip_on_device: max_norm must be > 0");
  group.finish_backward();
  auto& device = group.device();
  auto values = detail::allocate_uninitialized(device, sizeof(detail::clip_values), mem_kind::transient);
  auto* v = values.template as<detail::clip_values>();
  if constexpr (requires { device.compute_stream(); }) {
    detail::cuda_global_sum_of_squares_into(group, &v->norm);
  } else {
    v->norm = detail::host_global_sum_of_squares(group);
  }
  detail::for_each_index(device.execution_policy(), 1, detail::finish_clip{v, max_norm});
  return {device, std::move(values)};
}

//! Collective. grad_norm(), then the gradient shards scaled by clip_coefficient() in a pass of
//! their own (torch.nn.utils.clip_grad_norm_). Returns the norm before clipping. To clip in the
//! optimizer's pass instead (one pass over the gradients fewer, the gradients left unscaled):
//!   opt.step(fsdp::clip_coefficient(fsdp::grad_norm(group), max_norm));
//!
//! A gradient holding nan or inf makes the norm nan or inf on every rank alike. Then nothing is
//! scaled and the norm is returned (check it: an optimizer step would spread the nan), or, with
//! .error_if_nonfinite, every rank throws fsdp::error(errc::non_finite).
template <class Group>
double clip_grad_norm(Group& group, double max_norm, clip_options o = {}) {
  if (!(max_norm > 0.0)) throw error(errc::invalid_argument, "clip_grad_norm: max_norm must be > 0");
  const double norm = detail::grad_norm_for(group, o, "clip_grad_norm");
  const float coef = clip_coefficient(norm, max_norm);
  if (coef < 1.0f)
    for (std::size_t b = 0; b < group.num_buckets(); ++b) {
      const auto s = group.shard(b);
      detail::scale(group.device().execution_policy(), s.grads, s.numel, coef);
    }
  return norm;
}

}  // namespace fsdp
