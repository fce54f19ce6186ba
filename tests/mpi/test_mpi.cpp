// The mpi backend, as real processes: collectives against plain expectations, and the core
// parity suite (shard_group over MPI equals the single-process reference) for every strategy.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "common/catch_error.hpp"
#include "common/mlp.hpp"
#include "fsdp/comm/mpi.hpp"
#include "mpi_env.hpp"

namespace {

using fsdp::dtype;
using comm_t = fsdp::mpi::communicator;

// The value rank r contributes at element k: distinct per rank, exact in bf16 and f16.
float input(int r, std::size_t k) { return static_cast<float>((static_cast<int>(k % 13) - 6) * (r + 1)); }

// wake: the queue's mode; on_wait, the waiting thread runs each collective's task itself.
template <class T>
void check_collectives(comm_t& c, fsdp::queue_wake wake = fsdp::queue_wake::on_enqueue) {
  const dtype t = fsdp::dtype_of<T>;
  const int n = c.size(), r = c.rank();
  const std::size_t count = 37;
  fsdp::host_queue q("collectives", wake);
  INFO("dtype " << fsdp::to_string(t) << ", " << n << " processes, on_wait queue: " << (wake == fsdp::queue_wake::on_wait));
  // all_gather, out of place and in place
  std::vector<T> mine(count), all(count * static_cast<std::size_t>(n));
  for (std::size_t k = 0; k < count; ++k) mine[k] = fsdp::convert<T>(input(r, k));
  c.all_gather(mine.data(), all.data(), count, t, q).wait(c.timeout());
  std::vector<T> inplace(count * static_cast<std::size_t>(n));
  std::copy(mine.begin(), mine.end(), inplace.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(r) * count));
  c.all_gather(inplace.data() + static_cast<std::size_t>(r) * count, inplace.data(), count, t, q).wait(c.timeout());
  for (int j = 0; j < n; ++j)
    for (std::size_t k = 0; k < count; ++k) {
      const std::size_t at = static_cast<std::size_t>(j) * count + k;
      REQUIRE(fsdp::convert<float>(all[at]) == input(j, k));
      REQUIRE(fsdp::convert<float>(inplace[at]) == input(j, k));
    }
  // reduce_scatter and all_reduce, sum and avg: sum over ranks of input(j, .) = input(0, .) * n(n+1)/2
  const float ranks_sum = static_cast<float>(n * (n + 1)) / 2.0f;
  for (fsdp::reduce_op op : {fsdp::reduce_op::sum, fsdp::reduce_op::avg}) {
    const float factor = op == fsdp::reduce_op::sum ? ranks_sum : ranks_sum / static_cast<float>(n);
    std::vector<T> send(count * static_cast<std::size_t>(n)), out(count);
    for (std::size_t k = 0; k < send.size(); ++k) send[k] = fsdp::convert<T>(input(r, k));
    c.reduce_scatter(send.data(), out.data(), count, t, op, q).wait(c.timeout());
    for (std::size_t k = 0; k < count; ++k)
      REQUIRE(fsdp::convert<float>(out[k]) == doctest::Approx(input(0, static_cast<std::size_t>(r) * count + k) * factor).epsilon(1e-2));
    std::vector<T> ar(count);
    for (std::size_t k = 0; k < count; ++k) ar[k] = fsdp::convert<T>(input(r, k));
    c.all_reduce(ar.data(), ar.data(), count, t, op, q).wait(c.timeout());
    for (std::size_t k = 0; k < count; ++k) REQUIRE(fsdp::convert<float>(ar[k]) == doctest::Approx(input(0, k) * factor).epsilon(1e-2));
  }
  // broadcast from the last rank
  std::vector<T> b(count);
  for (std::size_t k = 0; k < count; ++k) b[k] = fsdp::convert<T>(input(r, k));
  c.broadcast(b.data(), count, t, n - 1, q).wait(c.timeout());
  for (std::size_t k = 0; k < count; ++k) REQUIRE(fsdp::convert<float>(b[k]) == input(n - 1, k));
}

}  // namespace

TEST_CASE("mpi collectives match plain expectations (f32, f64, bf16, f16; in place; avg is the mean)") {
  comm_t c = fsdp_test::mpi_world();
  check_collectives<float>(c);
  check_collectives<double>(c);
  check_collectives<fsdp::bf16>(c);
  check_collectives<fsdp::f16>(c);
  check_collectives<float>(c, fsdp::queue_wake::on_wait);
}

namespace {

// Floats of mixed magnitudes, a different stream per rank: their sum depends on the order of
// the additions, so equal bits pin the order.
std::vector<float> mixed(int rank, std::size_t count) {
  std::mt19937 rng(static_cast<unsigned>(91 + rank));
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exp(-10, 20);
  std::vector<float> v(count);
  for (auto& f : v) f = std::ldexp(mant(rng), exp(rng));
  return v;
}

// The documented order written out plainly: ((x0 + x1) + x2) + ... in float (double for f64),
// times the rounded 1/n for avg, rounded to T once.
template <class T>
T rank_order_reference(int n, std::size_t k, fsdp::reduce_op op, std::size_t count) {
  using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;
  acc_t acc = 0;
  for (int j = 0; j < n; ++j) acc += fsdp::convert<acc_t>(fsdp::convert<T>(mixed(j, count)[k]));
  if (op == fsdp::reduce_op::avg) acc *= acc_t(1) / static_cast<acc_t>(n);
  return fsdp::convert<T>(acc);
}

template <class T>
void check_rank_order(comm_t& c, fsdp::queue_wake wake = fsdp::queue_wake::on_enqueue) {
  const dtype t = fsdp::dtype_of<T>;
  const int n = c.size(), r = c.rank();
  const std::size_t count = 23;  // an all_reduce of 23 splits unevenly over 2, 3 and 4 ranks
  const auto mine = mixed(r, count * static_cast<std::size_t>(n));
  fsdp::host_queue q("rank order", wake);  // on_wait: the last wait runs all three collectives
  for (fsdp::reduce_op op : {fsdp::reduce_op::sum, fsdp::reduce_op::avg}) {
    INFO(fsdp::to_string(t) << " " << fsdp::to_string(op) << ", " << n << " processes");
    std::vector<T> send(mine.size()), out(count), ar(count), ar_in(count);
    for (std::size_t k = 0; k < send.size(); ++k) send[k] = fsdp::convert<T>(mine[k]);
    c.reduce_scatter(send.data(), out.data(), count, t, op, q);
    c.all_reduce(send.data(), ar.data(), count, t, op, q);
    std::copy(send.begin(), send.begin() + static_cast<std::ptrdiff_t>(count), ar_in.begin());
    c.all_reduce(ar_in.data(), ar_in.data(), count, t, op, q).wait(c.timeout());
    const std::size_t all = count * static_cast<std::size_t>(n);
    std::size_t wrong = 0;
    for (std::size_t k = 0; k < count; ++k) {
      const T rs = rank_order_reference<T>(n, static_cast<std::size_t>(r) * count + k, op, all);
      const T a = rank_order_reference<T>(n, k, op, all);
      wrong += std::memcmp(&out[k], &rs, sizeof(T)) != 0;
      wrong += std::memcmp(&ar[k], &a, sizeof(T)) != 0;
      wrong += std::memcmp(&ar_in[k], &a, sizeof(T)) != 0;
    }
    CHECK(wrong == 0);
  }
}

}  // namespace

TEST_CASE("mpi reductions add ranks in rank order, bit for bit (the threads backend's order)") {
  comm_t c = fsdp_test::mpi_world();
  check_rank_order<float>(c);
  check_rank_order<double>(c);
  check_rank_order<fsdp::bf16>(c);
  check_rank_order<fsdp::f16>(c);
  check_rank_order<float>(c, fsdp::queue_wake::on_wait);
}

TEST_CASE("mpi: small collectives waited at once (the fast path) beside large ones left to the engine thread") {
  // A small collective is started and tested by the thread that waits for it while the engine
  // is free (engine::run); one above engine::fast_path_bytes stays with the engine thread. Here
  // both are in flight at once, for several rounds: the small ones' rounds also start and poll
  // the large one (issued first, so started first), and every result must be exact.
  comm_t c = fsdp_test::mpi_world();
  const int n = c.size(), r = c.rank();
  const auto ranks = static_cast<std::size_t>(n);
  // 4 MiB per rank: far above the limit, and long enough to outlast the small ones' rounds.
  const std::size_t large = 16 * fsdp::mpi::detail::engine::fast_path_bytes / sizeof(float);
  fsdp::host_queue waited("small", fsdp::queue_wake::on_wait), queued("large");
  for (int round = 0; round < 10; ++round) {
    INFO("round " << round << ", " << n << " processes");
    std::vector<float> big(large), big_all(large * ranks), mine(37), all(37 * ranks), send(37 * ranks), out(37);
    for (std::size_t k = 0; k < big.size(); ++k) big[k] = input(r, k + static_cast<std::size_t>(round));
    for (std::size_t k = 0; k < mine.size(); ++k) mine[k] = input(r, k);
    for (std::size_t k = 0; k < send.size(); ++k) send[k] = input(r, k);
    const fsdp::host_event big_done = c.all_gather(big.data(), big_all.data(), large, dtype::f32, queued);
    c.all_gather(mine.data(), all.data(), 37, dtype::f32, waited);
    c.reduce_scatter(send.data(), out.data(), 37, dtype::f32, fsdp::reduce_op::sum, waited).wait(c.timeout());
    const float ranks_sum = static_cast<float>(n * (n + 1)) / 2.0f;
    for (std::size_t k = 0; k < 37; ++k) {
      REQUIRE(out[k] == input(0, static_cast<std::size_t>(r) * 37 + k) * ranks_sum);
      for (int j = 0; j < n; ++j) REQUIRE(all[static_cast<std::size_t>(j) * 37 + k] == input(j, k));
    }
    big_done.wait(c.timeout());
    for (int j = 0; j < n; ++j)
      for (std::size_t k = 0; k < large; k += 997)
        REQUIRE(big_all[static_cast<std::size_t>(j) * large + k] == input(j, k + static_cast<std::size_t>(round)));
  }
}

TEST_CASE("mpi traffic counters follow the ring formulas") {
  comm_t c = fsdp_test::mpi_world();
  const auto n = static_cast<std::uint64_t>(c.size());
  fsdp::host_queue q;
  std::vector<float> x(64 * n), y(64 * n);
  c.all_gather(x.data(), y.data(), 64, dtype::f32, q);
  c.reduce_scatter(x.data(), y.data(), 64, dtype::f32, fsdp::reduce_op::avg, q);
  c.all_reduce(x.data(), x.data(), 64 * n, dtype::f32, fsdp::reduce_op::sum, q);
  q.synchronize(c.timeout());
  const auto t = c.traffic();
  CHECK(t.all_gather == 64 * 4 * (n - 1));
  CHECK(t.reduce_scatter == 64 * 4 * (n - 1));
  CHECK(t.all_reduce == 2 * 64 * n * 4 * (n - 1) / n);
  CHECK(t.collectives == 3);
}

TEST_CASE("mpi all_to_all, send and recv: values, order, traffic; a shorter message than the recv asks is a mismatch") {
  comm_t c = fsdp_test::mpi_world();
  const int n = c.size(), r = c.rank();
  const std::size_t count = 5;
  // Rank r's block for rank j, element k: distinct for every (r, j, k).
  auto value = [](int from, int to, std::size_t k) { return static_cast<float>(1000 * from + 100 * to) + static_cast<float>(k); };
  fsdp::host_queue q, in("recv");
  std::vector<float> send(count * static_cast<std::size_t>(n)), recv(send.size());
  for (int j = 0; j < n; ++j)
    for (std::size_t k = 0; k < count; ++k) send[static_cast<std::size_t>(j) * count + k] = value(r, j, k);
  c.all_to_all(send.data(), recv.data(), count, dtype::f32, q).wait(c.timeout());
  for (int j = 0; j < n; ++j)
    for (std::size_t k = 0; k < count; ++k) REQUIRE(recv[static_cast<std::size_t>(j) * count + k] == value(j, r, k));
  // A ring, three messages each way round, sends and receives on separate queues.
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  std::vector<std::vector<float>> msgs(3, std::vector<float>(count)), into(3, std::vector<float>(count, -1.0f));
  std::vector<fsdp::host_event> done;
  for (std::size_t m = 0; m < 3; ++m) {
    for (std::size_t k = 0; k < count; ++k) msgs[m][k] = value(r, static_cast<int>(m), k);
    done.push_back(c.send(msgs[m].data(), count, dtype::f32, next, q));
  }
  for (std::size_t m = 0; m < 3; ++m) done.push_back(c.recv(into[m].data(), count, dtype::f32, prev, in));
  for (auto& e : done) e.wait(c.timeout());
  for (std::size_t m = 0; m < 3; ++m)
    for (std::size_t k = 0; k < count; ++k) REQUIRE(into[m][k] == value(prev, static_cast<int>(m), k));
  fsdp::traffic_counters expect;
  expect.add_all_to_all(count, dtype::f32, n, fsdp::topology_of(c).remote_peers(r));
  for (int m = 0; m < 3; ++m) expect.add_send(count, dtype::f32, false), expect.add_recv();
  CHECK(c.traffic() == expect);
  // Rank 0 sends 4 elements to rank 1, which asks for 5: MPI completes the receive quietly with 4.
  std::vector<float> v(5);
  if (r == 0) c.send(v.data(), 4, dtype::f32, 1, q).wait(c.timeout());
  if (r == 1) {
    bool mismatch = false;
    try {
      c.recv(v.data(), 5, dtype::f32, 0, q).wait(c.timeout());
    } catch (const fsdp::error& e) {
      mismatch = e.code() == fsdp::errc::mismatch && std::string(e.what()).find("rank 0 sent 4 elements, not 5") != std::string::npos;
    }
    CHECK(mismatch);
  }
  c.barrier();
}

TEST_CASE("mpi: a reduce_scatter in place and a count over MPI's int are refused by name, sending nothing") {
  comm_t c = fsdp_test::mpi_world();
  const std::size_t n = static_cast<std::size_t>(c.size());
  fsdp::host_queue q;
  std::vector<float> buf(4 * n, 1.0f);
  using fsdp_test::check_error;
  check_error([&] { c.reduce_scatter(buf.data(), buf.data() + 4 * (n - 1), 4, dtype::f32, fsdp::reduce_op::sum, q); },
              fsdp::errc::invalid_argument, "reduce_scatter needs distinct send and receive buffers on MPI");
  // The count is refused before either buffer is touched.
  const std::size_t over = std::size_t{1} << 31;
  check_error([&] { c.all_gather(buf.data(), buf.data(), over, dtype::u8, q); }, fsdp::errc::invalid_argument,
              " elements exceed MPI's int count; use smaller buckets");
  CHECK(c.traffic() == fsdp::traffic_counters{});
  // Nothing was issued: the next collective matches the peers' as usual.
  std::vector<float> out(4);
  c.reduce_scatter(buf.data(), out.data(), 4, dtype::f32, fsdp::reduce_op::sum, q).wait(c.timeout());
  CHECK(out == std::vector<float>(4, static_cast<float>(n)));
}

TEST_CASE("mpi split and barrier") {
  comm_t c = fsdp_test::mpi_world();
  comm_t half = c.split(c.rank() % 2, c.rank());
  CHECK(half.size() == (c.size() + 1 - c.rank() % 2) / 2);
  CHECK(half.rank() == c.rank() / 2);
  fsdp::host_queue q;
  int v = c.rank(), sum = 0;
  std::vector<int> members(static_cast<std::size_t>(half.size()));
  half.all_gather(&v, members.data(), 1, dtype::i32, q).wait(half.timeout());
  for (std::size_t j = 0; j < members.size(); ++j) sum += members[j] % 2 == c.rank() % 2;
  CHECK(sum == half.size());
  half.barrier();
  c.barrier();
}

TEST_CASE("mpi: shard_group parity with the single-process reference, every strategy") {
  using namespace fsdp_test;
  comm_t c = mpi_world();
  const int n = c.size();
  for (optimizer o : {optimizer::sgd, optimizer::adamw}) {
    train_config cfg;
    cfg.opt = o;
    const train_result ref = train_reference(cfg);
    using group = fsdp::shard_group<fsdp::buffer<float>, comm_t>;
    CHECK(max_rel_diff(train_rank<group>(c, cfg), ref) <= 1e-5);
    CHECK(max_rel_diff(train_rank<group>(c, cfg, {.sharding = fsdp::shard_grad_op()}), ref) <= 1e-5);
    CHECK(max_rel_diff(train_rank<group>(c, cfg, {.sharding = fsdp::no_shard()}), ref) <= 1e-5);
    if (n % 2 == 0) CHECK(max_rel_diff(train_rank<group>(c, cfg, {.sharding = fsdp::hybrid_shard(2)}), ref) <= 1e-5);
    CHECK(max_rel_diff(train_rank<group>(c, cfg, {.sharding = fsdp::hybrid_shard(1)}), ref) <= 1e-5);
  }
  // bf16 parameters with f32 reduction: a user-defined MPI sum for the gathers' dtype is not
  // needed, but bf16 reduction is.
  using bf16_group = fsdp::shard_group<fsdp::buffer<fsdp::bf16>, fsdp::mixed_precision<fsdp::bf16, fsdp::bf16, float>, comm_t>;
  train_config cfg;
  const auto ref = train_reference(cfg);
  const auto got = train_rank<bf16_group>(c, cfg);
  for (std::size_t s = 0; s < got.losses.size(); ++s) CHECK(got.losses[s] == doctest::Approx(ref.losses[s]).epsilon(0.05));
}

TEST_CASE("mpi: processes that registered different parameters all get errc::mismatch") {
  comm_t c = fsdp_test::mpi_world();
  fsdp::buffer<float> a(35, "w0"), b(c.rank() == c.size() - 1 ? 78 : 77, "w1");
  fsdp::shard_group<fsdp::buffer<float>, comm_t> g{c};
  g.add_unit({&a});
  g.add_unit({&b});
  try {
    g.finalize(fsdp::init::broadcast_from{0});
    FAIL("finalize accepted mismatched registrations");
  } catch (const fsdp::error& e) {
    CHECK(e.code() == fsdp::errc::mismatch);
    CHECK(std::string(e.what()).find("unit 1 parameter 0 ('w1')") != std::string::npos);
  }
}
