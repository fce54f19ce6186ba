#pragma once
//! \file device_spans: a step's communication timed on the device's own clock, for devices whose
//! queues run by themselves (CUDA streams), where the host's clock sees only issue. Each
//! all-gather and reduction is a span between two marks on its queue (device/concepts.hpp,
//! device_mark), and each wait of compute for a collective a span between a mark on compute just
//! before the wait and one just after: the second mark is reached only once compute got there
//! and the collective ended, so that span is how long compute stalled on communication, the
//! exposed communication. Marks are read once they have happened (resolve(), never waiting), and
//! placed on the host's clock through an anchor mark taken while the device was idle.

#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/core/timeline.hpp"
#include "fsdp/device/concepts.hpp"

namespace fsdp::detail {

class device_spans {
 public:
  using clock = timeline::clock;

  //! Starts timing: `anchor` is a mark the device reached at host time `anchor_host`.
  void start(device_mark anchor, clock::time_point anchor_host) {
    anchor_ = std::move(anchor);
    anchor_host_ = anchor_host;
  }
  bool on() const noexcept { return static_cast<bool>(anchor_); }

  //! A span from `begin` to `end` on `lane`, named `name`; `exposed` for compute's waits.
  void add(timeline::lane lane, std::string name, device_mark begin, device_mark end, bool exposed) {
    pending_.push_back({lane, std::move(name), std::move(begin), std::move(end), exposed});
  }

  //! Takes every span whose marks have happened: adds the exposed ones to `exposed` and writes
  //! each into `t` (if any) for `rank`. Spans still in flight stay for a later call.
  void resolve(std::chrono::nanoseconds& exposed, timeline* t, int rank) {
    std::erase_if(pending_, [&](const span& s) {
      const double b = s.begin.ms_since(anchor_), e = s.end.ms_since(anchor_);
      if (b < 0 || e < 0) return false;
      if (s.exposed) exposed += std::chrono::nanoseconds(static_cast<long long>((e - b) * 1e6));
      const auto at = [&](double ms) { return anchor_host_ + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double, std::milli>(ms)); };
      if (t) t->add(rank, s.lane, s.name, at(b), at(e));
      return true;
    });
  }

 private:
  struct span {
    timeline::lane lane;
    std::string name;
    device_mark begin, end;
    bool exposed;
  };
  device_mark anchor_;
  clock::time_point anchor_host_{};
  std::vector<span> pending_;
};

}  // namespace fsdp::detail
