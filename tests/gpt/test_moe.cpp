// The Mixture-of-Experts layer (examples/gpt/moe.hpp): its hand-written backward against central
// finite differences, expert parallelism over 2 and 4 threads ranks against the plain layer run
// on all their tokens in one process, and bad input.

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "common/catch_error.hpp"
#include "fsdp/comm/threads.hpp"
#include "gpt/moe.hpp"

namespace {

namespace moe = gpt::moe;
using traits = fsdp::param_traits<fsdp::buffer<float>>;

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// A uniform value in [-1, 1), a pure function of (name, index, seed): every rank builds the same
// parameters and the same global batch without talking.
float uniform(const std::string& name, std::size_t i, std::uint64_t seed) {
  std::uint64_t h = 0xCBF29CE484222325ull ^ seed;
  for (char ch : name) h = (h ^ static_cast<unsigned char>(ch)) * 0x100000001B3ull;
  std::uint64_t v = h + 0x9E3779B97F4A7C15ull * (i + 1);
  v = (v ^ (v >> 30)) * 0xBF58476D1CE4E5B9ull;
  v = (v ^ (v >> 27)) * 0x94D049BB133111EBull;
  v ^= v >> 31;
  return static_cast<float>(static_cast<double>(v >> 11) / 4503599627370496.0 - 1.0);
}

std::vector<float> uniforms(const std::string& name, std::size_t n, float scale = 1.0f) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = scale * uniform(name, i, 11);
  return v;
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// One ep rank's layer on plain vectors (no fsdp group): the router and this rank's experts,
// bound to values by name, gradients zeroed. Router weights ~ U(-1, 1), so that the logits of a
// token are well apart and a small step does not change its routing; the experts' weights scaled
// by 1 / sqrt(fan-in) as usual.
struct layer {
  moe::router<float> router;
  moe::experts<float> experts;
  std::map<std::string, std::vector<float>> data, grad;

  layer(const moe::shape& s, int ep_size, int ep_rank) : router(s, 0), experts(s, 0, ep_size, ep_rank) {
    for (auto* p : params()) {
      const std::string& n = p->name();
      const float scale = ends_with(n, "fc_w")    ? 1.0f / std::sqrt(static_cast<float>(s.dim))
                          : ends_with(n, "out_w") ? 1.0f / std::sqrt(static_cast<float>(s.hidden))
                          : ends_with(n, "_b")    ? 0.1f
                                                  : 1.0f;
      data[n] = uniforms(n, p->size(), scale);
      grad[n].assign(p->size(), 0.0f);
      traits::bind(*p, data[n].data(), grad[n].data());
    }
  }
  ~layer() {
    for (auto* p : params()) traits::bind(*p, nullptr, nullptr);
  }
  std::vector<fsdp::buffer<float>*> params() {
    std::vector<fsdp::buffer<float>*> all = router.params();
    for (auto* p : experts.params()) all.push_back(p);
    return all;
  }
};

const moe::shape small{.experts = 4, .top_k = 2, .dim = 8, .hidden = 16};

}  // namespace

TEST_CASE("moe: the plain layer's gradients match central finite differences") {
  const moe::shape s = small;
  const int N = 6;
  const auto z = [](int v) { return static_cast<std::size_t>(v); };
  layer m(s, 1, 0);
  std::vector<float> x = uniforms("x", z(N) * z(s.dim)), w = uniforms("w", z(N) * z(s.dim)), y(x.size());
  moe::activations a;
  // loss = sum of w . y, in double: its gradient with respect to y is w.
  const auto loss = [&] {
    moe::forward(y.data(), a, x.data(), N, m.router, m.experts, s, {});
    double l = 0;
    for (std::size_t i = 0; i < y.size(); ++i) l += static_cast<double>(w[i]) * y[i];
    return l;
  };
  loss();
  const std::vector<int> routing = a.chosen;
  // Every expert gets rows: no expert's gradient is trivially zero on both sides.
  for (int e = 0; e < s.experts; ++e) REQUIRE(std::count(routing.begin(), routing.end(), e) > 0);
  std::vector<float> dx(x.size(), 0.0f);
  moe::backward(dx.data(), a, w.data(), x.data(), m.router, m.experts, s, {});

  // Central differences with a step of 1e-2 on f32 values: the truncation error is
  // O(step^2 * third derivative), the rounding error about 1e-7 (float y, summed in double)
  // / 2e-2 ~ 5e-6. Seen: at most 4.3e-6 absolute, 1.1e-3 relative where |gradient| > 1e-3.
  // Tolerance 2e-5 + 5e-3 relative: a few times that, and far below the gradients' size (up to
  // ~1.3), so a wrong term or a sign fails it. The worst error seen is printed.
  const double step = 1e-2;
  double worst = 0;
  int checked = 0;
  const auto check = [&](const std::string& what, std::vector<float>& v, const std::vector<float>& g) {
    for (std::size_t i = 0; i < v.size(); ++i) {
      const float keep = v[i];
      v[i] = static_cast<float>(keep + step);
      const double up = loss();
      REQUIRE(a.chosen == routing);  // the selection is not differentiable: the step must not change it
      v[i] = static_cast<float>(keep - step);
      const double down = loss();
      REQUIRE(a.chosen == routing);
      v[i] = keep;
      const double numeric = (up - down) / (2 * step), analytic = g[i];
      CAPTURE(what);
      CAPTURE(i);
      CHECK(std::abs(numeric - analytic) <= 2e-5 + 5e-3 * std::abs(analytic));
      worst = std::max(worst, std::abs(numeric - analytic));
      ++checked;
    }
  };
  check("x", x, dx);
  for (auto* p : m.params()) check(p->name(), m.data[p->name()], m.grad[p->name()]);
  MESSAGE("finite differences: " << checked << " entries, worst absolute error " << worst);
  CHECK(checked == N * s.dim + s.experts * s.dim + s.experts * (2 * s.hidden * s.dim + s.hidden + s.dim));
}

TEST_CASE("moe: expert parallel over 2 and 4 ranks equals the plain layer on all their tokens") {
  const int local = 5;  // tokens per rank: the same on every rank, as the capacity needs
  const auto z = [](int v) { return static_cast<std::size_t>(v); };
  // top_k 3 besides 2: with two terms the order of combine's sum does not matter (a + b == b + a
  // in floats), with three it does, so only top_k 3 shows that the order is fixed.
  for (const auto& [ep, top_k] : std::vector<std::pair<int, int>>{{2, 2}, {4, 2}, {2, 3}, {4, 3}}) {
    CAPTURE(ep);
    CAPTURE(top_k);
    moe::shape s = small;
    s.top_k = top_k;
    const int N = ep * local;
    const std::vector<float> x = uniforms("x", z(N) * z(s.dim)), dy = uniforms("dy", z(N) * z(s.dim));

    // The plain layer on all N tokens.
    layer plain(s, 1, 0);
    std::vector<float> y(x.size()), dx(x.size(), 0.0f);
    moe::activations a;
    moe::forward(y.data(), a, x.data(), N, plain.router, plain.experts, s, {});
    moe::backward(dx.data(), a, dy.data(), x.data(), plain.router, plain.experts, s, {});

    // ep ranks, rank r holding tokens [r * local, (r + 1) * local) and experts of its own.
    struct rank_result {
      std::vector<float> y, dx;
      std::map<std::string, std::vector<float>> grad;
      int rows_from_others = 0;  // rows that crossed ranks: the exchange is really used
    };
    std::vector<rank_result> got(z(ep));
    fsdp::threads::world{ep}.run([&](fsdp::threads::communicator& comm) {
      const int r = comm.rank();
      fsdp::host_queue q;
      const moe::ep_group group{.size = ep, .rank = r, .all_to_all = [&](const float* send, float* recv, std::size_t count) {
                                  comm.all_to_all(send, recv, count, fsdp::dtype::f32, q).wait(comm.timeout());
                                }};
      layer mine(s, ep, r);
      const std::size_t from = z(r) * z(local) * z(s.dim), to = from + z(local) * z(s.dim);
      const std::vector<float> xr(x.begin() + static_cast<std::ptrdiff_t>(from), x.begin() + static_cast<std::ptrdiff_t>(to));
      const std::vector<float> dyr(dy.begin() + static_cast<std::ptrdiff_t>(from), dy.begin() + static_cast<std::ptrdiff_t>(to));
      rank_result& out = got[z(r)];
      out.y.resize(xr.size()), out.dx.assign(xr.size(), 0.0f);
      moe::activations ar;
      moe::forward(out.y.data(), ar, xr.data(), local, mine.router, mine.experts, s, group);
      moe::backward(out.dx.data(), ar, dyr.data(), xr.data(), mine.router, mine.experts, s, group);
      out.grad = mine.grad;
      for (const auto& le : ar.local)
        for (int row : le.rows) out.rows_from_others += row / ar.capacity != r;
    });

    int crossed = 0;
    for (int r = 0; r < ep; ++r) crossed += got[z(r)].rows_from_others;
    CHECK(crossed > 0);
    // Outputs and dx: bit-identical. Each row is computed on its own by the same code, and
    // combine adds the top_k outputs in the order j = 0..top_k-1 on every rank count.
    for (int r = 0; r < ep; ++r) {
      CAPTURE(r);
      const std::size_t from = z(r) * z(local) * z(s.dim);
      for (std::size_t i = 0; i < got[z(r)].y.size(); ++i) {
        REQUIRE(got[z(r)].y[i] == y[from + i]);
        REQUIRE(got[z(r)].dx[i] == dx[from + i]);
      }
    }
    // Expert gradients: bit-identical on the one rank that owns each expert (its rows arrive in
    // the global token order, so the sums over rows add in the same order), zero elsewhere as
    // the rank never holds them. router_w's gradient: each rank sums over its own tokens, and the
    // ranks' sums are added here, in another order than the plain layer's one sum: equal within
    // float rounding, 1e-6 relative to the largest entry.
    for (auto& [name, ref] : plain.grad) {
      CAPTURE(name);
      if (name == "block0.router_w") {
        std::vector<float> sum(ref.size(), 0.0f);
        for (int r = 0; r < ep; ++r)
          for (std::size_t i = 0; i < ref.size(); ++i) sum[i] += got[z(r)].grad.at(name)[i];
        float largest = 0, diff = 0;
        for (std::size_t i = 0; i < ref.size(); ++i) {
          largest = std::max(largest, std::abs(ref[i]));
          diff = std::max(diff, std::abs(sum[i] - ref[i]));
        }
        REQUIRE(largest > 0);
        CHECK(diff <= 1e-6f * largest);
        continue;
      }
      int owners = 0;
      for (int r = 0; r < ep; ++r) {
        const auto it = got[z(r)].grad.find(name);
        if (it == got[z(r)].grad.end()) continue;
        ++owners;
        REQUIRE(it->second == ref);
      }
      CHECK(owners == 1);
      CHECK(std::any_of(ref.begin(), ref.end(), [](float g) { return g != 0.0f; }));
    }
  }
}

TEST_CASE("moe: routing picks the largest logits, ties to the lower expert index, gates a softmax of the chosen") {
  layer m(small, 1, 0);
  const auto C = static_cast<std::size_t>(small.dim);
  std::vector<float> x(2 * C, 0.0f), y(x.size());
  x[0] = 1.0f;  // token 0: logits = router_w[e][0]; token 1: all logits 0, a four-way tie
  std::vector<float>& w = m.data.at("block0.router_w");
  std::fill(w.begin(), w.end(), 0.0f);
  const float logit[4] = {0.5f, 2.0f, -1.0f, 2.0f};  // experts 1 and 3 tie for the first place
  for (std::size_t e = 0; e < 4; ++e) w[e * C] = logit[e];
  moe::activations a;
  moe::forward(y.data(), a, x.data(), 2, m.router, m.experts, small, {});
  CHECK(a.chosen == std::vector<int>{1, 3, 0, 1});
  CHECK(a.gates[0] == doctest::Approx(0.5));
  CHECK(a.gates[1] == doctest::Approx(0.5));
  CHECK(a.gates[2] == doctest::Approx(0.5));
  CHECK(a.gates[3] == doctest::Approx(0.5));
  m.data.at("block0.router_w")[0] = 3.0f;  // expert 0 now first, then 1 (the lower of the tie)
  moe::forward(y.data(), a, x.data(), 2, m.router, m.experts, small, {});
  CHECK(a.chosen[0] == 0);
  CHECK(a.chosen[1] == 1);
  CHECK(a.gates[0] == doctest::Approx(1.0 / (1.0 + std::exp(-1.0))));
  CHECK(a.gates[0] + a.gates[1] == doctest::Approx(1.0));
}

TEST_CASE("moe: ranks of one ep group with different token counts: the all-to-all's mismatch, not a hang") {
  using namespace std::chrono_literals;
  const fsdp::error e = fsdp_test::catch_error([] {
    fsdp::threads::world{2, {.timeout = 300ms}}.run([](fsdp::threads::communicator& comm) {
      fsdp::host_queue q;
      const moe::ep_group group{.size = 2, .rank = comm.rank(), .all_to_all = [&](const float* send, float* recv, std::size_t count) {
                                  comm.all_to_all(send, recv, count, fsdp::dtype::f32, q).wait(comm.timeout());
                                }};
      layer mine(small, 2, comm.rank());
      const int N = 3 + comm.rank();
      std::vector<float> x = uniforms("x", static_cast<std::size_t>(N * small.dim)), y(x.size());
      moe::activations a;
      moe::forward(y.data(), a, x.data(), N, mine.router, mine.experts, small, group);
    });
  });
  // Capacity N * min(top_k, E / ep) rows of 1 + dim floats, plus the header: 55 and 73 floats.
  CHECK(e.code() == fsdp::errc::mismatch);
  CHECK(contains(e.what(), "all_to_all of 55 f32"));
  CHECK(contains(e.what(), "all_to_all of 73 f32"));
}

TEST_CASE("moe: bad input names the numbers") {
  SUBCASE("experts that do not divide over the ep group") {
    const auto e = fsdp_test::catch_error([] { moe::experts<float>({.experts = 6, .top_k = 2, .dim = 8, .hidden = 16}, 0, 4, 0); });
    CHECK(e.code() == fsdp::errc::invalid_argument);
    CHECK(contains(e.what(), "6 experts do not divide over an ep group of 4 ranks"));
  }
  SUBCASE("top_k larger than the number of experts") {
    const auto e = fsdp_test::catch_error([] { moe::check({.experts = 4, .top_k = 5, .dim = 8, .hidden = 16}, 1); });
    CHECK(e.code() == fsdp::errc::invalid_argument);
    CHECK(contains(e.what(), "top_k 5 > experts 4"));
  }
  SUBCASE("a forward whose ep group does not match the experts it is given, or has no all_to_all") {
    layer mine(small, 2, 1);  // experts 2..3
    std::vector<float> x(static_cast<std::size_t>(2 * small.dim), 0.5f), y(x.size());
    moe::activations a;
    const auto wrong = fsdp_test::catch_error(
        [&] { moe::forward(y.data(), a, x.data(), 2, mine.router, mine.experts, small, {.size = 2, .rank = 0, .all_to_all = {}}); });
    CHECK(contains(wrong.what(), "ep rank 0 of 2 owns experts 0..1 but was given experts 2..3"));
    const auto none = fsdp_test::catch_error(
        [&] { moe::forward(y.data(), a, x.data(), 2, mine.router, mine.experts, small, {.size = 2, .rank = 1, .all_to_all = {}}); });
    CHECK(contains(none.what(), "an ep group of 2 ranks needs an all_to_all"));
  }
}
