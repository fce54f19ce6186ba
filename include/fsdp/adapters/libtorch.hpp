#pragma once
//! \file fsdp for LibTorch's C++ frontend, which has no DDP and no FSDP of its own. A
//! sharded_module owns a shard_group over the parameters of a torch::nn::Module's chosen
//! submodules (one unit each) and drives it from LibTorch's autograd:
//!
//!   auto model = std::make_shared<Net>();                       // every rank builds it (rank 0's values win)
//!   fsdp::libtorch::sharded_module<fsdp::shard_group<fsdp::libtorch::param>> sharded{comm, {model->l1, model->l2}};
//!   fsdp::adamw opt{sharded.group(), {.lr = 1e-3f}};
//!   auto h = sharded.forward(0, [&] { return model->l1->forward(x); });   // each unit's forward
//!   auto y = sharded.forward(1, [&] { return model->l2->forward(h); });
//!   loss(y).backward();                                         // hooks fire inside; reductions overlap
//!   opt.step(); opt.zero_grad();
//!
//! How each hook is reached (C++ modules have no forward hooks, so forward(u, f) brackets the
//! unit's forward):
//!   pre_forward / post_forward   around f() in forward(u, f);
//!   pre_backward                 a hook on the gradient of each output of f() that requires
//!                                one (the first to fire of a unit's outputs);
//!   post_backward                a post-hook on the gradient accumulator of each of the unit's
//!                                parameters: when every one has accumulated;
//!   finish_backward              a callback queued on the autograd engine at the first backward
//!                                hook, run when the backward pass ends.
//!
//! The three rules a binding to autograd must keep, each kept here (and tested):
//!   1. keep the parameter's storage object, moving only its data pointer and size: autograd
//!      saves the weight for backward, and a new storage (set_data) would leave it a view of
//!      memory fsdp has freed (NaN from step 1);
//!   2. bind .grad to fsdp's storage before the first gradient arrives, and check it stays so:
//!      autograd adds into a defined .grad in place, but replaces one under create_graph (then
//!      the gradient would miss fsdp's storage): that, or a .grad set by hand, is an fsdp::error;
//!   3. keep the gradient accumulator nodes alive: a post-hook lives on its node, which autograd
//!      frees with the graph, and then every reduction would slide to the end of backward.
//! The parameter handles are declared before the group (its destructor unbinds them), and
//! LibTorch's intra-op threads are capped so that N ranks on one host do not oversubscribe it
//! (issue 13 reports 20 steps of a small model taking 3-12 s instead of 0.09 s on 4 thread ranks).
//!
//! Evaluation: forward(u, f) under torch::NoGradGuard arms no backward hooks; call reshard()
//! after a forward-only pass. Between forward passes the module's parameters hold no memory:
//! LibTorch does not check, so reading one (or a torch::optim step on module->parameters())
//! crashes. After training, gather_into_module() gives them back their full values.
//!
//! Tested on Debian's LibTorch 1.13.1 (tests/libtorch, in CI) and on 2.15 (the same tests, by
//! hand: scripts/check-libtorch2.sh).

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <cstddef>
#include <functional>
#include <map>
#include <span>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "fsdp/comm/topology.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/init.hpp"
#include "fsdp/core/param_traits.hpp"

namespace fsdp::libtorch {

//! One parameter of a module, as fsdp's handle (param_traits below).
struct param {
  torch::Tensor tensor;   //!< the module's own parameter: its storage object is kept, its data pointer moved
  std::string name;       //!< "unit1.weight": the unit, then its name in the unit's module
  torch::Tensor initial;  //!< a contiguous copy of its values until finalize (broadcast init reads rank 0's)
  const void* grad_impl = nullptr;  //!< the .grad tensor bound to fsdp's storage (rule 2)
  //! Reset by gather_into_module, which hands the tensor back: fsdp never binds it again
  //! (param_traits contract 7), the group's destructor included.
  std::shared_ptr<const void> alive;
};

namespace detail {

inline dtype dtype_of_tensor(const torch::Tensor& t, const std::string& name) {
  switch (t.scalar_type()) {
    case torch::kFloat: return dtype::f32;
    case torch::kBFloat16: return dtype::bf16;
    case torch::kHalf: return dtype::f16;
    default: throw error(errc::invalid_argument, "libtorch: parameter " + name + " is " + std::string(c10::toString(t.scalar_type())) +
                                                     "; fsdp shards float, bfloat16 and half parameters");
  }
}

//! Rule 1: the tensor's storage object now holds `bytes` at `data` (not owned: fsdp frees it).
inline void point_storage(const torch::Tensor& t, void* data, std::size_t bytes) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(c10::DataPtr(data, t.device()));
  s->set_nbytes(bytes);
}

}  // namespace detail

}  // namespace fsdp::libtorch

template <>
struct fsdp::param_traits<fsdp::libtorch::param> {
  using P = fsdp::libtorch::param;
  static std::size_t numel(const P& p) { return static_cast<std::size_t>(p.tensor.numel()); }
  static dtype type(const P& p) { return fsdp::libtorch::detail::dtype_of_tensor(p.tensor, p.name); }
  static std::string_view name(const P& p) { return p.name; }
  static const void* initial_values(const P& p) { return p.initial.defined() ? p.initial.data_ptr() : nullptr; }
  static void release_initial_values(P& p) { p.initial = torch::Tensor(); }
  static std::weak_ptr<const void> lifetime(const P& p) noexcept { return p.alive; }
  static std::vector<std::size_t> shape(const P& p) {
    std::vector<std::size_t> s;
    for (auto d : p.tensor.sizes()) s.push_back(static_cast<std::size_t>(d));
    return s;
  }
  static void bind(P& p, void* data, void* grad) {
    const std::size_t bytes = data ? numel(p) * size_of(type(p)) : 0;
    fsdp::libtorch::detail::point_storage(p.tensor, data, bytes);
    if (!grad) {
      if (p.tensor.grad().defined()) fsdp::libtorch::detail::point_storage(p.tensor.grad(), nullptr, 0);
      return;
    }
    // Rule 2: a .grad of our own, bound before any gradient arrives; the same tensor every step.
    if (!p.tensor.grad().defined()) {
      p.tensor.mutable_grad() = torch::empty_like(p.tensor);  // its memory is let go just below
      p.grad_impl = p.tensor.grad().unsafeGetTensorImpl();
    }
    if (p.tensor.grad().unsafeGetTensorImpl() != p.grad_impl)
      throw error(errc::invalid_argument, "libtorch: the .grad of " + p.name +
                                              " was replaced (set by hand, or by a backward with create_graph): fsdp's "
                                              "gradient storage no longer receives its gradients");
    fsdp::libtorch::detail::point_storage(p.tensor.grad(), grad, bytes);
  }
};

namespace fsdp::libtorch {

//! A unit's module: a torch::nn::ModuleHolder (torch::nn::Linear, ...) or a shared_ptr to a module.
struct unit {
  std::shared_ptr<torch::nn::Module> module;
  template <class M>
  unit(std::shared_ptr<M> m) : module(std::move(m)) {}  // NOLINT: implicit, for {a, b, c}
  template <class M>
  unit(const torch::nn::ModuleHolder<M>& h) : module(h.ptr()) {}  // NOLINT: implicit
};

//! A shard_group over a module's units, driven by autograd (see the file comment). Group is a
//! shard_group<param, ...> of the caller's policies and communicator.
template <class Group>
class sharded_module {
 public:
  using comm_type = typename Group::comm_type;

  struct options {
    typename Group::options group{};
    //! Cap LibTorch's intra-op threads at this host's cores / the ranks on this host (set once
    //! per process; false leaves torch's setting alone).
    bool cap_threads = true;
    //! The initial values, by parameter name ("unit<u>.<name in its module>", as
    //! full_state_dict() names them), each rank filling only its shards from it; empty: rank
    //! 0's module values, broadcast.
    std::map<std::string, torch::Tensor> initial_state = {};
  };

  //! Collective. `units`: the submodules that are fsdp units, in order; each contributes the
  //! parameters it holds (recursively) that no earlier unit holds (a weight tied to an earlier
  //! unit's belongs to that unit). The parameters' values on rank 0 become everyone's.
  sharded_module(comm_type& comm, const std::vector<unit>& units, options o = {})
      : params_(collect(units)), group_(comm, {}, o.group) {
    if (o.cap_threads) cap_threads(comm);
    for (std::size_t u = 0; u < by_unit_.size(); ++u) {
      std::vector<param*> ps, frozen;  // requires_grad=false: frozen (no gradient storage, reduction or state)
      for (std::size_t i : by_unit_[u]) {
        ps.push_back(&params_[i]);
        if (!params_[i].tensor.requires_grad()) frozen.push_back(&params_[i]);
      }
      group_.add_unit(std::span<param* const>(ps), unit_names_[u], std::span<param* const>(frozen));
    }
    if (o.initial_state.empty())
      group_.finalize(init::broadcast_from{0});
    else
      group_.finalize(from_state(std::move(o.initial_state)));
    // Rule 3: every trainable parameter's accumulator, kept alive, with our post-hook on it.
    for (std::size_t u = 0; u < by_unit_.size(); ++u)
      for (std::size_t i : by_unit_[u]) {
        if (!params_[i].tensor.requires_grad()) continue;
        auto acc = torch::autograd::impl::grad_accumulator(params_[i].tensor);
        const std::uintptr_t key = acc->add_post_hook(std::make_unique<accumulated>([this, u] { on_accumulated(static_cast<int>(u)); }));
        accumulators_.push_back({std::move(acc), key});
        ++trainable_[u];
      }
    pending_.assign(by_unit_.size(), -1);
  }
  sharded_module(const sharded_module&) = delete;
  sharded_module& operator=(const sharded_module&) = delete;
  //! Takes its hooks off the accumulators (which the parameters keep). It must outlive the
  //! graphs of its forward passes; afterwards the module's parameters hold no memory (call
  //! gather_into_module() first to keep the values in the module, or take full_state_dict()).
  ~sharded_module() {
    for (auto& [node, key] : accumulators_) node->del_post_hook(key);
  }

  Group& group() noexcept { return group_; }
  int num_units() const noexcept { return static_cast<int>(by_unit_.size()); }

  //! Runs f(), unit u's forward, with u's parameters gathered, and arms u's backward hooks on
  //! what it returns (a tensor, or a std::vector or std::tuple of tensors) unless grad mode is off.
  //! A module of another unit run inside f() finds its parameters empty: an fsdp::error
  //! (errc::invalid_argument) naming the units, instead of LibTorch's "setStorage ... size 0".
  template <class F>
  auto forward(int u, F&& f) {
    if (handed_back_)
      throw error(errc::order, "libtorch: forward(" + std::to_string(u) +
                                   ") after gather_into_module(): the module's parameters are its own again; build a new "
                                   "sharded_module to train it sharded");
    group_.pre_forward(u);
    auto out = [&] {
      try {
        return f();
      } catch (const c10::Error& e) {
        const std::string why = e.what_without_backtrace();
        if (why.find("storage of size 0") == std::string::npos) throw;
        std::string units;
        for (std::size_t v = 0; v < unit_names_.size(); ++v) units += (v ? ", " : "") + std::to_string(v) + " " + unit_names_[v];
        throw error(errc::invalid_argument, "libtorch: forward(" + std::to_string(u) + ", f) used a parameter fsdp has not gathered (" +
                                                why.substr(0, why.find('\n')) + "): run each module inside forward(v, f) of the unit v "
                                                "holding its parameters (units: " + units + ")");
      }
    }();
    group_.post_forward(u);
    if (torch::GradMode::is_enabled()) arm(u, out);
    return out;
  }

  //! After a forward-only pass: frees what is still gathered (shard_group::reshard_all).
  void reshard() { group_.reshard_all(); }

  //! Collective over the shard group, after training: every parameter of the module gets its
  //! full values in memory of its own again (its dtype; .grad undefined), and fsdp lets go of
  //! it. The module is then plain LibTorch (read or save its parameters, hand
  //! module->parameters() to a torch::optim optimizer); forward() throws errc::order.
  void gather_into_module() {
    if (handed_back_) return;
    auto full = full_state_dict();
    for (auto& [node, key] : accumulators_) node->del_post_hook(key);
    accumulators_.clear();
    for (param& p : params_) {
      const torch::Tensor v = full.at(p.name).to(p.tensor.scalar_type());
      p.alive.reset();
      // Rule 1 still: the parameter keeps its storage object, which takes over v's memory.
      c10::StorageImpl* s = p.tensor.storage().unsafeGetStorageImpl();
      s->set_data_ptr_noswap(v.storage().unsafeGetStorageImpl()->set_data_ptr(c10::DataPtr(nullptr, v.device())));
      s->set_nbytes(v.nbytes());
      p.tensor.mutable_grad() = torch::Tensor();  // it pointed into fsdp's gradient storage
    }
    handed_back_ = true;
  }

  //! Collective over the shard group: every parameter's full values (master dtype, float), by
  //! name, on every rank.
  std::map<std::string, torch::Tensor> full_state_dict() {
    std::map<std::string, torch::Tensor> out;
    for (std::size_t b = 0; b < group_.num_buckets(); ++b) {
      auto full = group_.full_bucket(b);
      const auto& layout = group_.layout(b);
      const auto infos = group_.parameters(b);
      for (std::size_t i = 0; i < layout.size(); ++i) {
        std::vector<std::int64_t> shape(infos[i].shape.begin(), infos[i].shape.end());
        out[infos[i].name] =
            torch::from_blob(full.data() + layout[i].offset, shape, torch::TensorOptions().dtype(torch::kFloat)).clone();
      }
    }
    return out;
  }

 private:
  //! A post-hook on a gradient accumulator node (rule 3).
  struct accumulated : torch::autograd::FunctionPostHook {
    explicit accumulated(std::function<void()> f) : fn(std::move(f)) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list&) override {
      fn();
      return outputs;
    }
    std::function<void()> fn;
  };

  std::vector<param> collect(const std::vector<unit>& units) {
    std::vector<param> out;
    std::unordered_map<const void*, std::size_t> seen;  // TensorImpl -> index: tied weights once
    by_unit_.resize(units.size());
    trainable_.assign(units.size(), 0);
    for (std::size_t u = 0; u < units.size(); ++u) {
      const auto& mod = units[u].module;
      if (!mod) throw error(errc::invalid_argument, "libtorch: unit " + std::to_string(u) + " is a null module");
      unit_names_.push_back(mod->name() + "#" + std::to_string(u));
      for (const auto& item : mod->named_parameters(true)) {
        const torch::Tensor& t = item.value();
        if (seen.count(t.unsafeGetTensorImpl())) continue;
        const std::string name = "unit" + std::to_string(u) + "." + item.key();
        if (!t.is_contiguous() || t.storage_offset() != 0 ||
            t.storage().nbytes() != static_cast<std::size_t>(t.numel()) * t.element_size())
          throw error(errc::invalid_argument, "libtorch: parameter " + name +
                                                  " is not the whole of its own contiguous storage; fsdp moves its storage");
        seen[t.unsafeGetTensorImpl()] = out.size();
        by_unit_[u].push_back(out.size());
        out.push_back({t, name, t.detach().clone().contiguous(), nullptr, std::make_shared<char>(0)});
      }
    }
    return out;
  }

  // A per_shard fill from a state dict, checked first (every name present, every size right):
  // a fill that threw on one rank inside finalize would leave the others waiting.
  auto from_state(std::map<std::string, torch::Tensor> state) const {
    for (const param& p : params_) {
      const auto it = state.find(p.name);
      if (it == state.end())
        throw error(errc::invalid_argument, "libtorch: initial_state has no entry " + p.name + " (names as full_state_dict() gives them)");
      if (it->second.numel() != p.tensor.numel())
        throw error(errc::invalid_argument, "libtorch: initial_state's " + p.name + " has " + std::to_string(it->second.numel()) +
                                                " elements, the parameter " + std::to_string(p.tensor.numel()));
      it->second = it->second.detach().to(torch::kFloat).contiguous().view({-1});
    }
    return init::per_shard([state = std::move(state)](const param_slice& s, std::span<float> out) {
      const float* v = state.at(std::string(s.name)).template data_ptr<float>() + s.offset;
      std::copy(v, v + out.size(), out.begin());
    });
  }

  // LibTorch's intra-op pool is per process: at most cores / (ranks on this host) threads.
  static void cap_threads(comm_type& comm) {
    static std::once_flag once;
    const topology t = topology_of(comm);
    const int mine = t.host_of[static_cast<std::size_t>(comm.rank())];
    const auto here = std::count(t.host_of.begin(), t.host_of.end(), mine);
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    std::call_once(once, [&] { torch::set_num_threads(std::max(1, cores / static_cast<int>(here))); });
  }

  // The hooks of unit u's backward on each output that will receive a gradient.
  template <class T>
  void arm(int u, const T& out) {
    if constexpr (std::is_same_v<T, torch::Tensor>) {
      if (out.requires_grad()) out.register_hook([this, u](const torch::Tensor&) { on_output_grad(u); });
    } else if constexpr (std::is_same_v<T, std::vector<torch::Tensor>>) {
      for (const auto& t : out) arm(u, t);
    } else {
      std::apply([&](const auto&... t) { (arm(u, t), ...); }, out);
    }
  }

  void on_output_grad(int u) {
    if (torch::GradMode::is_enabled())
      throw error(errc::invalid_argument, "libtorch: backward with create_graph=true reached unit " + std::to_string(u) +
                                              ": fsdp reduces first-order gradients only (autograd would replace each .grad "
                                              "instead of adding into fsdp's storage)");
    if (!finish_queued_) {  // once per backward pass: finish_backward when the engine is done
      finish_queued_ = true;
      torch::autograd::Engine::get_default_engine().queue_callback([this] { on_backward_end(); });
    }
    auto& left = pending_[static_cast<std::size_t>(u)];
    if (left >= 0) return;  // another output of u got its gradient first
    left = trainable_[static_cast<std::size_t>(u)];
    group_.pre_backward(u);
    if (left == 0) end_unit(u);  // nothing of u to wait for
  }

  void on_accumulated(int u) {
    auto& left = pending_[static_cast<std::size_t>(u)];
    if (left <= 0) return;  // a parameter used outside its unit's forward: no pre_backward came
    if (--left == 0) end_unit(u);
  }

  void end_unit(int u) {
    pending_[static_cast<std::size_t>(u)] = 0;
    group_.post_backward(u);
  }

  void on_backward_end() {
    finish_queued_ = false;
    // A unit some of whose parameters got no gradient (unused in this pass) ends here.
    for (std::size_t u = 0; u < pending_.size(); ++u)
      if (pending_[u] > 0) end_unit(static_cast<int>(u));
    std::fill(pending_.begin(), pending_.end(), -1);
    group_.finish_backward();  // waits for every reduction
  }

  // Declared before group_: the group's destructor unbinds these handles.
  std::vector<std::vector<std::size_t>> by_unit_;  // parameter indices of each unit
  std::vector<std::string> unit_names_;
  std::vector<int> trainable_;                     // parameters with gradients, per unit
  std::vector<param> params_;
  Group group_;
  // The accumulator node and our hook's key. LibTorch 1.13 hands nodes out as std::shared_ptr,
  // 2.x as c10::intrusive_ptr: whatever grad_accumulator() returns, kept.
  using node_ptr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const torch::Tensor&>()));
  std::vector<std::pair<node_ptr, std::uintptr_t>> accumulators_;
  std::vector<int> pending_;  // per unit in this backward: -1 not started, else accumulations left
  bool finish_queued_ = false;
  bool handed_back_ = false;  // gather_into_module() ran
};

}  // namespace fsdp::libtorch
