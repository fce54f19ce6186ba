#pragma once
//! \file A move-only `void()` callable (std::move_only_function is C++23).

#include <memory>
#include <utility>

namespace fsdp::detail {

class task {
 public:
  task() = default;
  template <class F>
    requires(!std::is_same_v<std::decay_t<F>, task>)
  task(F&& f) : impl_(std::make_unique<model<std::decay_t<F>>>(std::forward<F>(f))) {}  // NOLINT

  explicit operator bool() const noexcept { return impl_ != nullptr; }
  void operator()() { impl_->call(); }

 private:
  struct concept_t {
    virtual ~concept_t() = default;
    virtual void call() = 0;
  };
  template <class F>
  struct model final : concept_t {
    explicit model(F f) : f_(std::move(f)) {}
    void call() override { f_(); }
    F f_;
  };
  std::unique_ptr<concept_t> impl_;
};

}  // namespace fsdp::detail
