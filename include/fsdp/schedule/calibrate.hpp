#pragma once
//! \file calibrate(comm, queue): measures a cost model on this machine. A short run of each
//! collective kind at a few sizes (median of a few repetitions), and a least-squares fit of
//! alpha and beta per kind against the bytes this rank sends (cost_model.hpp).
//!
//!   fsdp::host_queue q;
//!   fsdp::schedule::cost_model m = fsdp::schedule::calibrate(comm, q);   // every rank calls it
//!
//! From tests/schedule/test_calibrate.cpp: on a threads world with a link model of
//! alpha = 8 ms and beta = 2 MB/s, the fit recovers both within 25 %.

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "fsdp/comm/concepts.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/device/host.hpp"
#include "fsdp/schedule/cost_model.hpp"

namespace fsdp::schedule {

//! What calibrate() measures: each kind at each size (elements of f32 per rank: the all-gather
//! input, the reduce-scatter output, the all-reduce buffer), `reps` timed runs after `warmup`
//! untimed ones, and the median of the runs.
struct calibrate_options {
  std::vector<std::size_t> counts{std::size_t{1} << 12, std::size_t{1} << 16, std::size_t{1} << 18};
  int warmup = 1;
  int reps = 5;
};

namespace detail {

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t m = v.size() / 2;
  return v.size() % 2 == 1 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

// Least squares of y = alpha + x / beta over the points (x = bytes sent, y = seconds). A slope
// at or below zero (noise, or a free link) gives beta = infinity; a negative intercept alpha 0.
inline link_cost fit_link(const std::vector<double>& x, const std::vector<double>& y) {
  const double n = static_cast<double>(x.size());
  double mx = 0, my = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    mx += x[i] / n;
    my += y[i] / n;
  }
  double sxx = 0, sxy = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    sxx += (x[i] - mx) * (x[i] - mx);
    sxy += (x[i] - mx) * (y[i] - my);
  }
  const double slope = sxx > 0 ? sxy / sxx : 0;
  const double alpha = std::max(0.0, my - slope * mx);
  return {alpha, slope > 0 ? 1.0 / slope : std::numeric_limits<double>::infinity()};
}

}  // namespace detail

//! Collective over `comm` (every rank calls it): times all-gather, reduce-scatter and
//! all-reduce of f32 at each of opts.counts on `queue`, takes the median of opts.reps runs
//! (each after a barrier, so that skew between ranks is not counted), averages the medians
//! over ranks (one all-reduce) so that every rank gets the same model, and fits alpha and beta
//! per kind by least squares against the bytes this rank sends. Buffers come from `device`.
//! Throws fsdp::error(errc::invalid_argument) with fewer than 2 counts or reps, or on one rank
//! (nothing is sent). Calibrate the shard group for all-gather and reduce-scatter and the
//! replica group for all-reduce when they differ.
template <class Comm, class Device>
  requires can_all_gather<Comm> && can_reduce_scatter<Comm> && can_all_reduce<Comm> && can_split<Comm>
cost_model calibrate(Comm& comm, Device& device, queue_of<Comm>& queue, const calibrate_options& opts = {}) {
  const int n = comm.size();
  if (n < 2) throw error(errc::invalid_argument, "calibrate: needs a communicator of at least 2 ranks");
  if (opts.counts.size() < 2 || opts.reps < 1 || opts.warmup < 0)
    throw error(errc::invalid_argument, "calibrate: needs at least 2 counts and 1 rep");
  for (std::size_t c : opts.counts)
    if (c == 0) throw error(errc::invalid_argument, "calibrate: counts must be at least 1");
  const std::size_t largest = *std::max_element(opts.counts.begin(), opts.counts.end());
  const auto wait_bound = comm.timeout() * 2 + std::chrono::milliseconds(1000);
  // One buffer of n * largest floats serves as every send and receive (zero-filled values).
  auto buf = device.allocate(largest * static_cast<std::size_t>(n) * 2 * sizeof(float), mem_kind::transient);
  float* base = static_cast<float*>(buf.data());
  float* out = base + largest * static_cast<std::size_t>(n);

  using clock = std::chrono::steady_clock;
  const std::size_t kinds = 3;
  std::vector<double> medians(kinds * opts.counts.size());
  for (std::size_t k = 0; k < kinds; ++k) {
    for (std::size_t s = 0; s < opts.counts.size(); ++s) {
      const std::size_t count = opts.counts[s];
      auto run = [&] {
        if (k == 0)
          return comm.all_gather(base + count * static_cast<std::size_t>(comm.rank()), base, count, dtype::f32, queue);
        if (k == 1) return comm.reduce_scatter(base, out, count, dtype::f32, reduce_op::sum, queue);
        return comm.all_reduce(base, base, count, dtype::f32, reduce_op::sum, queue);
      };
      std::vector<double> times;
      for (int r = 0; r < opts.warmup + opts.reps; ++r) {
        comm.barrier();
        const auto t0 = clock::now();
        run().wait(wait_bound, "calibrate");
        const auto t1 = clock::now();
        if (r >= opts.warmup) times.push_back(std::chrono::duration<double>(t1 - t0).count());
      }
      medians[k * opts.counts.size() + s] = detail::median(std::move(times));
    }
  }
  // Every rank must plan from the same model: average the medians over ranks.
  auto shared = device.allocate(medians.size() * sizeof(double), mem_kind::transient);
  device.copy_from_host(shared.data(), medians.data(), shared.bytes());
  comm.all_reduce(shared.data(), shared.data(), medians.size(), dtype::f64, reduce_op::avg, queue)
      .wait(wait_bound, "calibrate");
  device.copy_to_host(medians.data(), shared.data(), shared.bytes());

  cost_model m;
  link_cost* out_costs[kinds] = {&m.all_gather, &m.reduce_scatter, &m.all_reduce};
  for (std::size_t k = 0; k < kinds; ++k) {
    std::vector<double> x, y;
    for (std::size_t s = 0; s < opts.counts.size(); ++s) {
      const std::size_t c = opts.counts[s];
      const std::uint64_t sent = k == 2 ? detail::all_reduce_bytes(c, sizeof(float), n)
                                        : detail::all_gather_bytes(c, sizeof(float), n);
      x.push_back(static_cast<double>(sent));
      y.push_back(medians[k * opts.counts.size() + s]);
    }
    *out_costs[k] = detail::fit_link(x, y);
  }
  return m;
}

//! calibrate() with buffers in host memory, for communicators of the host device (threads,
//! mpi).
template <class Comm>
  requires can_all_gather<Comm> && can_reduce_scatter<Comm> && can_all_reduce<Comm> && can_split<Comm> &&
           std::same_as<typename Comm::device_type, host_device>
cost_model calibrate(Comm& comm, queue_of<Comm>& queue, const calibrate_options& opts = {}) {
  host_device device;
  return calibrate(comm, device, queue, opts);
}

}  // namespace fsdp::schedule
