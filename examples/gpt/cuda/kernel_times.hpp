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
//! the records, stop() disables them and flushes them into table(); the destructor stops. Call
//! stop() once the GPU has finished the work to be counted: a record CUPTI hands back unfinished
//! is counted in dropped(), not in the table.
class kernel_times {
 public:
  kernel_times() = default;
  kernel_times(const kernel_times&) = delete;
  kernel_times& operator=(const kernel_times&) = delete;
  ~kernel_times() {
    if (current() == this) (void)stop_quietly();
  }

  void start() {
    {
      std::lock_guard lock(mutex());
      if (current() != nullptr) throw fsdp::error(fsdp::errc::invalid_argument, "kernel_times: another recording is running");
      current() = this;
    }
    // Not under the lock: CUPTI may hand back an earlier recording's buffer from inside these.
    CUptiResult r = cuptiActivityRegisterCallbacks(&buffer_requested, &buffer_completed);
    for (const CUpti_ActivityKind k : kinds)
      if (r == CUPTI_SUCCESS) r = cuptiActivityEnable(k);
    if (r != CUPTI_SUCCESS) {
      (void)stop_quietly();
      check(r, "enabling the activity records");
    }
  }
  void stop() { check(stop_quietly(), "cuptiActivityFlushAll"); }
  const kernel_table& table() const { return table_; }
  //! Records lost: CUPTI's count of dropped ones, those without both timestamps, and those this
  //! recorder could not read.
  std::size_t dropped() const { return dropped_; }

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
  // Disabled first, so that nothing is recorded after the flush that would reach a later buffer.
  CUptiResult stop_quietly() {
    for (const CUpti_ActivityKind k : kinds) (void)cuptiActivityDisable(k);
    const CUptiResult r = cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);  // calls buffer_completed
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
  // Called by CUPTI (its own thread, or the flushing one): nothing may be thrown through it.
  static void CUPTIAPI buffer_completed(CUcontext context, std::uint32_t stream, std::uint8_t* buffer, std::size_t, std::size_t valid) {
    std::unique_ptr<std::uint8_t, decltype(&std::free)> owned(buffer, &std::free);
    std::lock_guard lock(mutex());
    kernel_times* self = current();
    if (!self) return;
    try {
      std::size_t lost = 0;
      if (cuptiActivityGetNumDroppedRecords(context, stream, &lost) == CUPTI_SUCCESS) self->dropped_ += lost;
      CUpti_Activity* record = nullptr;
      CUptiResult r;
      while ((r = cuptiActivityGetNextRecord(buffer, valid, &record)) == CUPTI_SUCCESS) self->add(record);
      if (r != CUPTI_ERROR_MAX_LIMIT_REACHED) ++self->dropped_;  // the rest of this buffer could not be read
    } catch (...) {
      ++self->dropped_;
    }
  }
  // Every kind's start and end sit at the same offsets in all of CUDA 13's versions of its record
  // (new fields are appended), as do a kernel's name and a copy's kind.
  void add(const CUpti_Activity* record) {
    auto timed = [&](const std::string& name, std::uint64_t start, std::uint64_t end) {
      if (start == 0 || end <= start) ++dropped_;  // CUPTI could not time it
      else table_.add(name, end - start);
    };
    switch (record->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
        timed(demangled(k->name), k->start, k->end);
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
        timed("[memset]", m->start, m->end);
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
        timed(copy_name(m->copyKind), m->start, m->end);
        break;
      }
      default: break;
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
  std::size_t dropped_ = 0;
};

}  // namespace gpt::cuda
