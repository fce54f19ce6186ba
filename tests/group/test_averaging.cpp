// Averaging: with 3 ranks (where a sum and a mean differ by 3x) the reduced gradient is the
// mean of the ranks' gradients, for every strategy and dtype. (PyTorch's gloo backend once
// shipped a silent sum-instead-of-average bug.)
#include <doctest/doctest.h>

#include <atomic>

#include "fsdp/fsdp.hpp"

namespace {

// Rank r writes (r + 1) * k(i) into element i; k is small so every value and the mean are
// exact in bf16 and f16. The mean over 3 ranks is 2 k(i); a sum would be 6 k(i).
float k_of(std::size_t i) { return static_cast<float>(static_cast<int>(i % 9) - 4); }

template <class Group>
void check_mean(int n, typename Group::options opts = {}) {
  using T = typename Group::param_type;
  std::vector<std::vector<float>> got;
  fsdp::threads::world{n}.run([&](fsdp::threads::communicator& comm) {
    fsdp::buffer<T> a(37, "a"), b(1, "b"), c(130, "c");
    Group g{comm, {}, opts};
    g.add_unit({&a, &b});
    g.add_unit({&c});
    g.finalize(fsdp::init::per_shard([](const fsdp::param_slice&, std::span<float> v) { std::fill(v.begin(), v.end(), 0.5f); }));
    for (int u = 0; u < 2; ++u) auto s = g.forward(u);
    for (int u = 2; u-- > 0;) {
      auto s = g.backward(u);
      for (auto* p : u == 0 ? std::vector<fsdp::buffer<T>*>{&a, &b} : std::vector<fsdp::buffer<T>*>{&c})
        for (std::size_t i = 0; i < p->size(); ++i)
          p->grad()[i] = fsdp::convert<T>(static_cast<float>(comm.rank() + 1) * k_of(i));
    }
    g.finish_backward();
    std::vector<std::vector<float>> mine;
    for (auto [u, p] : {std::pair{0, 0}, std::pair{0, 1}, std::pair{1, 0}}) {
      auto v = g.full_gradient(u, p);
      mine.emplace_back(v.begin(), v.end());
    }
    if (comm.rank() == 0) got = mine;
  });
  const float mean_factor = static_cast<float>(n + 1) / 2.0f;  // mean of 1..n
  for (const auto& v : got)
    for (std::size_t i = 0; i < v.size(); ++i) REQUIRE(v[i] == mean_factor * k_of(i));
}

// The gradient of unit 1's parameter (130 elements) on rank 0 after `passes` synced backward
// passes on n ranks, each writing (r + 1) k(i); before pass p, between(p, group) runs.
template <class Group, class Between>
std::vector<float> gradient_after(int n, int passes, Between between, typename Group::options opts = {}) {
  using T = typename Group::param_type;
  std::vector<float> got;
  fsdp::threads::world{n}.run([&](fsdp::threads::communicator& comm) {
    fsdp::buffer<T> a(37, "a"), c(130, "c");
    Group g{comm, {}, opts};
    g.add_unit({&a});
    g.add_unit({&c});
    g.finalize(fsdp::init::per_shard([](const fsdp::param_slice&, std::span<float> v) { std::fill(v.begin(), v.end(), 0.5f); }));
    for (int pass = 0; pass < passes; ++pass) {
      between(pass, g);
      for (int u = 0; u < 2; ++u) auto s = g.forward(u);
      for (int u = 2; u-- > 0;) {
        auto s = g.backward(u);
        fsdp::buffer<T>& p = u == 0 ? a : c;
        for (std::size_t i = 0; i < p.size(); ++i)  // added, as the engine's contract says (docs/guide.md)
          p.grad()[i] = fsdp::convert<T>(fsdp::convert<float>(p.grad()[i]) + static_cast<float>(comm.rank() + 1) * k_of(i));
      }
      g.finish_backward();
    }
    auto v = g.full_gradient(1, 0);
    if (comm.rank() == 0) got.assign(v.begin(), v.end());
  });
  return got;
}

// What an engine's own optimizer step might do: write every gradient element through shard(b).
template <class Group>
void add_one_through_views(Group& g) {
  for (std::size_t b = 0; b < g.num_buckets(); ++b) {
    auto v = g.shard(b);
    for (std::size_t i = 0; i < v.numel; ++i) v.grads[i] += 1.0f;
  }
}

// Synced passes add into the gradient shard; zero_grad() restarts it (the first reduction after it
// writes the shard directly where it can: docs/design.md, "The gradient path"); and what the caller
// writes through a shard view is kept, not overwritten.
template <class Group>
void check_accumulation(int n, typename Group::options opts = {}) {
  const float mean = static_cast<float>(n + 1) / 2.0f;
  auto nothing = [](int, Group&) {};
  const auto two = gradient_after<Group>(n, 2, nothing, opts);
  for (std::size_t i = 0; i < two.size(); ++i) REQUIRE(two[i] == 2 * mean * k_of(i));
  const auto restarted = gradient_after<Group>(n, 3, [](int pass, Group& g) { if (pass == 2) g.zero_grad(); }, opts);
  for (std::size_t i = 0; i < restarted.size(); ++i) REQUIRE(restarted[i] == mean * k_of(i));
  // A view written after zero_grad, then zero_grad again: the second pass starts from zeros (and
  // may write its shard directly again)
  const auto written = gradient_after<Group>(n, 2, [](int pass, Group& g) {
    g.zero_grad();
    if (pass == 0) add_one_through_views(g);
  }, opts);
  for (std::size_t i = 0; i < written.size(); ++i) REQUIRE(written[i] == mean * k_of(i));
  const auto kept = gradient_after<Group>(n, 1, [](int, Group& g) {
    g.zero_grad();
    add_one_through_views(g);
  }, opts);
  for (std::size_t i = 0; i < kept.size(); ++i) REQUIRE(kept[i] == mean * k_of(i) + 1.0f);
}

// The hooks' contract (docs/guide.md): at pre_backward the gradient storage reads zero at the
// first backward since the last reduction, and holds what earlier passes with sync off added.
// Passes: sync off, on, on, on (no zero_grad): the storage must read (r + 1) k(i) in pass 1 and
// zero in passes 0, 2 and 3. Returns the elements that read otherwise, over every rank, and checks
// the reduced sum. One rank of one dtype is the case that broke it: the storage there is the
// gradient shard itself, which a reduction has written.
template <class Group>
std::size_t storage_violations(int n) {
  using T = typename Group::param_type;
  std::atomic<std::size_t> bad{0};
  std::vector<float> got;
  fsdp::threads::world{n}.run([&](fsdp::threads::communicator& comm) {
    fsdp::buffer<T> a(37, "a"), c(130, "c");
    Group g{comm};
    g.add_unit({&a});
    g.add_unit({&c});
    g.finalize(fsdp::init::per_shard([](const fsdp::param_slice&, std::span<float> v) { std::fill(v.begin(), v.end(), 0.5f); }));
    for (int pass = 0; pass < 4; ++pass) {
      g.set_requires_gradient_sync(pass != 0);
      for (int u = 0; u < 2; ++u) auto s = g.forward(u);
      for (int u = 2; u-- > 0;) {
        auto s = g.backward(u);
        fsdp::buffer<T>& p = u == 0 ? a : c;
        const float mine = static_cast<float>(comm.rank() + 1);
        for (std::size_t i = 0; i < p.size(); ++i) {
          const float want = pass == 1 ? mine * k_of(i) : 0.0f;
          if (fsdp::convert<float>(p.grad()[i]) != want) ++bad;
          p.grad()[i] = fsdp::convert<T>(fsdp::convert<float>(p.grad()[i]) + mine * k_of(i));
        }
      }
      g.finish_backward();
    }
    auto v = g.full_gradient(1, 0);
    if (comm.rank() == 0) got.assign(v.begin(), v.end());
  });
  const float mean = static_cast<float>(n + 1) / 2.0f;
  for (std::size_t i = 0; i < got.size(); ++i) REQUIRE(got[i] == 4 * mean * k_of(i));  // 2 + 1 + 1 passes' worth
  return bad.load();
}

}  // namespace

TEST_CASE("the gradient storage reads zero at the first backward after a reduction, on one rank too") {
  using f32 = fsdp::shard_group<fsdp::buffer<float>>;
  using bf16_f32 = fsdp::shard_group<fsdp::buffer<fsdp::bf16>, fsdp::mixed_precision<fsdp::bf16, float, float>>;
  for (int n : {1, 2}) {
    CAPTURE(n);
    CHECK(storage_violations<f32>(n) == 0);
    CHECK(storage_violations<bf16_f32>(n) == 0);
  }
}

TEST_CASE("synced passes add into the gradient shard until zero_grad(); a value written through shard() is kept") {
  using f32 = fsdp::shard_group<fsdp::buffer<float>>;
  using bf16_f32 = fsdp::shard_group<fsdp::buffer<fsdp::bf16>, fsdp::mixed_precision<fsdp::bf16, float, float>>;
  for (int n : {2, 3}) {
    CAPTURE(n);
    check_accumulation<f32>(n);
    check_accumulation<f32>(n, {.sharding = fsdp::shard_grad_op()});
    check_accumulation<f32>(n, {.sharding = fsdp::hybrid_shard(1)});
    check_accumulation<bf16_f32>(n);
  }
  check_accumulation<f32>(4, {.sharding = fsdp::hybrid_shard(2)});
  check_accumulation<f32>(1);
}

TEST_CASE("the reduced gradient is the mean of the ranks' gradients (N = 3), every strategy and dtype") {
  using fsdp::bf16;
  using fsdp::f16;
  using fsdp::buffer;
  using fsdp::shard_group;
  // f32
  using f32 = shard_group<buffer<float>>;
  check_mean<f32>(3);
  check_mean<f32>(3, {.sharding = fsdp::shard_grad_op()});
  check_mean<f32>(3, {.sharding = fsdp::no_shard()});
  check_mean<f32>(3, {.sharding = fsdp::hybrid_shard(1)});
  check_mean<f32>(3, {.sharding = fsdp::hybrid_shard(3)});
  check_mean<f32>(6, {.sharding = fsdp::hybrid_shard(3)});
  // bf16 params, f32 reduce; bf16 reduce; f16
  using bf16_f32 = fsdp::mixed_precision<bf16, float, float>;
  using bf16_bf16 = fsdp::mixed_precision<bf16, bf16, float>;
  using f16_f16 = fsdp::mixed_precision<f16, f16, float>;
  check_mean<shard_group<buffer<bf16>, bf16_f32>>(3);
  check_mean<shard_group<buffer<bf16>, bf16_bf16>>(3, {.sharding = fsdp::no_shard()});
  check_mean<shard_group<buffer<bf16>, bf16_bf16>>(3, {.sharding = fsdp::hybrid_shard(1)});
  check_mean<shard_group<buffer<f16>, f16_f16>>(3);
  check_mean<shard_group<buffer<f16>, f16_f16>>(6, {.sharding = fsdp::hybrid_shard(3)});
  check_mean<shard_group<buffer<float>, fsdp::full_precision<float>, fsdp::fixed_bytes>>(3, {.bucket = {.bytes = 1 << 20}});
}
