#pragma once
//! \file timeline: time spans of each rank's compute and communication, written as a Chrome /
//! Perfetto trace (the JSON "trace event" format: open it at ui.perfetto.dev or chrome://tracing).
//!
//! A shard_group records into a timeline when given one (shard_group::record_timeline): its
//! waits and each unit's compute on the "compute" lane, each all-gather and reduction on the
//! lane of the queue that ran it. Engines may add their own spans (an optimizer step, a data
//! load) with add(). Thread-safe: the ranks of a threads world can share one timeline.
//!
//!   fsdp::timeline tl;
//!   group.record_timeline(&tl);
//!   ... train ...
//!   std::ofstream("trace.json") << tl.chrome_trace();

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace fsdp {

class timeline {
 public:
  using clock = std::chrono::steady_clock;

  //! Where a span ran: the compute thread (or stream) or one of the communication queues.
  enum class lane : std::uint8_t { compute = 0, all_gather = 1, reduce = 2 };

  struct span {
    int rank;
    lane where;
    std::string name;
    std::int64_t begin_ns;  //!< since the timeline's epoch
    std::int64_t end_ns;
  };

  //! The epoch is the construction time; every span is measured from it.
  timeline() : epoch_(clock::now()) {}
  explicit timeline(clock::time_point epoch) : epoch_(epoch) {}

  clock::time_point epoch() const noexcept { return epoch_; }

  //! Records a span (thread-safe).
  void add(int rank, lane where, std::string name, clock::time_point begin, clock::time_point end) {
    span s{rank, where, std::move(name), ns(begin), ns(end)};
    std::lock_guard lock(m_);
    spans_.push_back(std::move(s));
  }

  //! A copy of the spans recorded so far, in recording order.
  std::vector<span> spans() const {
    std::lock_guard lock(m_);
    return spans_;
  }

  //! Drops every span (keeps the epoch).
  void clear() {
    std::lock_guard lock(m_);
    spans_.clear();
  }

  //! The spans as trace-event JSON objects separated by commas, without the enclosing array:
  //! the pieces that processes (MPI ranks) gather and join into one file.
  std::string chrome_events() const {
    std::vector<span> all = spans();
    std::string out;
    std::vector<int> ranks;
    for (const auto& s : all) ranks.push_back(s.rank);
    std::sort(ranks.begin(), ranks.end());
    ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
    // Metadata events name each process (rank) and thread (lane) in the viewer.
    for (int r : ranks) {
      append_meta(out, "process_name", r, 0, "rank " + std::to_string(r));
      for (lane l : {lane::compute, lane::all_gather, lane::reduce}) append_meta(out, "thread_name", r, int(l), lane_name(l));
    }
    char buf[160];
    for (const auto& s : all) {
      if (!out.empty()) out += ",\n";
      // Complete events ("X") with microsecond timestamps, as the format wants.
      std::snprintf(buf, sizeof buf, "{\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f,\"cat\":\"%s\",\"name\":", s.rank,
                    int(s.where), static_cast<double>(s.begin_ns) / 1e3, static_cast<double>(s.end_ns - s.begin_ns) / 1e3,
                    lane_name(s.where));
      out += buf;
      append_json_string(out, s.name);
      out += "}";
    }
    return out;
  }

  //! A complete trace document of `events` (as chrome_events() returns them, joined by commas).
  static std::string chrome_document(std::string_view events) {
    std::string doc = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
    doc.append(events);
    doc += "\n]}\n";
    return doc;
  }
  //! This timeline as a complete trace document.
  std::string chrome_trace() const { return chrome_document(chrome_events()); }

  static const char* lane_name(lane l) noexcept {
    switch (l) {
      case lane::compute: return "compute";
      case lane::all_gather: return "all_gather";
      case lane::reduce: return "reduce";
    }
    return "?";
  }

 private:
  std::int64_t ns(clock::time_point t) const {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(t - epoch_).count();
  }
  static void append_meta(std::string& out, const char* what, int pid, int tid, const std::string& name) {
    if (!out.empty()) out += ",\n";
    out += "{\"ph\":\"M\",\"pid\":" + std::to_string(pid) + ",\"tid\":" + std::to_string(tid) + ",\"name\":\"" + what +
           "\",\"args\":{\"name\":";
    append_json_string(out, name);
    out += "}}";
  }
  static void append_json_string(std::string& out, std::string_view s) {
    out += '"';
    for (char c : s) {
      if (c == '"' || c == '\\') {
        out += '\\';
        out += c;
      } else if (static_cast<unsigned char>(c) < 0x20) {
        char esc[8];
        std::snprintf(esc, sizeof esc, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
        out += esc;
      } else {
        out += c;
      }
    }
    out += '"';
  }

  clock::time_point epoch_;
  mutable std::mutex m_;
  std::vector<span> spans_;
};

}  // namespace fsdp
