#pragma once
//! \file A world of thread ranks: runs a function on N threads, each with its communicator over
//! all of them, and joins them.

#include <cmath>
#include <exception>
#include <memory>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "fsdp/comm/threads/communicator.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp::threads {

//! Runs a function on N thread ranks and joins them.
//!   fsdp::threads::world{4}.run([&](fsdp::threads::communicator& comm) { ... });
//! run() returns when every rank has returned, and rethrows the first failure (the root
//! cause, not the peer failures it caused on other ranks).
class world {
 public:
  explicit world(int size, world_options opts = {}) : size_(size), opts_(opts) {
    if (size < 1) throw error(errc::invalid_argument, "a world needs at least 1 rank, got " + std::to_string(size));
    if (opts.timeout <= milliseconds(0)) throw error(errc::invalid_argument, "world timeout must be positive");
    if (opts.ranks_per_host < 0)
      throw error(errc::invalid_argument,
                  "world_options::ranks_per_host must be >= 0 (0: one host), got " + std::to_string(opts.ranks_per_host));
    const link_model& l = opts.link;
    if (!std::isfinite(l.alpha_s) || l.alpha_s < 0)
      throw error(errc::invalid_argument,
                  "world_options::link.alpha_s must be finite and >= 0 seconds, got " + detail::format_g(l.alpha_s));
    if (!std::isfinite(l.beta_bytes_per_s) || l.beta_bytes_per_s < 0)
      throw error(errc::invalid_argument,
                  "world_options::link.beta_bytes_per_s must be finite and >= 0 (0 disables the link model), got " +
                      detail::format_g(l.beta_bytes_per_s));
  }
  int size() const noexcept { return size_; }

  template <class F>
  void run(F&& fn) const {
    auto state = std::make_shared<detail::world_state>(size_, opts_);
    std::vector<int> all(static_cast<std::size_t>(size_));
    for (int r = 0; r < size_; ++r) all[static_cast<std::size_t>(r)] = r;
    auto root = state->make_group(all, "world");
    std::vector<std::thread> threads;
    threads.reserve(static_cast<std::size_t>(size_));
    for (int r = 0; r < size_; ++r) {
      try {
        threads.emplace_back([&, r] {
          try {
            communicator comm(root, r);
            fn(comm);
          } catch (const error& e) {
            state->fail(std::current_exception(), "rank " + std::to_string(r) + " failed: " + e.what(),
                        e.code() == errc::peer_failure);
          } catch (const std::exception& e) {
            state->fail(std::current_exception(), "rank " + std::to_string(r) + " failed: " + e.what());
          } catch (...) {
            state->fail(std::current_exception(), "rank " + std::to_string(r) + " failed");
          }
          state->mark_exited(r);
        });
      } catch (const std::system_error& e) {
        // No thread for rank r (a thread or memory limit): the ranks already running must not be
        // left joinable (std::terminate) nor wait for ranks that never start. Fail the world,
        // count the missing ranks as gone (their peers stop at once), join, throw the cause.
        const error failure(errc::invalid_argument, "a world of " + std::to_string(size_) +
                                                        " ranks: could not start the thread of rank " + std::to_string(r) +
                                                        " (" + e.what() + "); ask for fewer ranks or raise the thread limit");
        state->fail(std::make_exception_ptr(failure), failure.what());
        for (int q = r; q < size_; ++q) state->mark_exited(q);
        break;
      }
    }
    for (auto& t : threads) t.join();
    if (state->first_failure) std::rethrow_exception(state->first_failure);
    if (state->first_echo) std::rethrow_exception(state->first_echo);
  }

 private:
  int size_;
  world_options opts_;
};

}  // namespace fsdp::threads
