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
//!                 gradients into the gradient shard, all-reduce across replicas (hybrid;
//!                 or hold the sum for a later one), free the unsharded buffers
//!   finish_backward  wait for the reductions (an optimizer's step() calls it)
//! A forward inside the unit's own backward (activation recomputation) uses what pre_backward
//! gathered: no gather, no reshard, not recorded in the step's order.
//!
//! Hooks must be called in the same order on every rank; collectives are matched by issue
//! order, as NCCL does. This file is the driver; the parts it drives, each owning its state,
//! are in detail/group/: units and their hook state machine (unit_registry), communicators
//! (process_groups), the buckets' bytes (bucket_store) and initial values (initial_values), the
//! order and plan (step_order), measurements (hook_profiler), memory bound, RAII scopes.

#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <initializer_list>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
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
#include "fsdp/detail/group/bucket_collectives.hpp"
#include "fsdp/detail/group/bucket_store.hpp"
#include "fsdp/detail/group/hook_profiler.hpp"
#include "fsdp/detail/group/initial_values.hpp"
#include "fsdp/detail/group/memory_bound.hpp"
#include "fsdp/detail/group/policies.hpp"
#include "fsdp/detail/group/process_groups.hpp"
#include "fsdp/detail/group/scopes.hpp"
#include "fsdp/detail/group/step_order.hpp"
#include "fsdp/detail/group/unit_registry.hpp"
#include "fsdp/detail/kernels.hpp"
#include "fsdp/device/concepts.hpp"
#include "fsdp/policy/bucket.hpp"
#include "fsdp/policy/collectives.hpp"
#include "fsdp/policy/group_options.hpp"
#include "fsdp/policy/mixed_precision.hpp"
#include "fsdp/policy/offload.hpp"
#include "fsdp/policy/prefetch.hpp"
#include "fsdp/policy/sharding.hpp"
#include "fsdp/schedule/plan.hpp"
#include "fsdp/schedule/trace.hpp"

namespace fsdp {

//! Shards parameters of type Params (any type with a param_traits specialization). The type
//! arguments that change code, in any order, each optional: a MixedPrecision (default
//! full_precision<float>), a BucketPolicy (default per_unit) and a Communicator type (default
//! threads::communicator). Sharding, prefetching, a plan and custom collectives are values in `options`:
//!
//!   fsdp::shard_group<fsdp::buffer<float>> group{
//!       comm, {}, {.sharding = fsdp::hybrid_shard(2), .prefetch = {.forward = 1, .backward = 1}}};
template <parameter Params, class... Policies>
class shard_group {
  static_assert((detail::check_policy<Policies>::value && ...));
  static_assert(detail::count_of<detail::is_precision, Policies...> <= 1, "shard_group: more than one MixedPrecision given");
  static_assert(detail::count_of<detail::is_bucket, Policies...> <= 1, "shard_group: more than one BucketPolicy given");
  static_assert(detail::count_of<detail::is_comm, Policies...> <= 1, "shard_group: more than one Communicator given");

 public:
  using precision_type = typename detail::pick<detail::is_precision, full_precision<float>, Policies...>::type;
  using bucket_type = typename detail::pick<detail::is_bucket, per_unit, Policies...>::type;
  using comm_type = typename detail::pick<detail::is_comm, threads::communicator, Policies...>::type;
  using device_type = typename comm_type::device_type;
  static_assert(fsdp::device<device_type>, "shard_group: the Communicator's device_type is not a device (see fsdp/device/concepts.hpp)");
  using param_type = typename precision_type::param_type;
  using reduce_type = typename precision_type::reduce_type;
  using master_type = typename precision_type::master_type;
  using memory_bound = detail::memory_bound;
  using unit_timing = detail::hook_profiler::unit_timing;
  using queue_type = typename device_type::queue;
  using collectives_type = custom_collectives<param_type, reduce_type, comm_type, queue_type>;

  //! The run-time choices (policy/group_options.hpp).
  using options = group_options<bucket_type, collectives_type>;
  //! One bucket's shard of the trainable master parameters and their averaged gradients
  //! (detail/group/bucket_store.hpp), what shard(b) hands an optimizer.
  using shard_view = detail::shard_view<master_type, param_type>;

  shard_group(comm_type& comm, device_type device = {}, options opts = {})
      : device_(std::move(device)),
        opts_(std::move(opts)),
        wait_timeout_(comm.timeout() * 2 + milliseconds(1000)),
        exceptions_at_start_(std::uncaught_exceptions()),
        rank_(comm.rank()),
        world_size_(comm.size()),
        units_(comm.rank()),
        groups_(comm, device_, wait_timeout_),
        buckets_(units_, device_),
        order_(comm.rank(), opts_.prefetch, opts_.plan) {
    detail::check_options(opts_, std::is_same_v<bucket_type, per_unit>, site());
  }
  shard_group(const shard_group&) = delete;
  shard_group& operator=(const shard_group&) = delete;

  //! Unbinds the parameters (skipping handles that tell they were destroyed: param_traits
  //! contract 7). Leaving by an exception aborts the communicator (where it can), so that peers
  //! waiting on this rank fail now instead of at their timeout.
  ~shard_group() {
    if (std::uncaught_exceptions() > exceptions_at_start_) {
      if constexpr (requires { comm().abort(std::string{}); })
        comm().abort("an exception left its shard_group (as rank " + std::to_string(rank()) + " of " + std::to_string(world_size_) + ")");
    }
    for (int u = 0; u < units_.size(); ++u) units_.unbind(u);
  }

  // ---- registration ---------------------------------------------------------------------------

  //! Registers a unit: parameters used together (e.g. one transformer block), numbered 0, 1, ...
  //! in registration order, the order buckets are formed in. Those also in `frozen` (FSDP2's
  //! requires_grad=False) are gathered but get no gradient (grad() null), reduction or optimizer state.
  int add_unit(std::span<Params* const> params, std::string name = {}, std::span<Params* const> frozen = {}) {
    if (finalized_) throw error(errc::order, "add_unit after finalize", site());
    return units_.add(params, std::move(name), dtype_of<param_type>, frozen);
  }
  int add_unit(std::initializer_list<Params*> params, std::string name = {}, std::initializer_list<Params*> frozen = {}) {
    return add_unit(std::span<Params* const>(params.begin(), params.size()), std::move(name),
                    std::span<Params* const>(frozen.begin(), frozen.size()));
  }

  //! Collective. Checks that every rank registered the same units, forms the buckets and
  //! shards, sets the initial values (init::broadcast_from or init::per_shard) and releases the
  //! handles' own copies. Parameters stay unbound until their unit's pre_forward.
  template <class Init>
  void finalize(const Init& init) {
    static_assert(initial_values<Init>,
                  "shard_group::finalize: the argument must be fsdp::init::broadcast_from{root} or "
                  "fsdp::init::per_shard(fill)");
    if (finalized_) throw error(errc::order, "finalize called twice", site());
    if (units_.empty()) throw error(errc::invalid_argument, "finalize with no units registered", site());
    const std::vector<std::uint64_t> registration = units_.describe();
    if (auto d = groups_.agree_across_ranks(std::span<const std::uint64_t>(registration), ag_queue_))
      throw error(errc::mismatch, units_.describe_difference(d->odd_rank, d->odd, d->ref_rank, d->ref), site());
    groups_.split(opts_.sharding);
    const std::vector<std::size_t> unit_bytes = units_.bytes(sizeof(param_type));
    if (opts_.plan) detail::step_order::check_plan(*opts_.plan, unit_bytes, rank());
    buckets_.build(opts_.plan ? opts_.plan->bucket_of_unit : opts_.bucket.assign(bucket_request{unit_bytes}),
                   groups_.shard_size(), world_size(), rank(), opts_.offload, opts_.keep_low_precision_shard);
    if constexpr (std::is_same_v<Init, init::broadcast_from>) {
      detail::broadcast_from(buckets_, init.root, comm(), groups_.shard_rank(), ag_queue_, wait_timeout_);
    } else {
      detail::fill_per_shard(buckets_, init.fill, groups_.shard_rank());
    }
    detail::release_initial_values(buckets_);
    if (replica_size() > 1) detail::require_replicas_agree(buckets_, groups_, ag_queue_, rank());
    order_.follow_explicit_order(units_.size(), buckets_.bucket_of_unit());
    std::vector<std::string> names;
    for (int u = 0; u < units_.size(); ++u) names.push_back(units_[u].name);
    profiler_.emplace(rank(), std::move(names));
    finalized_ = true;
  }

  // ---- hooks ----------------------------------------------------------------------------------

  //! Before unit u's forward: its parameters are gathered and bound when this returns.
  void pre_forward(int u) {
    [[maybe_unused]] auto range = device_.range("fsdp pre_forward");
    require_finalized("pre_forward");
    const int b = units_.pre_forward(u);
    if (units_.in_backward(u)) return;  // a recompute: pre_backward gathered and bound the bucket; its time counts as backward
    order_.record_forward(u);
    profiler_->enter(u, hook::pre_forward);
    begin_pass(b, /*backward=*/false);
    gather(b);
    wait_gathered(b);
    buckets_.bind(b, /*with_grads=*/false);
    for (int next : order_.gathers_after(b, /*backward=*/false)) gather(next);
    profiler_->leave(u, hook::pre_forward);
  }

  //! After unit u's forward. Frees the bucket's gathered parameters once all of its units
  //! have run forward (when the sharding reshards after forward).
  void post_forward(int u) {
    [[maybe_unused]] auto range = device_.range("fsdp post_forward");
    require_finalized("post_forward");
    const int b = units_.post_forward(u);
    if (units_.in_backward(u)) return;  // a recompute ended: the backward that follows uses the bucket
    profiler_->enter(u, hook::post_forward);
    auto& k = buckets_[b];
    if (--k.forward_remaining == 0) {
      k.in_forward_pass = false;
      if (opts_.sharding.reshard_after_forward) reshard(b, /*after_forward=*/true);
    }
    profiler_->leave(u, hook::post_forward);
  }

  //! Before unit u's backward: parameters gathered and bound, gradient storage bound (zeroed
  //! at the first backward since the last reduction; kept across no_sync micro-batches; one
  //! rank of one dtype: the gradient shard itself, bucket_store::grads_in_shard).
  void pre_backward(int u) {
    [[maybe_unused]] auto range = device_.range("fsdp pre_backward");
    require_finalized("pre_backward");
    const int b = units_.pre_backward(u);
    order_.record_backward(u);
    profiler_->enter(u, hook::pre_backward);
    begin_pass(b, /*backward=*/true);
    gather(b);
    auto& k = buckets_[b];
    if (!k.grad_full && k.layout.trainable_numel() > 0 && !k.grads_to_shard) {
      // Zeroed in compute order, where the backward accumulates into it: no host wait.
      k.grad_full = detail::allocate_for_compute(device_, k.layout.trainable_numel() * sizeof(param_type), mem_kind::transient);
    }
    wait_gathered(b);
    buckets_.bind(b, /*with_grads=*/true);
    for (int next : order_.gathers_after(b, /*backward=*/true)) gather(next);
    profiler_->leave(u, hook::pre_backward);
  }

  //! After unit u's backward (its gradients are written). Once every unit of the bucket ran
  //! backward, issues the reduction (unless gradient sync is off) and frees the parameters.
  void post_backward(int u) {
    [[maybe_unused]] auto range = device_.range("fsdp post_backward");
    require_finalized("post_backward");
    const int b = units_.post_backward(u);
    profiler_->enter(u, hook::post_backward);
    if (--buckets_[b].backward_remaining == 0) end_backward_of(b);
    profiler_->leave(u, hook::post_backward);
  }

  //! RAII: pre_forward / pre_backward now, post_* at the end of the scope (detail/group/scopes.hpp).
  [[nodiscard]] detail::unit_scope<shard_group> forward(int u) { return {*this, u, true}; }
  [[nodiscard]] detail::unit_scope<shard_group> backward(int u) { return {*this, u, false}; }
  //! RAII, activation recomputation: unit u's forward re-run inside its own backward scope,
  //! on the parameters its pre_backward gathered (what forward(u) there does too; this one
  //! refuses, with errc::order, to run anywhere else).
  [[nodiscard]] detail::unit_scope<shard_group> recompute(int u) {
    require_finalized("recompute");
    units_.require_recompute_allowed(u);
    return {*this, u, true};
  }

  //! Ends the backward pass: issues the reductions of buckets whose backward ran only in part,
  //! waits for every reduction, frees what is still gathered. The first call also checks that
  //! every rank ran its units in the same order and follows that order from then on.
  void finish_backward() {
    [[maybe_unused]] auto range = device_.range("fsdp finish_backward");
    require_finalized("finish_backward");
    units_.require_idle("finish_backward");
    for (int b = 0; b < buckets_.size(); ++b)
      if (buckets_[b].in_backward_pass) end_backward_of(b);
    finish_pending();
    reshard_every_bucket();
    if (!order_.recorded_checked()) order_.check_recorded_across(groups_, ag_queue_, buckets_.bucket_of_unit());
    profiler_->end_step();
  }

  //! Frees every gathered bucket after a forward-only pass (evaluation), which has no backward
  //! to end it: with shard_grad_op, or with buckets prefetched and not used, gathered
  //! parameters would otherwise stay until the next backward. A forward-only pass before the
  //! first training step does not count as the recorded unit order.
  void reshard_all() {
    require_finalized("reshard_all");
    units_.require_idle("reshard_all");
    for (int b = 0; b < buckets_.size(); ++b)
      if (buckets_[b].in_backward_pass) throw error(errc::order, "reshard_all during a backward pass", site(buckets_[b].units.front()));
    reshard_every_bucket();
    order_.forget_forward_only_pass();
    profiler_->end_forward_only_pass();
  }

  //! Gradient sync for the next backward passes (FSDP2's set_requires_gradient_sync). While
  //! off, unsharded gradients accumulate across micro-batches and nothing is reduced.
  void set_requires_gradient_sync(bool on) noexcept { sync_ = on; }
  bool requires_gradient_sync() const noexcept { return sync_; }

  //! RAII: gradient sync off for the scope (FSDP1's no_sync()).
  [[nodiscard]] detail::sync_guard<shard_group> no_sync() { return detail::sync_guard<shard_group>(*this); }

  //! The replicas' all-reduce for the next reductions (FSDP2's set_requires_all_reduce; hybrid
  //! and no sharding have replicas). While off, a reduction stops after the reduce-scatter and
  //! adds its shard into the bucket's held sum (reduce dtype); the next one with it on adds the
  //! held sum in and all-reduces once. shard() refuses a bucket whose sum is still held.
  void set_requires_all_reduce(bool on) noexcept { all_reduce_ = on; }
  bool requires_all_reduce() const noexcept { return all_reduce_; }

  // ---- sharded state (what optimizers use) ------------------------------------------------------

  std::size_t num_buckets() const noexcept { return static_cast<std::size_t>(buckets_.size()); }
  //! Bucket b's shard, to step or read (an optimizer, clipping, checkpoints). Refused while a
  //! reduction into it is in flight or its sum is held for a later all-reduce.
  shard_view shard(std::size_t b) {
    buckets_.require_all_reduced(b, rank());
    buckets_.require_reduced(b, rank());
    return buckets_.writable_shard(b);
  }
  //! The caller of shard(b) wrote its low_precision copy as shard_view::low_precision says
  //! (fsdp's optimizers do, in their pass): the next gather reads it without casting the master.
  void low_precision_written(std::size_t b) { buckets_.low_precision_written(b); }
  //! Zeroes the gradient shards and drops held sums (waits for pending reductions first).
  void zero_grad() {
    finish_pending();
    buckets_.zero_grads();
  }
  //! Waits for every reduction issued so far, without ending the backward pass.
  void finish_pending() {
    while (!pending_.empty()) wait_oldest_reduction();
  }
  //! Collective over the shard group: sum over ranks of a per-rank double (the norm pieces).
  double shard_group_sum(double local) { return groups_.shard_sum(local, ag_queue_); }
  //! Collective over the shard group: `*sum`, a double in the device's memory, summed over the
  //! ranks in place, after the compute issued so far and before the compute issued next; the
  //! host does not wait (clip_grad_norm on a GPU).
  void shard_group_sum_in_place(double* sum) {
    if (!groups_.shard()) return;
    wait_for_compute(ag_queue_);
    device_.compute_wait(groups_.shard()->all_reduce(sum, sum, 1, dtype::f64, reduce_op::sum, ag_queue_), wait_timeout_);
  }

  //! Collective over the shard group: bucket b's unsharded master values, at layout(b)'s offsets.
  std::vector<master_type> full_bucket(std::size_t b) {
    settle("full_bucket");
    return buckets_.full_bucket(static_cast<int>(b), false, groups_.shard(), ag_queue_, wait_timeout_);
  }
  //! Collective over the world: every rank's bytes, of any length (checkpoint metadata, agreement).
  std::vector<std::vector<std::byte>> all_gather_host(std::span<const std::byte> b) { return groups_.all_gather_variable(b, ag_queue_); }
  device_type& device() noexcept { return device_; }
  comm_type& comm() noexcept { return groups_.world(); }

  // ---- introspection --------------------------------------------------------------------------

  int rank() const noexcept { return rank_; }
  int world_size() const noexcept { return world_size_; }
  bool finalized() const noexcept { return finalized_; }  //!< the shards (optimizer state) exist
  //! Ranks sharing one copy of the parameters (S), and copies (R = world / S).
  int shard_size() const noexcept { return groups_.shard_size(); }
  int replica_size() const noexcept { return groups_.replica_size(); }
  int num_units() const noexcept { return units_.size(); }
  int bucket_of(int u) const { return units_.at(u).bucket; }
  //! The name given to add_unit ("unit<u>" when none was).
  const std::string& unit_name(int u) const { return units_.at(u).name; }
  const flat_layout& layout(std::size_t b) const { return buckets_.at(b).layout; }
  //! This rank's place in its shard group: it holds shard shard_rank() of every layout.
  int shard_rank() const noexcept { return groups_.shard_rank(); }
  //! Bucket b's parameters in the order of layout(b)'s entries: their param_traits names
  //! ("#<index>" for one without) and shapes (contract 8; else {numel}). For checkpoints.
  std::vector<parameter_info> parameters(std::size_t b) const {
    std::vector<parameter_info> out;
    for (int u : buckets_.at(b).units)
      for (const Params* p : units_[u].params) out.push_back({units_.param_name(*p, out.size()), shape_of(*p)});
    return out;
  }
  memory_stats memory() const { return device_.memory(); }
  //! Bytes this rank sent through the group's communicators since the group was built.
  traffic_counters traffic() const { return groups_.traffic(); }

  //! What the hooks measured: unit_timings(), communication_wait(), reset(),
  //! record_timeline(&t) (detail/group/hook_profiler.hpp). Available after finalize.
  detail::hook_profiler& profile() {
    require_finalized("profile");
    return *profiler_;
  }

  //! On a device with its own clock (CUDA): from now on, times every all-gather and reduction,
  //! and compute's waits for them, on the GPU (detail/group/device_spans.hpp), so that
  //! profile().communication_wait() is the time compute stalled on communication (exposed
  //! communication) and a recorded timeline gets the collectives' lanes. One host wait here,
  //! none in the steps. Nothing changes on the host device, whose clock is the host's.
  void time_on_device() {
    require_finalized("time_on_device");
    if constexpr (requires { device_.compute_mark(); }) profiler_->time_on_device(device_, wait_timeout_);
  }

  //! Collective. The step as the hooks saw it since profile().reset(), for the planner and the
  //! simulator (schedule/): each unit's sizes and mean compute time per step, the unit orders
  //! followed, every hook call of a step with the compute before it (so units that stay in use
  //! around others are described as they run), the sharding and the dtypes, and as optimizer_s
  //! the mean time from finish_backward to the next step's first hook. Times are averaged over
  //! the ranks, so every rank gets the same trace and plans the same. A step here is one
  //! forward and one backward pass.
  schedule::step_trace step_trace(int optimizer_states = 2) {
    if (!order_.known()) throw error(errc::order, "step_trace before the first step's finish_backward", site());
    schedule::step_trace t;
    t.units = units_.profiles();
    t.forward_order.assign(order_.forward_units().begin(), order_.forward_units().end());
    t.backward_order.assign(order_.backward_units().begin(), order_.backward_units().end());
    t.world_size = world_size();
    t.shard_size = shard_size();
    t.reshard_after_forward = opts_.sharding.reshard_after_forward;
    t.param_elem = sizeof(param_type);
    t.reduce_elem = sizeof(reduce_type);
    t.master_elem = sizeof(master_type);
    t.optimizer_states = optimizer_states;
    t.low_precision_shard = bucket_store_type::keeps_low_precision(opts_.keep_low_precision_shard);
    profiler_->fill(t);
    // Every rank measured its own times: plan from their mean. The lengths agree (the order was
    // checked across ranks), but the event lists may not have been recorded in full everywhere.
    const std::vector<double*> slots = detail::hook_profiler::times_of(t);
    if (!groups_.same_length_everywhere(slots.size(), ag_queue_))
      throw error(errc::mismatch, "step_trace: ranks recorded different hook sequences (a step is one forward and one backward)", site());
    groups_.average(slots, ag_queue_);
    return t;
  }

  //! The unit order prefetching follows: the explicit order of the Prefetch option, else the
  //! order recorded in the first forward and backward (known after the first finish_backward).
  std::span<const int> forward_order() const noexcept { return order_.forward_units(); }
  std::span<const int> backward_order() const noexcept { return order_.backward_units(); }

  //! The plan the group replays: options.plan from the start; else the plan of the prefetch
  //! depths over the order followed, once that order is known (nullopt before).
  const std::optional<schedule::plan>& plan() const noexcept { return order_.plan(); }

  //! Peak transient bytes the design allows for these buckets and this plan
  //! (detail/group/memory_bound.hpp): position by position once the order is known; before,
  //! (1 + prefetch depth) x the largest bucket, plus in backward the largest gradient buffer
  //! and the largest reduction in flight (with a plan: every bucket and every reduction).
  memory_bound transient_memory_bound() const {
    const auto bytes = buckets_.transient_bytes(shard_size(), opts_.sharding.reshard_after_forward_to);
    return detail::transient_memory_bound(bytes, opts_.sharding.reshard_after_forward, order_.known() ? &order_.positions() : nullptr,
                                          order_.plan() ? &*order_.plan() : nullptr, opts_.prefetch.forward, opts_.prefetch.backward);
  }

  //! Collective: the full values of parameter `index` of unit `u`, in the master dtype
  //! (gathered from the shards; for checkpoints and tests).
  std::vector<master_type> full_parameter(int u, int index) { return gather_full(u, index, false); }
  //! Collective: the full averaged gradient of parameter `index` of unit `u`, in the master
  //! dtype, as the last reductions left it in the gradient shards.
  std::vector<master_type> full_gradient(int u, int index) { return gather_full(u, index, true); }

 private:
  using hook = detail::hook_profiler::hook;
  using buffer_t = typename device_type::buffer;
  using event_t = typename device_type::event;
  using bucket_store_type = detail::bucket_store<Params, precision_type, device_type>;
  using bucket_io = detail::bucket_collectives<bucket_store_type>;

  struct pending_reduction {
    int bucket;
    event_t done;
  };

  error_site site(int u = -1) const { return {rank(), u, {}}; }
  void require_finalized(const char* what) const {
    if (!finalized_) throw error(errc::order, std::string(what) + " before finalize", site());
  }

  // The first unit of bucket b to run in this pass: count down its units.
  void begin_pass(int b, bool backward) {
    auto& k = buckets_[b];
    bool& in = backward ? k.in_backward_pass : k.in_forward_pass;
    if (in) return;
    in = true;
    (backward ? k.backward_remaining : k.forward_remaining) = static_cast<int>(k.units.size());
    // One rank of one dtype: the gradients go into the shard itself, unless it holds a reduced
    // gradient already (the storage must read zero at the first backward after a reduction).
    if (backward) k.grads_to_shard = buckets_.grads_in_shard(b) && !k.shard_reduced;
  }

  // -- gather / reshard --

  // Issues bucket b's all-gather on the all-gather queue (nothing if it is gathered already).
  void gather(int b) {
    auto& k = buckets_[b];
    if (k.gathered) return;
    k.gathered = true;
    k.waited = false;
    if (buckets_.aliased()) {
      k.full_ptr = k.master.template as<param_type>();
      k.gather_done = {};
      return;
    }
    wait_for_compute(ag_queue_);  // the optimizer's last writes to the master shard
    auto began = profiler_->begin_span(ag_queue_);
    bucket_io::issue_gather(buckets_, b, groups_.shard_rank(), groups_.shard(), groups_.secondary(), opts_.collectives.all_gather, ag_queue_);
    profiler_->end_span(ag_queue_, std::move(began), timeline::lane::all_gather, "all_gather", k.name);
    k.gather_done = ag_queue_.record();
  }

  void wait_gathered(int b) {
    auto& k = buckets_[b];
    if (k.waited) return;
    wait_counted(k.gather_done, "all_gather", b);
    k.waited = true;
  }

  // Orders `q` after the compute issued so far (free on the host, where compute is synchronous).
  void wait_for_compute(queue_type& q) {
    event_t e = device_.compute_record();
    if (!e.ready()) q.wait(std::move(e), wait_timeout_);
  }

  // The compute side waits for `e`, counted as communication wait.
  void wait_counted(const event_t& e, const char* what, int b) {
    profiler_->wait(e, [&] { device_.compute_wait(e, wait_timeout_); }, [&] { return detail::compute_mark(device_); }, what,
                    buckets_[b].name);
  }

  void reshard(int b, bool after_forward = false) {
    auto& k = buckets_[b];
    if (!k.gathered) return;
    wait_gathered(b);  // a prefetched buffer may still be in flight
    if (after_forward && groups_.secondary()) bucket_io::keep_secondary(buckets_, b, *groups_.secondary());  // hpZ
    buckets_.unbind(b);
    k.full.reset();
    k.full_ptr = nullptr;
    k.gathered = false;
  }

  void reshard_every_bucket() {
    for (int b = 0; b < buckets_.size(); ++b) {
      buckets_[b].in_forward_pass = false;
      buckets_[b].secondary = {};  // hpZ: a forward whose backward did not come (evaluation)
      reshard(b);
    }
    units_.end_pass();
  }

  // -- reduction --

  // The bucket's backward is over: free its parameters, wait for the reductions the plan wants
  // done by now (one in flight by default: the previous one had this bucket's whole backward
  // to finish behind), then reduce its gradients.
  void end_backward_of(int b) {
    auto& k = buckets_[b];
    k.in_backward_pass = false;
    k.backward_remaining = 0;
    reshard(b);
    if (sync_ && k.grads_to_shard) k.shard_reduced = true;  // nothing to reduce at one rank
    if (!sync_ || !k.grad_full) return;
    if (buckets_.grads_in_shard(b)) return buckets_.add_gradients_into_shard(b);  // one rank, after a reduction
    const std::size_t due = order_.reductions_due(b, pending_, [](const pending_reduction& r) { return r.bucket; });
    for (std::size_t i = 0; i < due; ++i) wait_oldest_reduction();
    issue_reduction(b);
  }

  // Bucket b's reduction on the reduce queue (detail/group/bucket_collectives.hpp), timed.
  void issue_reduction(int b) {
    auto& k = buckets_[b];
    wait_for_compute(rs_queue_);  // the gradients are written
    auto began = profiler_->begin_span(rs_queue_);
    const bool hold = groups_.replica() && !all_reduce_;  // the all-reduce waits for a later reduction
    bucket_io::issue_reduction(buckets_, b, groups_.shard(), groups_.replica(), hold, opts_.collectives.reduce_scatter, rs_queue_);
    profiler_->end_span(rs_queue_, std::move(began), timeline::lane::reduce, "reduce", k.name);
    pending_.push_back({b, rs_queue_.record()});
  }

  void wait_oldest_reduction() {
    pending_reduction r = std::move(pending_.front());
    pending_.pop_front();
    wait_counted(r.done, "reduce", r.bucket);
  }

  // Before reading the shards: the optimizer's writes and every reduction done.
  void settle(const char* what) {
    require_finalized(what);
    finish_pending();
    wait_for_compute(ag_queue_);
  }
  std::vector<master_type> gather_full(int u, int index, bool grads) {
    settle(grads ? "full_gradient" : "full_parameter");
    const auto& rec = units_.checked(u, grads ? "full_gradient" : "full_parameter");
    if (index < 0 || static_cast<std::size_t>(index) >= rec.params.size())
      throw error(errc::invalid_argument, "no parameter " + std::to_string(index), site(u));
    return buckets_.full_values(u, static_cast<std::size_t>(index), grads, groups_.shard(), ag_queue_, wait_timeout_, rank());
  }

  // -- members (declaration order matters: queues last, so they drain while buffers and
  //    communicators their tasks use are still alive) --
  device_type device_;
  options opts_;
  milliseconds wait_timeout_;
  int exceptions_at_start_;
  int rank_;
  int world_size_;
  bool finalized_ = false;
  bool sync_ = true;
  bool all_reduce_ = true;
  detail::unit_registry<Params> units_;
  detail::process_groups<comm_type, device_type> groups_;
  bucket_store_type buckets_;
  detail::step_order order_;
  std::optional<detail::hook_profiler> profiler_;  // made at finalize, when the units are known
  std::deque<pending_reduction> pending_;
  queue_type ag_queue_ = detail::make_queue<queue_type>("all_gather", opts_.collectives_high_priority);
  queue_type rs_queue_ = detail::make_queue<queue_type>("reduce_scatter", opts_.collectives_high_priority);
};

}  // namespace fsdp
