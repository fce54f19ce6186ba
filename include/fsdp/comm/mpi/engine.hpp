#pragma once
//! \file The MPI engine: the one thread that owns every MPI call of the process after MPI_Init.
//!
//! Open MPI as packaged in Debian makes no asynchronous progress on its own ("OMPI progress:
//! no"): a non-blocking collective only advances while someone calls into MPI. So the engine
//! makes every MPI call, in rounds: it starts the operations in issue order (the order the host
//! issued them, whatever queue they were enqueued on, so that every rank starts them in the same
//! order, as MPI requires), and polls them with MPI_Test while the ranks compute. A collective
//! enqueued on a host_queue hands its operations to the engine when the queue reaches them and
//! waits for completion. The engine's thread runs the rounds, except that a thread waiting for a
//! small operation runs them itself while the engine is free (the fast path, engine::run()): one
//! thread at a time, under the engine's turn.
//!
//! Every wait is bounded by the communicator's timeout. MPI cannot cancel a collective, so a
//! timed-out or failed one leaves the engine broken: later operations fail at once with
//! errc::peer_failure (mpi::environment then ends the job with MPI_Abort), and the peers are
//! told (comm/mpi/failure_notices.hpp). A peer that stops answering (comm/mpi/heartbeats.hpp)
//! fails everything the same way, within seconds, whatever the timeout.

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fsdp/comm/mpi/datatypes.hpp"
#include "fsdp/comm/mpi/failure_notices.hpp"
#include "fsdp/comm/mpi/heartbeats.hpp"
#include "fsdp/comm/mpi/operation.hpp"
#include "fsdp/core/backoff.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp::mpi::detail {

//! The thread that owns every MPI call of the process after MPI_Init.
class engine {
 public:
  //! `failures` and `beats` are the private communicators failure notices and heartbeats
  //! travel on (duplicates of MPI_COMM_WORLD, which the engine frees: comm/mpi/failure_notices.hpp,
  //! comm/mpi/heartbeats.hpp).
  engine(int rank, MPI_Comm failures, MPI_Comm beats, liveness l)
      : rank_(rank), notices_(rank, failures), beats_(rank, beats, l), thread_([this] { loop(); }) {}
  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;
  ~engine() {
    {
      std::lock_guard lock(m_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  //! The first of `n` consecutive issue-order numbers (host side, at issue time).
  std::uint64_t reserve(std::uint64_t n) noexcept { return issued_.fetch_add(n); }

  //! Operations that receive at most this many bytes take the fast path (run()). Where the
  //! number comes from (bench/mpi_collectives, 2 and 4 processes on the 2-core VM, 2026-11-27):
  //! handing a collective to the engine thread and back cost 5-15 us, most of a 64 KiB
  //! all-gather (10-60 us) and under a tenth of a 1 MiB one (60-300 us). Larger operations
  //! stay with the engine thread: driven from the caller, a 1 MiB reduce-scatter took 3-4x
  //! longer when that thread also made Open MPI's own large calls (about 250 fresh pages were
  //! faulted in a repetition either way, and fsdp's side paid for them; docs/benchmarks.md).
  static constexpr std::size_t fast_path_bytes = std::size_t{256} << 10;

  //! Submits `o` and waits for it (bounded by `wait`; `what` names it in a timeout). For an
  //! operation of at most fast_path_bytes, the waiting thread drives the engine's rounds itself
  //! while nobody else does, for up to handoff_yields() rounds (the fast path, see loop()), then
  //! leaves the rest to the engine thread.
  //!
  //! Its rounds are lean: back to back (it yields only when the engine thread has the turn;
  //! Open MPI's own progress yields the core when processes outnumber cores), and without the
  //! look for peers' failure notices and heartbeats, which the engine thread takes once this
  //! thread hands over (at most handoff_yields() rounds later, or at its 20 ms wake-up). Each of
  //! those looks is an MPI call, and so a pass of Open MPI's progress engine, in every round.
  //! Measured with bench/mpi_collectives on the 2-core VM (2026-11-28, docs/benchmarks.md, 5
  //! interleaved pairs): the waited 64 KiB all-gather went from 0.77 of MPI_Allgather to 0.95 on
  //! 4 processes, and from 0.61 to 0.85 on 2 (medians).
  void run(op o, milliseconds wait, const std::string& what) {
    const std::shared_ptr<op_state> state = o.state;
    const bool drive = o.bytes <= fast_path_bytes;
    {
      std::lock_guard lock(m_);
      submitted_.push_back(std::move(o));
      has_submitted_ = true;
    }
    if (drive) {
      // Counted while it drives (also if a round throws), so that the engine thread sleeps meanwhile.
      struct driving {
        std::atomic<int>& n;
        explicit driving(std::atomic<int>& c) : n(c) { ++n; }
        ~driving() { --n; }
      } counted(drivers_);
      for (unsigned i = fsdp::detail::handoff_yields(); i > 0 && !state->done.load(); --i) {
        if (std::unique_lock turn(turn_, std::try_to_lock); turn) {
          round(/*look_for_failures=*/false);
          if (state->done.load()) break;
          continue;
        }
        std::this_thread::yield();
      }
    }
    // Whatever is left (this op, or others that this thread's rounds started) is the engine
    // thread's now: wake it. Taking m_ first orders its idle wait's look at the flags with this
    // notify.
    if (pending_.load() || has_submitted_.load()) {
      { std::lock_guard lock(m_); }
      cv_.notify_all();
    }
    state->wait(wait, what);
  }

  //! True once a collective timed out or failed: MPI state can no longer be trusted.
  bool broken() const noexcept { return broken_; }
  //! Why it broke: the first failure this process saw or was told of (empty while healthy).
  std::string broken_reason() {
    std::lock_guard lock(m_);
    return broken_text_;
  }

  //! Tells every other rank that this one failed (`why` is the message they report), fails
  //! what is queued here, and returns once the notices were sent (at most about 1 s: a dead
  //! peer never receives). Any thread; the first call counts.
  void abort(const std::string& why) {
    std::unique_lock lock(m_);
    if (!abort_request_) abort_request_ = why;
    cv_.notify_all();
    cv_.wait_for(lock, std::chrono::seconds(2), [&] { return notices_sent_ || exited_; });
  }

 private:
  // Fails op o with fsdp::error(code, what), thrown and caught here: a copied runtime_error
  // shares a reference-counted message with its original, so no copy of it may die on this
  // thread while the waiter reads it (ThreadSanitizer reported that as a race: libstdc++'s
  // reference counts are not instrumented). The waiter takes the only reference (op_state::wait).
  void fail(op& o, errc code, const std::string& what) {
    std::exception_ptr e;
    try {
      throw error(code, what, error_site{rank_});
    } catch (...) {
      e = std::current_exception();
    }
    o.state->complete(std::move(e));
  }
  void finish(op& o) {
    try {
      if (o.finish) o.finish(o.status);
      o.state->complete(nullptr);
    } catch (...) {
      o.state->complete(std::current_exception());
    }
  }
  void poison(const std::string& why) {
    if (!broken_) {
      broken_reason_ = why;
      std::lock_guard lock(m_);
      broken_text_ = why;
    }
    broken_ = true;
  }

  // Tells the peers that this process failed, or (relayed) that another one did (once), then
  // whoever waits in abort().
  void notify_peers(const std::string& why, bool relayed) {
    notices_.send(why, relayed);
    {
      std::lock_guard lock(m_);
      notices_sent_ = true;
    }
    cv_.notify_all();
  }

  // A failure: remember `why`, send `notice` to the peers (unless this failure came from one;
  // `relayed` when it is about another rank), fail every collective here, in flight or queued.
  // Collectives in flight are abandoned, never tested again (MPI cannot cancel them; their
  // buffers may be freed).
  void fail_everything(errc code, const std::string& why, const std::string& notice, bool relayed = false) {
    poison(why);
    if (!notices_.received()) notify_peers(notice, relayed);
    for (auto& o : active_) fail(o, code, o.what + ": " + why);
    active_.clear();
    for (auto& [seq, o] : waiting_) fail(o, code, o.what + ": not started: " + why);
    waiting_.clear();
  }

  // Looks for a peer's failure notice; on one, fails everything (and releases abort()'s wait:
  // the failed rank told everyone, this one has nothing to add).
  void check_notices() {
    const std::optional<peer_notice> n = notices_.poll();
    if (!n) return;
    {
      std::lock_guard lock(m_);
      notices_sent_ = true;
    }
    cv_.notify_all();
    fail_everything(errc::peer_failure, n->relayed ? n->text : "rank " + std::to_string(n->rank) + " failed: " + n->text, {});
  }

  // Sends and takes heartbeats; a peer silent past the limit fails everything here, and the
  // others are told (each would find it within about 100 ms; the notice makes it at once).
  void check_liveness() {
    const std::optional<silent_peer> s = beats_.tick(std::chrono::steady_clock::now());
    if (!s) return;
    char ago[32];
    std::snprintf(ago, sizeof ago, "%.1f", std::chrono::duration<double>(s->silent).count());
    const std::string why = "rank " + std::to_string(s->rank) + " stopped answering (killed, stopped, or its host unreachable) " +
                            ago + " s ago";
    fail_everything(errc::peer_failure, why, why + " (seen by rank " + std::to_string(rank_) + ")", true);
  }

  void start_ready_ops() {
    if (broken_) {  // nothing starts any more, whatever its number
      for (auto& [seq, o] : waiting_)
        fail(o, errc::peer_failure, o.what + ": not started because an earlier collective failed: " + broken_reason_);
      waiting_.clear();
      return;
    }
    for (auto it = waiting_.find(next_start_); it != waiting_.end(); it = waiting_.find(next_start_)) {
      op o = std::move(it->second);
      waiting_.erase(it);
      ++next_start_;
      if (broken_) {
        fail(o, errc::peer_failure, o.what + ": not started because an earlier collective failed: " + broken_reason_);
        continue;
      }
      const int rc = o.start(&o.request);
      if (rc != MPI_SUCCESS) {
        const std::string what = o.what + " failed: " + mpi_error_string(rc);
        const std::string text = error(errc::peer_failure, what, error_site{rank_}).what();
        fail(o, errc::peer_failure, what);
        fail_everything(errc::peer_failure, text, text);
      } else if (o.request == MPI_REQUEST_NULL) {
        finish(o);  // a blocking call, done inside start()
      } else {
        o.deadline = std::chrono::steady_clock::now() + o.timeout;
        active_.push_back(std::move(o));
      }
    }
  }

  // Tests every active request once; returns whether any completed. A failure or a timeout
  // fails everything (the notice tells the peers).
  bool progress() {
    bool any = false;
    const auto now = std::chrono::steady_clock::now();
    for (auto it = active_.begin(); it != active_.end();) {
      int flag = 0;
      const int rc = MPI_Test(&it->request, &flag, &it->status);
      std::optional<std::pair<errc, std::string>> failed;
      if (rc != MPI_SUCCESS) {
        failed.emplace(errc::peer_failure, it->what + " failed: " + mpi_error_string(rc));
      } else if (flag) {
        finish(*it);
        any = true;
        it = active_.erase(it);
        continue;
      } else if (now > it->deadline) {
        failed.emplace(errc::timeout, it->what + ": no progress after " + std::to_string(it->timeout.count()) +
                                          " ms (a peer is stuck, gone, or issued different collectives)");
      } else {
        ++it;
        continue;
      }
      const std::string text = error(failed->first, failed->second, error_site{rank_}).what();
      fail(*it, failed->first, failed->second);
      active_.erase(it);
      fail_everything(failed->first, text, text);
      return any;
    }
    return any;
  }

  // One round of the engine's work, on whichever thread holds turn_: take what was submitted,
  // act on an abort request, look for a peer's failure notice and silent peers (the engine
  // thread's rounds: run() says why), start what is next in issue order, test what is in
  // flight; count a round that completed an operation.
  void round(bool look_for_failures = true) {
    std::optional<std::string> abort_request;
    {
      std::lock_guard lock(m_);
      for (auto& o : submitted_) {
        const std::uint64_t s = o.seq;
        waiting_.emplace(s, std::move(o));
      }
      submitted_.clear();
      has_submitted_ = false;
      if (abort_request_ && !notices_.settled()) abort_request = abort_request_;
    }
    if (abort_request) fail_everything(errc::peer_failure, "rank " + std::to_string(rank_) + " failed: " + *abort_request, *abort_request);
    if (look_for_failures && !broken_) check_notices();
    if (look_for_failures && !broken_) check_liveness();
    start_ready_ops();
    if (progress()) ++completions_;
    pending_ = !active_.empty() || waiting_.find(next_start_) != waiting_.end();
  }

  // The engine thread. Each round runs under turn_, which a thread waiting for its own small
  // collective takes too when it is free (run(): the fast path): it then starts and tests the
  // collective itself, without handing it to this thread and back (two wake-ups of a thread
  // that, with ranks outnumbering cores, first waits for a core). This thread drives whatever
  // is left, and alone shuts the engine down.
  void loop() {
    for (;;) {
      bool stopping = false;
      {
        std::unique_lock lock(m_);
        // Idle, or a waiting thread drives the rounds: wake for a stop, an abort, work left to
        // this thread, or every 20 ms to look for a peer's notice. It spins first, polling the
        // flags without the lock (detail::spin_then_wait): the next collective often follows
        // within microseconds, and waking a sleeping engine costs more than that.
        auto mine = [&] { return drivers_.load() == 0 && (has_submitted_.load() || pending_.load()); };
        auto work = [&] { return stop_ || (abort_request_ && !notices_.settled()) || mine(); };
        if (!work()) fsdp::detail::spin_then_wait(cv_, lock, std::chrono::steady_clock::now() + milliseconds(20), work, mine);
        stopping = stop_;
      }
      std::unique_lock turn(turn_, std::try_to_lock);
      if (!turn) {  // a waiting thread runs a round: look again after it
        std::this_thread::yield();
        continue;
      }
      round();
      if (stopping && active_.empty()) {
        // What is still waiting can never start: an earlier number was issued but never handed
        // over (its queue was torn down after a failure).
        for (auto& [seq, o] : waiting_)
          fail(o, errc::peer_failure, o.what + ": never started (shutting down)");
        waiting_.clear();
        if (!broken_) {
          notices_.close();
          beats_.close();
        }
        std::lock_guard lock(m_);
        exited_ = true;
        cv_.notify_all();
        return;
      }
      turn.unlock();
      // Open MPI progresses only inside MPI calls: poll, back to back for a while after a
      // completion, then with short sleeps (core/backoff.hpp) so that the ranks' compute
      // (often oversubscribed) keeps running. Completions in waiting threads' rounds count too:
      // the backoff measures how long nothing has completed.
      if (const std::uint64_t c = completions_.load(); c != completions_seen_) {
        completions_seen_ = c;
        idle_.reset();
      } else if (pending_.load()) {
        idle_.pause();
      }
    }
  }

  int rank_;
  std::atomic<std::uint64_t> issued_{0};
  std::mutex m_;
  std::condition_variable cv_;
  std::vector<op> submitted_;             // guarded by m_
  std::atomic<bool> has_submitted_{false};  // !submitted_.empty(), set under m_, polled without it
  // The right to run a round (round()): held by the engine thread or by a waiting thread
  // (run()). What the comments below call the engine's own is guarded by it.
  std::mutex turn_;
  std::atomic<bool> pending_{false};  // set by round(): an operation is in flight or can start
  std::atomic<int> drivers_{0};       // threads in run()'s fast path
  std::atomic<std::uint64_t> completions_{0};  // rounds that completed an operation, on any thread
  bool stop_ = false;                     // guarded by m_
  std::optional<std::string> abort_request_;  // guarded by m_: communicator::abort() was called
  bool notices_sent_ = false;             // guarded by m_
  bool exited_ = false;                   // guarded by m_: the engine thread returned
  std::string broken_text_;               // guarded by m_: broken_reason_ for other threads
  std::map<std::uint64_t, op> waiting_;   // the engine's own
  std::deque<op> active_;                 // the engine's own
  std::uint64_t next_start_ = 0;          // the engine's own
  fsdp::detail::backoff idle_ = fsdp::detail::backoff::mpi_progress();  // the engine thread's only
  std::uint64_t completions_seen_ = 0;    // the engine thread's only: completions_ at its last reset
  std::atomic<bool> broken_{false};
  std::string broken_reason_;             // the engine's own
  failure_notices notices_;               // the engine's own (in rounds); after the hot members: its 1 KiB text
  heartbeats beats_;                      // the engine's own (in rounds)
  std::thread thread_;                    // last: starts after the members it uses
};

}  // namespace fsdp::mpi::detail
