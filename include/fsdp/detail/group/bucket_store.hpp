#pragma once
//! \file bucket_store: the buckets of a shard_group and the bytes they own. A bucket is a run
//! of consecutive units sharing one flat layout (core/layout.hpp): per rank it owns its
//! persistent master shard and gradient shard, and while gathered its transient unsharded
//! parameters (and gradients in backward). Frozen parameters sit in a region of the layout
//! after the trainable ones: gathered like them, with no gradient storage. The store builds
//! the buckets and binds the handles to gathered storage; how a bucket's bytes are gathered and
//! reduced is bucket_collectives.hpp's, when is the driver's (shard_group.hpp), the initial
//! values are initial_values.hpp's.

#include <cstddef>
#include <cstdint>
#include <new>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "fsdp/comm/concepts.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/init.hpp"
#include "fsdp/core/layout.hpp"
#include "fsdp/core/param_traits.hpp"
#include "fsdp/detail/group/memory_bound.hpp"
#include "fsdp/detail/group/unit_registry.hpp"
#include "fsdp/detail/kernels.hpp"
#include "fsdp/core/memory.hpp"
#include "fsdp/core/timeout.hpp"
#include "fsdp/policy/mixed_precision.hpp"
#include "fsdp/policy/offload.hpp"

namespace fsdp::detail {

//! One bucket's shard of the trainable master parameters and of their averaged gradients
//! (shard_group::shard_view, what optimizers step).
template <class Master, class Param>
struct shard_view {
  Master* params;
  Master* grads;
  std::size_t numel;
  std::size_t frozen_numel;  //!< frozen elements that follow params[numel) in the master shard (checkpoints read them)
  mem_kind kind;             //!< offloaded: host memory, which optimizers step on the host
  //! options::keep_low_precision_shard: the shard in the gathered dtype, frozen elements
  //! included (null otherwise). An optimizer that writes low_precision[i] =
  //! convert<Param>(params[i]) for every i < numel it steps, and no frozen element, says
  //! so with shard_group::low_precision_written(b), and the next gather reads it as it is.
  Param* low_precision = nullptr;
};

template <parameter Params, mixed_precision_policy Precision, class Device>
class bucket_store {
 public:
  using params_type = Params;
  using param_type = typename Precision::param_type;
  using reduce_type = typename Precision::reduce_type;
  using master_type = typename Precision::master_type;
  using rules = precision_rules<Precision>;
  using device_type = Device;
  using buffer_t = typename Device::buffer;
  using event_t = typename Device::event;

  struct bucket {
    std::vector<int> units;
    std::string name;  // its units' names joined by '+' (for traces)
    flat_layout layout;
    mem_kind state_kind = mem_kind::persistent;  // offloaded: the shards below live in host memory (policy/offload.hpp)
    buffer_t master;      // persistent: master_type[shard_numel], trainable chunk first
    buffer_t grad_shard;  // persistent: master_type[trainable_shard_numel]
    // persistent, options::keep_low_precision_shard: param_type[shard_numel], the master shard
    // cast to the gathered dtype, which the all-gather reads. `low_precision_current`: it equals
    // that cast (set by the gather that casts it and by an optimizer that wrote it in its pass,
    // shard_group::low_precision_written; cleared by every shard view handed out).
    buffer_t low_precision;
    bool low_precision_current = false;
    // grad_shard holds zeros: true when allocated and after zero_grads(); cleared by whatever may
    // write it (a reduction, the engine through grads_in_shard, a shard view handed out).
    bool grad_shard_zero = true;
    // grads_in_shard buckets: grad_shard holds a reduced gradient (a pass that wrote it ended
    // with sync on, since zero_grads), so the next backward pass gets a zeroed grad_full instead
    // (the hooks' contract), added into the shard when that pass is reduced.
    bool shard_reduced = false;
    bool grads_to_shard = false;  // this backward pass's gradients are written into grad_shard
    buffer_t full;        // transient: param_type[padded_numel] while gathered
    param_type* full_ptr = nullptr;
    bool gathered = false;  // a gather was issued and not resharded
    bool waited = false;    // its event was waited on
    event_t gather_done{};
    buffer_t grad_full;  // transient: param_type[trainable_numel] while in backward / no_sync
    buffer_t held;       // persistent: reduce_type[trainable_shard_numel], the sum not yet all-reduced across replicas
    buffer_t secondary;  // transient, hpZ: param_type[padded_numel / k], this rank's part of the gathered buffer from forward to backward
    bool in_forward_pass = false;
    bool in_backward_pass = false;
    int forward_remaining = 0;  // units of the bucket still to run in this pass
    int backward_remaining = 0;
  };

  bucket_store(unit_registry<Params>& units, Device& device) : units_(units), device_(device) {}

  //! Forms the buckets of `assignment` (per unit, its bucket: 0, 1, ... over consecutive
  //! units; checked), each sharded over `shard_size` ranks, and allocates the shards.
  //! `low_precision`: keep each shard in the gathered dtype too (options::keep_low_precision_shard;
  //! only where it differs from the master dtype).
  void build(const std::vector<int>& assignment, int shard_size, int world_size, int rank, const offload& off = {},
             bool low_precision = false) {
    if (assignment.size() != static_cast<std::size_t>(units_.size()) || assignment.front() != 0)
      throw error(errc::invalid_argument, "bucket policy returned an assignment that does not start at bucket 0 or has the wrong length",
                  {rank, -1, {}});
    for (std::size_t u = 1; u < assignment.size(); ++u)
      if (assignment[u] != assignment[u - 1] && assignment[u] != assignment[u - 1] + 1)
        throw error(errc::invalid_argument, "bucket policy must put consecutive units in numbered buckets",
                    {rank, static_cast<int>(u), {}});
    aliased_ = rules::master_aliases_gathered(shard_size);
    grads_in_shard_ = world_size == 1 && std::is_same_v<param_type, master_type> && !rules::reduce_dtype_differs;
    buckets_.resize(static_cast<std::size_t>(assignment.back() + 1));
    std::vector<std::vector<std::size_t>> numels(buckets_.size());
    std::vector<std::vector<bool>> frozen(buckets_.size());
    for (int u = 0; u < units_.size(); ++u) {
      auto& rec = units_[u];
      rec.bucket = assignment[static_cast<std::size_t>(u)];
      auto& b = buckets_[static_cast<std::size_t>(rec.bucket)];
      auto& n = numels[static_cast<std::size_t>(rec.bucket)];
      rec.first_entry = n.size();
      b.units.push_back(u);
      b.name.append(b.name.empty() ? "" : "+").append(rec.name);
      for (Params* p : rec.params) n.push_back(param_traits<Params>::numel(*p));
      frozen[static_cast<std::size_t>(rec.bucket)].insert(frozen[static_cast<std::size_t>(rec.bucket)].end(), rec.frozen.begin(), rec.frozen.end());
    }
    const std::size_t pad = padding_multiple(world_size);
    try {
      for (std::size_t i = 0; i < buckets_.size(); ++i) {
        auto& b = buckets_[i];
        b.layout = flat_layout(numels[i], shard_size, pad, frozen[i]);
        b.state_kind = off.covers(b.units) ? mem_kind::offloaded : mem_kind::persistent;
        b.master = device_.allocate(b.layout.shard_numel() * sizeof(master_type), b.state_kind);
        b.grad_shard = device_.allocate(b.layout.trainable_shard_numel() * sizeof(master_type), b.state_kind);
        if (keeps_low_precision(low_precision))
          b.low_precision = device_.allocate(b.layout.shard_numel() * sizeof(param_type), b.state_kind);
      }
    } catch (const std::bad_alloc&) {  // a size this process cannot hold: say which, not a bare bad_alloc
      std::size_t total = 0;
      for (std::size_t unit_bytes : units_.bytes(sizeof(param_type))) total += unit_bytes;
      throw error(errc::invalid_argument, "finalize: cannot allocate the sharded state (std::bad_alloc): the units hold " +
                  std::to_string(total) + " bytes of parameters, " + std::to_string(total / static_cast<std::size_t>(shard_size)) +
                  " per rank over a shard group of " + std::to_string(shard_size) + ", each with a gradient shard and optimizer state beside it", {rank, -1, {}});
    }
  }

  //! Whether options::keep_low_precision_shard = `asked` keeps a copy: only for a gathered dtype
  //! other than the master's (otherwise the gather reads the master itself).
  static constexpr bool keeps_low_precision(bool asked) noexcept { return asked && !std::is_same_v<param_type, master_type>; }

  //! Bucket b's shard, handed to a caller that may write it (an optimizer, clipping, a
  //! checkpoint's load): from now on its gradient shard is not known to be zero, nor its
  //! low-precision copy to be the master's cast.
  shard_view<master_type, param_type> writable_shard(std::size_t b) {
    auto& m = buckets_.at(b);
    m.grad_shard_zero = false;
    m.low_precision_current = false;
    return {m.master.template as<master_type>(), m.grad_shard.template as<master_type>(), m.layout.trainable_shard_numel(),
            m.layout.shard_numel() - m.layout.trainable_shard_numel(), m.state_kind,
            m.low_precision ? m.low_precision.template as<param_type>() : nullptr};
  }
  //! The holder of a writable_shard(b) wrote its low-precision copy in full: the next gather
  //! reads it without casting. Not for a bucket with frozen elements, which a view could have
  //! written: it is cast again at every gather.
  void low_precision_written(std::size_t b) {
    auto& m = buckets_.at(b);
    m.low_precision_current = m.low_precision && m.layout.shard_numel() == m.layout.trainable_shard_numel();
  }

  int size() const noexcept { return static_cast<int>(buckets_.size()); }
  bucket& operator[](int b) { return buckets_[static_cast<std::size_t>(b)]; }
  const bucket& operator[](int b) const { return buckets_[static_cast<std::size_t>(b)]; }
  bucket& at(std::size_t b) { return buckets_.at(b); }
  const bucket& at(std::size_t b) const { return buckets_.at(b); }
  std::span<bucket> all() noexcept { return buckets_; }
  unit_registry<Params>& units() noexcept { return units_; }
  Device& device() const noexcept { return device_; }
  //! The gathered storage is the master shard (precision_rules::master_aliases_gathered).
  bool aliased() const noexcept { return aliased_; }
  //! One rank, one dtype (param = reduce = master): bucket b's gradient shard is its whole
  //! gradient, so backward writes it directly, as the gathered parameters are the master shard:
  //! no gradient buffer, no reduction. It saved 1 allocation and 2 queue hand-offs per unit of
  //! the one-rank step (docs/benchmarks.md). Not for offloaded state, which is host memory.
  bool grads_in_shard(int b) const noexcept { return grads_in_shard_ && (*this)[b].state_kind != mem_kind::offloaded; }

  std::vector<int> bucket_of_unit() const {
    std::vector<int> out;
    for (int u = 0; u < units_.size(); ++u) out.push_back(units_[u].bucket);
    return out;
  }

  //! Transient bytes of each bucket, as the memory bound counts them; `secondary_size` is hpZ's
  //! k (0: none).
  std::vector<bucket_bytes> transient_bytes(int shard_size, int secondary_size = 0) const {
    std::vector<bucket_bytes> all;
    for (const auto& k : buckets_) {
      all.push_back(bytes_of(k.layout, shard_size));
      if (secondary_size > 0) all.back().secondary = k.layout.padded_numel() / static_cast<std::size_t>(secondary_size) * sizeof(param_type);
    }
    return all;
  }
  //! Gradients and their reduction cover the trainable region only.
  bucket_bytes bytes_of(const flat_layout& layout, int shard_size) const {
    const std::size_t n = layout.padded_numel(), t = layout.trainable_numel();
    bucket_bytes out{aliased_ ? 0 : n * sizeof(param_type), t * sizeof(param_type), t * sizeof(param_type)};
    if (rules::reduce_dtype_differs) out.reduction += t * sizeof(reduce_type);
    if (shard_size > 1) out.reduction += layout.trainable_shard_numel() * sizeof(reduce_type);
    return out;
  }

  //! Refuses to hand out bucket b's gradient shard while part of it is held back from the
  //! replicas' all-reduce (an optimizer would step on a gradient missing the other replicas).
  void require_all_reduced(std::size_t b, int rank) const {
    const auto& k = at(b);
    if (k.held)
      throw error(errc::order, "bucket " + std::to_string(b) + " ('" + k.name + "') holds gradients not yet all-reduced across "
                  "replicas (its last reduction ran with set_requires_all_reduce(false)): turn it on for the last micro-batch", {rank, -1, {}});
  }

  //! Refuses to hand out bucket b's gradient shard while its gradients sit unreduced in the
  //! unsharded buffer (backward ran with gradient sync off, and no backward with it on came
  //! after): an optimizer would step without them, silently.
  void require_reduced(std::size_t b, int rank) const {
    const auto& k = at(b);
    if (k.grad_full && !k.in_backward_pass)
      throw error(errc::order, "bucket " + std::to_string(b) + " ('" + k.name + "') holds gradients accumulated with gradient "
                  "sync off and never reduced (set_requires_gradient_sync(false) and not back on): turn it on for the last "
                  "micro-batch's backward, or zero_grad() to drop them", {rank, -1, {}});
  }

  //! One rank of one dtype (grads_in_shard), a pass after a reduction: bucket b's gradient
  //! buffer added into its shard in compute order and freed at once (a reduce-queue hand-off
  //! would hold it while the next micro-batch allocates its own: more than stage memory bounds
  //! allow).
  void add_gradients_into_shard(int b) {
    auto& k = (*this)[b];
    accumulate(device_.execution_policy(), k.grad_shard.template as<master_type>(), k.grad_full.template as<param_type>(),
               k.layout.trainable_numel());
    k.grad_full = buffer_t{};
    k.shard_reduced = true;
    k.grad_shard_zero = false;
  }

  //! Zeroes the gradient shards and drops the held sums (no reduction may be pending).
  void zero_grads() {
    for (auto& k : buckets_) {
      // In compute order, without a host wait, except offloaded state (pinned host memory).
      if (k.state_kind == mem_kind::offloaded) device_.zero(k.grad_shard.data(), k.grad_shard.bytes());
      else zero_async(device_, k.grad_shard.data(), k.grad_shard.bytes());
      k.grad_shard_zero = true;
      k.shard_reduced = false;
      k.held = buffer_t{};
      if (!k.in_backward_pass) k.grad_full = buffer_t{};  // sums kept with sync off go too
    }
  }

  //! Collective over the shard group `shard` (null: one rank): bucket b's full values (at the
  //! offsets of its layout, padding included), from the master shards, in the master dtype; or
  //! (grads) its trainable region's, from the gradient shards.
  template <class Comm>
  std::vector<master_type> full_bucket(int b, bool grads, Comm* shard, typename Device::queue& q, milliseconds timeout) {
    const bucket& k = (*this)[b];
    const std::size_t n = grads ? k.layout.trainable_numel() : k.layout.padded_numel();
    buffer_t full = device_.allocate(n * sizeof(master_type), mem_kind::transient);
    for (const flat_region& g : k.layout.regions()) {
      if (grads && g.frozen) break;
      const master_type* src = (grads ? k.grad_shard : k.master).template as<master_type>() + g.shard_offset;
      master_type* dst = full.template as<master_type>() + g.offset;
      if (shard) shard->all_gather(src, dst, g.numel / static_cast<std::size_t>(shard->size()), dtype_of<master_type>, q).wait(timeout, "all_gather");
      else device_.copy(dst, src, g.numel * sizeof(master_type));
    }
    std::vector<master_type> out(n);
    device_.copy_to_host(out.data(), full.data(), out.size() * sizeof(master_type));
    return out;
  }
  //! The same, for parameter `index` of unit `u` only; a frozen one has no gradient.
  template <class Comm>
  std::vector<master_type> full_values(int u, std::size_t index, bool grads, Comm* shard, typename Device::queue& q, milliseconds timeout,
                                       int rank) {
    const auto& rec = units_[u];
    if (grads && rec.frozen[index])
      throw error(errc::invalid_argument, "full_gradient: the parameter is frozen, it has no gradient",
                  {rank, u, unit_registry<Params>::param_name(*rec.params[index], index)});
    const std::vector<master_type> all = full_bucket(rec.bucket, grads, shard, q, timeout);
    const flat_entry e = (*this)[rec.bucket].layout[rec.first_entry + index];
    const auto first = all.begin() + static_cast<std::ptrdiff_t>(e.offset);
    return std::vector<master_type>(first, first + static_cast<std::ptrdiff_t>(e.numel));
  }

  // ---- gathering and binding ----------------------------------------------------------------

  //! Binds bucket b's handles to its gathered parameters (and gradient buffer when
  //! `with_grads`).
  void bind(int b, bool with_grads) {
    bucket& k = (*this)[b];
    auto* grads = !with_grads ? nullptr : k.grads_to_shard ? k.grad_shard.template as<param_type>() : k.grad_full.template as<param_type>();
    if (with_grads && k.grads_to_shard) k.grad_shard_zero = false;
    for (int u : k.units) units_.require_alive(u);
    for (int u : k.units) {
      auto& rec = units_[u];
      for (std::size_t i = 0; i < rec.params.size(); ++i) {
        const std::size_t off = k.layout[rec.first_entry + i].offset;
        param_traits<Params>::bind(*rec.params[i], k.full_ptr + off, grads && !rec.frozen[i] ? grads + off : nullptr);
      }
    }
  }
  void unbind(int b) {
    for (int u : (*this)[b].units) units_.unbind(u);
  }

 private:
  unit_registry<Params>& units_;
  Device& device_;
  std::vector<bucket> buckets_;
  bool aliased_ = false;
  bool grads_in_shard_ = false;
};

}  // namespace fsdp::detail
