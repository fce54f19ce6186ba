// Uses the installed fsdp: two thread ranks shard one parameter, run one forward/backward and
// one SGD step, and check the result. Exits non-zero when a value is wrong.
//   w = [1, 2, 3, 4, 5] (rank 0's values, broadcast), rank r writes gradient r + 1 everywhere,
//   so the averaged gradient is 1.5 and one step with lr 0.1 gives w - 0.15.
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <exception>
#include <vector>

#include <fsdp/fsdp.hpp>

int main() {
  constexpr std::size_t n = 5;
  constexpr float lr = 0.1f;
  std::atomic<int> wrong{0};
  auto expect = [&](bool ok, const char* what, int rank, std::size_t i, float got, float want) {
    if (ok) return;
    std::fprintf(stderr, "rank %d: %s[%zu] is %g, expected %g\n", rank, what, i, double(got), double(want));
    ++wrong;
  };
  try {
    fsdp::threads::world{2}.run([&](fsdp::threads::communicator& comm) {
      const int rank = comm.rank();
      fsdp::buffer<float> w(n, "w");
      // Other ranks' values differ on purpose: broadcast_from{0} must replace them.
      for (std::size_t i = 0; i < n; ++i) w.values()[i] = rank == 0 ? float(i + 1) : -100.0f;

      fsdp::shard_group<fsdp::buffer<float>> group{comm};
      group.add_unit({&w}, "layer");
      group.finalize(fsdp::init::broadcast_from{0});
      fsdp::sgd opt{group, {.lr = lr}};

      {
        auto scope = group.forward(0);
        for (std::size_t i = 0; i < n; ++i) expect(w.values()[i] == float(i + 1), "forward w", rank, i, w.values()[i], float(i + 1));
      }
      {
        auto scope = group.backward(0);
        for (float& g : w.grads()) g += float(rank + 1);
      }
      opt.step();

      const std::vector<float> after = group.full_parameter(0, 0);
      for (std::size_t i = 0; i < n; ++i) {
        const float want = float(i + 1) - lr * 1.5f;
        expect(std::fabs(after[i] - want) <= 1e-6f, "stepped w", rank, i, after[i], want);
      }
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp consumer failed: %s\n", e.what());
    return 1;
  }
  if (wrong != 0) return 1;
  std::puts("fsdp consumer: ok");
  return 0;
}
