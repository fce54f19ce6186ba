#pragma once
// gpt/cuda/kernel_times.hpp: every kernel, memset and copy the GPU runs between start() and
// stop(), timed by CUPTI's activity records into a gpt::kernel_table (train_gpt --device cuda
// --kernel-times). CUPTI's activity API is what PyTorch's profiler reads: it works where Nsight
// Compute cannot read the hardware counters (the lent machines' gVisor runtime), it times each
// kernel where it ran, among the others (ncu replays each alone), and it needs no second tool.
// The records are the process's: with thread ranks, every rank's work.

#include <cupti.h>
#include <cxxabi.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>

#include <fsdp/core/error.hpp>

#include "gpt/kernel_table.hpp"

namespace gpt::cuda {

//! One recording at a time in a process (CUPTI's activity callbacks are global). start() enables
//! the records, stop() flushes them into table() and disables them; the destructor stops.
class kernel_times {
 public:
  kernel_times() = default;
  kernel_times(const kernel_times&) = delete;
  kernel_times& operator=(const kernel_times&) = delete;
  ~kernel_times() {
    if (current() == this) (void)stop_quietly();
  }

  void start() {
    std::lock_guard lock(mutex());
    if (current() != nullptr) throw fsdp::error(fsdp::errc::invalid_argument, "kernel_times: another recording is running");
    check(cuptiActivityRegisterCallbacks(&buffer_requested, &buffer_completed), "cuptiActivityRegisterCallbacks");
    for (const CUpti_ActivityKind k : kinds) check(cuptiActivityEnable(k), "cuptiActivityEnable");
    current() = this;
  }
  void stop() { check(stop_quietly(), "cuptiActivityFlushAll"); }
  const kernel_table& table() const { return table_; }

 private:
  static constexpr CUpti_ActivityKind kinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMSET,
                                                 CUPTI_ACTIVITY_KIND_MEMCPY};
  static constexpr std::size_t buffer_bytes = 8 << 20;  // records of about 200 bytes: 40k a buffer

  static void check(CUptiResult r, const char* what) {
    if (r == CUPTI_SUCCESS) return;
    const char* text = nullptr;
    (void)cuptiGetResultString(r, &text);
    throw fsdp::error(fsdp::errc::internal, std::string("kernel_times: ") + what + " failed: " + (text ? text : "?"));
  }
  CUptiResult stop_quietly() {
    const CUptiResult r = cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);  // calls buffer_completed
    for (const CUpti_ActivityKind k : kinds) (void)cuptiActivityDisable(k);
    std::lock_guard lock(mutex());
    current() = nullptr;
    return r;
  }
  static kernel_times*& current() {
    static kernel_times* c = nullptr;
    return c;
  }
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static void CUPTIAPI buffer_requested(std::uint8_t** buffer, std::size_t* size, std::size_t* max_records) {
    *buffer = static_cast<std::uint8_t*>(std::aligned_alloc(8, buffer_bytes));
    *size = *buffer ? buffer_bytes : 0;
    *max_records = 0;  // as many as fit
  }
  static void CUPTIAPI buffer_completed(CUcontext, std::uint32_t, std::uint8_t* buffer, std::size_t, std::size_t valid) {
    std::unique_ptr<std::uint8_t, decltype(&std::free)> owned(buffer, &std::free);
    std::lock_guard lock(mutex());
    kernel_times* self = current();
    CUpti_Activity* record = nullptr;
    while (self && cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
      switch (record->kind) {
        case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
          const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
          self->table_.add(demangled(k->name), k->end - k->start);
          break;
        }
        case CUPTI_ACTIVITY_KIND_MEMSET: {
          const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
          self->table_.add("[memset]", m->end - m->start);
          break;
        }
        case CUPTI_ACTIVITY_KIND_MEMCPY: {
          const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
          self->table_.add(copy_name(m->copyKind), m->end - m->start);
          break;
        }
        default: break;
      }
    }
  }
  static std::string copy_name(std::uint8_t kind) {
    switch (kind) {
      case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return "[memcpy host to device]";
      case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return "[memcpy device to host]";
      case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return "[memcpy device to device]";
      default: return "[memcpy kind " + std::to_string(kind) + "]";
    }
  }
  static std::string demangled(const char* name) {
    if (!name) return "?";
    int status = 0;
    std::unique_ptr<char, decltype(&std::free)> d(abi::__cxa_demangle(name, nullptr, nullptr, &status), &std::free);
    return status == 0 && d ? std::string(d.get()) : std::string(name);
  }

  kernel_table table_;
};

}  // namespace gpt::cuda
