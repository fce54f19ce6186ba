#pragma once
//! \file What one rank asks of a collective (`collective`): its kind, count, dtype, reduction and
//! root or peer, its name in errors, and its buffer and traffic sizes. Shared by the front every
//! backend's collectives pass (comm/front.hpp) and the flight recorder (comm/flight_recorder.hpp).

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "fsdp/comm/concepts.hpp"
#include "fsdp/core/dtype.hpp"

namespace fsdp::detail {

enum class collective_kind : std::uint8_t { all_gather, reduce_scatter, all_reduce, broadcast, all_to_all, send, recv, barrier, split };

inline const char* to_string(collective_kind k) {
  switch (k) {
    case collective_kind::all_gather: return "all_gather";
    case collective_kind::reduce_scatter: return "reduce_scatter";
    case collective_kind::all_reduce: return "all_reduce";
    case collective_kind::broadcast: return "broadcast";
    case collective_kind::all_to_all: return "all_to_all";
    case collective_kind::send: return "send";
    case collective_kind::recv: return "recv";
    case collective_kind::barrier: return "barrier";
    case collective_kind::split: return "split";
  }
  return "?";
}

//! What one rank asked for; every rank of a collective must ask for the same (a send and its
//! recv: the same count and dtype). `count` is the elements per rank as the concepts
//! (comm/concepts.hpp) define them; `op` matters for the reductions, `root` for broadcast, and
//! `root` is the peer of a send or recv.
struct collective {
  collective_kind kind = collective_kind::barrier;
  std::size_t count = 0;
  dtype type = dtype::u8;
  reduce_op op = reduce_op::sum;
  int root = 0;
  friend bool operator==(const collective&, const collective&) = default;

  bool reduces() const noexcept { return kind == collective_kind::reduce_scatter || kind == collective_kind::all_reduce; }
  bool moves_data() const noexcept { return kind != collective_kind::barrier && kind != collective_kind::split; }
  bool point_to_point() const noexcept { return kind == collective_kind::send || kind == collective_kind::recv; }

  //! "reduce_scatter of 1024 f32 (avg)", "broadcast of 8 u8 from root 0", "barrier": how every
  //! backend names a collective in its errors.
  std::string str() const {
    std::string s = to_string(kind);
    if (!moves_data()) return s;
    s += " of " + std::to_string(count) + " " + std::string(fsdp::to_string(type));
    if (reduces()) s += std::string(" (") + fsdp::to_string(op) + ")";
    if (kind == collective_kind::broadcast) s += " from root " + std::to_string(root);
    if (kind == collective_kind::send) s += " to rank " + std::to_string(root);
    if (kind == collective_kind::recv) s += " from rank " + std::to_string(root);
    return s;
  }

  //! The bytes of this rank's send and receive buffers over a group of `n` ranks (the layouts of
  //! comm/concepts.hpp): what a backend stages when they are not where its transport reads.
  std::pair<std::size_t, std::size_t> buffer_bytes(int n) const noexcept {
    const std::size_t one = count * size_of(type), all = one * static_cast<std::size_t>(n);
    switch (kind) {
      case collective_kind::all_gather: return {one, all};
      case collective_kind::reduce_scatter: return {all, one};
      case collective_kind::all_reduce:
      case collective_kind::broadcast: return {one, one};
      case collective_kind::all_to_all: return {all, all};
      case collective_kind::send: return {one, 0};
      case collective_kind::recv: return {0, one};
      case collective_kind::barrier:
      case collective_kind::split: return {0, 0};
    }
    return {0, 0};
  }

  //! Bytes one rank sends in it over a group of `n` ranks: traffic_counters' formulas (the link
  //! model of the threads backend charges them). barrier and split move no data.
  std::uint64_t sent_bytes(int n) const noexcept {
    switch (kind) {
      case collective_kind::all_gather: return traffic_counters::all_gather_bytes(count, type, n);
      case collective_kind::reduce_scatter: return traffic_counters::reduce_scatter_bytes(count, type, n);
      case collective_kind::all_reduce: return traffic_counters::all_reduce_bytes(count, type, n);
      case collective_kind::broadcast: return traffic_counters::broadcast_bytes(count, type, n);
      case collective_kind::all_to_all: return traffic_counters::all_to_all_bytes(count, type, n);
      case collective_kind::send: return count * size_of(type);
      case collective_kind::recv:
      case collective_kind::barrier:
      case collective_kind::split: return 0;
    }
    return 0;
  }
};

}  // namespace fsdp::detail
