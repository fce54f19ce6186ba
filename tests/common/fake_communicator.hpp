#pragma once
//! \file fake_communicator: a communicator for tests of bookkeeping. One process, one thread:
//! it pretends to be rank r of a group of n ranks, records every call (calls()), counts the
//! collectives in traffic() as the real backends do, and fails on cue (fail_at, fail_next), so
//! that tests of hook order, memory, traffic and error paths need no real peers.
//!
//! Data rule: every peer is taken to hold what this rank holds. all_gather copies this rank's
//! send into every rank's slot; reduce_scatter and all_reduce give, for sum, n times this rank's
//! block (in float, double for f64, rounded to the dtype) and, for avg, the block itself;
//! broadcast and recv leave the buffer; all_to_all gives every block this rank's own. So
//! nothing that needs peers to differ (parity, ranks that disagree) can be tested on it. Each collective is a task on the given host_queue, so its data
//! moves in queue order, and returns that queue's event.
//!
//! split(color, key) cannot know the other ranks' colors: the test plans each split in turn with
//! plan_split(colors), the color every rank of the group passes; the new group is the ranks of
//! this rank's color, in rank order (every rank passes its rank as key, as shard_group does).
//!
//!   fsdp_test::fake_communicator comm{0, 4};  // rank 0 of 4
//!   comm.plan_split({0, 0, 1, 1});            // hybrid_shard(2)'s shard groups
//!   comm.plan_split({0, 1, 0, 1});            // and its replica groups
//!   comm.fail_next(fsdp_test::fake_op::reduce_scatter, fsdp::errc::timeout, fsdp_test::fail_how::on_completion);

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "fsdp/comm/concepts.hpp"
#include "fsdp/comm/front.hpp"
#include "fsdp/comm/topology.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/timeout.hpp"
#include "fsdp/device/host.hpp"

namespace fsdp_test {

//! What a fake_communicator can be asked for: the backends' kinds (comm/front.hpp).
using fake_op = fsdp::detail::collective_kind;

//! One call as recorded: what was asked (comm/front.hpp's `collective`: kind, count, dtype, op,
//! root), split's color, and the group it was issued on ("world", "world/split0:color1").
struct fake_call : fsdp::detail::collective {
  int color = 0;
  std::string group{};
};

//! How a call fails on cue: it throws, or (a collective) its event's wait throws, as a peer's
//! failure shows on a real backend; the queue then stays failed, as a CUDA stream does.
enum class fail_how : std::uint8_t { on_issue, on_completion };

//! World ranks 0..k-1 on host 0, k..2k-1 on host 1, ... (threads::world_options::ranks_per_host).
inline std::vector<int> hosts_in_runs(int n, int k) {
  std::vector<int> h;
  for (int r = 0; r < n; ++r) h.push_back(k > 0 ? r / k : 0);
  return h;
}

//! A full_communicator that is rank `rank` of `size` ranks, alone (see the file comment). Its
//! collectives are the backends' front (comm/front.hpp: the same checks and traffic counts).
//! Device: the host device, or one derived from it that a test watches (its queues are host_queues).
template <class Device = fsdp::host_device>
class basic_fake_communicator
    : public fsdp::detail::collective_methods<basic_fake_communicator<Device>, fsdp::host_queue, fsdp::host_event> {
 public:
  using device_type = Device;

  //! `hosts`: the host of every rank (comm/topology.hpp), empty for one host.
  basic_fake_communicator(int rank, int size, std::vector<int> hosts = {}, fsdp::milliseconds timeout = fsdp::default_timeout())
      : basic_fake_communicator(std::make_shared<state>(), rank, "world", timeout, checked_hosts(rank, size, std::move(hosts))) {}

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return front_.size(); }
  const void* native_handle() const noexcept { return state_.get(); }
  fsdp::milliseconds timeout() const noexcept { return timeout_; }
  fsdp::traffic_counters traffic() const noexcept { return front_.traffic(); }
  std::span<const int> hosts() const noexcept { return front_.hosts(); }

  //! Every call so far, in order, on this fake and on the groups split from it (shared).
  const std::vector<fake_call>& calls() const noexcept { return state_->calls; }
  //! The reason abort() was given, once it was.
  const std::optional<std::string>& aborted() const noexcept { return state_->aborted; }
  //! The colors every rank of the group passes to the next split() not yet planned.
  void plan_split(std::vector<int> colors) { state_->plans.push_back(std::move(colors)); }
  //! Call number k (calls()' index, over this fake and its splits) fails with `code`.
  void fail_at(std::size_t k, fsdp::errc code, fail_how how = fail_how::on_issue) {
    state_->faults.push_back({k, fake_op::barrier, code, how});
  }
  //! The next call of `kind` fails with `code`.
  void fail_next(fake_op kind, fsdp::errc code, fail_how how = fail_how::on_issue) {
    state_->faults.push_back({std::nullopt, kind, code, how});
  }

  //! Records the reason; later calls throw errc::peer_failure, as on the threads backend.
  void abort(const std::string& why) { state_->aborted = why; }

  void barrier() {
    if (std::exception_ptr f = record({fake_op::barrier})) std::rethrow_exception(f);
  }

  //! The group of this rank's color under the next planned split (plan_split).
  basic_fake_communicator split(int color, int /*key: rank order, see the file comment*/) {
    if (color < 0) throw fsdp::error(fsdp::errc::invalid_argument, "split color must be >= 0, got " + std::to_string(color), {rank_});
    if (std::exception_ptr f = record({fake_op::split}, color)) std::rethrow_exception(f);
    state& s = *state_;
    const std::string which = "fake_communicator: split #" + std::to_string(s.splits) + " on " + label_;
    if (s.plans.empty()) throw fsdp::error(fsdp::errc::invalid_argument, which + " was not planned (plan_split)", {rank_});
    const std::vector<int> colors = std::move(s.plans.front());
    s.plans.pop_front();
    if (colors.size() != static_cast<std::size_t>(size()) || colors[static_cast<std::size_t>(rank_)] != color)
      throw fsdp::error(fsdp::errc::invalid_argument, which + ": rank " + std::to_string(rank_) + " passes color " +
                                                          std::to_string(color) + ", not the plan's", {rank_});
    std::vector<int> hosts;
    int me = 0;
    for (std::size_t r = 0; r < colors.size(); ++r) {
      if (colors[r] != color) continue;
      if (r == static_cast<std::size_t>(rank_)) me = static_cast<int>(hosts.size());
      hosts.push_back(front_.hosts()[r]);
    }
    return basic_fake_communicator(state_, me, label_ + "/split" + std::to_string(s.splits++) + ":color" + std::to_string(color), timeout_,
                             std::move(hosts));
  }

 private:
  friend class fsdp::detail::collective_methods<basic_fake_communicator, fsdp::host_queue, fsdp::host_event>;

  // Every collective: the front's checks, then recorded (which throws when the group was aborted
  // or the call fails on issue), then counted; its data moves by the rule of the file comment
  // when the queue reaches it.
  fsdp::host_event issue(const fsdp::detail::collective& c, const void* send, void* recv, fsdp::host_queue& q) {
    std::exception_ptr failure;
    front_.admit(c, send, recv, [&] { failure = record(c); });
    const int n = size();
    const std::size_t bytes = c.count * fsdp::size_of(c.type);
    return enqueue(q, failure, [=, me = rank_] {
      switch (c.kind) {
        case fake_op::all_gather:
          for (int r = 0; r < n; ++r) {
            char* slot = static_cast<char*>(recv) + static_cast<std::size_t>(r) * bytes;
            if (slot != send && bytes) std::memcpy(slot, send, bytes);
          }
          break;
        case fake_op::reduce_scatter:
          reduce(recv, static_cast<const char*>(send) + static_cast<std::size_t>(me) * bytes, c.count, c.type, c.op, n);
          break;
        case fake_op::all_reduce: reduce(recv, send, c.count, c.type, c.op, n); break;
        case fake_op::all_to_all:  // every peer's block for this rank is this rank's own
          for (int r = 0; r < n && bytes; ++r)
            std::memcpy(static_cast<char*>(recv) + static_cast<std::size_t>(r) * bytes,
                        static_cast<const char*>(send) + static_cast<std::size_t>(me) * bytes, bytes);
          break;
        default: break;  // broadcast, send, recv: the peer holds what this rank holds, the buffer stays
      }
    });
  }

  struct fault {
    std::optional<std::size_t> index;  // else the next call of `kind`
    fake_op kind;
    fsdp::errc code;
    fail_how how;
  };
  // Shared by a fake and the groups split from it.
  struct state {
    std::vector<fake_call> calls;
    std::deque<std::vector<int>> plans;
    std::vector<fault> faults;
    std::optional<std::string> aborted;
    int splits = 0;
  };

  basic_fake_communicator(std::shared_ptr<state> s, int rank, std::string label, fsdp::milliseconds timeout, std::vector<int> hosts)
      : state_(std::move(s)), rank_(rank), label_(std::move(label)), timeout_(timeout), front_(rank, std::move(hosts), rank) {}

  static std::vector<int> checked_hosts(int rank, int size, std::vector<int> hosts) {
    if (size < 1 || rank < 0 || rank >= size || (!hosts.empty() && hosts.size() != static_cast<std::size_t>(size)))
      throw fsdp::error(fsdp::errc::invalid_argument, "fake_communicator: rank " + std::to_string(rank) + " of " +
                                                          std::to_string(size) + " ranks, with " + std::to_string(hosts.size()) + " hosts given");
    return hosts.empty() ? std::vector<int>(static_cast<std::size_t>(size), 0) : std::move(hosts);
  }

  // Records `asked`; throws when the group was aborted or `c` fails on issue; returns the failure
  // its event completes with, if it fails on completion.
  std::exception_ptr record(const fsdp::detail::collective& asked, int color = 0) {
    state& s = *state_;
    const std::size_t k = s.calls.size();
    fake_call c;
    static_cast<fsdp::detail::collective&>(c) = asked;
    c.color = color;
    c.group = label_;
    s.calls.push_back(c);
    const std::string what = std::string(to_string(c.kind)) + " #" + std::to_string(k) + " on " + label_;
    if (s.aborted) throw fsdp::error(fsdp::errc::peer_failure, "stopped " + what + " because the group was aborted: " + *s.aborted, {rank_});
    for (auto it = s.faults.begin(); it != s.faults.end(); ++it) {
      if (it->index ? *it->index != k : it->kind != c.kind) continue;
      const fsdp::error e(it->code, what + " failed on cue", {rank_});
      const fail_how how = it->how;
      s.faults.erase(it);
      if (how == fail_how::on_issue) throw e;
      return std::make_exception_ptr(e);
    }
    return nullptr;
  }

  // The data moves (or the failure is thrown) when the queue reaches the collective.
  template <class Move>
  static fsdp::host_event enqueue(fsdp::host_queue& q, std::exception_ptr failure, Move move) {
    q.enqueue([failure, move] {
      if (failure) std::rethrow_exception(failure);
      move();
    }, fsdp::run_on::queue_or_waiter);
    return q.record();
  }

  // out = n x in (sum of n equal blocks) or in (avg), in float (double for f64); may alias.
  static void reduce(void* out, const void* in, std::size_t count, fsdp::dtype t, fsdp::reduce_op op, int n) {
    fsdp::visit_floating(t, [&](auto tag) {
      using T = decltype(tag);
      using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;
      const acc_t factor = op == fsdp::reduce_op::sum ? static_cast<acc_t>(n) : acc_t(1);
      for (std::size_t i = 0; i < count; ++i)
        static_cast<T*>(out)[i] = fsdp::convert<T>(fsdp::convert<acc_t>(static_cast<const T*>(in)[i]) * factor);
    });
  }

  std::shared_ptr<state> state_;
  int rank_ = 0;
  std::string label_;
  fsdp::milliseconds timeout_;
  fsdp::detail::collective_front front_;
};

using fake_communicator = basic_fake_communicator<>;
static_assert(fsdp::full_communicator<fake_communicator>);
static_assert(fsdp::knows_hosts<fake_communicator>);

}  // namespace fsdp_test
