#pragma once
//! \file One MPI operation as the engine (comm/mpi/engine.hpp) runs it, and its completion, which
//! the thread that submitted it waits for.

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "fsdp/core/backoff.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/timeout.hpp"

namespace fsdp::mpi::detail {

//! Completion of one operation, waited on by the thread that submitted it.
struct op_state {
  std::mutex m;
  std::condition_variable cv;
  std::atomic<bool> done{false};  // set under m; polled without it while the waiter spins
  std::exception_ptr failure;

  void complete(std::exception_ptr e) {
    {
      std::lock_guard lock(m);
      failure = std::move(e);
      done = true;
    }
    cv.notify_all();
  }
  // Spins briefly before it sleeps (detail::spin_then_wait): a small collective completes
  // within microseconds, and a sleeping waiter costs a futex wake-up on top.
  void wait(milliseconds timeout, const std::string& what) {
    std::unique_lock lock(m);
    auto is_done = [&] { return done.load(); };
    if (!fsdp::detail::spin_then_wait(cv, lock, std::chrono::steady_clock::now() + timeout, is_done, is_done))
      throw error(errc::timeout, what + ": not started or finished within " + std::to_string(timeout.count()) +
                                     " ms (an earlier collective is stuck)");
    // The waiter takes the failure: the engine, which destroys the op later, must not be
    // the one to release an exception other threads have read. (It was, and ThreadSanitizer
    // reported a race in ~runtime_error: libstdc++'s reference counts are not instrumented, so
    // the order they give is invisible to it.)
    if (failure) std::rethrow_exception(std::exchange(failure, nullptr));
  }
};

//! One operation for the engine: start() issues it (returning an MPI return code and, for a
//! non-blocking call, a request); finish(status) runs on completion (e.g. the sum of a
//! reduce-scatter's blocks, or the check of a receive's length), and may throw to fail it.
struct op {
  std::uint64_t seq = 0;
  std::string what;
  std::function<int(MPI_Request*)> start;
  std::function<void(const MPI_Status&)> finish;
  milliseconds timeout{0};
  std::shared_ptr<op_state> state = std::make_shared<op_state>();
  std::size_t bytes = 0;  // what this rank receives: engine::run() drives only small operations
  MPI_Request request = MPI_REQUEST_NULL;
  MPI_Status status{};  // of the completed request (MPI_Test)
  std::chrono::steady_clock::time_point deadline{};
};

}  // namespace fsdp::mpi::detail
