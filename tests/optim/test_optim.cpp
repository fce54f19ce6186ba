// Optimizers on a shard_group: each update equals the plain formula applied to the full
// parameter, whatever the sharding; clip_grad_norm sees the norm of the whole gradient.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <string>

#include "common/catch_error.hpp"
#include "common/fake_communicator.hpp"
#include "fsdp/fsdp.hpp"

namespace {

constexpr std::size_t kNumel = 301;  // prime: shards split it unevenly

float w0(std::size_t i) { return 0.01f * static_cast<float>(i % 17) - 0.05f; }
// The gradient rank r writes for element i; the mean over n ranks is what the optimizer sees.
float grad_of(int r, std::size_t i, int step) { return 0.001f * static_cast<float>((i * 7 + static_cast<std::size_t>(r) * 3 + static_cast<std::size_t>(step)) % 23) - 0.01f; }
float mean_grad(int n, std::size_t i, int step) {
  float acc = 0;
  for (int r = 0; r < n; ++r) acc += grad_of(r, i, step);
  return acc / static_cast<float>(n);
}

// Runs `steps` steps on n ranks with a shard_group of one unit (one parameter), calling
// opt_step(group) after each backward; returns the final full parameter from rank 0.
template <class Group, class Step>
std::vector<float> run(int n, int steps, Step opt_step, typename Group::options opts = {}) {
  std::vector<float> out;
  fsdp::threads::world{n}.run([&](fsdp::threads::communicator& comm) {
    fsdp::buffer<float> w(kNumel, "w");
    Group g{comm, {}, opts};
    g.add_unit({&w});
    g.finalize(fsdp::init::per_shard([](const fsdp::param_slice& s, std::span<float> v) {
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = w0(s.offset + i);
    }));
    auto step_fn = opt_step(g);
    for (int step = 0; step < steps; ++step) {
      { auto s = g.forward(0); }
      {
        auto s = g.backward(0);
        for (std::size_t i = 0; i < kNumel; ++i) w.grad()[i] += grad_of(comm.rank(), i, step);
      }
      step_fn();
    }
    auto full = g.full_parameter(0, 0);
    if (comm.rank() == 0) out.assign(full.begin(), full.end());
  });
  return out;
}

using full = fsdp::shard_group<fsdp::buffer<float>>;
using fake_full = fsdp::shard_group<fsdp::buffer<float>, fsdp_test::fake_communicator>;

}  // namespace

TEST_CASE("sgd: plain, momentum, nesterov and weight decay equal the formula") {
  for (fsdp::sgd_options o : {fsdp::sgd_options{.lr = 0.1f}, fsdp::sgd_options{.lr = 0.1f, .momentum = 0.9f},
                              fsdp::sgd_options{.lr = 0.05f, .momentum = 0.8f, .weight_decay = 0.1f, .nesterov = true}}) {
    for (int n : {1, 3, 4}) {
      CAPTURE(n);
      const int steps = 5;
      const auto got = run<full>(n, steps, [&](auto& g) {
        return [opt = std::make_shared<fsdp::sgd<full>>(g, o)] { opt->step(); opt->zero_grad(); };
      });
      for (std::size_t i = 0; i < kNumel; ++i) {
        float w = w0(i), buf = 0;
        for (int s = 0; s < steps; ++s) {
          float d = mean_grad(n, i, s) + o.weight_decay * w;
          if (o.momentum != 0) {
            buf = s == 0 ? d : o.momentum * buf + d;
            d = o.nesterov ? d + o.momentum * buf : buf;
          }
          w -= o.lr * d;
        }
        REQUIRE(got[i] == doctest::Approx(w).epsilon(1e-6));
      }
    }
  }
}

TEST_CASE("adamw equals the formula (bias correction, decoupled weight decay)") {
  const fsdp::adamw_options o{.lr = 0.01f, .beta1 = 0.8f, .beta2 = 0.95f, .eps = 1e-6f, .weight_decay = 0.2f};
  for (int n : {2, 4}) {
    const int steps = 6;
    const auto got = run<full>(n, steps, [&](auto& g) {
      return [opt = std::make_shared<fsdp::adamw<full>>(g, o)] { opt->step(); opt->zero_grad(); };
    }, {.sharding = fsdp::hybrid_shard(2)});
    for (std::size_t i = 0; i < kNumel; ++i) {
      double w = w0(i), m = 0, v = 0;
      for (int s = 1; s <= steps; ++s) {
        const double g = mean_grad(n, i, s - 1);
        w *= 1.0 - o.lr * o.weight_decay;
        m = o.beta1 * m + (1 - o.beta1) * g;
        v = o.beta2 * v + (1 - o.beta2) * g * g;
        const double mh = m / (1 - std::pow(double(o.beta1), s)), vh = v / (1 - std::pow(double(o.beta2), s));
        w -= o.lr * mh / (std::sqrt(vh) + o.eps);
      }
      REQUIRE(got[i] == doctest::Approx(w).epsilon(1e-5));
    }
  }
}

TEST_CASE("adamw capturable: the step count and bias corrections kept in the device's memory give the host's bits") {
  const fsdp::adamw_options o{.lr = 0.01f, .beta1 = 0.8f, .beta2 = 0.95f, .eps = 1e-6f, .weight_decay = 0.2f};
  fsdp::adamw_options c = o;
  c.capturable = true;
  long counted = 0;
  auto with = [&](fsdp::adamw_options opts) {
    return run<full>(3, 7, [&](auto& g) {
      auto opt = std::make_shared<fsdp::adamw<full>>(g, opts);
      return [opt, &counted, &g] {
        opt->step();
        opt->zero_grad();
        if (g.rank() == 0) counted = opt->steps();  // one rank writes it
      };
    });
  };
  const auto host = with(o);
  CHECK(counted == 7);
  const auto device = with(c);
  CHECK(counted == 7);  // read back from the device's memory
  REQUIRE(host.size() == device.size());
  CHECK(std::memcmp(host.data(), device.data(), host.size() * sizeof(float)) == 0);
  CHECK(host != run<full>(3, 6, [&](auto& g) {  // the count matters: one step fewer differs
    return [opt = std::make_shared<fsdp::adamw<full>>(g, c)] { opt->step(); opt->zero_grad(); };
  }));
}

TEST_CASE("adamw capturable: a learning-rate schedule through set_lr, or options().lr, gives the host's bits") {
  // A warm-up then a decay, with weight decay (which reads lr too): what train_gpt's loop sets.
  const auto schedule = [](int step) { return step < 3 ? 0.004f * static_cast<float>(step + 1) : 0.012f / static_cast<float>(step); };
  const fsdp::adamw_options o{.lr = 0.5f, .beta1 = 0.8f, .beta2 = 0.95f, .eps = 1e-6f, .weight_decay = 0.2f};
  fsdp::adamw_options c = o;
  c.capturable = true;
  auto with = [&](fsdp::adamw_options opts, bool through_set_lr, auto lr_of) {
    return run<full>(3, 7, [&, opts, through_set_lr, lr_of](auto& g) {
      return [opt = std::make_shared<fsdp::adamw<full>>(g, opts), through_set_lr, lr_of, step = 0]() mutable {
        if (through_set_lr) opt->set_lr(lr_of(step++));
        else opt->options().lr = lr_of(step++);
        opt->step();
        opt->zero_grad();
      };
    });
  };
  const auto host = with(o, false, schedule);
  const auto device = with(c, true, schedule);
  REQUIRE(host.size() == device.size());
  CHECK(std::memcmp(host.data(), device.data(), host.size() * sizeof(float)) == 0);
  const auto direct = with(c, false, schedule);  // options().lr changed directly: step() writes it
  CHECK(std::memcmp(host.data(), direct.data(), host.size() * sizeof(float)) == 0);
  // The schedule reaches the update: the constructor's lr (0.5) throughout differs.
  CHECK(host != with(c, false, [](int) { return 0.5f; }));
}

TEST_CASE("adamw capturable: set_steps restores the count the bias corrections read; offloaded state is refused") {
  fsdp::threads::world{1}.run([&](fsdp::threads::communicator& comm) {
    fsdp::buffer<float> w(kNumel, "w");
    full g{comm};
    g.add_unit({&w});
    g.finalize(fsdp::init::per_shard([](const fsdp::param_slice& s, std::span<float> v) {
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = w0(s.offset + i);
    }));
    fsdp::adamw<full> opt{g, {.lr = 0.01f, .capturable = true}};
    CHECK(opt.steps() == 0);
    for (float bad : {-1.0f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
      const fsdp::error e = fsdp_test::catch_error([&] { opt.set_lr(bad); });
      CHECK(e.code() == fsdp::errc::invalid_argument);
      CHECK(opt.options().lr == 0.01f);
      const fsdp::error built = fsdp_test::catch_error([&] { fsdp::adamw<full> other(g, {.lr = bad}); });
      CHECK(built.code() == fsdp::errc::invalid_argument);
    }
    opt.set_steps(41);
    CHECK(opt.steps() == 41);
    { auto s = g.forward(0); }
    {
      auto s = g.backward(0);
      for (std::size_t i = 0; i < kNumel; ++i) w.grad()[i] = grad_of(0, i, 0);
    }
    opt.step();
    CHECK(opt.steps() == 42);
    // Step 42's update: bias corrections of t = 42 (from zero moments, m / (1 - b1^t) = (1 - b1) g / (1 - b1^t)).
    const auto got = g.full_parameter(0, 0);
    const float lr = 0.01f, b1 = 0.9f, b2 = 0.999f, t = 42.0f;
    for (std::size_t i : {std::size_t{0}, std::size_t{5}, kNumel - 1}) {
      const float gi = grad_of(0, i, 0), m = (1 - b1) * gi, v = (1 - b2) * gi * gi;
      const float want = w0(i) * (1 - lr * 1e-2f) - lr / (1 - std::pow(b1, t)) * m / (std::sqrt(v) / std::sqrt(1 - std::pow(b2, t)) + 1e-8f);
      CHECK(got[i] == doctest::Approx(want).epsilon(1e-6));
    }
  });
  fsdp::threads::world{1}.run([&](fsdp::threads::communicator& comm) {
    fsdp::buffer<float> w(kNumel, "w");
    full g{comm, {}, {.offload = fsdp::offload_all()}};
    g.add_unit({&w});
    g.finalize(fsdp::init::per_shard([](const fsdp::param_slice&, std::span<float> v) { std::fill(v.begin(), v.end(), 1.0f); }));
    const fsdp::error e = fsdp_test::catch_error([&] { fsdp::adamw<full> opt(g, {.capturable = true}); });
    CHECK(e.code() == fsdp::errc::invalid_argument);
    CHECK(std::string(e.what()).find("capturable") != std::string::npos);
  });
}

TEST_CASE("clip_grad_norm: the norm of the whole averaged gradient, across shards and replicas") {
  for (auto [n, s] : {std::pair{1, 1}, std::pair{3, 3}, std::pair{4, 2}}) {
    CAPTURE(n);
    double expected_sq = 0;
    for (std::size_t i = 0; i < kNumel; ++i) expected_sq += double(mean_grad(n, i, 0)) * mean_grad(n, i, 0);
    const double expected = std::sqrt(expected_sq);
    std::vector<double> norms(static_cast<std::size_t>(n));
    std::vector<float> grad_after;
    fsdp::threads::world{n}.run([&](fsdp::threads::communicator& comm) {
      fsdp::buffer<float> w(kNumel, "w");
      full g{comm, {}, {.sharding = fsdp::hybrid_shard(s)}};
      g.add_unit({&w});
      g.finalize(fsdp::init::broadcast_from{0});
      { auto sc = g.forward(0); }
      {
        auto sc = g.backward(0);
        for (std::size_t i = 0; i < kNumel; ++i) w.grad()[i] += grad_of(comm.rank(), i, 0);
      }
      norms[static_cast<std::size_t>(comm.rank())] = fsdp::clip_grad_norm(g, expected / 4);
      auto gf = g.full_gradient(0, 0);
      if (comm.rank() == 0) grad_after.assign(gf.begin(), gf.end());
    });
    for (double v : norms) CHECK(v == doctest::Approx(expected).epsilon(1e-6));
    double after = 0;
    for (float x : grad_after) after += double(x) * x;
    CHECK(std::sqrt(after) == doctest::Approx(expected / 4).epsilon(1e-5));
  }
}

TEST_CASE("step(clip_coefficient(grad_norm)) clips in the optimizer's pass: bit for bit clip_grad_norm then step()") {
  // Both optimizers, 3 ranks, 4 steps of a gradient whose norm exceeds max_norm (so every step
  // clips): the same parameters as the separate scaling pass, to the bit (an f32 master: g * c
  // rounds once either way), with the gradients left unscaled.
  const double max_norm = 0.01;
  const int n = 3, steps = 4;
  auto clip_then_step = [&](auto make) {
    return run<full>(n, steps, [&](auto& g) {
      return [&g, opt = make(g), max_norm] { fsdp::clip_grad_norm(g, max_norm); opt->step(); opt->zero_grad(); };
    });
  };
  std::vector<float> grad_norms;  // rank 0's norm of its (unscaled) full gradient after each fused step
  auto fused = [&](auto make) {
    grad_norms.clear();
    return run<full>(n, steps, [&](auto& g) {
      return [&g, opt = make(g), max_norm, &grad_norms] {
        const double norm = fsdp::grad_norm(g);
        const float c = fsdp::clip_coefficient(norm, max_norm);
        REQUIRE(c < 1.0f);
        opt->step(c);
        auto gf = g.full_gradient(0, 0);
        double sq = 0;
        for (float x : gf) sq += double(x) * x;
        if (g.rank() == 0) grad_norms.push_back(static_cast<float>(std::sqrt(sq) / norm));
        opt->zero_grad();
      };
    });
  };
  auto make_adamw = [](full& g) { return std::make_shared<fsdp::adamw<full>>(g, fsdp::adamw_options{.lr = 0.01f}); };
  auto make_sgd = [](full& g) { return std::make_shared<fsdp::sgd<full>>(g, fsdp::sgd_options{.lr = 0.1f, .momentum = 0.9f}); };
  for (int which = 0; which < 2; ++which) {
    CAPTURE(which);
    const auto a = which == 0 ? clip_then_step(make_adamw) : clip_then_step(make_sgd);
    const auto b = which == 0 ? fused(make_adamw) : fused(make_sgd);
    REQUIRE(a.size() == kNumel);
    REQUIRE(b.size() == kNumel);
    CHECK(std::memcmp(a.data(), b.data(), kNumel * sizeof(float)) == 0);
    const auto plain = which == 0 ? run<full>(n, steps, [&](auto& g) { return [opt = make_adamw(g)] { opt->step(); opt->zero_grad(); }; })
                                  : run<full>(n, steps, [&](auto& g) { return [opt = make_sgd(g)] { opt->step(); opt->zero_grad(); }; });
    CHECK(std::memcmp(a.data(), plain.data(), kNumel * sizeof(float)) != 0);  // the clipping mattered
    REQUIRE(grad_norms.size() == static_cast<std::size_t>(steps));
    for (float r : grad_norms) CHECK(r == doctest::Approx(1.0).epsilon(1e-5));  // the gradient unscaled
  }
  CHECK(fsdp::clip_coefficient(0.5, 1.0) == 1.0f);
  CHECK(fsdp::clip_coefficient(std::nan(""), 1.0) == 1.0f);  // nothing scaled, as clip_grad_norm
  CHECK(fsdp::clip_coefficient(4.0, 1.0) == static_cast<float>(1.0 / (4.0 + 1e-6)));
}

TEST_CASE("step(clip_on_device) clips by the factor left where the gradients are: the bits of step(clip_coefficient(grad_norm))") {
  // Both optimizers, 3 ranks, 4 steps, max_norm below the norm (every step clips) and above it
  // (none does); the norm read back is grad_norm's.
  const int n = 3, steps = 4;
  auto make_adamw = [](full& g) { return std::make_shared<fsdp::adamw<full>>(g, fsdp::adamw_options{.lr = 0.01f}); };
  auto make_sgd = [](full& g) { return std::make_shared<fsdp::sgd<full>>(g, fsdp::sgd_options{.lr = 0.1f, .momentum = 0.9f}); };
  for (const double max_norm : {0.01, 100.0})
    for (int which = 0; which < 2; ++which) {
      CAPTURE(max_norm);
      CAPTURE(which);
      auto train = [&](bool on_device) {
        return run<full>(n, steps, [&](auto& g) {
          auto step = [&g, on_device, max_norm](auto& opt) {
            if (on_device) {
              const auto clip = fsdp::clip_on_device(g, max_norm);
              const double norm = clip.norm();
              CHECK(norm == fsdp::grad_norm(g));
              CHECK(clip.factor_on_host() == fsdp::clip_coefficient(norm, max_norm));
              opt.step(clip);
            } else {
              opt.step(fsdp::clip_coefficient(fsdp::grad_norm(g), max_norm));
            }
            opt.zero_grad();
          };
          if (which == 0) return std::function<void()>([step, opt = make_adamw(g)] { step(*opt); });
          return std::function<void()>([step, opt = make_sgd(g)] { step(*opt); });
        });
      };
      const auto host = train(false), device = train(true);
      REQUIRE(host.size() == kNumel);
      REQUIRE(device.size() == kNumel);
      CHECK(std::memcmp(host.data(), device.data(), kNumel * sizeof(float)) == 0);
    }
  const fsdp::error e = fsdp_test::catch_error([] {
    fsdp::threads::world{1}.run([](fsdp::threads::communicator& comm) {
      full g{comm};
      fsdp::buffer<float> w(4, "w");
      g.add_unit({&w});
      g.finalize(fsdp::init::per_shard([](const fsdp::param_slice&, std::span<float> v) { std::fill(v.begin(), v.end(), 1.0f); }));
      (void)fsdp::clip_on_device(g, 0.0);
    });
  });
  CHECK(e.code() == fsdp::errc::invalid_argument);
}

TEST_CASE("step's grad_scale must be finite and >= 0: refused before anything changes") {
  fsdp_test::fake_communicator comm{0, 1};
  fsdp::buffer<float> w(kNumel, "w");
  fake_full g{comm};
  g.add_unit({&w});
  g.finalize(fsdp::init::broadcast_from{0});
  fsdp::adamw<fake_full> adam(g, {});
  fsdp::sgd<fake_full> plain(g, {});
  for (float bad : {-1.0f, std::nanf(""), INFINITY}) {
    CAPTURE(bad);
    const fsdp::error a = fsdp_test::catch_error([&] { adam.step(bad); });
    CHECK(a.code() == fsdp::errc::invalid_argument);
    CHECK(std::string(a.what()).find("adamw: step's grad_scale must be finite and >= 0") != std::string::npos);
    const fsdp::error s = fsdp_test::catch_error([&] { plain.step(bad); });
    CHECK(s.code() == fsdp::errc::invalid_argument);
  }
  CHECK(adam.steps() == 0);
  CHECK(plain.steps() == 0);
  CHECK_THROWS_AS(fsdp::clip_coefficient(1.0, 0.0), fsdp::error);
}

TEST_CASE("clip_grad_norm: a nan gradient on one rank gives every rank a nan norm, scales nothing, or throws when asked") {
  for (bool error_if_nonfinite : {false, true}) {
    CAPTURE(error_if_nonfinite);
    std::vector<double> norms(2);
    std::vector<fsdp::errc> codes(2, fsdp::errc::internal);
    std::vector<float> grad_after;
    fsdp::threads::world{2}.run([&](fsdp::threads::communicator& comm) {
      fsdp::buffer<float> w(kNumel, "w");
      full g{comm};
      g.add_unit({&w});
      g.finalize(fsdp::init::broadcast_from{0});
      { auto sc = g.forward(0); }
      {
        auto sc = g.backward(0);
        for (std::size_t i = 0; i < kNumel; ++i) w.grad()[i] += 1.0f;
        if (comm.rank() == 1) w.grad()[3] = std::nanf("");
      }
      const auto r = static_cast<std::size_t>(comm.rank());
      try {
        norms[r] = fsdp::clip_grad_norm(g, 0.5, {.error_if_nonfinite = error_if_nonfinite});
      } catch (const fsdp::error& e) {
        codes[r] = e.code();
      }
      auto gf = g.full_gradient(0, 0);
      if (comm.rank() == 0) grad_after.assign(gf.begin(), gf.end());
    });
    for (std::size_t r = 0; r < 2; ++r) {
      if (error_if_nonfinite) {
        CHECK(codes[r] == fsdp::errc::non_finite);
      } else {
        CHECK(std::isnan(norms[r]));
      }
    }
    // Nothing was scaled: the averaged gradient is still 1 away from the nan.
    REQUIRE(grad_after.size() == kNumel);
    CHECK(std::isnan(grad_after[3]));
    CHECK(grad_after[0] == 1.0f);
  }
}

TEST_CASE("an optimizer built before finalize is refused with errc::order") {
  // An optimizer sizes its state from the group's shards, which finalize makes: built before,
  // adamw's first step() wrote past its (empty) moments and sgd silently dropped its momentum.
  {
    fsdp_test::fake_communicator comm{0, 1};  // a rank alone: nothing here needs peers
    fsdp::buffer<float> w(kNumel, "w");
    fake_full g{comm};
    g.add_unit({&w});
    CHECK_FALSE(g.finalized());
    auto expect_order = [](auto build, const std::string& text) {
      const fsdp::error e = fsdp_test::catch_error(build);
      CHECK(e.code() == fsdp::errc::order);
      CHECK(e.rank() == 0);
      CHECK_MESSAGE(std::string(e.what()).find(text) != std::string::npos, e.what());
    };
    expect_order([&] { fsdp::sgd<fake_full> opt(g, {.momentum = 0.9f}); }, "sgd: optimizer built before finalize");
    expect_order([&] { fsdp::sgd<fake_full> opt(g, {}); }, "sgd: optimizer built before finalize");
    expect_order([&] { fsdp::adamw<fake_full> opt(g, {}); }, "adamw: optimizer built before finalize");
    g.finalize(fsdp::init::broadcast_from{0});
    CHECK(g.finalized());
    CHECK_NOTHROW(fsdp::sgd<fake_full>(g, {.momentum = 0.9f}));
    CHECK_NOTHROW(fsdp::adamw<fake_full>(g, {}));
  }
}

TEST_CASE("optimizer options are validated") {
  {
    fsdp_test::fake_communicator comm{0, 1};  // a rank alone: nothing here needs peers
    fsdp::buffer<float> w(4);
    fake_full g{comm};
    g.add_unit({&w});
    g.finalize(fsdp::init::broadcast_from{0});
    CHECK_THROWS_AS(fsdp::sgd<fake_full>(g, {.lr = -1.0f}), fsdp::error);
    CHECK_THROWS_AS(fsdp::sgd<fake_full>(g, {.nesterov = true}), fsdp::error);
    CHECK_THROWS_AS(fsdp::adamw<fake_full>(g, {.beta2 = 1.0f}), fsdp::error);
    CHECK_THROWS_AS(fsdp::adamw<fake_full>(g, {.eps = 0.0f}), fsdp::error);
    CHECK_THROWS_AS(fsdp::clip_grad_norm(g, 0.0), fsdp::error);
  }
}

namespace {
// The bytes of one optimizer state on the host device.
std::vector<float> values_of(const fsdp::optimizer_state& s) {
  REQUIRE(s.type == fsdp::dtype::f32);
  const float* p = static_cast<const float*>(s.data);
  return std::vector<float>(p, p + s.numel);
}
}  // namespace

TEST_CASE("optimizer state: adamw's moments and sgd's momentum, named as torch names them, hold the formula's values") {
  fsdp::threads::world{1}.run([](fsdp::threads::communicator& comm) {
    fsdp::buffer<float> w(kNumel, "w");
    full g{comm};
    g.add_unit({&w});
    g.finalize(fsdp::init::broadcast_from{0});
    fsdp::adamw adam{g, {.lr = 0.01f, .beta1 = 0.9f, .beta2 = 0.99f}};
    fsdp::sgd sgd_m{g, {.lr = 0.0f, .momentum = 0.5f}};  // lr 0: only its momentum moves
    for (int step = 0; step < 2; ++step) {
      { auto s = g.forward(0); }
      {
        auto s = g.backward(0);
        for (std::size_t i = 0; i < kNumel; ++i) w.grad()[i] += grad_of(0, i, step);
      }
      sgd_m.step();
      adam.step();
      g.zero_grad();
    }
    CHECK(adam.steps() == 2);
    CHECK(sgd_m.steps() == 2);
    const auto st = adam.state(0);
    REQUIRE(st.size() == 2);
    CHECK(st[0].name == "exp_avg");
    CHECK(st[1].name == "exp_avg_sq");
    const auto m = values_of(st[0]), v = values_of(st[1]);
    const auto mom = sgd_m.state(0);
    REQUIRE(mom.size() == 1);
    CHECK(mom[0].name == "momentum_buffer");
    const auto buf = values_of(mom[0]);
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < kNumel; ++i) {
      const float g0 = grad_of(0, i, 0), g1 = grad_of(0, i, 1);
      const float m_ref = 0.9f * ((1 - 0.9f) * g0) + (1 - 0.9f) * g1;
      const float v_ref = 0.99f * ((1 - 0.99f) * g0 * g0) + (1 - 0.99f) * g1 * g1;
      wrong += std::abs(m[i] - m_ref) > 1e-7f + 1e-5f * std::abs(m_ref);
      wrong += std::abs(v[i] - v_ref) > 1e-9f + 1e-5f * std::abs(v_ref);
      wrong += std::abs(buf[i] - (0.5f * g0 + g1)) > 1e-7f;  // torch: the first step's buffer is the gradient
    }
    CHECK(wrong == 0);
    CHECK(fsdp::sgd<full>{g, {.lr = 0.1f}}.state(0).empty());  // no momentum, no state
  });
}

TEST_CASE("optimizer state: restored into a fresh optimizer (state and steps), the next step is bit-identical") {
  for (int which : {0, 1}) {  // adamw, sgd with nesterov momentum
    CAPTURE(which);
    fsdp::threads::world{2}.run([&](fsdp::threads::communicator& comm) {
      fsdp::buffer<float> w(kNumel, "w");
      full g{comm};
      g.add_unit({&w});
      g.finalize(fsdp::init::broadcast_from{0});
      const auto backward = [&](int step) {
        { auto s = g.forward(0); }
        auto s = g.backward(0);
        for (std::size_t i = 0; i < kNumel; ++i) w.grad()[i] += grad_of(comm.rank(), i, step);
      };
      const auto run = [&](auto& a, auto& b) {  // 3 steps of a; then step 4 by a and, from the same start, by b
        for (int step = 0; step < 3; ++step) {
          backward(step);
          a.step();
          a.zero_grad();
        }
        const auto sh = g.shard(0);
        const std::vector<float> params(sh.params, sh.params + sh.numel);
        std::vector<std::vector<float>> saved;
        for (const auto& s : a.state(0)) saved.push_back(values_of(s));
        backward(3);
        a.step();
        const std::vector<float> by_a(sh.params, sh.params + sh.numel);
        std::copy(params.begin(), params.end(), sh.params);  // resume: parameters, state, steps
        const auto into = b.state(0);
        REQUIRE(into.size() == saved.size());
        for (std::size_t k = 0; k < saved.size(); ++k) std::copy(saved[k].begin(), saved[k].end(), static_cast<float*>(into[k].data));
        b.set_steps(a.steps() - 1);
        b.step();  // the same gradient shard: zero_grad was not called since step 4's reduction
        CHECK(std::memcmp(by_a.data(), sh.params, sh.numel * sizeof(float)) == 0);
      };
      if (which == 0) {
        fsdp::adamw a{g, {.lr = 0.01f, .weight_decay = 0.1f}}, b{g, {.lr = 0.01f, .weight_decay = 0.1f}};
        run(a, b);
      } else {
        fsdp::sgd a{g, {.lr = 0.05f, .momentum = 0.8f, .nesterov = true}}, b{g, {.lr = 0.05f, .momentum = 0.8f, .nesterov = true}};
        run(a, b);
      }
    });
  }
}

TEST_CASE("optimizer state: set_steps refuses a negative count") {
  {
    fsdp_test::fake_communicator comm{0, 1};  // a rank alone: nothing here needs peers
    fsdp::buffer<float> w(8, "w");
    fake_full g{comm};
    g.add_unit({&w});
    g.finalize(fsdp::init::broadcast_from{0});
    fsdp::adamw a{g, {}};
    CHECK_THROWS_AS(a.set_steps(-1), fsdp::error);
    fsdp::sgd s{g, {.momentum = 0.9f}};
    CHECK_THROWS_AS(s.set_steps(-1), fsdp::error);
  }
}

namespace {
// One step with a finite gradient, then one whose gradient holds `bad` at b[5] (written by rank
// 1 only; the mean is nan or inf too). Per rank: the error of the second step, if any, and
// whether its shard of parameters and optimizer state came out of it bitwise unchanged.
struct refused {
  std::vector<fsdp::errc> codes = std::vector<fsdp::errc>(2, fsdp::errc::internal);
  std::vector<std::string> params = std::vector<std::string>(2), what = std::vector<std::string>(2);
  std::vector<char> unchanged = std::vector<char>(2, 0);  // not vector<bool>: the two ranks write their own element at once
  std::vector<long> steps = std::vector<long>(2, -1), retried = std::vector<long>(2, -1);
};
template <class Opt, class Options>
refused step_with(float bad, Options o) {
  refused out;
  fsdp::threads::world{2}.run([&](fsdp::threads::communicator& comm) {
    fsdp::buffer<float> w(kNumel, "w"), b(16, "b");
    full g{comm};
    g.add_unit({&w, &b});
    g.finalize(fsdp::init::broadcast_from{0});
    Opt opt{g, o};
    for (int step = 0; step < 2; ++step) {
      { auto s = g.forward(0); }
      {
        auto s = g.backward(0);
        for (std::size_t i = 0; i < kNumel; ++i) w.grad()[i] += grad_of(comm.rank(), i, step);
        for (std::size_t i = 0; i < 16; ++i) b.grad()[i] += grad_of(comm.rank(), i, step);
        if (step == 1 && comm.rank() == 1) b.grad()[5] = bad;
      }
      if (step == 0) {
        opt.step();
        opt.zero_grad();
        continue;
      }
      const auto sh = g.shard(0);
      auto bytes = [&] {  // this rank's parameters and optimizer state
        std::vector<float> all(sh.params, sh.params + sh.numel);
        for (const auto& st : opt.state(0)) {
          const auto v = values_of(st);
          all.insert(all.end(), v.begin(), v.end());
        }
        return all;
      };
      const auto before = bytes();
      const auto r = static_cast<std::size_t>(comm.rank());
      try {
        opt.step();
      } catch (const fsdp::error& e) {
        out.codes[r] = e.code();
        out.params[r] = e.param();
        out.what[r] = e.what();
      }
      const auto after = bytes();
      out.unchanged[r] = std::memcmp(before.data(), after.data(), before.size() * sizeof(float)) == 0;
      out.steps[r] = opt.steps();
      if (out.codes[r] == fsdp::errc::non_finite) {  // the gradient fixed (zeroed), the step is retried
        opt.zero_grad();
        opt.step();
        out.retried[r] = opt.steps();
      }
    }
  });
  return out;
}
}  // namespace

TEST_CASE("refuse_nonfinite_grads: a nan or inf gradient throws naming the parameter and element, nothing changed") {
  for (float bad : {std::nanf(""), INFINITY}) {
    CAPTURE(bad);
    for (int which : {0, 1}) {  // sgd with momentum, adamw
      CAPTURE(which);
      const refused r = which == 0 ? step_with<fsdp::sgd<full>>(bad, fsdp::sgd_options{.lr = 0.1f, .momentum = 0.9f, .refuse_nonfinite_grads = true})
                                   : step_with<fsdp::adamw<full>>(bad, fsdp::adamw_options{.lr = 0.01f, .refuse_nonfinite_grads = true});
      int named = 0;
      for (std::size_t k = 0; k < 2; ++k) {
        CHECK(r.codes[k] == fsdp::errc::non_finite);  // every rank, also the one whose shard is finite
        CHECK(r.unchanged[k]);
        CHECK(r.steps[k] == 1);
        CHECK(r.retried[k] == 2);
        if (r.params[k] == "b") {
          ++named;
          CHECK_MESSAGE(r.what[k].find("gradient element 5 is nan or inf") != std::string::npos, r.what[k]);
          CHECK_MESSAGE(r.what[k].find(which == 0 ? "sgd: step refused" : "adamw: step refused") != std::string::npos, r.what[k]);
        }
      }
      CHECK(named == 1);  // the rank whose shard holds b[5]
    }
  }
  // Off (the default), the step goes on as before: the nan reaches the parameter.
  for (int which : {0, 1}) {
    CAPTURE(which);
    const refused r = which == 0 ? step_with<fsdp::sgd<full>>(std::nanf(""), fsdp::sgd_options{.lr = 0.1f, .momentum = 0.9f})
                                 : step_with<fsdp::adamw<full>>(std::nanf(""), fsdp::adamw_options{.lr = 0.01f});
    CHECK(r.codes == std::vector<fsdp::errc>(2, fsdp::errc::internal));  // nothing thrown
    CHECK(r.steps == std::vector<long>{2, 2});
    CHECK(r.unchanged != std::vector<char>{1, 1});  // the parameters moved, b[5] to nan
  }
}
