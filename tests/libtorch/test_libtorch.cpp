// The LibTorch adapter (fsdp/adapters/libtorch.hpp) against plain single-process LibTorch: the
// same module, the same data, the whole batch in one process (the reference) or split over
// thread ranks and sharded (fsdp). Every strategy, prefetch, SGD and AdamW, tied weights, a
// unit with two outputs, evaluation, no_sync; and each rule of the adapter as a test.
#include <fsdp/adapters/libtorch.hpp>
#include <fsdp/fsdp.hpp>
// LibTorch brings glog's CHECK macros; doctest's are the ones meant here.
#undef CHECK
#undef CHECK_EQ
#undef CHECK_NE
#undef CHECK_LT
#undef CHECK_LE
#undef CHECK_GT
#undef CHECK_GE
#include <doctest/doctest.h>

#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <variant>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int batch = 8, in = 8, width = 16;

// l0 (8 -> 16), l1, l2 (16 -> 16) and a head tied to l0's weight (16 -> 8). Units: l0 (with the
// head, so its forward brackets the others), l1, l2.
struct net : torch::nn::Module {
  net() {
    torch::manual_seed(7);
    l0 = register_module("l0", torch::nn::Linear(in, width));
    l1 = register_module("l1", torch::nn::Linear(width, width));
    l2 = register_module("l2", torch::nn::Linear(width, width));
  }
  torch::nn::Linear l0{nullptr}, l1{nullptr}, l2{nullptr};
};

// The forward, with a hook to run each unit through (the identity for the reference). Unit 1
// returns two tensors (its output split in halves), to show a unit of several outputs.
template <class Unit>
torch::Tensor forward(net& m, const torch::Tensor& x, Unit&& unit) {
  return unit(0, [&] {
    auto h = torch::tanh(m.l0->forward(x));
    auto halves = unit(1, [&] {
      auto y = torch::tanh(m.l1->forward(h));
      return std::make_tuple(y.narrow(1, 0, width / 2), y.narrow(1, width / 2, width / 2));
    });
    h = torch::cat({std::get<0>(halves), std::get<1>(halves) * 2}, 1);
    h = unit(2, [&] { return torch::tanh(m.l2->forward(h)); });
    return torch::matmul(h, m.l0->weight);  // the head, tied to l0
  });
}

// Inputs (salt 1) and targets (salt 2) of micro-batch `step`. Seeds LibTorch's global
// generator: call it before the rank threads start (they would race on it).
torch::Tensor data(int step, int rows, int cols, int salt) {
  torch::manual_seed(1000 * step + salt);
  return torch::randn({rows, cols});
}

struct run_result {
  std::vector<double> losses;                     // the global batch's loss per step
  std::map<std::string, torch::Tensor> params;    // after the last step, by "unit<u>.<name>"
};

// The reference: the whole batch in one process, torch's own optimizer. With `freeze`, l1's
// weight has requires_grad=false (torch's optimizers skip it: it has no .grad).
run_result reference(int steps, bool adamw, int micro = 1, bool freeze = false) {
  net m;
  if (freeze) m.l1->weight.requires_grad_(false);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (adamw)
    opt = std::make_unique<torch::optim::AdamW>(m.parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(1e-2));
  else
    opt = std::make_unique<torch::optim::SGD>(m.parameters(), torch::optim::SGDOptions(0.1));
  run_result r;
  for (int s = 0; s < steps; ++s) {
    opt->zero_grad();
    double loss = 0;
    for (int k = 0; k < micro; ++k) {
      const auto x = data(s * micro + k, batch, in, 1), t = data(s * micro + k, batch, in, 2);
      auto l = torch::mse_loss(forward(m, x, [](int, auto&& f) { return f(); }), t) / micro;
      l.backward();
      loss += l.item<double>();
    }
    opt->step();
    r.losses.push_back(loss);
  }
  r.params = {{"unit0.weight", m.l0->weight.detach().clone()}, {"unit0.bias", m.l0->bias.detach().clone()},
              {"unit1.weight", m.l1->weight.detach().clone()}, {"unit1.bias", m.l1->bias.detach().clone()},
              {"unit2.weight", m.l2->weight.detach().clone()}, {"unit2.bias", m.l2->bias.detach().clone()}};
  return r;
}

using group_t = fsdp::shard_group<fsdp::libtorch::param>;
using sharded_t = fsdp::libtorch::sharded_module<group_t>;

// fsdp: the batch split over `ranks` thread ranks; micro-batches beyond the first accumulate
// under no_sync. Rank 0's view of the global loss and the gathered parameters.
run_result sharded(int ranks, fsdp::sharding s, int prefetch, bool adamw, int steps, int micro = 1, bool freeze = false) {
  run_result out;
  std::mutex m_out;
  // Built here, on one thread: the modules' initialisation and the data use the global generator.
  std::vector<std::shared_ptr<net>> nets;
  for (int r = 0; r < ranks; ++r) nets.push_back(std::make_shared<net>());
  if (freeze)
    for (auto& n : nets) n->l1->weight.requires_grad_(false);
  std::vector<torch::Tensor> xs, ts;
  for (int k = 0; k < steps * micro; ++k) xs.push_back(data(k, batch, in, 1)), ts.push_back(data(k, batch, in, 2));
  fsdp::threads::world{ranks}.run([&](fsdp::threads::communicator& comm) {
    auto m = nets[static_cast<std::size_t>(comm.rank())];
    sharded_t model{comm, {m->l0, m->l1, m->l2}, {.group = {.sharding = s, .prefetch = {.forward = prefetch, .backward = prefetch}}}};
    std::variant<fsdp::sgd<group_t>, fsdp::adamw<group_t>> opt =
        adamw ? decltype(opt){std::in_place_index<1>, model.group(), fsdp::adamw_options{.lr = 1e-2f, .weight_decay = 1e-2f}}
              : decltype(opt){std::in_place_index<0>, model.group(), fsdp::sgd_options{.lr = 0.1f}};
    const int local = batch / ranks, r = comm.rank();
    std::vector<double> losses;
    for (int step = 0; step < steps; ++step) {
      double loss = 0;
      for (int k = 0; k < micro; ++k) {
        const auto x = xs[static_cast<std::size_t>(step * micro + k)].narrow(0, r * local, local);
        const auto t = ts[static_cast<std::size_t>(step * micro + k)].narrow(0, r * local, local);
        model.group().set_requires_gradient_sync(k + 1 == micro);  // accumulate, reduce at the last
        auto l = torch::mse_loss(forward(*m, x, [&](int u, auto&& f) { return model.forward(u, f); }), t) / micro;
        l.backward();
        loss += l.item<double>();  // this rank's part
      }
      std::visit([](auto& o) { o.step(); o.zero_grad(); }, opt);
      losses.push_back(loss);
    }
    auto params = model.full_state_dict();
    // The global loss: the mean of the ranks' (equal-sized) local means.
    std::vector<double> global(losses.size());
    for (std::size_t i = 0; i < losses.size(); ++i) {
      double v = losses[i];
      fsdp::host_queue q;
      comm.all_reduce(&v, &v, 1, fsdp::dtype::f64, fsdp::reduce_op::avg, q).wait(comm.timeout(), "loss");
      global[i] = v;
    }
    if (r == 0) {
      std::lock_guard lock(m_out);
      out.losses = global;
      out.params = params;
    }
  });
  return out;
}

void check_same(const run_result& a, const run_result& b) {
  REQUIRE(a.losses.size() == b.losses.size());
  for (std::size_t i = 0; i < a.losses.size(); ++i) CHECK(a.losses[i] == doctest::Approx(b.losses[i]).epsilon(1e-6));
  REQUIRE(a.params.size() == b.params.size());
  for (const auto& [name, ref] : b.params) {
    CAPTURE(name);
    REQUIRE(a.params.count(name) == 1);
    const double diff = (a.params.at(name) - ref).abs().max().item<double>();
    const double scale = std::max(1.0, ref.abs().max().item<double>());
    CHECK(diff <= 1e-6 * scale);
  }
}

}  // namespace

TEST_CASE("libtorch: LibTorch's intra-op threads are capped at the cores per rank on this host (first group of the process)") {
  // The first sharded_module of this process sets it, once: 4 thread ranks on one host.
  fsdp::threads::world{4}.run([&](fsdp::threads::communicator& comm) {
    auto m = std::make_shared<net>();
    sharded_t model{comm, {m->l0, m->l1, m->l2}};
  });
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  CHECK(torch::get_num_threads() == std::max(1, cores / 4));
}

TEST_CASE("libtorch: training through the adapter equals single-process LibTorch (every strategy, prefetch, SGD)") {
  const run_result ref = reference(6, false);
  for (int ranks : {2, 4}) {
    for (auto s : {fsdp::full_shard(), fsdp::shard_grad_op(), fsdp::no_shard()}) {
      for (int prefetch : {0, 1}) {
        CAPTURE(ranks);
        CAPTURE(fsdp::to_string(s));
        CAPTURE(prefetch);
        check_same(sharded(ranks, s, prefetch, false, 6), ref);
      }
    }
  }
  check_same(sharded(4, fsdp::hybrid_shard(2), 1, false, 6), ref);
}

TEST_CASE("libtorch: AdamW, and no_sync micro-batches, equal LibTorch's") {
  check_same(sharded(2, fsdp::full_shard(), 1, true, 6), reference(6, true));
  check_same(sharded(2, fsdp::full_shard(), 1, false, 4, 2), reference(4, false, 2));
}

TEST_CASE("libtorch: a requires_grad=false parameter is frozen: it matches LibTorch's, keeps its values, and is not reduced") {
  const run_result ref = reference(6, true, 1, true);
  const torch::Tensor initial = net{}.l1->weight.detach().clone();
  CHECK(torch::equal(ref.params.at("unit1.weight"), initial));  // torch leaves it too
  for (auto s : {fsdp::full_shard(), fsdp::hybrid_shard(2)}) {
    CAPTURE(fsdp::to_string(s));
    const run_result got = sharded(4, s, 1, true, 6, 1, true);
    check_same(got, ref);
    CHECK(torch::equal(got.params.at("unit1.weight"), initial));  // bit for bit
  }
  // Unit 1's reduce-scatter carries its bias only: 16 of its 272 elements (padded to 128).
  fsdp::threads::world{2}.run([&](fsdp::threads::communicator& comm) {
    auto m = std::make_shared<net>();
    m->l1->weight.requires_grad_(false);
    sharded_t model{comm, {m->l0, m->l1, m->l2}};
    CHECK(model.group().layout(1).trainable_numel() == 128);
    CHECK(model.group().layout(1).padded_numel() == 128 + 256);
  });
}

TEST_CASE("libtorch: rule 1, the parameter keeps its storage object, which holds no memory between passes") {
  fsdp::threads::world{2}.run([&](fsdp::threads::communicator& comm) {
    auto m = std::make_shared<net>();
    const c10::StorageImpl* before = m->l1->weight.storage().unsafeGetStorageImpl();
    sharded_t model{comm, {m->l0, m->l1, m->l2}};
    const auto x = torch::ones({2, in});
    auto loss = forward(*m, x, [&](int u, auto&& f) { return model.forward(u, f); }).sum();
    CHECK(m->l1->weight.storage().unsafeGetStorageImpl() == before);
    CHECK(m->l1->weight.storage().nbytes() == 0);  // resharded after its forward
    loss.backward();  // the backward reads the weight autograd saved: gathered again, same storage
    CHECK(std::isfinite(loss.item<double>()));
    CHECK(m->l1->weight.storage().nbytes() == 0);
    CHECK(model.group().memory().transient_live == 0);
  });
}

TEST_CASE("libtorch: rule 2, a .grad replaced by hand or by create_graph is an fsdp::error naming it") {
  fsdp::threads::world{2}.run([&](fsdp::threads::communicator& comm) {
    auto m = std::make_shared<net>();
    sharded_t model{comm, {m->l0, m->l1, m->l2}};
    fsdp::sgd<group_t> opt{model.group(), {.lr = 0.1f}};
    const auto x = torch::ones({2, in});
    auto run = [&](bool create_graph) {
      auto loss = forward(*m, x, [&](int u, auto&& f) { return model.forward(u, f); }).sum();
      loss.backward({}, c10::nullopt, create_graph);  // c10::optional: LibTorch 1.13
    };
    run(false);
    opt.step();
    opt.zero_grad();
    std::string what;
    try {
      run(true);
    } catch (const std::exception& e) {
      what = e.what();
    }
    CHECK(what.find("create_graph") != std::string::npos);
    comm.abort("rule 2 test: this world is done");  // the failed backward left collectives unmatched
  });
}

TEST_CASE("libtorch: rule 2, a .grad set by hand between steps is refused at the next backward, by name") {
  std::string what;
  try {
    fsdp::threads::world{1}.run([&](fsdp::threads::communicator& comm) {
      auto m = std::make_shared<net>();
      sharded_t model{comm, {m->l0, m->l1, m->l2}};
      const auto x = torch::ones({2, in});
      auto step = [&] { forward(*m, x, [&](int u, auto&& f) { return model.forward(u, f); }).sum().backward(); };
      step();
      m->l1->weight.mutable_grad() = torch::zeros({width, width});
      step();
    });
  } catch (const std::exception& e) {
    what = e.what();
  }
  CHECK(what.find("the .grad of unit1.weight was replaced") != std::string::npos);
}

TEST_CASE("libtorch: rule 3, reductions are issued during the backward pass, not all at its end") {
  fsdp::threads::world{2}.run([&](fsdp::threads::communicator& comm) {
    auto m = std::make_shared<net>();
    sharded_t model{comm, {m->l0, m->l1, m->l2}};
    for (int step = 0; step < 3; ++step) {  // the hooks must outlive step 0's graph
      const auto x = torch::ones({2, in}).requires_grad_();
      // When the gradient reaches the input, units 2 and 1 have finished their backward.
      std::uint64_t reduced_before_end = 0;
      const auto start = model.group().traffic().reduce_scatter;
      x.register_hook([&](const torch::Tensor&) { reduced_before_end = model.group().traffic().reduce_scatter - start; });
      forward(*m, x, [&](int u, auto&& f) { return model.forward(u, f); }).sum().backward();
      CAPTURE(step);
      CHECK(reduced_before_end > 0);
      CHECK(model.group().traffic().reduce_scatter - start > reduced_before_end);  // unit 0's, at the end
    }
  });
}

TEST_CASE("libtorch: evaluation under NoGradGuard equals the reference and leaves nothing gathered") {
  net ref;
  const auto x = torch::ones({3, in});
  const auto want = forward(ref, x, [](int, auto&& f) { return f(); }).detach();
  std::vector<std::shared_ptr<net>> nets{std::make_shared<net>(), std::make_shared<net>()};  // one thread: the seed
  fsdp::threads::world{2}.run([&](fsdp::threads::communicator& comm) {
    auto m = nets[static_cast<std::size_t>(comm.rank())];
    sharded_t model{comm, {m->l0, m->l1, m->l2}, {.group = {.sharding = fsdp::shard_grad_op()}}};
    torch::NoGradGuard no_grad;
    const auto got = forward(*m, x, [&](int u, auto&& f) { return model.forward(u, f); });
    CHECK((got - want).abs().max().item<double>() == 0.0);
    model.reshard();
    CHECK(model.group().memory().transient_live == 0);
  });
}

TEST_CASE("libtorch: a unit whose parameter gets no gradient in a pass still ends its backward (its reduction at the end)") {
  fsdp::threads::world{2}.run([&](fsdp::threads::communicator& comm) {
    auto m = std::make_shared<net>();
    sharded_t model{comm, {m->l0, m->l1, m->l2}};
    const auto x = torch::ones({2, in});
    // Unit 2's bias unused: its weight accumulates, its bias never does.
    auto y = model.forward(0, [&] {
      auto h = torch::tanh(m->l0->forward(x));
      h = model.forward(1, [&] { return torch::tanh(m->l1->forward(h)); });
      h = model.forward(2, [&] { return torch::matmul(h, m->l2->weight.t()); });
      return torch::matmul(h, m->l0->weight);
    });
    y.sum().backward();
    CHECK(model.group().memory().transient_live == 0);
    CHECK(model.group().traffic().reduce_scatter > 0);
  });
}

TEST_CASE("libtorch: sharded state per rank is the padded model over the ranks (master and gradient shards, f32)") {
  // Padded by hand (docs/design.md): each parameter starts on a multiple of 64 elements, a unit
  // is padded to a multiple of lcm(world, 128). l0: 128 + 16 -> 256; l1, l2: 256 + 16 -> 384.
  const std::size_t padded = 256 + 384 + 384;
  for (int ranks : {1, 2, 4}) {
    std::vector<std::size_t> persistent(static_cast<std::size_t>(ranks));
    fsdp::threads::world{ranks}.run([&](fsdp::threads::communicator& comm) {
      auto m = std::make_shared<net>();
      sharded_t model{comm, {m->l0, m->l1, m->l2}};
      persistent[static_cast<std::size_t>(comm.rank())] = model.group().memory().persistent_live;
    });
    for (std::size_t p : persistent) CHECK(p == padded / static_cast<std::size_t>(ranks) * 4 * 2);
  }
}

TEST_CASE("libtorch: full_state_dict round-trips through initial_state, whatever the new modules hold") {
  std::map<std::string, torch::Tensor> trained, restored;
  std::vector<std::shared_ptr<net>> nets{std::make_shared<net>(), std::make_shared<net>()};
  fsdp::threads::world{2}.run([&](fsdp::threads::communicator& comm) {
    auto m = nets[static_cast<std::size_t>(comm.rank())];
    sharded_t model{comm, {m->l0, m->l1, m->l2}};
    fsdp::sgd<group_t> opt{model.group(), {.lr = 0.1f}};
    forward(*m, torch::ones({2, in}), [&](int u, auto&& f) { return model.forward(u, f); }).sum().backward();
    opt.step();
    auto dict = model.full_state_dict();
    if (comm.rank() == 0) trained = dict;
  });
  std::vector<std::shared_ptr<net>> fresh;  // untrained: initial_state's values must win
  for (int r = 0; r < 5; ++r) fresh.push_back(std::make_shared<net>());
  fsdp::threads::world{4}.run([&](fsdp::threads::communicator& comm) {
    auto m = fresh[static_cast<std::size_t>(comm.rank())];
    sharded_t model{comm, {m->l0, m->l1, m->l2}, {.initial_state = trained}};
    auto dict = model.full_state_dict();
    if (comm.rank() == 0) restored = dict;
  });
  REQUIRE(restored.size() == trained.size());
  for (const auto& [name, t] : trained) CHECK(torch::equal(restored.at(name), t));
  // A missing entry is named before any collective.
  std::string what;
  try {
    fsdp::threads::world{1}.run([&](fsdp::threads::communicator& comm) {
      auto partial = trained;
      partial.erase("unit1.bias");
      sharded_t model{comm, {fresh[4]->l0, fresh[4]->l1, fresh[4]->l2}, {.initial_state = partial}};
    });
  } catch (const fsdp::error& e) {
    what = e.what();
  }
  CHECK(what.find("initial_state has no entry unit1.bias") != std::string::npos);
}

TEST_CASE("libtorch: the user's module may go before the sharded_module (the handles keep the tensors)") {
  fsdp::threads::world{2}.run([&](fsdp::threads::communicator& comm) {
    auto m = std::make_shared<net>();
    auto model = std::make_unique<sharded_t>(comm, std::vector<fsdp::libtorch::unit>{m->l0, m->l1, m->l2});
    forward(*m, torch::ones({2, in}), [&](int u, auto&& f) { return model->forward(u, f); }).sum().backward();
    const std::weak_ptr<net> gone = m;
    m.reset();  // the module first (an engine that owns it elsewhere), then the group
    CHECK(gone.expired());
    model.reset();  // unbinds the parameters through the tensors the handles still hold
  });
}

TEST_CASE("libtorch: a module run inside another unit's forward is an fsdp::error naming the units, not LibTorch's setStorage") {
  // l2's parameters belong to unit 2, which is not gathered inside forward(1, ...): LibTorch
  // said only "setStorage: ... out of bounds for storage of size 0".
  std::string what;
  fsdp::errc code = fsdp::errc::internal;
  try {
    fsdp::threads::world{2}.run([&](fsdp::threads::communicator& comm) {
      auto m = std::make_shared<net>();
      sharded_t model{comm, {m->l0, m->l1, m->l2}};
      model.forward(1, [&] { return m->l2->forward(torch::ones({2, width})); });
    });
  } catch (const fsdp::error& e) {
    what = e.what();
    code = e.code();
  }
  CHECK(code == fsdp::errc::invalid_argument);
  CHECK_MESSAGE(what.find("forward(1, f) used a parameter fsdp has not gathered") != std::string::npos, what);
  CHECK_MESSAGE(what.find("storage of size 0") != std::string::npos, what);
  CHECK_MESSAGE(what.find("units: 0 ") != std::string::npos, what);
}

TEST_CASE("libtorch: gather_into_module gives the module its trained parameters (readable, torch::optim), forward then refused") {
  // Before it, a parameter read after training (or a torch::optim step on module->parameters())
  // crashed: between passes the parameters hold no memory, and LibTorch does not check.
  std::vector<std::shared_ptr<net>> nets{std::make_shared<net>(), std::make_shared<net>()};
  std::vector<std::map<std::string, torch::Tensor>> dicts(2);
  std::vector<std::string> refused(2);
  fsdp::threads::world{2}.run([&](fsdp::threads::communicator& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    auto& m = *nets[r];
    sharded_t model{comm, {m.l0, m.l1, m.l2}};
    fsdp::sgd<group_t> opt{model.group(), {.lr = 0.1f}};
    forward(m, torch::ones({2, in}), [&](int u, auto&& f) { return model.forward(u, f); }).sum().backward();
    opt.step();
    dicts[r] = model.full_state_dict();
    model.gather_into_module();
    try {
      model.forward(0, [&] { return m.l0->forward(torch::ones({2, in})); });
    } catch (const fsdp::error& e) {
      if (e.code() == fsdp::errc::order) refused[r] = e.what();
    }
  });  // the sharded_modules are gone; the modules keep their values
  for (std::size_t r = 0; r < 2; ++r) {
    CAPTURE(r);
    const net& m = *nets[r];
    const std::map<std::string, torch::Tensor> mine{{"unit0.weight", m.l0->weight}, {"unit0.bias", m.l0->bias},
                                                    {"unit1.weight", m.l1->weight}, {"unit1.bias", m.l1->bias},
                                                    {"unit2.weight", m.l2->weight}, {"unit2.bias", m.l2->bias}};
    for (const auto& [name, t] : mine) {
      CAPTURE(name);
      CHECK(t.storage().nbytes() == static_cast<std::size_t>(t.numel()) * sizeof(float));
      CHECK(torch::equal(t, dicts[r].at(name)));
      CHECK_FALSE(t.grad().defined());
    }
    CHECK_MESSAGE(refused[r].find("after gather_into_module()") != std::string::npos, refused[r]);
  }
  // torch's own optimizer on module->parameters(): a plain LibTorch step.
  net& m = *nets[0];
  torch::optim::SGD sgd(m.parameters(), torch::optim::SGDOptions(0.1));
  forward(m, torch::ones({2, in}), [](int, auto&& f) { return f(); }).sum().backward();
  const torch::Tensor expected = (m.l1->weight - 0.1 * m.l1->weight.grad()).detach();
  sgd.step();
  CHECK(torch::allclose(m.l1->weight, expected));
}
