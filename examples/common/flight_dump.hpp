#pragma once
// examples/common/flight_dump.hpp: the examples' use of fsdp's flight recorder
// (fsdp/comm/flight_recorder.hpp): a rank's record is written when it fails, and every rank's of
// this process on SIGUSR1, at once (a hung job never reaches the step end where the stop that
// SIGUSR1 also asks for is agreed). With a log directory the records go to
// DIR/flight_rank_<r>.jsonl, for scripts/fsdp-flight to merge; without one, each rank's
// unfinished collectives go to stderr.

#include <chrono>
#include <csignal>
#include <cstdio>
#include <exception>
#include <mutex>
#include <sstream>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include <fsdp/comm/flight_recorder.hpp>
#include <fsdp/core/stop_signals.hpp>

namespace example {

//! Writes the flight records of `ranks` (world ranks of this process); `why` says what led to it.
inline void dump_flight_records(const std::string& dir, const std::vector<int>& ranks, int world_size, const char* why) {
  // One rank thread at a time: stderr may be rank_log.hpp's tee, whose stdio locking inside
  // glibc ThreadSanitizer cannot see (it reported two failing ranks' lines as a race).
  static std::mutex one_at_a_time;
  const std::lock_guard lock(one_at_a_time);
  for (int r : ranks) {
    try {
      const auto& rec = fsdp::flight_recorder::of(r);
      if (rec.capacity() == 0) continue;  // FSDP_FLIGHT_RECORDER=0
      if (!dir.empty()) {
        std::fprintf(stderr, "rank %d's flight record (%s): %s\n", r, why, rec.write_to(dir, world_size).c_str());
      } else {
        std::ostringstream s;
        rec.write(s, world_size, /*unfinished_only=*/true);
        if (s.str().find('\n') + 1 == s.str().size()) continue;  // the header alone: nothing unfinished
        std::fprintf(stderr, "rank %d's flight record (%s), its unfinished collectives:\n%s", r, why, s.str().c_str());
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank %d's flight record could not be written: %s\n", r, e.what());
    }
  }
  std::fflush(stderr);
}

//! While it lives, a SIGUSR1 (read from fsdp::stop_signals, polled every 100 ms) writes the
//! records of `ranks` once.
class flight_dump_on_usr1 {
 public:
  flight_dump_on_usr1(std::string dir, std::vector<int> ranks, int world_size)
      : thread_([dir = std::move(dir), ranks = std::move(ranks), world_size](std::stop_token stop) {
          while (!stop.stop_requested()) {
            if (fsdp::stop_signals::received() == SIGUSR1) {
              dump_flight_records(dir, ranks, world_size, "SIGUSR1");
              return;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
          }
        }) {}

 private:
  std::jthread thread_;
};

}  // namespace example
