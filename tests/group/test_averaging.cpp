// Averaging: with 3 ranks (where a sum and a mean differ by 3x) the reduced gradient is the
// mean of the ranks' gradients, for every strategy and dtype. (PyTorch's gloo backend once
// shipped a silent sum-instead-of-average bug.)
#include <doctest/doctest.h>

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

}  // namespace

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
