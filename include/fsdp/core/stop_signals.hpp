#pragma once
//! \file Preemption: SIGTERM (what Slurm and cloud schedulers send before they kill a job),
//! SIGINT (Ctrl-C) and SIGUSR1 (Slurm's `--signal=USR1@SECONDS`) turned into a request to stop
//! that a training loop reads at each step end, agrees on with every rank (the ranks may have
//! received it at different steps, or only one of them at all), and acts on: a checkpoint, then
//! exit with exit_status(signal).
//!
//!   fsdp::stop_signals stop;                      // before the ranks start
//!   for (int step = 0; ...; ++step) {
//!     /* ... the step ... */
//!     const int mine = fsdp::stop_signals::received();       // 0, or the signal
//!     if (int s = agree_over_ranks(mine); s != 0) {          // e.g. in the step's exchange of figures
//!       save_checkpoint(step + 1);
//!       return fsdp::stop_signals::exit_status(s);           // 128 + s, as a shell reports it
//!     }
//!   }
//!
//! A second signal while the first is still pending ends the process at once (Ctrl-C twice).
//! One stop_signals at a time; its destructor puts the previous handlers back.

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <string>

#include "fsdp/core/error.hpp"

namespace fsdp {

class stop_signals {
 public:
  stop_signals() {
    pending() = 0;  // the flag exists before any handler can touch it
    struct sigaction sa {};
    sa.sa_handler = &on_signal;
    sigemptyset(&sa.sa_mask);
    for (int k = 0; k < 3; ++k)
      if (::sigaction(signals[k], &sa, &previous_[k]) != 0)
        throw error(errc::internal, "stop_signals: cannot install a handler for " + name(signals[k]));
  }
  ~stop_signals() {
    for (int k = 0; k < 3; ++k) ::sigaction(signals[k], &previous_[k], nullptr);
  }
  stop_signals(const stop_signals&) = delete;
  stop_signals& operator=(const stop_signals&) = delete;

  //! The signal received since construction (the first one), 0 when none.
  static int received() noexcept { return pending().load(std::memory_order_relaxed); }
  //! The exit status a shell reports for a process that `signal` ended: 128 + signal (143 for
  //! SIGTERM, 130 for SIGINT, 138 for SIGUSR1 on Linux), so a scheduler reads the cause.
  static int exit_status(int signal) noexcept { return 128 + signal; }
  //! "SIGTERM", "SIGINT", "SIGUSR1".
  static std::string name(int signal) {
    switch (signal) {
      case SIGTERM: return "SIGTERM";
      case SIGINT: return "SIGINT";
      case SIGUSR1: return "SIGUSR1";
      default: return "signal " + std::to_string(signal);
    }
  }

 private:
  static constexpr int signals[3] = {SIGTERM, SIGINT, SIGUSR1};
  static std::atomic<int>& pending() noexcept {
    static std::atomic<int> s{0};
    static_assert(std::atomic<int>::is_always_lock_free);  // what a signal handler may touch
    return s;
  }
  static void on_signal(int s) {
    int none = 0;
    if (!pending().compare_exchange_strong(none, s)) std::_Exit(exit_status(s));  // the second one
  }
  struct sigaction previous_[3] {};
};

}  // namespace fsdp
