#pragma once
//! \file The RAII scopes a shard_group hands out: unit_scope (group.forward(u), group.backward(u))
//! and sync_guard (group.no_sync()).

#include <exception>

namespace fsdp::detail {

//! pre_forward / pre_backward of unit u now, post_forward / post_backward at the end of the scope.
//! The post hook is skipped when an exception is unwinding through the scope: the group's own
//! destructor then tells the peers.
template <class Group>
class unit_scope {
 public:
  unit_scope(Group& g, int u, bool forward) : g_(&g), u_(u), forward_(forward), exceptions_(std::uncaught_exceptions()) {
    forward ? g.pre_forward(u) : g.pre_backward(u);
  }
  unit_scope(const unit_scope&) = delete;
  unit_scope& operator=(const unit_scope&) = delete;
  ~unit_scope() noexcept(false) {
    if (std::uncaught_exceptions() != exceptions_) return;
    forward_ ? g_->post_forward(u_) : g_->post_backward(u_);
  }

 private:
  Group* g_;
  int u_;
  bool forward_;
  int exceptions_;
};

//! Gradient sync off for the scope (FSDP1's no_sync()), restored at its end.
template <class Group>
class sync_guard {
 public:
  explicit sync_guard(Group& g) : g_(g), was_(g.requires_gradient_sync()) { g.set_requires_gradient_sync(false); }
  sync_guard(const sync_guard&) = delete;
  sync_guard& operator=(const sync_guard&) = delete;
  ~sync_guard() { g_.set_requires_gradient_sync(was_); }

 private:
  Group& g_;
  bool was_;
};

}  // namespace fsdp::detail
