#pragma once
//! \file shard_group<Params, Policies...>: shards the parameters of a framework's units over
//! the ranks of a communicator, gathers them just in time through the hooks, reduce-scatters
//! their gradients, and holds the sharded master parameters and gradients an optimizer steps.
//!
//! Per step and bucket (a bucket is one or more consecutive units sharing one flat buffer):
//!   pre_forward   all-gather the bucket (unless prefetched) and wait; prefetch the next ones
//!   post_forward  free the gathered buffer once every unit of the bucket ran (reshard)
//!   pre_backward  gather again (full_shard), expose a zeroed gradient buffer
//!   post_backward once every unit of the bucket ran backward: reduce-scatter (average) the
//!                 gradients into the gradient shard, all-reduce across replicas (hybrid),
//!                 free the unsharded buffers
//!   finish_backward  wait for the reductions (an optimizer's step() calls it)
//!
//! Hooks must be called in the same order on every rank; collectives are matched by issue
//! order, as NCCL does.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <initializer_list>
#include <iterator>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "fsdp/comm/concepts.hpp"
#include "fsdp/comm/threads.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/init.hpp"
#include "fsdp/core/layout.hpp"
#include "fsdp/core/param_traits.hpp"
#include "fsdp/core/timeline.hpp"
#include "fsdp/detail/kernels.hpp"
#include "fsdp/device/host.hpp"
#include "fsdp/policy/bucket.hpp"
#include "fsdp/policy/mixed_precision.hpp"
#include "fsdp/policy/prefetch.hpp"
#include "fsdp/policy/sharding.hpp"
#include "fsdp/schedule/plan.hpp"

namespace fsdp {

namespace detail {

template <class P>
inline constexpr int policy_kinds = int(sharding_strategy<P>) + int(mixed_precision_policy<P>) +
                                    int(prefetch_policy<P>) + int(bucket_policy<P>) +
                                    int(full_communicator<P>);

//! Instantiated once per policy argument so that the compiler names the offending type.
template <class P>
struct check_policy {
  static_assert(policy_kinds<P> != 0,
                "shard_group: this policy argument is not a ShardingStrategy, MixedPrecision, "
                "Prefetch, BucketPolicy or Communicator (see the numbered requirements in "
                "fsdp/policy/*.hpp and fsdp/comm/concepts.hpp)");
  static_assert(policy_kinds<P> <= 1, "shard_group: this policy argument models more than one policy kind");
  static constexpr bool value = true;
};

template <template <class> class Is, class Default, class... Ps>
struct pick;
template <template <class> class Is, class Default>
struct pick<Is, Default> {
  using type = Default;
};
template <template <class> class Is, class Default, class P, class... Ps>
struct pick<Is, Default, P, Ps...> {
  using type = std::conditional_t<Is<P>::value, P, typename pick<Is, Default, Ps...>::type>;
};
template <template <class> class Is, class... Ps>
inline constexpr int count_of = (0 + ... + int(Is<Ps>::value));

template <class P> struct is_sharding : std::bool_constant<sharding_strategy<P>> {};
template <class P> struct is_precision : std::bool_constant<mixed_precision_policy<P>> {};
template <class P> struct is_prefetch : std::bool_constant<prefetch_policy<P>> {};
template <class P> struct is_bucket : std::bool_constant<bucket_policy<P>> {};
template <class P> struct is_comm : std::bool_constant<full_communicator<P>> {};

}  // namespace detail

//! Shards parameters of type Params (any type with a param_traits specialization). Policies,
//! in any order, each optional: a ShardingStrategy (default full_shard), a MixedPrecision
//! (default full_precision<float>), a Prefetch (default prefetch), a BucketPolicy (default
//! per_unit) and a Communicator type (default threads::communicator).
//!
//!   fsdp::shard_group<fsdp::buffer<float>, fsdp::hybrid_shard> group{
//!       comm, {}, {.sharding = {.shard_size = 2}, .prefetch = {.forward = 1, .backward = 1}}};
template <parameter Params, class... Policies>
class shard_group {
  static_assert((detail::check_policy<Policies>::value && ...));
  static_assert(detail::count_of<detail::is_sharding, Policies...> <= 1, "shard_group: more than one ShardingStrategy given");
  static_assert(detail::count_of<detail::is_precision, Policies...> <= 1, "shard_group: more than one MixedPrecision given");
  static_assert(detail::count_of<detail::is_prefetch, Policies...> <= 1, "shard_group: more than one Prefetch given");
  static_assert(detail::count_of<detail::is_bucket, Policies...> <= 1, "shard_group: more than one BucketPolicy given");
  static_assert(detail::count_of<detail::is_comm, Policies...> <= 1, "shard_group: more than one Communicator given");

 public:
  using sharding_type = typename detail::pick<detail::is_sharding, full_shard, Policies...>::type;
  using precision_type = typename detail::pick<detail::is_precision, full_precision<float>, Policies...>::type;
  using prefetch_type = typename detail::pick<detail::is_prefetch, prefetch, Policies...>::type;
  using bucket_type = typename detail::pick<detail::is_bucket, per_unit, Policies...>::type;
  using comm_type = typename detail::pick<detail::is_comm, threads::communicator, Policies...>::type;
  using device_type = typename comm_type::device_type;
  using param_type = typename precision_type::param_type;
  using reduce_type = typename precision_type::reduce_type;
  using master_type = typename precision_type::master_type;

  //! The runtime values of the policies.
  struct options {
    sharding_type sharding{};
    prefetch_type prefetch{};
    bucket_type bucket{};
  };

  //! One bucket's shard of the master parameters and of the averaged gradients.
  struct shard_view {
    master_type* params;
    master_type* grads;
    std::size_t numel;
  };

  //! Peak transient bytes the design promises (see docs/design.md, "Memory").
  struct memory_bound {
    std::size_t forward;
    std::size_t backward;
  };

  shard_group(comm_type& comm, device_type device = {}, options opts = {})
      : comm_(comm), device_(std::move(device)), opts_(std::move(opts)),
        wait_timeout_(comm.timeout() * 2 + milliseconds(1000)), exceptions_at_start_(std::uncaught_exceptions()) {
    if (opts_.prefetch.forward_depth() < 0 || opts_.prefetch.backward_depth() < 0)
      throw error(errc::invalid_argument, "prefetch depths must be >= 0", site());
  }
  shard_group(const shard_group&) = delete;
  shard_group& operator=(const shard_group&) = delete;

  //! Unbinds the parameters. Leaving by an exception aborts the communicator (where it can),
  //! so that peers waiting on this rank fail now instead of at their timeout.
  ~shard_group() {
    if (std::uncaught_exceptions() > exceptions_at_start_) {
      if constexpr (requires { comm_.abort(std::string{}); })
        comm_.abort("rank " + std::to_string(comm_.rank()) + " left its shard_group by an exception");
    }
    for (auto& u : units_)
      for (Params* p : u.params) param_traits<Params>::bind(*p, nullptr, nullptr);
  }

  // ---- registration ---------------------------------------------------------------------------

  //! Registers a unit: parameters used together (e.g. one transformer block). Units are
  //! numbered 0, 1, ... in registration order, which is also the order buckets are formed in.
  int add_unit(std::span<Params* const> params, std::string name = {}) {
    if (finalized_) throw error(errc::order, "add_unit after finalize", site());
    const int u = static_cast<int>(units_.size());
    if (params.empty()) throw error(errc::invalid_argument, "a unit needs at least one parameter", site(u));
    unit_rec rec;
    rec.name = name.empty() ? "unit" + std::to_string(u) : std::move(name);
    for (std::size_t i = 0; i < params.size(); ++i) {
      Params* p = params[i];
      if (p == nullptr) throw error(errc::invalid_argument, "parameter " + std::to_string(i) + " is null", site(u));
      const std::string pname = param_name(*p, i);
      for (std::size_t v = 0; v < units_.size(); ++v)
        for (Params* q : units_[v].params)
          if (q == p)
            throw error(errc::invalid_argument,
                        "registered twice (already in unit " + std::to_string(v) + ")", site(u, pname));
      if (std::find(rec.params.begin(), rec.params.end(), p) != rec.params.end())
        throw error(errc::invalid_argument, "registered twice in the same unit", site(u, pname));
      const dtype t = param_traits<Params>::type(*p);
      if (!is_shardable(t))
        throw error(errc::unsupported_dtype,
                    "dtype " + std::string(to_string(t)) + " cannot be sharded (supported: f32, bf16, f16)",
                    site(u, pname));
      if (t != dtype_of<param_type>)
        throw error(errc::unsupported_dtype,
                    "dtype " + std::string(to_string(t)) + " differs from the MixedPrecision param type " +
                        std::string(to_string(dtype_of<param_type>)),
                    site(u, pname));
      const std::size_t n = param_traits<Params>::numel(*p);
      if (n == 0) throw error(errc::invalid_argument, "has 0 elements", site(u, pname));
      if (n > max_param_numel)
        throw error(errc::invalid_argument,
                    "has " + std::to_string(n) + " elements, more than fsdp's limit of " +
                        std::to_string(max_param_numel),
                    site(u, pname));
      rec.params.push_back(p);
    }
    units_.push_back(std::move(rec));
    return u;
  }
  int add_unit(std::initializer_list<Params*> params, std::string name = {}) {
    return add_unit(std::span<Params* const>(params.begin(), params.size()), std::move(name));
  }

  //! Collective. Checks that every rank registered the same units, forms the buckets and
  //! shards, sets the initial values (init::broadcast_from or init::per_shard) and releases the
  //! handles' own copies. Parameters stay unbound until their unit's pre_forward.
  template <class Init>
  void finalize(const Init& init) {
    if (finalized_) throw error(errc::order, "finalize called twice", site());
    if (units_.empty()) throw error(errc::invalid_argument, "finalize with no units registered", site());
    check_registration_across_ranks();
    setup_communicators();
    build_buckets();
    if constexpr (std::is_same_v<Init, init::broadcast_from>) {
      init_broadcast(init.root);
    } else {
      init_per_shard(init.fill);
    }
    for (auto& u : units_)
      for (Params* p : u.params) {
        param_traits<Params>::release_initial_values(*p);
        param_traits<Params>::bind(*p, nullptr, nullptr);
      }
    set_explicit_orders();
    reset_timings();
    finalized_ = true;
  }

  // ---- hooks ----------------------------------------------------------------------------------

  //! Before unit u's forward: its parameters are gathered and bound when this returns.
  void pre_forward(int u) {
    [[maybe_unused]] auto range = device_.range("fsdp pre_forward");
    unit_rec& rec = unit(u, "pre_forward");
    if (rec.state == unit_state::forward)
      throw error(errc::order, "pre_forward called twice without post_forward", site(u));
    if (rec.state == unit_state::backward)
      throw error(errc::order, "pre_forward while the unit is in backward", site(u));
    if (recording_ && !bwd_trace_.empty()) recording_ = false;  // the first forward-backward is over
    if (recording_) fwd_trace_.push_back(u);
    const auto began = timeline::clock::now();  // one clock read at each end of a hook (~40 ns each)
    if (finished_at_ != timeline::clock::time_point{}) {  // the first hook of a step
      between_steps_ += began - finished_at_;
      ++between_runs_;
      finished_at_ = {};
      hook_ended_ = {};
    }
    hook_begins(u, true, false, began);
    pause_compute(began);
    bucket_rec& b = buckets_[static_cast<std::size_t>(rec.bucket)];
    if (!b.in_forward_pass) {
      b.in_forward_pass = true;
      b.fwd_remaining = static_cast<int>(b.units.size());
    }
    gather(rec.bucket);
    wait_gathered(rec.bucket);
    bind_params(rec.bucket, false);
    prefetch_after(rec.bucket, fwd_issue_at_, fwd_bucket_pos_);
    rec.state = unit_state::forward;
    hook_ends(start_compute(u));
  }

  //! After unit u's forward. Frees the bucket's gathered parameters once all of its units
  //! have run forward (when the strategy reshards after forward).
  void post_forward(int u) {
    [[maybe_unused]] auto range = device_.range("fsdp post_forward");
    unit_rec& rec = unit(u, "post_forward");
    if (rec.state != unit_state::forward) throw error(errc::order, "post_forward without pre_forward", site(u));
    const auto began = timeline::clock::now();
    hook_begins(u, false, false, began);
    end_compute(u, began);
    rec.state = unit_state::idle;
    rec.awaiting_backward = true;
    bucket_rec& b = buckets_[static_cast<std::size_t>(rec.bucket)];
    if (--b.fwd_remaining == 0) {
      b.in_forward_pass = false;
      if (reshard_after_forward()) reshard(rec.bucket);
    }
    hook_ends(resume_compute());
  }

  //! Before unit u's backward: parameters gathered and bound, gradient storage bound (zeroed
  //! at the first backward since the last reduction; kept across no_sync micro-batches).
  void pre_backward(int u) {
    [[maybe_unused]] auto range = device_.range("fsdp pre_backward");
    unit_rec& rec = unit(u, "pre_backward");
    if (rec.state == unit_state::backward)
      throw error(errc::order, "pre_backward called twice without post_backward", site(u));
    if (rec.state == unit_state::forward)
      throw error(errc::order, "pre_backward while the unit is in forward", site(u));
    if (!rec.awaiting_backward) throw error(errc::order, "pre_backward before the unit's forward", site(u));
    if (recording_) bwd_trace_.push_back(u);
    const auto began = timeline::clock::now();
    hook_begins(u, true, true, began);
    pause_compute(began);
    bucket_rec& b = buckets_[static_cast<std::size_t>(rec.bucket)];
    if (!b.in_backward_pass) {
      b.in_backward_pass = true;
      b.bwd_remaining = static_cast<int>(b.units.size());
    }
    gather(rec.bucket);
    if (!b.grad_full)
      b.grad_full = device_.allocate(b.layout.padded_numel() * sizeof(param_type), mem_kind::transient);
    wait_gathered(rec.bucket);
    bind_params(rec.bucket, true);
    prefetch_after(rec.bucket, bwd_issue_at_, bwd_bucket_pos_);
    rec.state = unit_state::backward;
    hook_ends(start_compute(u));
  }

  //! After unit u's backward (its gradients are written). Once every unit of the bucket ran
  //! backward, issues the reduction (unless gradient sync is off) and frees the parameters.
  void post_backward(int u) {
    [[maybe_unused]] auto range = device_.range("fsdp post_backward");
    unit_rec& rec = unit(u, "post_backward");
    if (rec.state != unit_state::backward) throw error(errc::order, "post_backward without pre_backward", site(u));
    const auto began = timeline::clock::now();
    hook_begins(u, false, true, began);
    end_compute(u, began);
    rec.state = unit_state::idle;
    rec.awaiting_backward = false;
    bucket_rec& b = buckets_[static_cast<std::size_t>(rec.bucket)];
    if (--b.bwd_remaining == 0) end_backward_of(rec.bucket);
    hook_ends(resume_compute());
  }

  //! RAII scope: pre_* now, post_* at the end of the scope (skipped when an exception is
  //! unwinding through it).
  class unit_scope {
   public:
    unit_scope(shard_group& g, int u, bool forward) : g_(&g), u_(u), forward_(forward), exceptions_(std::uncaught_exceptions()) {
      forward ? g.pre_forward(u) : g.pre_backward(u);
    }
    unit_scope(const unit_scope&) = delete;
    unit_scope& operator=(const unit_scope&) = delete;
    ~unit_scope() noexcept(false) {
      if (std::uncaught_exceptions() != exceptions_) return;
      forward_ ? g_->post_forward(u_) : g_->post_backward(u_);
    }

   private:
    shard_group* g_;
    int u_;
    bool forward_;
    int exceptions_;
  };
  [[nodiscard]] unit_scope forward(int u) { return unit_scope(*this, u, true); }
  [[nodiscard]] unit_scope backward(int u) { return unit_scope(*this, u, false); }

  //! Ends the backward pass: issues the reductions of buckets whose backward ran only in part,
  //! waits for every reduction, frees what is still gathered. The first call also checks that
  //! every rank ran its units in the same order and freezes that order for prefetching.
  void finish_backward() {
    [[maybe_unused]] auto range = device_.range("fsdp finish_backward");
    require_finalized("finish_backward");
    for (std::size_t u = 0; u < units_.size(); ++u)
      if (units_[u].state != unit_state::idle)
        throw error(errc::order, "finish_backward while the unit is still between its pre and post hooks",
                    site(static_cast<int>(u)));
    for (std::size_t b = 0; b < buckets_.size(); ++b)
      if (buckets_[b].in_backward_pass) end_backward_of(static_cast<int>(b));
    while (!pending_reductions_.empty()) wait_oldest_reduction();
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      buckets_[b].in_forward_pass = false;
      reshard(static_cast<int>(b));
    }
    for (auto& u : units_) u.awaiting_backward = false;
    if (!order_checked_) check_order();
    end_step_events();
    // The first finish_backward after a backward starts the time between steps: clipping, the
    // optimizer (whose step() calls finish_backward again) and whatever the engine does next.
    if (finished_at_ == timeline::clock::time_point{}) finished_at_ = timeline::clock::now();
  }

  //! Frees every gathered bucket after a forward-only pass (evaluation), which has no backward
  //! to end it: with grad_op, or with buckets prefetched and not used, gathered parameters would
  //! otherwise stay until the next backward. A forward-only pass before the first training step
  //! does not count as the recorded unit order.
  void reshard_all() {
    require_finalized("reshard_all");
    for (std::size_t u = 0; u < units_.size(); ++u)
      if (units_[u].state != unit_state::idle)
        throw error(errc::order, "reshard_all while the unit is still between its pre and post hooks", site(static_cast<int>(u)));
    for (std::size_t b = 0; b < buckets_.size(); ++b)
      if (buckets_[b].in_backward_pass)
        throw error(errc::order, "reshard_all during a backward pass", site(buckets_[b].units.front()));
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      buckets_[b].in_forward_pass = false;
      reshard(static_cast<int>(b));
    }
    for (auto& u : units_) u.awaiting_backward = false;
    if (recording_ && bwd_trace_.empty()) fwd_trace_.clear();
    step_fwd_events_.clear();  // a forward-only pass is not a step
    hook_ended_ = {};
    if (finished_at_ != timeline::clock::time_point{}) finished_at_ = timeline::clock::now();
  }

  //! Gradient sync for the next backward passes (FSDP2's set_requires_gradient_sync). While
  //! off, unsharded gradients accumulate across micro-batches and nothing is reduced.
  void set_requires_gradient_sync(bool on) noexcept { sync_ = on; }
  bool requires_gradient_sync() const noexcept { return sync_; }

  //! RAII: gradient sync off for the scope (FSDP1's no_sync()).
  class sync_guard {
   public:
    explicit sync_guard(shard_group& g) : g_(g), was_(g.sync_) { g.sync_ = false; }
    sync_guard(const sync_guard&) = delete;
    sync_guard& operator=(const sync_guard&) = delete;
    ~sync_guard() { g_.sync_ = was_; }

   private:
    shard_group& g_;
    bool was_;
  };
  [[nodiscard]] sync_guard no_sync() { return sync_guard(*this); }

  // ---- sharded state (what optimizers use) ------------------------------------------------------

  std::size_t num_buckets() const noexcept { return buckets_.size(); }
  shard_view shard(std::size_t b) {
    bucket_rec& k = buckets_.at(b);
    return {k.master.template as<master_type>(), k.grad_shard.template as<master_type>(), k.layout.shard_numel()};
  }
  //! Zeroes the gradient shards (waits for pending reductions first).
  void zero_grad() {
    finish_pending();
    for (auto& k : buckets_) device_.zero(k.grad_shard.data(), k.grad_shard.bytes());
  }
  //! Waits for every reduction issued so far, without ending the backward pass.
  void finish_pending() {
    while (!pending_reductions_.empty()) wait_oldest_reduction();
  }
  //! Collective over the shard group: sum over ranks of a per-rank double (the norm pieces).
  double shard_group_sum(double local) {
    if (!shard_comm_) return local;
    double v = local;
    shard_comm_->all_reduce(&v, &v, 1, dtype::f64, reduce_op::sum, ag_queue_).wait(wait_timeout_, "all_reduce");
    return v;
  }

  device_type& device() noexcept { return device_; }
  comm_type& comm() noexcept { return comm_; }

  // ---- introspection --------------------------------------------------------------------------

  int rank() const noexcept { return comm_.rank(); }
  int world_size() const noexcept { return comm_.size(); }
  //! Ranks sharing one copy of the parameters (S), and copies (R = world / S).
  int shard_size() const noexcept { return shard_size_; }
  int replica_size() const noexcept { return comm_.size() / shard_size_; }
  int num_units() const noexcept { return static_cast<int>(units_.size()); }
  int bucket_of(int u) const { return units_.at(static_cast<std::size_t>(u)).bucket; }
  //! The name given to add_unit ("unit<u>" when none was).
  const std::string& unit_name(int u) const { return units_.at(static_cast<std::size_t>(u)).name; }
  const flat_layout& layout(std::size_t b) const { return buckets_.at(b).layout; }
  const options& policy_values() const noexcept { return opts_; }
  memory_stats memory() const { return device_.memory(); }
  //! Bytes this rank sent through the group's communicators since the group was built.
  traffic_counters traffic() const {
    traffic_counters t = comm_.traffic() - comm_traffic_at_start_;
    if (owned_shard_comm_) t = t + owned_shard_comm_->traffic();
    if (owned_replica_comm_) t = t + owned_replica_comm_->traffic();
    return t;
  }
  //! Compute time of each unit, summed over the steps since the last reset_timings(): the time
  //! between its pre hook returning and its post hook, less the time spent in hooks of units
  //! nested inside it (a unit that stays gathered around others, like a tied embedding/head).
  //! Host time: on CUDA it measures issue, not kernels.
  struct unit_timing {
    std::chrono::nanoseconds forward{};
    std::chrono::nanoseconds backward{};
    int forward_runs = 0;
    int backward_runs = 0;
  };
  std::span<const unit_timing> unit_timings() const noexcept { return timings_; }
  //! Time the caller spent blocked on communication (waiting for an all-gather, or for the
  //! previous reduction before issuing the next) since the last reset_timings(). On CUDA the
  //! compute stream waits instead of the host, and this stays near zero: use the trace.
  std::chrono::nanoseconds communication_wait() const noexcept { return comm_wait_; }
  void reset_timings() {
    timings_.assign(units_.size(), unit_timing{});
    comm_wait_ = {};
    between_steps_ = {};
    between_runs_ = 0;
    fwd_events_.clear(), bwd_events_.clear(), step_fwd_events_.clear(), step_bwd_events_.clear();
    backward_tail_s_ = 0;
    event_steps_ = 0;
  }
  //! Collective. The step as the hooks saw it since reset_timings(), for the planner and the
  //! simulator (schedule/): each unit's sizes and mean compute time per step, the recorded unit
  //! orders, every hook call of a step with the compute before it (so units that stay in use
  //! around others are described as they run), the sharding and the dtypes, and as optimizer_s
  //! the mean time from finish_backward to the next step's first hook (the optimizer and whatever
  //! else the engine does between steps). Times are averaged over the ranks, so every rank gets
  //! the same trace and plans the same. A step here is one forward and one backward pass.
  schedule::step_trace step_trace(int optimizer_states = 2) {
    if (fwd_order_.empty()) throw error(errc::order, "step_trace before the first step's finish_backward", site());
    schedule::step_trace t;
    for (std::size_t u = 0; u < units_.size(); ++u) {
      schedule::unit_profile p;
      p.name = units_[u].name;
      for (Params* q : units_[u].params) p.param_numels.push_back(param_traits<Params>::numel(*q));
      const unit_timing& tm = timings_[u];
      const auto seconds = [](std::chrono::nanoseconds d, int runs) { return runs > 0 ? std::chrono::duration<double>(d).count() / runs : 0.0; };
      p.forward_s = seconds(tm.forward, tm.forward_runs);
      p.backward_s = seconds(tm.backward, tm.backward_runs);
      t.units.push_back(std::move(p));
    }
    t.forward_order = fwd_order_;
    t.backward_order = bwd_order_;
    t.world_size = comm_.size();
    t.shard_size = shard_size_;
    t.reshard_after_forward = reshard_after_forward();
    t.param_elem = sizeof(param_type);
    t.reduce_elem = sizeof(reduce_type);
    t.master_elem = sizeof(master_type);
    t.optimizer_states = optimizer_states;
    t.optimizer_s = between_runs_ > 0 ? std::chrono::duration<double>(between_steps_).count() / between_runs_ : 0.0;
    if (event_steps_ > 0) {
      t.forward_events = fwd_events_;
      t.backward_events = bwd_events_;
      for (auto* list : {&t.forward_events, &t.backward_events})
        for (auto& e : *list) e.compute_s /= event_steps_;
      t.backward_tail_s = backward_tail_s_ / event_steps_;
    }
    // Every rank measured its own times: plan from their mean. The lengths agree (the order was
    // checked across ranks), but the event lists may not have been recorded in full everywhere.
    std::vector<double> times;
    const auto collect = [&](bool write) {
      std::size_t i = 0;
      auto visit = [&](double& x) {
        if (write) x = times[i];
        else times.push_back(x);
        ++i;
      };
      for (auto& u : t.units) visit(u.forward_s), visit(u.backward_s);
      for (auto* list : {&t.forward_events, &t.backward_events})
        for (auto& e : *list) visit(e.compute_s);
      visit(t.backward_tail_s);
      visit(t.optimizer_s);
    };
    collect(false);
    std::uint64_t n = times.size();
    std::vector<std::uint64_t> lens(static_cast<std::size_t>(comm_.size()));
    blocking_all_gather(&n, lens.data(), sizeof n);
    if (!std::all_of(lens.begin(), lens.end(), [&](auto l) { return l == n; }))
      throw error(errc::mismatch, "step_trace: ranks recorded different hook sequences (a step is one forward and one backward)", site());
    buffer_t sum = device_.allocate(n * sizeof(double), mem_kind::transient);
    device_.copy_from_host(sum.data(), times.data(), n * sizeof(double));
    comm_.all_reduce(sum.data(), sum.data(), n, dtype::f64, reduce_op::avg, ag_queue_).wait(wait_timeout_, "all_reduce");
    device_.copy_to_host(times.data(), sum.data(), n * sizeof(double));
    collect(true);
    return t;
  }
  //! Records spans into `t` from now on (nullptr stops): each unit's compute and each wait on
  //! the compute lane, each all-gather and reduction on its queue's lane (host queues). `t`
  //! must outlive the group, or recording must be stopped and finish_backward() called first.
  void record_timeline(timeline* t) noexcept { timeline_ = t; }

  //! The unit order prefetching follows: the explicit order of the Prefetch policy, else the
  //! order recorded in the first forward and backward (known after the first finish_backward).
  std::span<const int> forward_order() const noexcept { return fwd_order_; }
  std::span<const int> backward_order() const noexcept { return bwd_order_; }

  //! Peak transient bytes the design allows for these buckets and policies:
  //!   forward  = (1 + forward prefetch) x largest gathered bucket (every bucket when the
  //!              strategy keeps parameters from forward to backward)
  //!   backward = (1 + backward prefetch) x largest gathered bucket + largest unsharded
  //!              gradient bucket (being computed) + largest reduction in flight (its
  //!              gradient buffer, its reduce-dtype copy if the dtypes differ, and its
  //!              reduce-scatter output shard)
  memory_bound transient_memory_bound() const {
    std::size_t p = 0, g = 0, red = 0, all_p = 0;
    for (const auto& b : buckets_) {
      const std::size_t n = b.layout.padded_numel();
      const std::size_t gathered = aliased(b) ? 0 : n * sizeof(param_type);
      p = std::max(p, gathered);
      all_p += gathered;
      g = std::max(g, n * sizeof(param_type));
      std::size_t r = n * sizeof(param_type);
      if (!std::is_same_v<param_type, reduce_type>) r += n * sizeof(reduce_type);
      if (shard_size_ > 1) r += b.layout.shard_numel() * sizeof(reduce_type);
      red = std::max(red, r);
    }
    if (plan_ && !bwd_bucket_pos_.empty()) return planned_memory_bound();
    const auto fd = static_cast<std::size_t>(opts_.prefetch.forward_depth());
    const auto bd = static_cast<std::size_t>(opts_.prefetch.backward_depth());
    const std::size_t fwd = reshard_after_forward() ? std::min(all_p, (1 + fd) * p) : all_p;
    const std::size_t bwd_params = reshard_after_forward() ? std::min(all_p, (1 + bd) * p) : all_p;
    return {fwd, bwd_params + g + red};
  }

  //! The bound for a plan's issue points, position by position: while the bucket at position k
  //! computes, the buckets whose all-gathers were issued at or before k and that run at or after
  //! k are gathered; in backward also k's gradient buffer and the reductions issued before k
  //! that are waited for at k or later.
  memory_bound planned_memory_bound() const {
    const std::size_t k = buckets_.size();
    std::vector<std::size_t> gathered(k), grad(k), red(k);
    std::size_t all_p = 0;
    for (std::size_t b = 0; b < k; ++b) {
      const std::size_t n = buckets_[b].layout.padded_numel();
      gathered[b] = aliased(buckets_[b]) ? 0 : n * sizeof(param_type);
      all_p += gathered[b];
      grad[b] = n * sizeof(param_type);
      red[b] = n * sizeof(param_type) + (std::is_same_v<param_type, reduce_type> ? 0 : n * sizeof(reduce_type)) +
               (shard_size_ > 1 ? buckets_[b].layout.shard_numel() * sizeof(reduce_type) : 0);
    }
    // Bytes gathered during position p of `order`, and at its end (p freed, later ones kept).
    auto params_at = [&](const std::vector<int>& order, const std::vector<int>& issue, std::size_t p, bool after) {
      std::size_t sum = 0;
      for (std::size_t q = 0; q < order.size(); ++q) {
        const auto j = static_cast<std::size_t>(order[q]);
        const auto first = std::min(static_cast<std::size_t>(issue[j]), q);
        if (first <= p && (after ? p < q : p <= q)) sum += gathered[j];
      }
      return sum;
    };
    std::size_t fwd = 0, bwd = 0;
    for (std::size_t p = 0; p < fwd_bucket_order_.size(); ++p)
      fwd = std::max(fwd, reshard_after_forward() ? params_at(fwd_bucket_order_, plan_->forward_issue, p, false) : all_p);
    for (std::size_t p = 0; p < bwd_bucket_order_.size(); ++p) {
      const auto b = static_cast<std::size_t>(bwd_bucket_order_[p]);
      std::size_t during = grad[b], after = red[b];
      for (std::size_t q = 0; q < p; ++q) {
        const auto j = static_cast<std::size_t>(bwd_bucket_order_[q]);
        if (reduce_wait_[j] >= static_cast<int>(p)) during += red[j];
        if (reduce_wait_[j] > static_cast<int>(p)) after += red[j];
      }
      const std::size_t params = reshard_after_forward() ? params_at(bwd_bucket_order_, plan_->backward_issue, p, false) : all_p;
      const std::size_t params_after = reshard_after_forward() ? params_at(bwd_bucket_order_, plan_->backward_issue, p, true) : all_p;
      bwd = std::max({bwd, params + during, params_after + after});
    }
    return {fwd, bwd};
  }

  //! The plan the group replays (from a bucket policy that plans), if any.
  const std::optional<schedule::plan>& plan() const noexcept { return plan_; }

  //! Collective: the full values of parameter `index` of unit `u`, in the master dtype
  //! (gathered from the shards; for checkpoints and tests).
  std::vector<master_type> full_parameter(int u, int index) { return gather_full(u, index, false); }
  //! Collective: the full averaged gradient of parameter `index` of unit `u`, in the master
  //! dtype, as the last reductions left it in the gradient shards.
  std::vector<master_type> full_gradient(int u, int index) { return gather_full(u, index, true); }

 private:
  //! The largest parameter fsdp accepts: 2^40 elements (indices and byte counts stay exact).
  static constexpr std::size_t max_param_numel = std::size_t{1} << 40;

  enum class unit_state : std::uint8_t { idle, forward, backward };

  struct unit_rec {
    std::vector<Params*> params;
    std::string name;
    int bucket = 0;
    std::size_t first_entry = 0;  // index of its first parameter in the bucket layout
    unit_state state = unit_state::idle;
    bool awaiting_backward = false;
  };

  using buffer_t = typename device_type::buffer;
  using event_t = typename device_type::event;
  using queue_t = typename device_type::queue;

  struct bucket_rec {
    std::vector<int> units;
    std::string name;  // its units' names joined by '+' (for traces)
    flat_layout layout;
    buffer_t master;      // persistent: master_type[shard_numel]
    buffer_t grad_shard;  // persistent: master_type[shard_numel]
    buffer_t full;        // transient: param_type[padded_numel] while gathered
    param_type* full_ptr = nullptr;
    bool gathered = false;   // a gather was issued and not resharded
    bool waited = false;     // its event was waited on
    event_t gather_done{};
    buffer_t grad_full;      // transient: param_type[padded_numel] while in backward / no_sync
    bool in_forward_pass = false;
    bool in_backward_pass = false;
    int fwd_remaining = 0;
    int bwd_remaining = 0;
  };

  struct pending_reduction {
    int bucket;
    event_t done;
  };

  struct active_unit {
    int unit;
    bool forward;
  };

  // -- helpers --

  error_site site(int u = -1, std::string p = {}) const { return {comm_.rank(), u, std::move(p)}; }
  static std::string param_name(const Params& p, std::size_t i) {
    const std::string_view n = param_traits<Params>::name(p);
    return n.empty() ? "#" + std::to_string(i) : std::string(n);
  }
  void require_finalized(const char* what) const {
    if (!finalized_) throw error(errc::order, std::string(what) + " before finalize", site());
  }
  unit_rec& unit(int u, const char* hook) {
    require_finalized(hook);
    if (u < 0 || static_cast<std::size_t>(u) >= units_.size())
      throw error(errc::invalid_argument,
                  std::string(hook) + ": no unit " + std::to_string(u) + " (" + std::to_string(units_.size()) +
                      " registered)",
                  site());
    return units_[static_cast<std::size_t>(u)];
  }
  bool reshard_after_forward() const { return static_cast<bool>(opts_.sharding.reshard_after_forward); }
  // One rank holds the whole parameter in the right dtype: gathered storage is the master.
  bool aliased(const bucket_rec&) const { return shard_size_ == 1 && std::is_same_v<param_type, master_type>; }

  // -- finalize --

  // Every rank must register the same units with the same shapes and dtypes.
  void check_registration_across_ranks() {
    std::vector<std::uint64_t> desc{units_.size()};
    for (const auto& u : units_) {
      desc.push_back(u.params.size());
      for (Params* p : u.params) {
        desc.push_back(param_traits<Params>::numel(*p));
        desc.push_back(static_cast<std::uint64_t>(param_traits<Params>::type(*p)));
      }
    }
    const int n = comm_.size();
    std::vector<std::uint64_t> lens(static_cast<std::size_t>(n));
    std::uint64_t mine = desc.size();
    blocking_all_gather(&mine, lens.data(), sizeof(std::uint64_t));
    std::vector<std::uint64_t> all;
    if (std::all_of(lens.begin(), lens.end(), [&](auto l) { return l == mine; })) {
      all.resize(desc.size() * static_cast<std::size_t>(n));
      blocking_all_gather(desc.data(), all.data(), desc.size() * sizeof(std::uint64_t));
    }
    for (int r = 0; r < n; ++r) {
      const auto ru = static_cast<std::size_t>(r);
      if (all.empty()) {
        if (lens[ru] != mine) throw error(errc::mismatch, describe_difference(r, {}), site());
      } else if (!std::equal(desc.begin(), desc.end(), all.begin() + static_cast<std::ptrdiff_t>(ru * desc.size()))) {
        throw error(errc::mismatch, describe_difference(r, std::span<const std::uint64_t>(all).subspan(ru * desc.size(), desc.size())), site());
      }
    }
  }

  // Names the first unit / parameter where this rank's registration differs from rank r's.
  std::string describe_difference(int r, std::span<const std::uint64_t> other) const {
    const std::string them = "rank " + std::to_string(r);
    if (other.empty())
      return "ranks registered different parameters: " + them +
             " registered a different number of units or parameters than this rank (" +
             std::to_string(units_.size()) + " units)";
    if (other[0] != units_.size())
      return them + " registered " + std::to_string(other[0]) + " units, this rank " + std::to_string(units_.size());
    std::size_t i = 1;
    for (std::size_t u = 0; u < units_.size(); ++u) {
      const auto& params = units_[u].params;
      if (other[i] != params.size())
        return "unit " + std::to_string(u) + ": " + them + " registered " + std::to_string(other[i]) +
               " parameters, this rank " + std::to_string(params.size());
      ++i;
      for (std::size_t k = 0; k < params.size(); ++k, i += 2) {
        const auto numel = param_traits<Params>::numel(*params[k]);
        const auto t = param_traits<Params>::type(*params[k]);
        if (other[i] != numel || other[i + 1] != static_cast<std::uint64_t>(t))
          return "unit " + std::to_string(u) + " parameter " + std::to_string(k) + " ('" + param_name(*params[k], k) +
                 "'): " + them + " registered " + std::to_string(other[i]) + " elements of " +
                 std::string(to_string(static_cast<dtype>(other[i + 1]))) + ", this rank " + std::to_string(numel) +
                 " of " + std::string(to_string(t));
      }
    }
    return "ranks registered different parameters";
  }

  void setup_communicators() {
    const int world = comm_.size(), me = comm_.rank();
    shard_size_ = opts_.sharding.shard_group_size(world);
    if (shard_size_ < 1 || world % shard_size_ != 0)
      throw error(errc::invalid_argument, to_string(opts_.sharding) + ": a shard group of " + std::to_string(shard_size_) +
                                              " ranks does not divide the world size " + std::to_string(world), site());
    const int replicas = world / shard_size_;
    if (shard_size_ == world) {
      shard_comm_ = &comm_;
    } else if (shard_size_ > 1) {
      owned_shard_comm_.emplace(comm_.split(me / shard_size_, me));
      shard_comm_ = &*owned_shard_comm_;
    }
    if (replicas == world) {
      replica_comm_ = &comm_;
    } else if (replicas > 1) {
      owned_replica_comm_.emplace(comm_.split(me % shard_size_, me));
      replica_comm_ = &*owned_replica_comm_;
    }
    shard_rank_ = shard_comm_ ? shard_comm_->rank() : 0;
  }

  void build_buckets() {
    std::vector<std::size_t> unit_bytes;
    for (const auto& u : units_) {
      std::size_t bytes = 0;
      for (Params* p : u.params) bytes += param_traits<Params>::numel(*p) * sizeof(param_type);
      unit_bytes.push_back(bytes);
    }
    // A bucket policy that plans (auto_bucket with a trace) also gives the issue points.
    if constexpr (planning_bucket_policy<bucket_type>) {
      plan_ = opts_.bucket.plan(bucket_request{unit_bytes});
      if (plan_) check_plan(*plan_);
    }
    const std::vector<int> assignment = plan_ ? plan_->bucket_of_unit : opts_.bucket.assign(bucket_request{unit_bytes});
    if (assignment.size() != units_.size() || assignment.front() != 0)
      throw error(errc::invalid_argument, "bucket policy returned an assignment that does not start at bucket 0 "
                                          "or has the wrong length", site());
    for (std::size_t u = 1; u < assignment.size(); ++u)
      if (assignment[u] != assignment[u - 1] && assignment[u] != assignment[u - 1] + 1)
        throw error(errc::invalid_argument, "bucket policy must put consecutive units in numbered buckets", site(static_cast<int>(u)));
    buckets_.resize(static_cast<std::size_t>(assignment.back() + 1));
    const std::size_t pad = padding_multiple(comm_.size());
    std::vector<std::vector<std::size_t>> numels(buckets_.size());
    for (std::size_t u = 0; u < units_.size(); ++u) {
      auto& b = buckets_[static_cast<std::size_t>(assignment[u])];
      auto& rec = units_[u];
      rec.bucket = assignment[u];
      rec.first_entry = numels[static_cast<std::size_t>(rec.bucket)].size();
      b.units.push_back(static_cast<int>(u));
      b.name.append(b.name.empty() ? "" : "+").append(rec.name);
      for (Params* p : rec.params) numels[static_cast<std::size_t>(rec.bucket)].push_back(param_traits<Params>::numel(*p));
    }
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      auto& k = buckets_[b];
      k.layout = flat_layout(numels[b], shard_size_, pad);
      k.master = device_.allocate(k.layout.shard_numel() * sizeof(master_type), mem_kind::persistent);
      k.grad_shard = device_.allocate(k.layout.shard_numel() * sizeof(master_type), mem_kind::persistent);
    }
  }

  void check_plan(const schedule::plan& p) const {
    const auto k = static_cast<std::size_t>(p.num_buckets());
    const auto bad = [&](const std::string& what) { throw error(errc::invalid_argument, "plan '" + p.name + "': " + what, site()); };
    if (p.bucket_of_unit.size() != units_.size())
      bad("assigns " + std::to_string(p.bucket_of_unit.size()) + " units, the group has " + std::to_string(units_.size()));
    if (p.forward_issue.size() != k || p.backward_issue.size() != k || p.reduce_wait.size() != k)
      bad("needs one forward_issue, backward_issue and reduce_wait per bucket (" + std::to_string(k) + ")");
    for (std::size_t b = 0; b < k; ++b)
      if (p.forward_issue[b] < 0 || p.backward_issue[b] < 0 || p.reduce_wait[b] < 0 || p.reduce_wait[b] > static_cast<int>(k))
        bad("bucket " + std::to_string(b) + " has a position out of range");
  }

  void init_broadcast(int root) {
    if (root < 0 || root >= comm_.size())
      throw error(errc::invalid_argument, "broadcast_from(" + std::to_string(root) + "): no such rank", site());
    std::vector<master_type> host;  // the root assembles each bucket here (values are host memory)
    for (auto& k : buckets_) {
      buffer_t full = device_.allocate(k.layout.padded_numel() * sizeof(master_type), mem_kind::transient);
      auto* dst = full.template as<master_type>();
      if (comm_.rank() == root) {
        host.assign(k.layout.padded_numel(), master_type{});
        for (int u : k.units) {
          auto& rec = units_[static_cast<std::size_t>(u)];
          for (std::size_t i = 0; i < rec.params.size(); ++i) {
            const Params& p = *rec.params[i];
            const auto* src = static_cast<const param_type*>(param_traits<Params>::initial_values(p));
            if (src == nullptr)
              throw error(errc::invalid_argument, "broadcast_from(" + std::to_string(root) + "): the root's handle has no initial values",
                          site(u, param_name(p, i)));
            detail::cast(thrust::cpp::par, host.data() + k.layout[rec.first_entry + i].offset, src,
                         param_traits<Params>::numel(p));
          }
        }
        device_.copy_from_host(dst, host.data(), full.bytes());
      }
      comm_.broadcast(dst, k.layout.padded_numel(), dtype_of<master_type>, root, ag_queue_).wait(wait_timeout_, "broadcast");
      device_.copy(k.master.data(), dst + k.layout.shard(shard_rank_).begin, k.master.bytes());
    }
  }

  template <class Fill>
  void init_per_shard(const Fill& fill) {
    std::vector<float> tmp;
    std::vector<master_type> host;  // the rank's shard, assembled on the host, then copied
    for (auto& k : buckets_) {
      host.assign(k.layout.shard_numel(), master_type{});
      for (int u : k.units) {
        auto& rec = units_[static_cast<std::size_t>(u)];
        for (std::size_t i = 0; i < rec.params.size(); ++i) {
          const auto s = k.layout.slice(rec.first_entry + i, shard_rank_);
          if (!s) continue;
          tmp.assign(s->numel, 0.0f);
          const Params& p = *rec.params[i];
          fill(param_slice{u, static_cast<int>(i), param_traits<Params>::name(p), s->param_offset,
                           param_traits<Params>::numel(p)},
               std::span<float>(tmp));
          detail::cast(thrust::cpp::par, host.data() + s->shard_offset, tmp.data(), s->numel);
        }
      }
      device_.copy_from_host(k.master.data(), host.data(), k.master.bytes());
    }
  }

  void set_explicit_orders() {
    auto check = [&](std::span<const int> order, const char* which) {
      for (int u : order)
        if (u < 0 || static_cast<std::size_t>(u) >= units_.size())
          throw error(errc::invalid_argument, std::string("prefetch ") + which + " order names unit " +
                                                  std::to_string(u) + ", which does not exist", site());
    };
    const auto f = opts_.prefetch.forward_order();
    const auto b = opts_.prefetch.backward_order();
    check(f, "forward");
    check(b, "backward");
    if (f.empty() && b.empty()) return;
    // An explicit order drives prefetching from the first step; the order the units really
    // run in is still recorded and checked across ranks.
    fwd_order_.assign(f.begin(), f.end());
    bwd_order_.assign(b.begin(), b.end());
    if (bwd_order_.empty()) bwd_order_.assign(fwd_order_.rbegin(), fwd_order_.rend());
    derive_bucket_orders();
  }

  // -- gather / reshard --

  void gather(int bi) {
    bucket_rec& b = buckets_[static_cast<std::size_t>(bi)];
    if (b.gathered) return;
    b.gathered = true;
    b.waited = false;
    if (aliased(b)) {
      b.full_ptr = b.master.template as<param_type>();
      b.gather_done = {};
      return;
    }
    b.full = device_.allocate(b.layout.padded_numel() * sizeof(param_type), mem_kind::transient);
    b.full_ptr = b.full.template as<param_type>();
    const std::size_t shard = b.layout.shard_numel();
    param_type* mine = b.full_ptr + static_cast<std::size_t>(shard_rank_) * shard;
    wait_for_compute(ag_queue_);  // the optimizer's last writes to the master shard
    auto began = begin_span(ag_queue_);
    ag_queue_.launch([mine, src = b.master.template as<master_type>(), shard](auto policy) {
      detail::cast(policy, mine, src, shard);
    });
    if (shard_comm_) shard_comm_->all_gather(mine, b.full_ptr, shard, dtype_of<param_type>, ag_queue_);
    end_span(ag_queue_, std::move(began), timeline::lane::all_gather, "all_gather " + b.name);
    b.gather_done = ag_queue_.record();
  }

  // Orders `q` after the compute issued so far (free on the host, where compute is synchronous).
  void wait_for_compute(queue_t& q) {
    event_t e = device_.compute_record();
    if (!e.ready()) q.wait(std::move(e), wait_timeout_);
  }

  void wait_gathered(int bi) {
    bucket_rec& b = buckets_[static_cast<std::size_t>(bi)];
    if (b.waited) return;
    wait_counted(b.gather_done, "all_gather", bi);
    b.waited = true;
  }

  // Waits for `e` on the compute side, adding the time blocked to communication_wait() and, if
  // it really waited, a "wait <what> <bucket>" span to the timeline.
  void wait_counted(const event_t& e, const char* what, int bi) {
    if (e.ready()) {  // the common, prefetched case: no clock reads (they cost ~40 ns each)
      device_.compute_wait(e, wait_timeout_);
      return;
    }
    const auto t0 = timeline::clock::now();
    device_.compute_wait(e, wait_timeout_);
    const auto t1 = timeline::clock::now();
    comm_wait_ += t1 - t0;
    if (timeline_)
      timeline_->add(rank(), timeline::lane::compute,
                     std::string("wait ").append(what).append(" ").append(buckets_[static_cast<std::size_t>(bi)].name), t0, t1);
  }

  // A span on a queue's lane: begin_span enqueues a task that notes the start time, end_span one
  // that records the span, so the span covers exactly the work queued in between (host queues;
  // a CUDA stream is better seen in Nsight, and gets no spans).
  using shared_time = std::shared_ptr<timeline::clock::time_point>;
  shared_time begin_span(queue_t& q) {
    if constexpr (requires { q.enqueue([] {}); }) {
      if (!timeline_) return nullptr;
      auto t = std::make_shared<timeline::clock::time_point>();
      q.enqueue([t] { *t = timeline::clock::now(); });
      return t;
    } else {
      return nullptr;
    }
  }
  void end_span(queue_t& q, shared_time began, timeline::lane lane, std::string name) {
    if constexpr (requires { q.enqueue([] {}); }) {
      if (!began || !timeline_) return;
      q.enqueue([began, tl = timeline_, r = rank(), lane, name = std::move(name)] {
        tl->add(r, lane, name, *began, timeline::clock::now());
      });
    }
  }

  // -- compute timing: the innermost unit between its hooks is the one computing --

  // A hook starts: the unit computing until now stops.
  void pause_compute(timeline::clock::time_point now) {
    if (!active_.empty()) charge(active_.back(), now);
  }
  // Unit u's pre hook ends: u computes from now (returned).
  timeline::clock::time_point start_compute(int u) {
    active_.push_back({u, units_[static_cast<std::size_t>(u)].state == unit_state::forward});
    return resumed_at_ = timeline::clock::now();
  }
  // Unit u's post hook starts: u's compute ends.
  void end_compute(int u, timeline::clock::time_point now) {
    const auto it = std::find_if(active_.rbegin(), active_.rend(), [u](const active_unit& a) { return a.unit == u; });
    if (it == active_.rend()) return;
    if (it == active_.rbegin()) charge(*it, now);  // an outer unit ended early: nothing to add
    auto& t = timings_[static_cast<std::size_t>(u)];
    ++(it->forward ? t.forward_runs : t.backward_runs);
    active_.erase(std::next(it).base());
  }
  // -- the hook sequence of a step (step_trace's events) --

  // A hook of unit u starts: the engine computed since the previous hook ended.
  void hook_begins(int u, bool pre, bool backward, timeline::clock::time_point now) {
    if (backward && !in_backward_pass_) {
      in_backward_pass_ = true;
      step_bwd_events_.clear();
    }
    const double computed = hook_ended_ == timeline::clock::time_point{} ? 0.0 : std::chrono::duration<double>(now - hook_ended_).count();
    (backward ? step_bwd_events_ : step_fwd_events_).push_back({u, pre, computed});
  }
  void hook_ends(timeline::clock::time_point now) { hook_ended_ = now; }
  // finish_backward: add this step's sequence to the sums (a differently shaped step restarts them).
  void end_step_events() {
    const double tail = hook_ended_ == timeline::clock::time_point{} ? 0.0
                                                                     : std::chrono::duration<double>(timeline::clock::now() - hook_ended_).count();
    const auto same_shape = [](const std::vector<schedule::hook_event>& a, const std::vector<schedule::hook_event>& b) {
      return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](const auto& x, const auto& y) {
               return x.unit == y.unit && x.pre == y.pre;
             });
    };
    if (!step_fwd_events_.empty() && !step_bwd_events_.empty()) {
      if (event_steps_ > 0 && same_shape(fwd_events_, step_fwd_events_) && same_shape(bwd_events_, step_bwd_events_)) {
        for (std::size_t i = 0; i < fwd_events_.size(); ++i) fwd_events_[i].compute_s += step_fwd_events_[i].compute_s;
        for (std::size_t i = 0; i < bwd_events_.size(); ++i) bwd_events_[i].compute_s += step_bwd_events_[i].compute_s;
        backward_tail_s_ += tail;
        ++event_steps_;
      } else {
        fwd_events_ = step_fwd_events_;
        bwd_events_ = step_bwd_events_;
        backward_tail_s_ = tail;
        event_steps_ = 1;
      }
    }
    step_fwd_events_.clear();
    step_bwd_events_.clear();
    in_backward_pass_ = false;
    hook_ended_ = {};
  }

  // A post hook ends: the enclosing unit, if any, computes again.
  timeline::clock::time_point resume_compute() { return resumed_at_ = timeline::clock::now(); }
  void charge(const active_unit& a, timeline::clock::time_point now) {
    auto& t = timings_[static_cast<std::size_t>(a.unit)];
    (a.forward ? t.forward : t.backward) += now - resumed_at_;
    if (timeline_)
      timeline_->add(rank(), timeline::lane::compute,
                     std::string(a.forward ? "forward " : "backward ").append(units_[static_cast<std::size_t>(a.unit)].name),
                     resumed_at_, now);
    resumed_at_ = now;
  }

  void reshard(int bi) {
    bucket_rec& b = buckets_[static_cast<std::size_t>(bi)];
    if (!b.gathered) return;
    wait_gathered(bi);  // a prefetched buffer may still be in flight
    for (int u : b.units)
      for (Params* p : units_[static_cast<std::size_t>(u)].params) param_traits<Params>::bind(*p, nullptr, nullptr);
    b.full.reset();
    b.full_ptr = nullptr;
    b.gathered = false;
  }

  void bind_params(int bi, bool with_grads) {
    bucket_rec& b = buckets_[static_cast<std::size_t>(bi)];
    auto* grads = with_grads ? b.grad_full.template as<param_type>() : nullptr;
    for (int u : b.units) {
      auto& rec = units_[static_cast<std::size_t>(u)];
      for (std::size_t i = 0; i < rec.params.size(); ++i) {
        const std::size_t off = b.layout[rec.first_entry + i].offset;
        param_traits<Params>::bind(*rec.params[i], b.full_ptr + off, grads ? grads + off : nullptr);
      }
    }
  }

  // At the pre-hook of bucket bi: gather what the issue lists say is issued at its position.
  void prefetch_after(int bi, const std::vector<std::vector<int>>& issue_at, const std::vector<int>& pos) {
    if (issue_at.empty()) return;
    const int at = pos[static_cast<std::size_t>(bi)];
    if (at < 0) return;
    for (int j : issue_at[static_cast<std::size_t>(at)]) gather(j);
  }

  // -- reduction --

  // The bucket's backward is over: free its parameters, then reduce its gradients. By default
  // one reduction is in flight at a time: the previous one had this bucket's whole backward to
  // finish behind, and waiting for it here keeps backward memory at (1 + prefetch) gathered
  // buckets + one gradient bucket being computed + one reduction. A plan may let reductions
  // run longer (reduce_wait).
  void end_backward_of(int bi) {
    bucket_rec& b = buckets_[static_cast<std::size_t>(bi)];
    b.in_backward_pass = false;
    b.bwd_remaining = 0;
    reshard(bi);
    if (sync_ && b.grad_full) {
      wait_reductions_due(bi);
      issue_reduction(bi);
    }
  }

  // Waits for the reductions that must be complete by the end of bucket bi's backward position.
  // They complete in issue order (one queue), so waiting for the last one due covers the rest.
  void wait_reductions_due(int bi) {
    const int k = bwd_bucket_pos_.empty() ? -1 : bwd_bucket_pos_[static_cast<std::size_t>(bi)];
    if (k < 0) {  // the order is not known yet (first step): one reduction in flight
      finish_pending();
      return;
    }
    std::size_t due = 0;
    for (std::size_t i = 0; i < pending_reductions_.size(); ++i)
      if (reduce_wait_[static_cast<std::size_t>(pending_reductions_[i].bucket)] <= k) due = i + 1;
    while (due-- > 0) wait_oldest_reduction();
  }

  void issue_reduction(int bi) {
    bucket_rec& b = buckets_[static_cast<std::size_t>(bi)];
    const std::size_t n = b.layout.padded_numel(), shard = b.layout.shard_numel();
    wait_for_compute(rs_queue_);  // the gradients are written
    auto began = begin_span(rs_queue_);
    // The gradients in the reduce dtype.
    buffer_t red;
    if constexpr (std::is_same_v<param_type, reduce_type>) {
      red = std::move(b.grad_full);
    } else {
      red = device_.allocate(n * sizeof(reduce_type), mem_kind::transient);
      rs_queue_.launch([dst = red.template as<reduce_type>(), g = b.grad_full.template as<param_type>(), n](auto policy) {
        detail::cast(policy, dst, g, n);
      });
      rs_queue_.release(std::move(b.grad_full));
    }
    b.grad_full = buffer_t{};
    // Reduce-scatter (average) inside the shard group: out holds this rank's averaged shard.
    buffer_t out;
    if (shard_comm_) {
      out = device_.allocate(shard * sizeof(reduce_type), mem_kind::transient);
      shard_comm_->reduce_scatter(red.data(), out.data(), shard, dtype_of<reduce_type>, reduce_op::avg, rs_queue_);
      rs_queue_.release(std::move(red));
    } else {
      out = std::move(red);  // one rank per shard group: the whole buffer is the shard
    }
    // Average across replicas (hybrid, no_shard).
    if (replica_comm_)
      replica_comm_->all_reduce(out.data(), out.data(), shard, dtype_of<reduce_type>, reduce_op::avg, rs_queue_);
    rs_queue_.launch([dst = b.grad_shard.template as<master_type>(), o = out.template as<reduce_type>(), shard](auto policy) {
      detail::accumulate(policy, dst, o, shard);
    });
    rs_queue_.release(std::move(out));
    end_span(rs_queue_, std::move(began), timeline::lane::reduce, "reduce " + b.name);
    pending_reductions_.push_back({bi, rs_queue_.record()});
  }

  void wait_oldest_reduction() {
    pending_reduction r = std::move(pending_reductions_.front());
    pending_reductions_.pop_front();
    wait_counted(r.done, "reduce", r.bucket);
  }

  // -- unit order --

  // All ranks must have run the same units in the same order in the first step. Unless the
  // Prefetch policy gave an order, that recorded order drives prefetching from now on.
  void check_order() {
    const std::vector<int> mine = encode_order();
    const int n = comm_.size();
    std::uint64_t len = mine.size();
    std::vector<std::uint64_t> lens(static_cast<std::size_t>(n));
    blocking_all_gather(&len, lens.data(), sizeof(len));
    bool same = std::all_of(lens.begin(), lens.end(), [&](auto l) { return l == len; });
    std::vector<int> all;
    if (same) {
      all.resize(mine.size() * static_cast<std::size_t>(n));
      blocking_all_gather(mine.data(), all.data(), mine.size() * sizeof(int));
      for (int r = 0; r < n && same; ++r)
        same = std::equal(mine.begin(), mine.end(), all.begin() + static_cast<std::ptrdiff_t>(r * mine.size()));
    }
    if (!same)
      throw error(errc::mismatch,
                  "ranks ran their units in different orders in the first step (this rank: forward " +
                      list(fwd_trace_) + ", backward " + list(bwd_trace_) + ")",
                  site());
    order_checked_ = true;
    recording_ = false;
    if (fwd_order_.empty() && bwd_order_.empty()) {
      fwd_order_ = fwd_trace_;
      bwd_order_ = bwd_trace_;
      derive_bucket_orders();
    }
  }
  std::vector<int> encode_order() const {
    std::vector<int> v(fwd_trace_);
    v.push_back(-1);
    v.insert(v.end(), bwd_trace_.begin(), bwd_trace_.end());
    return v;
  }
  static std::string list(const std::vector<int>& v) {
    std::string s = "[";
    for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
    return s + "]";
  }
  void derive_bucket_orders() {
    auto derive = [&](const std::vector<int>& units, std::vector<int>& order, std::vector<int>& pos) {
      order.clear();
      pos.assign(buckets_.size(), -1);
      for (int u : units) {
        const int b = units_[static_cast<std::size_t>(u)].bucket;
        if (pos[static_cast<std::size_t>(b)] < 0) {
          pos[static_cast<std::size_t>(b)] = static_cast<int>(order.size());
          order.push_back(b);
        }
      }
    };
    derive(fwd_order_, fwd_bucket_order_, fwd_bucket_pos_);
    derive(bwd_order_, bwd_bucket_order_, bwd_bucket_pos_);
    fwd_issue_at_ = issue_lists(fwd_bucket_order_, opts_.prefetch.forward_depth(), plan_ ? &plan_->forward_issue : nullptr, "forward");
    bwd_issue_at_ = issue_lists(bwd_bucket_order_, opts_.prefetch.backward_depth(), plan_ ? &plan_->backward_issue : nullptr, "backward");
    const int k = static_cast<int>(buckets_.size());
    reduce_wait_.assign(buckets_.size(), k);
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      const int pos = bwd_bucket_pos_[b];
      if (plan_) reduce_wait_[b] = plan_->reduce_wait[b];
      else if (pos >= 0) reduce_wait_[b] = pos + 1;
      if (pos >= 0 && reduce_wait_[b] <= pos)
        throw error(errc::invalid_argument, "plan: bucket " + std::to_string(b) + "'s reduction must be waited for after its own backward position " +
                                                std::to_string(pos) + ", not at " + std::to_string(reduce_wait_[b]), site());
    }
  }

  // Per position of `order`: the buckets whose all-gathers are issued at its pre-hook, after its
  // own. From a plan's issue positions, else the next `depth` buckets.
  std::vector<std::vector<int>> issue_lists(const std::vector<int>& order, int depth, const std::vector<int>* planned,
                                            const char* which) const {
    std::vector<std::vector<int>> at(order.size());
    for (std::size_t p = 0; p < order.size(); ++p) {
      if (!planned) {
        for (std::size_t d = 1; d <= static_cast<std::size_t>(depth) && p + d < order.size(); ++d) at[p].push_back(order[p + d]);
        continue;
      }
      const int j = order[p], issue = (*planned)[static_cast<std::size_t>(j)];
      if (issue > static_cast<int>(p))
        throw error(errc::invalid_argument, std::string("plan: bucket ") + std::to_string(j) + "'s " + which +
                                                " all-gather is issued at position " + std::to_string(issue) +
                                                ", after its own position " + std::to_string(p) + " in the recorded order", site());
      if (issue < static_cast<int>(p)) at[static_cast<std::size_t>(issue)].push_back(j);  // in position order
    }
    return at;
  }

  // -- collectives used at set-up --

  // Host bytes in, host bytes out, through device memory (NCCL needs device buffers).
  void blocking_all_gather(const void* send, void* recv, std::size_t bytes) {
    const auto n = static_cast<std::size_t>(comm_.size());
    buffer_t staging = device_.allocate(bytes * n, mem_kind::transient);
    char* mine = static_cast<char*>(staging.data()) + bytes * static_cast<std::size_t>(comm_.rank());
    device_.copy_from_host(mine, send, bytes);
    comm_.all_gather(mine, staging.data(), bytes, dtype::u8, ag_queue_).wait(wait_timeout_, "all_gather");
    device_.copy_to_host(recv, staging.data(), bytes * n);
  }

  std::vector<master_type> gather_full(int u, int index, bool grads) {
    unit_rec& rec = unit(u, grads ? "full_gradient" : "full_parameter");
    if (index < 0 || static_cast<std::size_t>(index) >= rec.params.size())
      throw error(errc::invalid_argument, "no parameter " + std::to_string(index), site(u));
    finish_pending();
    bucket_rec& b = buckets_[static_cast<std::size_t>(rec.bucket)];
    const buffer_t& src = grads ? b.grad_shard : b.master;
    buffer_t full = device_.allocate(b.layout.padded_numel() * sizeof(master_type), mem_kind::transient);
    if (shard_comm_) {
      wait_for_compute(ag_queue_);  // the optimizer's writes, and the reductions compute waited for
      shard_comm_->all_gather(src.data(), full.data(), b.layout.shard_numel(), dtype_of<master_type>, ag_queue_)
          .wait(wait_timeout_, "all_gather");
    } else {
      device_.copy(full.data(), src.data(), src.bytes());
    }
    const flat_entry e = b.layout[rec.first_entry + static_cast<std::size_t>(index)];
    std::vector<master_type> out(e.numel);
    device_.copy_to_host(out.data(), full.template as<master_type>() + e.offset, e.numel * sizeof(master_type));
    return out;
  }

  // -- members (declaration order matters: queues last, so they drain while buffers and
  //    communicators their tasks use are still alive) --
  comm_type& comm_;
  device_type device_;
  options opts_;
  milliseconds wait_timeout_;
  int exceptions_at_start_;
  traffic_counters comm_traffic_at_start_ = comm_.traffic();
  std::optional<comm_type> owned_shard_comm_;
  std::optional<comm_type> owned_replica_comm_;
  comm_type* shard_comm_ = nullptr;    // null when S == 1
  comm_type* replica_comm_ = nullptr;  // null when R == 1
  int shard_size_ = 1;
  int shard_rank_ = 0;
  bool finalized_ = false;
  bool sync_ = true;
  bool recording_ = true;       // recording the unit order of the first forward and backward
  bool order_checked_ = false;  // that order was checked across ranks
  std::vector<unit_rec> units_;
  std::vector<bucket_rec> buckets_;
  std::vector<int> fwd_trace_, bwd_trace_;  // the recorded order
  std::vector<int> fwd_order_, bwd_order_;  // the order prefetching follows
  std::vector<int> fwd_bucket_order_, fwd_bucket_pos_, bwd_bucket_order_, bwd_bucket_pos_;
  std::optional<schedule::plan> plan_;                     // from a bucket policy that plans (auto_bucket)
  std::vector<std::vector<int>> fwd_issue_at_, bwd_issue_at_;  // per position: buckets gathered ahead there
  std::vector<int> reduce_wait_;  // per bucket: backward position by whose end its reduction is complete
  std::deque<pending_reduction> pending_reductions_;
  std::vector<active_unit> active_;  // units between their pre and post hooks, innermost last
  timeline::clock::time_point resumed_at_{};
  std::vector<unit_timing> timings_;
  std::chrono::nanoseconds comm_wait_{};
  timeline::clock::time_point finished_at_{};  // end of the last finish_backward, until the next step's first hook
  timeline::clock::time_point hook_ended_{};   // when the last hook of this step returned
  bool in_backward_pass_ = false;              // this step's backward has begun
  std::vector<schedule::hook_event> step_fwd_events_, step_bwd_events_;  // this step's hooks
  std::vector<schedule::hook_event> fwd_events_, bwd_events_;            // summed over event_steps_ steps
  double backward_tail_s_ = 0;
  int event_steps_ = 0;
  std::chrono::nanoseconds between_steps_{};
  int between_runs_ = 0;
  timeline* timeline_ = nullptr;
  queue_t ag_queue_{"all_gather"};
  queue_t rs_queue_{"reduce_scatter"};
};

}  // namespace fsdp
