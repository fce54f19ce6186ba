#pragma once
//! \file The `mpi` backend: ranks are MPI processes (one or many hosts, launched by mpiexec).
//!
//! Open MPI as packaged in Debian makes no asynchronous progress on its own ("OMPI progress:
//! no"): a non-blocking collective only advances while someone calls into MPI. So one engine
//! per process makes every MPI call after MPI_Init, in rounds: it starts the collectives in issue
//! order (the order the host issued them, whatever queue they were enqueued on, so that every
//! rank starts them in the same order, as MPI requires), and polls them with MPI_Test while the
//! ranks compute. A collective enqueued on a host_queue hands its request to the engine when
//! the queue reaches it and waits for completion. The engine's thread runs the rounds, except
//! that a thread waiting for a small collective runs them itself while the engine is free (the
//! fast path, engine::run()): one thread at a time, under the engine's turn.
//!
//! Every wait is bounded by the communicator's timeout. MPI cannot cancel a collective, so a
//! timed-out collective leaves the engine broken: later collectives fail at once with
//! errc::peer_failure, and environment's destructor ends the job with MPI_Abort instead of
//! MPI_Finalize (which would wait forever on the stuck peer): the last resort, after the error
//! has been thrown on this rank, and after printing it (the root cause must reach the user
//! even when MPI_Abort ends the process before the program's own handler runs).
//!
//! Failing fast: each engine keeps a receive posted on a private duplicate of MPI_COMM_WORLD.
//! A rank that fails (communicator::abort(), which shard_group calls when it is left by an
//! exception, or a collective of its own that failed or timed out) sends its error text to
//! every other rank there. A rank that receives it fails every collective in flight or queued
//! with errc::peer_failure naming the failed rank and its message, within milliseconds, instead
//! of waiting out its timeout. After that the engine makes no more MPI calls for collectives
//! (their buffers may be freed), and the job ends with MPI_Abort. A process killed outright
//! sends nothing: its peers still end by the timeout.
//!
//! Reductions sum in rank order (comm/rank_order_sum.hpp), so that they equal the threads
//! backend's bit for bit: MPI's own reduce-scatter and all-reduce pick a ring, a tree or
//! recursive halving by size and rank count, and each adds in another order. A reduce_scatter is
//! an MPI_Ialltoall (rank r receives every rank's block r, into a scratch buffer as large as the
//! send buffer, held while the collective runs) followed by the sum on this rank; an all_reduce
//! is the same on 1/n of the elements (MPI_Ialltoallv) followed by an MPI_Iallgatherv of the
//! sums. Each rank sends what the ring formulas of traffic_counters count. bf16 and f16 (absent
//! from mpi.h) travel as 2-byte types. reduce_scatter always uses distinct send and receive
//! buffers, as NCCL's layout for an in-place reduce-scatter is not MPI's.
//!
//! Hosts (comm/topology.hpp): the processes that share memory (MPI_Comm_split_type with
//! MPI_COMM_TYPE_SHARED, found at MPI_Init) are one host; every communicator knows the host of
//! each of its ranks (hosts()), so the traffic counters split off the inter-host bytes and
//! hybrid_shard_per_host() shards inside each host.
//!
//!   int main(int argc, char** argv) {
//!     fsdp::mpi::environment env(argc, argv);
//!     fsdp::mpi::communicator comm = env.world();
//!     ... fsdp::shard_group<fsdp::buffer<float>, fsdp::mpi::communicator> group{comm}; ...
//!   }

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fsdp/comm/concepts.hpp"
#include "fsdp/comm/rank_order_sum.hpp"
#include "fsdp/comm/topology.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/detail/backoff.hpp"
#include "fsdp/device/host.hpp"

namespace fsdp::mpi {

namespace detail {

inline std::string mpi_error_string(int rc) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  return std::string(text, static_cast<std::size_t>(len));
}

//! The MPI datatypes for bf16 and f16, created once per process.
struct half_types {
  MPI_Datatype bf16 = MPI_DATATYPE_NULL;
  MPI_Datatype f16 = MPI_DATATYPE_NULL;
};
inline half_types& halves() {
  static half_types h;
  return h;
}

inline MPI_Datatype mpi_type(dtype t) {
  switch (t) {
    case dtype::f32: return MPI_FLOAT;
    case dtype::f64: return MPI_DOUBLE;
    case dtype::bf16: return halves().bf16;
    case dtype::f16: return halves().f16;
    case dtype::i32: return MPI_INT32_T;
    case dtype::i64: return MPI_INT64_T;
    case dtype::u8: return MPI_BYTE;
  }
  return MPI_DATATYPE_NULL;
}

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
//! non-blocking call, a request); finish() runs on completion (e.g. the scaling of an average).
struct op {
  std::uint64_t seq = 0;
  std::string what;
  std::function<int(MPI_Request*)> start;
  std::function<void()> finish;
  milliseconds timeout{0};
  std::shared_ptr<op_state> state = std::make_shared<op_state>();
  std::size_t bytes = 0;  // what this rank receives: engine::run() drives only small operations
  MPI_Request request = MPI_REQUEST_NULL;
  std::chrono::steady_clock::time_point deadline{};
};

//! The thread that owns every MPI call of the process after MPI_Init.
class engine {
 public:
  //! `failures` is the private communicator failure notices travel on (a duplicate of
  //! MPI_COMM_WORLD, which the engine frees).
  engine(int rank, MPI_Comm failures) : rank_(rank), failures_(failures), thread_([this] { loop(); }) {}
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
          round();
          if (state->done.load()) break;
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
      if (o.finish) o.finish();
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

  // ---- failure notices (in a round) ----

  static constexpr int notice_tag = 1;
  static constexpr int notice_bytes = 1024;  // a message's first KiB: enough to name the cause

  // Sends `why` to every other rank and waits (bounded) until the sends complete.
  void send_notices(const std::string& why) {
    if (notices_started_) return;
    notices_started_ = true;
    int size = 1;
    MPI_Comm_size(failures_, &size);
    const std::string text = why.substr(0, notice_bytes - 1);
    std::vector<MPI_Request> sends;
    for (int r = 0; r < size; ++r) {
      if (r == rank_) continue;
      MPI_Request q = MPI_REQUEST_NULL;
      if (MPI_Isend(text.data(), static_cast<int>(text.size()), MPI_CHAR, r, notice_tag, failures_, &q) == MPI_SUCCESS)
        sends.push_back(q);
    }
    // A peer that is alive takes the notice at once (its receive is posted); a dead one never
    // does. 1 s covers the first on a loaded machine without hanging on the second.
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    int done = 0;
    while (!sends.empty() && std::chrono::steady_clock::now() < until) {
      if (MPI_Testall(static_cast<int>(sends.size()), sends.data(), &done, MPI_STATUSES_IGNORE) != MPI_SUCCESS || done) break;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    std::lock_guard lock(m_);
    notices_sent_ = true;
    cv_.notify_all();
  }

  // A failure: remember `why`, send `notice` to the peers (unless this failure came from one),
  // fail every collective here, in flight or queued. Collectives in flight are abandoned, never
  // tested again (MPI cannot cancel them; their buffers may be freed).
  void fail_everything(errc code, const std::string& why, const std::string& notice) {
    poison(why);
    if (!peer_failed_) send_notices(notice);
    for (auto& o : active_) fail(o, code, o.what + ": " + why);
    active_.clear();
    for (auto& [seq, o] : waiting_) fail(o, code, o.what + ": not started: " + why);
    waiting_.clear();
  }

  // Posts the receive for a peer's failure notice, or tests it; on one, fails everything.
  void check_notices() {
    if (notice_ == MPI_REQUEST_NULL) {
      if (peer_failed_) return;
      MPI_Irecv(notice_text_, notice_bytes, MPI_CHAR, MPI_ANY_SOURCE, notice_tag, failures_, &notice_);
      return;
    }
    int flag = 0;
    MPI_Status st;
    if (MPI_Test(&notice_, &flag, &st) != MPI_SUCCESS || !flag) return;
    peer_failed_ = true;
    notices_started_ = true;  // the failed rank told everyone; an abort() here has nothing to add
    {
      std::lock_guard lock(m_);
      notices_sent_ = true;
      cv_.notify_all();
    }
    int len = 0;
    MPI_Get_count(&st, MPI_CHAR, &len);
    const std::string text(notice_text_, static_cast<std::size_t>(std::max(len, 0)));
    fail_everything(errc::peer_failure, "rank " + std::to_string(st.MPI_SOURCE) + " failed: " + text, {});
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
      const int rc = MPI_Test(&it->request, &flag, MPI_STATUS_IGNORE);
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
  // act on an abort request, look for a peer's failure notice, start what is next in issue
  // order, test what is in flight; count a round that completed an operation.
  void round() {
    std::optional<std::string> abort_request;
    {
      std::lock_guard lock(m_);
      for (auto& o : submitted_) {
        const std::uint64_t s = o.seq;
        waiting_.emplace(s, std::move(o));
      }
      submitted_.clear();
      has_submitted_ = false;
      if (abort_request_ && !notices_started_) abort_request = abort_request_;
    }
    if (abort_request) fail_everything(errc::peer_failure, "rank " + std::to_string(rank_) + " failed: " + *abort_request, *abort_request);
    if (!broken_) check_notices();
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
        auto work = [&] { return stop_ || (abort_request_ && !notices_started_) || mine(); };
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
        if (notice_ != MPI_REQUEST_NULL && !broken_) {  // MPI_Finalize needs no receive left posted
          MPI_Cancel(&notice_);
          MPI_Wait(&notice_, MPI_STATUS_IGNORE);
        }
        if (!broken_) MPI_Comm_free(&failures_);
        std::lock_guard lock(m_);
        exited_ = true;
        cv_.notify_all();
        return;
      }
      turn.unlock();
      // Open MPI progresses only inside MPI calls: poll, back to back for a while after a
      // completion, then with short sleeps (detail/backoff.hpp) so that the ranks' compute
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
  MPI_Comm failures_;                     // failure notices travel here
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
  std::atomic<bool> notices_started_{false};  // the engine's own; read under m_ by the idle wait too
  bool peer_failed_ = false;              // the engine's own
  MPI_Request notice_ = MPI_REQUEST_NULL;  // the engine's own: the posted receive
  char notice_text_[notice_bytes] = {};   // the engine's own
  std::map<std::uint64_t, op> waiting_;   // the engine's own
  std::deque<op> active_;                 // the engine's own
  std::uint64_t next_start_ = 0;          // the engine's own
  fsdp::detail::backoff idle_ = fsdp::detail::backoff::mpi_progress();  // the engine thread's only
  std::uint64_t completions_seen_ = 0;    // the engine thread's only: completions_ at its last reset
  std::atomic<bool> broken_{false};
  std::string broken_reason_;             // the engine's own
  std::thread thread_;                    // last: starts after the members it uses
};

}  // namespace detail

class environment;

//! One process's handle on an MPI communicator, for shard_group. Move-only (like
//! threads::communicator); created by environment::world() and split().
class communicator {
 public:
  using device_type = host_device;

  communicator(communicator&& o) noexcept
      : engine_(o.engine_), comm_(std::exchange(o.comm_, MPI_COMM_NULL)), timeout_(o.timeout_), rank_(o.rank_), size_(o.size_),
        traffic_(o.traffic_), world_hosts_(std::move(o.world_hosts_)), hosts_(std::move(o.hosts_)),
        remote_peers_(o.remote_peers_) {}
  communicator& operator=(communicator&& o) noexcept {
    if (this != &o) {
      release();
      engine_ = o.engine_;
      comm_ = std::exchange(o.comm_, MPI_COMM_NULL);
      timeout_ = o.timeout_;
      rank_ = o.rank_;
      size_ = o.size_;
      traffic_ = o.traffic_;
      world_hosts_ = std::move(o.world_hosts_);
      hosts_ = std::move(o.hosts_);
      remote_peers_ = o.remote_peers_;
    }
    return *this;
  }
  //! Frees the MPI communicator (through the engine, after what was issued on it). Must run
  //! before the environment ends. After a failure it is left to MPI_Abort.
  ~communicator() { release(); }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  MPI_Comm native_handle() const noexcept { return comm_; }
  milliseconds timeout() const noexcept { return timeout_; }
  traffic_counters traffic() const noexcept { return traffic_; }
  //! The host of each rank of the group (shared-memory domains, numbered in rank order).
  std::span<const int> hosts() const noexcept { return hosts_; }

  host_event all_gather(const void* send, void* recv, std::size_t count, dtype t, host_queue& q) {
    const int n = checked_count(count, "all_gather");
    traffic_.add_all_gather(count, t, size_, remote_peers_);
    const bool in_place = send == static_cast<const char*>(recv) + static_cast<std::size_t>(rank_) * count * size_of(t);
    const MPI_Datatype type = detail::mpi_type(t);
    const MPI_Comm c = comm_;
    return enqueue(q, {{fsdp::detail::describe("all_gather", count, t), [=](MPI_Request* r) {
      return in_place ? MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, recv, n, type, c, r)
                      : MPI_Iallgather(send, n, type, recv, n, type, c, r);
    }, {}, count * size_of(t) * static_cast<std::size_t>(size_)}});
  }

  host_event reduce_scatter(const void* send, void* recv, std::size_t count, dtype t, reduce_op op, host_queue& q) {
    fsdp::detail::require_reducible(t, "reduce_scatter", rank_);
    checked_count(count * static_cast<std::size_t>(size_), "reduce_scatter");  // the send buffer
    const int n = static_cast<int>(count), ranks = size_;
    const std::size_t bytes = count * size_of(t);
    const char* s = static_cast<const char*>(send);
    const char* r = static_cast<const char*>(recv);
    if (r < s + bytes * static_cast<std::size_t>(size_) && s < r + bytes)
      throw error(errc::invalid_argument, "reduce_scatter needs distinct send and receive buffers on MPI", {rank_});
    traffic_.add_reduce_scatter(count, t, size_, remote_peers_);
    const MPI_Datatype type = detail::mpi_type(t);
    const MPI_Comm c = comm_;
    // Every rank's block `rank` lands in `blocks` (allocated when the collective starts, freed
    // when it ends), then is summed here in rank order.
    auto blocks = std::make_shared<std::vector<std::byte>>();
    return enqueue(q, {{fsdp::detail::describe("reduce_scatter", count, t),
                        [=](MPI_Request* req) {
                          blocks->resize(bytes * static_cast<std::size_t>(ranks));
                          return MPI_Ialltoall(send, n, type, blocks->data(), n, type, c, req);
                        },
                        [=] {
                          sum_blocks(recv, blocks->data(), ranks, count, t, op);
                          std::vector<std::byte>().swap(*blocks);
                        },
                        bytes * static_cast<std::size_t>(ranks)}});
  }

  host_event all_reduce(const void* send, void* recv, std::size_t count, dtype t, reduce_op op, host_queue& q) {
    fsdp::detail::require_reducible(t, "all_reduce", rank_);
    checked_count(count, "all_reduce");
    traffic_.add_all_reduce(count, t, size_, remote_peers_);
    const MPI_Datatype type = detail::mpi_type(t);
    const MPI_Comm c = comm_;
    const int ranks = size_, me = rank_;
    // Rank j sums elements [displs[j], displs[j] + counts[j]) (the threads backend's split:
    // ceil(count / n) each, the last ones shorter or empty), then every rank gathers the sums.
    struct split {
      std::vector<int> counts, displs, mine_counts, mine_displs;
      std::vector<std::byte> blocks;
    };
    auto p = std::make_shared<split>();
    const std::size_t chunk = (count + static_cast<std::size_t>(ranks) - 1) / static_cast<std::size_t>(ranks);
    for (int j = 0; j < ranks; ++j) {
      const std::size_t b = std::min(count, static_cast<std::size_t>(j) * chunk), e = std::min(count, b + chunk);
      p->counts.push_back(static_cast<int>(e - b));
      p->displs.push_back(static_cast<int>(b));
    }
    const int mine = p->counts[static_cast<std::size_t>(me)];
    for (int j = 0; j < ranks; ++j) {
      p->mine_counts.push_back(mine);
      p->mine_displs.push_back(j * mine);
    }
    const std::size_t elem = size_of(t);
    char* out = static_cast<char*>(recv);
    const std::string what = fsdp::detail::describe("all_reduce", count, t);
    return enqueue(q, {{what + " (sum of this rank's part)",
                        [=](MPI_Request* req) {
                          p->blocks.resize(static_cast<std::size_t>(mine) * elem * static_cast<std::size_t>(ranks));
                          return MPI_Ialltoallv(send, p->counts.data(), p->displs.data(), type, p->blocks.data(),
                                                p->mine_counts.data(), p->mine_displs.data(), type, c, req);
                        },
                        [=] {
                          sum_blocks(out + static_cast<std::size_t>(p->displs[static_cast<std::size_t>(me)]) * elem, p->blocks.data(),
                                     ranks, static_cast<std::size_t>(mine), t, op);
                          std::vector<std::byte>().swap(p->blocks);
                        },
                        static_cast<std::size_t>(mine) * elem * static_cast<std::size_t>(ranks)},
                       {what + " (gather of the sums)",
                        [=](MPI_Request* req) {
                          return MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, recv, p->counts.data(), p->displs.data(),
                                                 type, c, req);
                        },
                        {},
                        count * elem}});
  }

  //! Tells every rank that this one failed: their collectives in flight or queued end at once
  //! with errc::peer_failure "rank <r> failed: <why>" (shard_group calls this when it is left by
  //! an exception). This rank's own collectives fail too; the job then ends with MPI_Abort in
  //! environment's destructor. Returns once the notices were sent (at most about 1 s).
  void abort(const std::string& why) { engine_->abort(why); }

  host_event broadcast(void* buf, std::size_t count, dtype t, int root, host_queue& q) {
    if (root < 0 || root >= size_)
      throw error(errc::invalid_argument, "broadcast root " + std::to_string(root) + " is not a rank of a group of " +
                                              std::to_string(size_), {rank_});
    const int n = checked_count(count, "broadcast");
    traffic_.add_broadcast(count, t, size_, remote_peers_);
    const MPI_Datatype type = detail::mpi_type(t);
    const MPI_Comm c = comm_;
    return enqueue(q, {{fsdp::detail::describe("broadcast", count, t),
                        [=](MPI_Request* r) { return MPI_Ibcast(buf, n, type, root, c, r); }, {}, count * size_of(t)}});
  }

  //! Blocking (bounded by timeout()).
  void barrier() {
    const MPI_Comm c = comm_;
    run_blocking("barrier", [=](MPI_Request* r) { return MPI_Ibarrier(c, r); });
  }

  //! Blocking: ranks with equal color form a new communicator, ordered by (key, rank).
  communicator split(int color, int key) {
    if (color < 0) throw error(errc::invalid_argument, "split color must be >= 0, got " + std::to_string(color), {rank_});
    MPI_Comm out = MPI_COMM_NULL;
    std::vector<int> members;
    const MPI_Comm c = comm_;
    run_blocking("split", [=, &out, &members](MPI_Request*) {
      const int rc = MPI_Comm_split(c, color, key, &out);
      if (rc == MPI_SUCCESS) {
        MPI_Comm_set_errhandler(out, MPI_ERRORS_RETURN);
        members = world_ranks_of(out);
      }
      return rc;
    });
    return communicator(engine_, out, timeout_, world_hosts_, members);
  }

 private:
  friend class environment;
  //! `members`: the world rank of each rank of `c` (world_ranks_of, in an engine round).
  communicator(detail::engine* e, MPI_Comm c, milliseconds timeout, std::shared_ptr<const std::vector<int>> world_hosts,
               const std::vector<int>& members)
      : engine_(e), comm_(c), timeout_(timeout), world_hosts_(std::move(world_hosts)) {
    MPI_Comm_rank(c, &rank_);  // local queries: safe from any thread once initialised
    MPI_Comm_size(c, &size_);
    for (int w : members) hosts_.push_back((*world_hosts_)[static_cast<std::size_t>(w)]);
    hosts_ = fsdp::detail::renumber_hosts(hosts_);
    remote_peers_ = topology{hosts_}.remote_peers(rank_);
  }

  //! The world rank of each rank of `c`. In an engine round (it allocates MPI groups).
  static std::vector<int> world_ranks_of(MPI_Comm c) {
    MPI_Group mine = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
    int n = 0;
    MPI_Comm_size(c, &n);
    MPI_Comm_group(c, &mine);
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    std::vector<int> ranks(static_cast<std::size_t>(n)), in_world(ranks.size());
    for (int r = 0; r < n; ++r) ranks[static_cast<std::size_t>(r)] = r;
    MPI_Group_translate_ranks(mine, n, ranks.data(), world, in_world.data());
    MPI_Group_free(&mine);
    MPI_Group_free(&world);
    return in_world;
  }

  void release() noexcept {
    if (comm_ == MPI_COMM_NULL) return;
    const MPI_Comm c = std::exchange(comm_, MPI_COMM_NULL);
    if (engine_->broken()) return;
    try {
      run_blocking("comm_free", [cc = c](MPI_Request*) mutable { return MPI_Comm_free(&cc); });
    } catch (...) {  // a failure already being reported elsewhere; MPI_Abort ends the job
    }
  }

  int checked_count(std::size_t count, const char* what) const {
    if (count > static_cast<std::size_t>(INT_MAX))
      throw error(errc::invalid_argument, std::string(what) + " of " + std::to_string(count) +
                                              " elements exceeds MPI's int count; use smaller buckets", {rank_});
    return static_cast<int>(count);
  }
  // recv = the sum in rank order of `ranks` consecutive blocks of `count` elements.
  static void sum_blocks(void* recv, const std::byte* blocks, int ranks, std::size_t count, dtype t, reduce_op op) {
    std::vector<const void*> src(static_cast<std::size_t>(ranks));
    for (std::size_t j = 0; j < src.size(); ++j) src[j] = blocks + j * count * size_of(t);
    fsdp::detail::sum_in_rank_order(recv, src.data(), ranks, count, t, op);
  }

  //! One MPI operation of a collective: start() issues it, finish() runs once it completed.
  struct step {
    std::string what;
    std::function<int(MPI_Request*)> start;
    std::function<void()> finish = {};
    std::size_t bytes = 0;  // what this rank receives (the fast path's limit: engine::run())
  };

  detail::op make_op(std::uint64_t seq, step st) {
    detail::op o;
    o.seq = seq;
    o.what = std::move(st.what) + " #" + std::to_string(seq);
    o.start = std::move(st.start);
    o.finish = std::move(st.finish);
    o.bytes = st.bytes;
    o.timeout = timeout_;
    return o;
  }

  // A collective as one or more MPI operations (all_reduce has two), numbered now in issue
  // order and handed to the engine one after the other when the queue reaches them.
  host_event enqueue(host_queue& q, std::vector<step> steps) {
    if (engine_->broken())
      throw error(errc::peer_failure, steps.front().what + ": not issued because an earlier collective failed: " + engine_->broken_reason(),
                  {rank_});
    const std::uint64_t first = engine_->reserve(steps.size());
    auto ops = std::make_shared<std::vector<detail::op>>();
    for (std::size_t i = 0; i < steps.size(); ++i) ops->push_back(make_op(first + i, std::move(steps[i])));
    detail::engine* e = engine_;
    const milliseconds wait = timeout_ * 2 + milliseconds(1000);
    // The task waits only for the engine and is bounded, so a thread that waits for the
    // collective may run it (run_on::queue_or_waiter; on a queue_wake::on_wait queue).
    q.enqueue(
        [e, ops, wait] {
          for (detail::op& o : *ops) {
            const std::string what = o.what;
            e->run(std::move(o), wait, what);
          }
        },
        run_on::queue_or_waiter);
    return q.record();
  }

  void run_blocking(const char* what, std::function<int(MPI_Request*)> start) {
    detail::op o = make_op(engine_->reserve(1), {what, std::move(start)});
    const std::string name = o.what;
    engine_->run(std::move(o), timeout_ * 2 + milliseconds(1000), name);
  }

  detail::engine* engine_ = nullptr;
  MPI_Comm comm_ = MPI_COMM_NULL;
  milliseconds timeout_{};
  int rank_ = 0;
  int size_ = 1;
  traffic_counters traffic_{};
  std::shared_ptr<const std::vector<int>> world_hosts_;  // the host of every world rank
  std::vector<int> hosts_;
  int remote_peers_ = 0;
};

static_assert(full_communicator<communicator>);
static_assert(knows_hosts<communicator>);

//! MPI for the lifetime of the object: MPI_Init_thread with MPI_THREAD_MULTIPLE (the engine
//! thread polls while other threads make local calls), the bf16/f16 types, and the engine. The destructor ends MPI
//! with MPI_Finalize, or with MPI_Abort when a collective was left stuck (see the file comment).
class environment {
 public:
  environment(int& argc, char**& argv) {
    int provided = 0;
    if (MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS)
      throw error(errc::internal, "MPI_Init_thread failed");
    if (provided < MPI_THREAD_MULTIPLE) {
      MPI_Finalize();
      throw error(errc::internal, "this MPI provides thread level " + std::to_string(provided) +
                                      "; fsdp's mpi backend needs MPI_THREAD_MULTIPLE");
    }
    auto& h = detail::halves();
    MPI_Type_contiguous(2, MPI_BYTE, &h.bf16);
    MPI_Type_commit(&h.bf16);
    MPI_Type_contiguous(2, MPI_BYTE, &h.f16);
    MPI_Type_commit(&h.f16);
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_);
    world_hosts_ = std::make_shared<const std::vector<int>>(find_hosts());
    MPI_Comm failures = MPI_COMM_NULL;
    MPI_Comm_dup(MPI_COMM_WORLD, &failures);
    MPI_Comm_set_errhandler(failures, MPI_ERRORS_RETURN);
    engine_ = std::make_unique<detail::engine>(world_rank_, failures);
  }
  environment(const environment&) = delete;
  environment& operator=(const environment&) = delete;
  ~environment() {
    const bool broken = engine_->broken();
    const std::string why = engine_->broken_reason();
    engine_.reset();  // joins the engine thread
    if (broken) {
      // The cause first: MPI_Abort may end this process before anything else is printed.
      std::fprintf(stderr, "fsdp: rank %d: ending the job with MPI_Abort after: %s\n", world_rank_, why.c_str());
      std::fflush(stderr);
      // Every broken rank waits 1 s before MPI_Abort makes mpiexec kill the others. The rank
      // whose failure the others were told of, so that their reports (out within milliseconds)
      // are printed; a rank that was told, so that the failing rank's own report gets out first:
      // a shard_group left by an exception tells the peers while the exception is still on its
      // way to the handler that prints it (the root cause; CI lost it once without this wait).
      std::this_thread::sleep_for(std::chrono::seconds(1));
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    MPI_Finalize();
  }

  //! What communicator::abort() does, for a failure outside any communicator's use (the
  //! program's own error handler): every rank's collectives end with errc::peer_failure.
  void abort(const std::string& why) { engine_->abort(why); }

  //! A communicator over every process (a duplicate of MPI_COMM_WORLD, errors returned, not
  //! fatal). Every wait on it is bounded by `timeout`.
  communicator world(milliseconds timeout = default_timeout()) {
    // On the engine thread, like every MPI call after MPI_Init: an MPI_Comm_dup here, beside the
    // engine's polling, raced inside Open MPI (ThreadSanitizer, mca_pml_ob1_add_comm).
    MPI_Comm c = MPI_COMM_NULL;
    std::vector<int> members;
    detail::op o;
    o.seq = engine_->reserve(1);
    o.what = "comm_dup #" + std::to_string(o.seq);
    o.start = [&c, &members](MPI_Request*) {
      const int rc = MPI_Comm_dup(MPI_COMM_WORLD, &c);
      if (rc == MPI_SUCCESS) {
        MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
        members = communicator::world_ranks_of(c);
      }
      return rc;
    };
    o.timeout = timeout;
    const std::string what = o.what;
    engine_->run(std::move(o), timeout * 2 + milliseconds(1000), what);
    return communicator(engine_.get(), c, timeout, world_hosts_, members);
  }

  int rank() const noexcept { return world_rank_; }
  //! The host of every process (hosts() of the world communicator).
  std::span<const int> hosts() const noexcept { return *world_hosts_; }

 private:
  //! Collective, before the engine starts: each process's host, keyed by the lowest world rank
  //! that shares its memory (MPI_COMM_TYPE_SHARED), gathered from every process.
  std::vector<int> find_hosts() {
    MPI_Comm node = MPI_COMM_NULL;
    int key = world_rank_, size = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) == MPI_SUCCESS) {
      MPI_Allreduce(&world_rank_, &key, 1, MPI_INT, MPI_MIN, node);
      MPI_Comm_free(&node);
    }
    std::vector<int> keys(static_cast<std::size_t>(size));
    MPI_Allgather(&key, 1, MPI_INT, keys.data(), 1, MPI_INT, MPI_COMM_WORLD);
    return fsdp::detail::renumber_hosts(keys);
  }

  int world_rank_ = 0;
  std::shared_ptr<const std::vector<int>> world_hosts_;
  std::unique_ptr<detail::engine> engine_;
};

}  // namespace fsdp::mpi
