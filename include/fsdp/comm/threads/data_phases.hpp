#pragma once
//! \file The data of a threads collective on the host: once every member has arrived at the
//! rendezvous (comm/threads/rendezvous.hpp), each copies or reduces straight between the
//! members' buffers, in phases. Reductions add ranks in rank order in float (double for f64),
//! the order of comm/rank_order_sum.hpp, so results do not depend on thread timing and equal the
//! mpi backend's bit for bit. The chunking and aliasing rules here serve the CUDA transport too.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "fsdp/comm/rank_order_sum.hpp"
#include "fsdp/comm/threads/world_state.hpp"

namespace fsdp::threads::detail {

//! The elements [begin, end) of an all_reduce of `count` that rank r reduces: chunks of
//! ceil(count / n), the last ones shorter or empty.
inline std::pair<std::size_t, std::size_t> all_reduce_chunk(std::size_t count, int n, int r) {
  const std::size_t chunk = (count + static_cast<std::size_t>(n) - 1) / static_cast<std::size_t>(n);
  const std::size_t b = std::min(count, static_cast<std::size_t>(r) * chunk);
  return {b, std::min(count, b + chunk)};
}

//! Whether a member may write [dst, dst + bytes) while its peers still read the send buffers:
//! every send buffer (`send_bytes` long) may overlap it only inside this member's own part of
//! that buffer, [mine, mine + bytes), which no peer reads (each reads only its own part). An
//! exact alias of that part is fine: the rank-order sum reads each block before writing it.
inline bool read_by_me_only(const slot& s, const void* dst, std::size_t bytes, std::size_t mine, std::size_t send_bytes) {
  const auto at = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p); };
  const std::uintptr_t d0 = at(dst), d1 = d0 + bytes;
  for (std::size_t j = 0; j < s.n; ++j) {
    const std::uintptr_t s0 = at(s.args[j].send), s1 = s0 + send_bytes;
    if (d1 <= s0 || s1 <= d0) continue;  // apart
    if (d0 != s0 + mine) return false;   // overlaps a part some peer reads
  }
  return true;
}

//! out = the sum over the members of send[j][offset, offset + count), in rank order
//! (comm/rank_order_sum.hpp: the order the mpi backend uses too), scaled for avg.
inline void reduce_on_host(const slot& s, const collective& d, std::size_t offset, std::size_t count, void* out) {
  const std::size_t elem = size_of(d.type);
  std::vector<const void*> src(s.n);
  for (std::size_t j = 0; j < src.size(); ++j) src[j] = static_cast<const char*>(s.args[j].send) + offset * elem;
  fsdp::detail::sum_in_rank_order(out, src.data(), static_cast<int>(src.size()), count, d.type, d.op);
}

//! The host's data phases for member `rank` of `n`, whose receive buffer is `recv`: each member
//! copies or reduces straight between the buffers, calling phase(k) where its peers must have
//! caught up before it goes on.
template <class Phase>
void copy_on_host(slot& s, const collective& d, int rank, int n, void* recv, Phase& phase) {
  const auto me = static_cast<std::size_t>(rank);
  const std::size_t elem = size_of(d.type);
  std::vector<std::byte> scratch;
  switch (d.kind) {
    case collective_kind::all_gather: {
      const std::size_t bytes = d.count * elem;
      for (int j = 0; j < n; ++j) {
        auto* dst = static_cast<char*>(recv) + static_cast<std::size_t>(j) * bytes;
        const void* src = s.args[static_cast<std::size_t>(j)].send;
        if (src != dst && bytes) std::memcpy(dst, src, bytes);
      }
      phase(0);  // peers have read my send buffer
      break;
    }
    case collective_kind::reduce_scatter: {
      // Summed straight into recv when no peer reads it (the usual case, in place included);
      // otherwise into a scratch buffer, written once everyone has read every send buffer.
      const std::size_t bytes = d.count * elem;
      const bool direct = read_by_me_only(s, recv, bytes, me * bytes, bytes * static_cast<std::size_t>(n));
      if (!direct) scratch.resize(bytes);
      reduce_on_host(s, d, me * d.count, d.count, direct ? recv : scratch.data());
      phase(0);  // everyone has read every send buffer: safe to write (even in place)
      if (!scratch.empty()) std::memcpy(recv, scratch.data(), scratch.size());
      break;
    }
    case collective_kind::all_reduce: {
      // Rank r reduces chunk r into its own recv buffer (or scratch, as above), then copies it
      // into every peer's recv buffer.
      const auto [b, e] = all_reduce_chunk(d.count, n, rank);
      char* mine = static_cast<char*>(recv) + b * elem;
      const bool direct = read_by_me_only(s, mine, (e - b) * elem, b * elem, d.count * elem);
      if (!direct) scratch.resize((e - b) * elem);
      void* reduced = direct ? static_cast<void*>(mine) : scratch.data();
      reduce_on_host(s, d, b, e - b, reduced);
      phase(0);
      for (int j = 0; j < n && e > b; ++j) {
        char* dst = static_cast<char*>(s.args[static_cast<std::size_t>(j)].recv) + b * elem;
        if (dst != reduced) std::memcpy(dst, reduced, (e - b) * elem);
      }
      phase(1);  // every chunk of my recv buffer has been written
      break;
    }
    case collective_kind::broadcast: {
      const void* src = s.args[static_cast<std::size_t>(d.root)].send;
      if (rank != d.root && d.count) std::memcpy(recv, src, d.count * elem);
      phase(0);
      break;
    }
    case collective_kind::all_to_all: {
      // Block j of my recv buffer is block `rank` of member j's send buffer.
      const std::size_t bytes = d.count * elem;
      for (int j = 0; j < n && bytes; ++j)
        std::memcpy(static_cast<char*>(recv) + static_cast<std::size_t>(j) * bytes,
                    static_cast<const char*>(s.args[static_cast<std::size_t>(j)].send) + me * bytes, bytes);
      phase(0);  // peers have read my send buffer
      break;
    }
    case collective_kind::send:
    case collective_kind::recv:  // point to point: rendezvous::exchange, not a slot
    case collective_kind::barrier:
    case collective_kind::split:
      break;
  }
}

}  // namespace fsdp::threads::detail
