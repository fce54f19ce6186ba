// The cost model's profiles (alpha grows with the ring, groups inside a node are priced at
// NVLink) and calibrate() against the threads backend's link model, whose alpha and beta the fit
// must recover. The link model makes each collective last at least alpha + bytes / beta, far
// longer than the copies themselves, so the fit sees the model; no test asserts speed.

#include "fsdp/schedule/calibrate.hpp"

#include <doctest/doctest.h>

#include <cstddef>
#include <vector>

#include "common/catch_error.hpp"
#include "fsdp/comm/threads.hpp"
#include "fsdp/device/host.hpp"
#include "fsdp/schedule/cost_model.hpp"

namespace {

using namespace fsdp::schedule;
using fsdp_test::catch_error;

}  // namespace

TEST_CASE("h100 profiles: NVLink inside a node, InfiniBand across, alpha growing with the ring") {
  const cost_model nv = h100_nvlink(8);
  CHECK(nv.all_gather.beta_bytes_per_s == h100::nvlink_busbw);
  CHECK(nv.all_gather.alpha_s == doctest::Approx(8.4e-6 + 7 * 3.4e-6));   // 7 NVLink steps
  CHECK(nv.all_reduce.alpha_s == doctest::Approx(8.4e-6 + 14 * 3.4e-6));  // 2 (n - 1) steps
  CHECK(nv.reduce_scatter == nv.all_gather);

  const cost_model ib = h100_infiniband(512);  // 64 nodes
  CHECK(ib.all_gather.beta_bytes_per_s == h100::ib_ring_busbw);
  CHECK(ib.all_gather.alpha_s == doctest::Approx(8.4e-6 + 448 * 3.4e-6 + 63 * 9.6e-6));
  CHECK(h100_infiniband(64).all_gather.alpha_s < ib.all_gather.alpha_s);
  CHECK(h100_infiniband(16).all_gather.alpha_s < h100_infiniband(64).all_gather.alpha_s);
  CHECK(h100_infiniband(8).all_gather == h100_nvlink(8).all_gather);  // a shard group of one node

  // Hybrid, a node per shard group: the replica all-reduce has one GPU per node, one NIC.
  const cost_model hy = h100_infiniband(8, 64);
  CHECK(hy.all_gather == nv.all_gather);
  CHECK(hy.all_reduce.beta_bytes_per_s == h100::ib_nic_busbw);
  CHECK(hy.all_reduce.alpha_s == doctest::Approx(8.4e-6 + 2 * 63 * 9.6e-6));
  // Two shard groups of 4 in one node: the replica all-reduce stays on NVLink.
  CHECK(h100_infiniband(4, 2).all_reduce.beta_bytes_per_s == h100::nvlink_busbw);

  // A strided shard group (the DP group of TP t = stride): t = 8 puts each member on its own
  // node, one NIC each; t = 2 puts 4 members in a node, 4 NICs' worth.
  CHECK(h100_strided(64, 1, 2) == h100_infiniband(64, 2));
  CHECK(h100_strided(8, 8).all_gather.beta_bytes_per_s == h100::ib_nic_busbw);
  CHECK(h100_strided(8, 8).all_gather.alpha_s == doctest::Approx(8.4e-6 + 7 * 9.6e-6));
  CHECK(h100_strided(64, 2).all_gather.beta_bytes_per_s == 4 * h100::ib_nic_busbw);
  CHECK(h100_strided(4, 2).all_gather.beta_bytes_per_s == h100::nvlink_busbw);  // ranks 0, 2, 4, 6
  CHECK(catch_error([] { h100_strided(8, 0); }).code() == fsdp::errc::invalid_argument);
  CHECK(catch_error([] { h100_nvlink(16); }).code() == fsdp::errc::invalid_argument);
  CHECK(catch_error([] { h100_infiniband(0); }).code() == fsdp::errc::invalid_argument);
}

TEST_CASE("calibrate: recovers the threads backend's link model within 25 %, the same model on every rank") {
  // 8 ms of latency, 1 MB/s, 2 ranks: an all-gather of 8192 f32 per rank sends 32 KB, 33 ms on
  // the link. The backend adds its copies and reductions to the modelled time; these figures keep
  // them small against it even under ThreadSanitizer on a loaded machine (with 4 ranks at 2 MB/s,
  // 98 KB per all-gather, a loaded TSan run once measured beta 28 % low).
  const fsdp::threads::link_model link{.alpha_s = 8e-3, .beta_bytes_per_s = 1e6};
  std::vector<cost_model> got(2);
  fsdp::threads::world{2, {.timeout = std::chrono::milliseconds(60000), .link = link}}.run(
      [&](fsdp::threads::communicator& comm) {
        fsdp::host_queue q;
        got[static_cast<std::size_t>(comm.rank())] = calibrate(comm, q, {.counts = {256, 2048, 8192}, .warmup = 1, .reps = 3});
      });
  for (const cost_model& m : got) CHECK(m == got[0]);
  for (const link_cost& l : {got[0].all_gather, got[0].reduce_scatter, got[0].all_reduce}) {
    CAPTURE(to_string(l));
    CHECK(l.alpha_s == doctest::Approx(link.alpha_s).epsilon(0.25));
    CHECK(l.beta_bytes_per_s == doctest::Approx(link.beta_bytes_per_s).epsilon(0.25));
  }
}

TEST_CASE("calibrate: needs two ranks and two sizes") {
  fsdp::threads::world{1}.run([](fsdp::threads::communicator& comm) {
    fsdp::host_queue q;
    CHECK(std::string(catch_error([&] { calibrate(comm, q); }).what()).find("at least 2 ranks") != std::string::npos);
  });
  fsdp::threads::world{2}.run([](fsdp::threads::communicator& comm) {
    fsdp::host_queue q;
    CHECK(catch_error([&] { calibrate(comm, q, {.counts = {1024}}); }).code() == fsdp::errc::invalid_argument);
  });
}
