#pragma once
//! \file The threads backend's link model: shared memory makes communication nearly free, so
//! overlap of compute and communication cannot be seen. With a latency alpha and a bandwidth
//! beta, each collective occupies a link of every member rank for alpha + bytes / beta seconds,
//! where bytes is what that rank sends under the ring formulas of traffic_counters (barrier and
//! split: alpha alone). Each rank has one link, shared by all its communicators (the world and
//! its splits) and queues: once a collective's data has moved, it takes the link at
//! max(now, when the link is next free) and the thread that ran it (a queue's thread; the caller
//! for barrier and split) sleeps until the modelled end before its event completes. So
//! collectives of one rank serialize on its link in the order they reach it, and the compute
//! thread is not slowed. The sleep ends at once with errc::peer_failure if the world aborts, and
//! with errc::timeout if the modelled end passes the collective's timeout (comm/threads/rendezvous.hpp).
//!
//! With a link model (from tests/comm/test_link.cpp), an all_gather of 4 f32 per rank on 4 ranks
//! sends 48 bytes from each rank and its event completes no sooner than 0.01 + 48 / 1e3 s after issue:
//!   fsdp::threads::world{4, {.link = {.alpha_s = 0.01, .beta_bytes_per_s = 1e3}}}.run(...);

#include <cstdint>
#include <cstdio>
#include <string>

namespace fsdp::threads {

namespace detail {
//! A double as printf's %g writes it ("0.01", "1.25e+10", "nan"): std::to_string's fixed six
//! decimals would print a 5 us latency as "0.000005".
inline std::string format_g(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}
}  // namespace detail

//! A modelled network link per rank: each collective holds it for alpha + bytes / beta
//! seconds, with bytes what the rank sends (see the file comment). beta = 0 disables the model
//! (the default; alpha is then ignored), and collectives take only the time their copies take.
//! For a latency-only link, give a beta far above the bytes moved. Example:
//!   fsdp::threads::world{4, {.link = {.alpha_s = 5e-6, .beta_bytes_per_s = 12.5e9}}}  // ~100 Gb/s
struct link_model {
  double alpha_s = 0;           //!< latency per collective, seconds (finite, >= 0)
  double beta_bytes_per_s = 0;  //!< bandwidth, bytes per second (finite, >= 0; 0 = no model)

  //! True when collectives are charged link time (beta > 0).
  bool enabled() const noexcept { return beta_bytes_per_s > 0; }
  //! Seconds the link is busy with a collective in which this rank sends `bytes`:
  //! alpha + bytes / beta; 0 when the model is disabled.
  double seconds(std::uint64_t bytes) const noexcept {
    return enabled() ? alpha_s + static_cast<double>(bytes) / beta_bytes_per_s : 0.0;
  }
  friend bool operator==(const link_model&, const link_model&) = default;
};

//! "link_model{.alpha_s = 0.01, .beta_bytes_per_s = 1000}"
inline std::string to_string(const link_model& l) {
  return "link_model{.alpha_s = " + detail::format_g(l.alpha_s) +
         ", .beta_bytes_per_s = " + detail::format_g(l.beta_bytes_per_s) + "}";
}

}  // namespace fsdp::threads
