#pragma once
//! \file Global gradient-norm clipping across all shards (torch.nn.utils.clip_grad_norm_).

#include <cmath>
#include <cstddef>
#include <string>

#include "fsdp/core/error.hpp"
#include "fsdp/detail/kernels.hpp"
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

//! Collective. Ends the backward pass, computes the L2 norm of the whole averaged gradient
//! (every shard of every bucket: a sum over the shard group), and scales the gradient shards
//! by max_norm / (norm + 1e-6) when the norm exceeds max_norm. Returns the norm before
//! clipping.
//!
//! A gradient holding nan or inf makes the norm nan or inf on every rank alike. Then nothing is
//! scaled and the norm is returned (check it: an optimizer step would spread the nan), or, with
//! .error_if_nonfinite, every rank throws fsdp::error(errc::non_finite).
template <class Group>
double clip_grad_norm(Group& group, double max_norm, clip_options o = {}) {
  if (!(max_norm > 0.0)) throw error(errc::invalid_argument, "clip_grad_norm: max_norm must be > 0");
  group.finish_backward();
  const auto policy = group.device().execution_policy();
  double sum = 0.0;
  if constexpr (requires { group.device().compute_stream(); }) {
    sum = detail::cuda_global_sum_of_squares(group);  // on the GPU, one host wait (detail/cuda_norm.hpp)
  } else {
    for (std::size_t b = 0; b < group.num_buckets(); ++b) {
      const auto s = group.shard(b);
      sum += detail::sum_of_squares(policy, s.grads, s.numel);
    }
    sum = group.shard_group_sum(sum);
  }
  const double norm = std::sqrt(sum);
  if (!std::isfinite(norm)) {
    if (o.error_if_nonfinite)
      throw error(errc::non_finite, "clip_grad_norm: the gradient norm is " + std::to_string(norm) +
                                        " (a gradient holds nan or inf); nothing was scaled", {group.rank(), -1, {}});
    return norm;
  }
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0)
    for (std::size_t b = 0; b < group.num_buckets(); ++b) {
      const auto s = group.shard(b);
      detail::scale(policy, s.grads, s.numel, static_cast<float>(coef));
    }
  return norm;
}

}  // namespace fsdp
