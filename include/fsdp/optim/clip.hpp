#pragma once
//! \file Global gradient-norm clipping across all shards (torch.nn.utils.clip_grad_norm_).

#include <cmath>
#include <cstddef>
#include <string>

#include "fsdp/core/error.hpp"
#include "fsdp/detail/kernels.hpp"
#include "fsdp/device/concepts.hpp"
#if defined(__CUDACC__)
#include "fsdp/detail/cuda_norm.hpp"
#endif

namespace fsdp::detail {
//! On a CUDA device (detail/cuda_norm.hpp, nvcc only): the shard group's sum of squares.
template <class Group>
double cuda_global_sum_of_squares(Group& group);
}  // namespace fsdp::detail

namespace fsdp {

struct clip_options {
  //! Throw errc::non_finite when the norm is nan or inf (torch's error_if_nonfinite), instead
  //! of returning it with the gradients left as they are.
  bool error_if_nonfinite = false;
};

namespace detail {
//! grad_norm() for `who` (the name its error gives).
template <class Group>
double grad_norm_for(Group& group, clip_options o, const char* who) {
  refuse_in_capture(group.device(), who, "it returns the norm to the host, which captured work cannot wait for", group.rank());
  group.finish_backward();
  double sum = 0.0;
  if constexpr (requires { group.device().compute_stream(); }) {
    sum = cuda_global_sum_of_squares(group);  // on the GPU, one host wait (detail/cuda_norm.hpp)
  } else {
    const auto policy = group.device().execution_policy();
    for (std::size_t b = 0; b < group.num_buckets(); ++b) {
      const auto s = group.shard(b);
      sum += sum_of_squares(policy, s.grads, s.numel);
    }
    sum = group.shard_group_sum(sum);
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
  const double coef = max_norm / (norm + 1e-6);
  return coef < 1.0 ? static_cast<float>(coef) : 1.0f;
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
