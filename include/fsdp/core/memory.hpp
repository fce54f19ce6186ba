#pragma once
//! \file Memory accounting shared by every device (device/host.hpp, device/cuda.hpp) and by the
//! code that allocates on one (shard_group, the optimizers): the budget an allocation counts
//! against, and the live/peak byte counters.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <mutex>

namespace fsdp {

//! Which budget an allocation counts against: state kept for the whole run (shards, optimizer
//! state), working memory that comes and goes (unsharded parameters and gradients), or state
//! kept for the run in host memory instead of the device's (offloaded: policy/offload.hpp;
//! pinned on CUDA). Offloaded bytes are not the device's: they count in offloaded_live only.
enum class mem_kind : std::uint8_t { persistent, transient, offloaded };

//! Per-device byte counters, the analogue of torch.cuda.memory_allocated / max_memory_allocated.
struct memory_stats {
  std::size_t live = 0;             //!< bytes allocated now
  std::size_t peak = 0;             //!< most bytes allocated at once since the last reset
  std::size_t persistent_live = 0;  //!< of live, the persistent part
  std::size_t transient_live = 0;   //!< of live, the transient part
  std::size_t transient_peak = 0;   //!< most transient bytes at once since the last reset
  std::size_t offloaded_live = 0;   //!< host bytes holding offloaded state (not in live)
};

namespace detail {

//! Thread-safe counters behind memory_stats (frees may run on a queue's thread), for devices.
class memory_counter {
 public:
  void add(std::size_t bytes, mem_kind kind) {
    std::lock_guard lock(m_);
    if (kind == mem_kind::offloaded) {
      s_.offloaded_live += bytes;
      return;
    }
    s_.live += bytes;
    (kind == mem_kind::persistent ? s_.persistent_live : s_.transient_live) += bytes;
    s_.peak = std::max(s_.peak, s_.live);
    s_.transient_peak = std::max(s_.transient_peak, s_.transient_live);
  }
  void remove(std::size_t bytes, mem_kind kind) {
    std::lock_guard lock(m_);
    if (kind == mem_kind::offloaded) {
      s_.offloaded_live -= bytes;
      return;
    }
    s_.live -= bytes;
    (kind == mem_kind::persistent ? s_.persistent_live : s_.transient_live) -= bytes;
  }
  memory_stats get() const {
    std::lock_guard lock(m_);
    return s_;
  }
  void reset_peak() {
    std::lock_guard lock(m_);
    s_.peak = s_.live;
    s_.transient_peak = s_.transient_live;
  }

 private:
  mutable std::mutex m_;
  memory_stats s_;
};

}  // namespace detail

}  // namespace fsdp
