#pragma once
//! \file param_traits<Params>: the customization point through which fsdp reads and rebinds a
//! framework's own parameter handles (a raw buffer, a tensor class, ...).

#include <concepts>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "fsdp/core/dtype.hpp"

namespace fsdp {

//! Specialize for your parameter handle type P. A specialization models `parameter` when:
//!   1. numel(p) is the number of elements (> 0);
//!   2. type(p) is its dtype (f32, bf16 or f16 to be sharded; add_unit rejects others);
//!   3. name(p) is a name for error messages (may be empty);
//!   4. initial_values(p) points at p's full initial values in type(p), or is null when p has
//!      none (broadcast init reads them on the root rank only);
//!   5. release_initial_values(p) frees them once fsdp holds the shards;
//!   6. bind(p, data, grad) points p at gathered storage and at its gradient storage (both
//!      numel(p) elements of type(p)); bind(p, nullptr, nullptr) when fsdp resharded it.
//!      The framework adds (+=) into grad storage, as autograd does.
//!   7. optional: lifetime(p) returns a std::weak_ptr<const void> that expires when p is
//!      destroyed. fsdp writes into a handle whenever it binds or unbinds it, the group's
//!      destructor included, so a handle must outlive its shard_group. With lifetime(), a group
//!      that outlives a handle never touches it again: binding it throws errc::order naming it,
//!      and the destructor skips it. Without lifetime() (a handle type that cannot tell), that
//!      order is the engine's to keep: declare the handles before the group.
//!   8. optional: shape(p) returns the dimensions (a std::vector<std::size_t> whose product is
//!      numel(p)); checkpoints record it and export_full writes it. Without it a parameter is
//!      1-D, {numel(p)}.
template <class P>
struct param_traits;

//! Whether param_traits<P> has contract 7's lifetime().
template <class P>
concept tracks_lifetime = requires(const P& p) {
  { param_traits<P>::lifetime(p) } -> std::convertible_to<std::weak_ptr<const void>>;
};

//! Whether param_traits<P> has contract 8's shape().
template <class P>
concept has_shape = requires(const P& p) {
  { param_traits<P>::shape(p) } -> std::convertible_to<std::vector<std::size_t>>;
};

//! A parameter's shape: contract 8's, or {numel}.
template <class P>
std::vector<std::size_t> shape_of(const P& p) {
  if constexpr (has_shape<P>) return param_traits<P>::shape(p);
  else return {static_cast<std::size_t>(param_traits<P>::numel(p))};
}

//! What a shard_group tells checkpoints of each parameter.
struct parameter_info {
  std::string name;
  std::vector<std::size_t> shape;
};

template <class P>
concept parameter = requires(P& p, const P& cp, void* d) {
  { param_traits<P>::numel(cp) } -> std::convertible_to<std::size_t>;
  { param_traits<P>::type(cp) } -> std::convertible_to<dtype>;
  { param_traits<P>::name(cp) } -> std::convertible_to<std::string_view>;
  { param_traits<P>::initial_values(cp) } -> std::convertible_to<const void*>;
  param_traits<P>::release_initial_values(p);
  param_traits<P>::bind(p, d, d);
};

//! A plain parameter buffer: the model shipped for engines whose parameters are flat arrays.
//! It owns its initial values until shard_group::finalize takes them; from then on data() and
//! grad() point at fsdp's gathered storage while the unit is in use, and are null otherwise.
//!   fsdp::buffer<float> w(64 * 32, "block0.w");   // 2048 zeros, filled by the engine
//!   fsdp::buffer<float> e({50257, 768}, "wte");   // with a shape (param_traits contract 8)
//!   std::ranges::copy(init, w.data());            // before finalize: the initial values
//! It tells fsdp when it is destroyed (param_traits contract 7), so a shard_group that outlives
//! it fails loudly instead of writing into freed memory.
template <element_type T>
class buffer {
 public:
  using value_type = T;
  buffer() = default;
  explicit buffer(std::size_t numel, std::string name = {})
      : init_(numel), data_(init_.data()), numel_(numel), name_(std::move(name)) {}
  buffer(std::vector<std::size_t> shape, std::string name)
      : buffer(product(shape), std::move(name)) {
    shape_ = std::move(shape);
  }
  buffer(const buffer&) = delete;  // fsdp keeps its address; copying would detach it
  buffer& operator=(const buffer&) = delete;

  T* data() noexcept { return data_; }
  const T* data() const noexcept { return data_; }
  //! Gradient storage while the unit is in backward; null otherwise.
  T* grad() noexcept { return grad_; }
  const T* grad() const noexcept { return grad_; }
  std::span<T> values() noexcept { return {data_, data_ ? numel_ : 0}; }
  std::span<const T> values() const noexcept { return {data_, data_ ? numel_ : 0}; }
  std::span<T> grads() noexcept { return {grad_, grad_ ? numel_ : 0}; }
  std::size_t size() const noexcept { return numel_; }
  const std::string& name() const noexcept { return name_; }

 private:
  static std::size_t product(const std::vector<std::size_t>& s) {
    std::size_t n = 1;
    for (std::size_t d : s) n *= d;
    return n;
  }
  friend struct param_traits<buffer>;
  std::vector<T> init_;
  T* data_ = nullptr;
  T* grad_ = nullptr;
  std::size_t numel_ = 0;
  std::string name_;
  std::vector<std::size_t> shape_;  // empty: 1-D
  std::shared_ptr<const void> alive_ = std::make_shared<char>(0);  // expires with the buffer
};

template <element_type T>
struct param_traits<buffer<T>> {
  static std::size_t numel(const buffer<T>& p) noexcept { return p.numel_; }
  static dtype type(const buffer<T>&) noexcept { return dtype_of<T>; }
  static std::string_view name(const buffer<T>& p) noexcept { return p.name_; }
  static const void* initial_values(const buffer<T>& p) noexcept {
    return p.init_.empty() ? nullptr : p.init_.data();
  }
  static void release_initial_values(buffer<T>& p) {
    std::vector<T>().swap(p.init_);
    p.data_ = nullptr;
  }
  static void bind(buffer<T>& p, void* data, void* grad) noexcept {
    p.data_ = static_cast<T*>(data);
    p.grad_ = static_cast<T*>(grad);
  }
  static std::weak_ptr<const void> lifetime(const buffer<T>& p) noexcept { return p.alive_; }
  static std::vector<std::size_t> shape(const buffer<T>& p) {
    return p.shape_.empty() ? std::vector<std::size_t>{p.numel_} : p.shape_;
  }
};

static_assert(parameter<buffer<float>>);
static_assert(tracks_lifetime<buffer<float>>);
static_assert(has_shape<buffer<float>>);

}  // namespace fsdp
