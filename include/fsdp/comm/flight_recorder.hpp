#pragma once
//! \file The flight recorder: each rank keeps its last N collectives (what, on which group,
//! its number there, when issued, started and finished) so that after a hang, a mismatch or a
//! dead peer the ranks' records can be merged and the culprit named (scripts/fsdp-flight), as
//! PyTorch's NCCL flight recorder and its trace analyzer do.
//!
//! Every communicator's front (comm/front.hpp) records what it admits into the recorder of its
//! world rank; the host backends (threads, MPI) mark when the collective's task starts and ends,
//! threads over CUDA records the issue only (its work is on a stream), and NCCL does not record
//! yet. A stream is one
//! communicator's sequence ("0,1,2,3/1": the first communicator over world ranks 0-3 on this
//! rank), or one direction of send/recv inside it ("0,1/1 0>1"): communicators are made
//! collectively, so every member names a stream alike and numbers its collectives alike.
//!
//!   fsdp::flight_recorder::of(world_rank).write(out, world_size);   // JSON lines, oldest first
//!
//! Cost: one mutex and three clock reads per collective. FSDP_FLIGHT_RECORDER=N keeps N entries
//! per rank (default 2000, PyTorch's; 0 turns recording off).

#include <chrono>
#include <cstddef>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <ostream>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "fsdp/comm/collective.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp {

class flight_recorder {
 public:
  using clock = std::chrono::steady_clock;

  //! Where an entry is, for started() and finished(); null when recording is off.
  struct token {
    flight_recorder* rec = nullptr;
    std::uint64_t n = 0;  // the entry's number in this recorder: its slot is n % capacity
    void started() const {
      if (rec) rec->mark(n, &entry::started);
    }
    void finished(bool ok = true) const {
      if (!rec) return;
      rec->mark(n, &entry::finished);
      if (!ok) rec->mark_failed(n);
    }
    //! Runs `work` marked started, then finished (or failed, when it throws).
    template <class F>
    void around(F&& work) const {
      started();
      try {
        work();
      } catch (...) {
        finished(false);
        throw;
      }
      finished();
    }
  };

  //! The recorder of `world_rank` in this process (thread ranks each have theirs).
  static flight_recorder& of(int world_rank) {
    static std::mutex m;
    static std::map<int, std::unique_ptr<flight_recorder>> all;
    std::lock_guard lock(m);
    auto& r = all[world_rank];
    if (!r) r.reset(new flight_recorder(world_rank, capacity_from_env()));
    return *r;
  }

  //! A new stream for a communicator over `members` (world ranks, in group-rank order).
  int open_stream(std::span<const int> members) {
    std::string name;
    // Appended piece by piece: g++ 12 at -O3 reports a false -Wrestrict on "," + std::to_string().
    for (int w : members) {
      if (!name.empty()) name += ',';
      name += std::to_string(w);
    }
    std::lock_guard lock(m_);
    const int n = ++opened_[name];
    name += '/';
    name += std::to_string(n);
    return add_stream(std::move(name));
  }

  //! Records `c`, issued on stream `s` by group rank `rank` of `size` whose world ranks are
  //! `members` (send and recv go to the stream of their direction).
  token issue(int s, const detail::collective& c, int rank, std::span<const int> members) {
    if (capacity_ == 0) return {};
    const double now = seconds();
    std::lock_guard lock(m_);
    if (c.point_to_point()) {
      const int me = members[static_cast<std::size_t>(rank)], peer = members[static_cast<std::size_t>(c.root)];
      const auto key = std::tuple(s, c.kind == detail::collective_kind::send ? me : peer, c.kind == detail::collective_kind::send ? peer : me);
      auto it = directions_.find(key);
      if (it == directions_.end())
        it = directions_.emplace(key, add_stream(streams_[static_cast<std::size_t>(s)].name + " " + std::to_string(std::get<1>(key)) +
                                                     ">" + std::to_string(std::get<2>(key)))).first;
      s = it->second;
    }
    const std::uint64_t n = next_++;
    entry& e = ring_[n % capacity_];
    e = entry{n, s, streams_[static_cast<std::size_t>(s)].issued++, c, now};
    return {this, n};
  }

  //! Writes the record as JSON lines: a header {"rank", "world_size", "now", "dropped"}, then
  //! the entries oldest first {"stream", "seq", "op", "kind", "count", "dtype", "issued",
  //! "started", "finished", "state"}; times in seconds on this process's clock, -1 for not yet.
  //! `unfinished_only`: just the entries not finished (what a rank waits in, or failed in).
  void write(std::ostream& out, int world_size, bool unfinished_only = false) const {
    std::lock_guard lock(m_);
    const std::uint64_t first = next_ > capacity_ ? next_ - capacity_ : 0;
    out << nlohmann::json{{"rank", rank_}, {"world_size", world_size}, {"now", seconds()}, {"dropped", first}}.dump() << '\n';
    for (std::uint64_t n = first; n < next_; ++n) {
      const entry& e = ring_[n % capacity_];
      const char* state = e.failed ? "failed" : e.finished >= 0 ? "finished" : e.started >= 0 ? "started" : "issued";
      if (unfinished_only && e.finished >= 0 && !e.failed) continue;
      out << nlohmann::json{{"stream", streams_[static_cast<std::size_t>(e.stream)].name}, {"seq", e.seq}, {"op", e.c.str()},
                            {"kind", detail::to_string(e.c.kind)}, {"count", e.c.count}, {"dtype", fsdp::to_string(e.c.type)},
                            {"issued", e.issued}, {"started", e.started}, {"finished", e.finished}, {"state", state}}
                 .dump()
          << '\n';
    }
  }

  //! Writes the record to DIR/flight_rank_<r>.jsonl (replacing it); returns the path. Throws
  //! fsdp::error when it cannot.
  std::filesystem::path write_to(const std::filesystem::path& dir, int world_size) const {
    const std::filesystem::path p = dir / ("flight_rank_" + std::to_string(rank_) + ".jsonl");
    std::ofstream out(p, std::ios::trunc);
    if (out) write(out, world_size);
    if (!out) throw error(errc::invalid_argument, "cannot write the flight record " + p.string() + ": " + std::strerror(errno));
    return p;
  }

  std::size_t capacity() const noexcept { return capacity_; }

 private:
  struct entry {
    std::uint64_t n = 0;
    int stream = 0;
    std::uint64_t seq = 0;
    detail::collective c{};
    double issued = -1, started = -1, finished = -1;
    bool failed = false;
  };
  struct stream {
    std::string name;
    std::uint64_t issued = 0;
  };

  flight_recorder(int rank, std::size_t capacity) : rank_(rank), capacity_(capacity), ring_(capacity) {}

  static std::size_t capacity_from_env() {
    if (const char* s = std::getenv("FSDP_FLIGHT_RECORDER")) {
      char* end = nullptr;
      const long long v = std::strtoll(s, &end, 10);
      if (end != s && *end == '\0' && v >= 0) return static_cast<std::size_t>(v);
    }
    return 2000;
  }
  static double seconds() {
    static const clock::time_point epoch = clock::now();
    return std::chrono::duration<double>(clock::now() - epoch).count();
  }
  int add_stream(std::string name) {  // under m_
    streams_.push_back({std::move(name), 0});
    return static_cast<int>(streams_.size() - 1);
  }
  void mark(std::uint64_t n, double entry::*when) {
    const double now = seconds();
    std::lock_guard lock(m_);
    if (entry& e = ring_[n % capacity_]; e.n == n) e.*when = now;  // else overwritten since
  }
  void mark_failed(std::uint64_t n) {
    std::lock_guard lock(m_);
    if (entry& e = ring_[n % capacity_]; e.n == n) e.failed = true;
  }

  const int rank_;
  const std::size_t capacity_;
  mutable std::mutex m_;
  std::vector<entry> ring_;
  std::uint64_t next_ = 0;
  std::vector<stream> streams_;
  std::map<std::string, int> opened_;                 // communicators opened per member list
  std::map<std::tuple<int, int, int>, int> directions_;  // (stream, from, to) -> its send/recv stream
};

}  // namespace fsdp
