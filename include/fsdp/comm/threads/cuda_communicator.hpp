#pragma once
//! \file The `threads` backend over the CUDA device: N ranks as threads of one process, each
//! with its own cuda_device (streams and memory pool) on the same GPU, collectives as
//! device-to-device copies and a summing kernel between the ranks' buffers. NCCL refuses two
//! ranks on one GPU ("Duplicate GPU detected"); this is how shard_group runs with 1-64 ranks
//! on one GPU, for tests against the host backend and for debugging sharded training on one
//! workstation GPU.
//!
//! How a collective runs: the issuing thread records an event on the queue ("my input is
//! ready") and meets its peers at the threads backend's rendezvous (comm/threads/rendezvous.hpp: matched
//! by issue order, checked for the same collective, bounded by the world's timeout, failing
//! with the same errors). There each rank enqueues on its queue's stream: a wait on every
//! peer's ready event, then its part of the work (its copies, or the sum of its chunk in rank
//! order by a kernel that reads the peers' buffers), then an event of its own. The members
//! exchange those events at the rendezvous's phases and each stream waits on all of them
//! before its later work, so no rank overwrites or frees a buffer a peer's stream still reads.
//! The host never waits for the GPU: issuing blocks only until the peers issue the same
//! collective, and the returned event completes when the GPU is done.
//!
//! Reductions add the ranks in rank order in float (double for f64) and round once, as
//! comm/rank_order_sum.hpp does on the host, so a run gives the threads backend's bits on
//! either device. Buffers in host memory (a step's figures, a norm's partial sum) are staged,
//! by the rule the NCCL backend uses too (detail::device_resident, device/cuda.hpp): copied
//! into device memory, collected, copied back, and the call returns when they are (a complete
//! event). The link model (world_options::link) is the host backend's: a world with one
//! enabled is refused.
//!
//! Run on an H100 (2026-11-27): tests/cuda/test_threads_cuda.cu passed bit for bit against the
//! host backend, clean under compute-sanitizer memcheck and racecheck (docs/gpu.md). Since then
//! the backend was rearranged over the shared front and rendezvous (comm/front.hpp,
//! comm/threads/rendezvous.hpp), and pinned host memory is staged: that has not run on a GPU.
//!
//!   fsdp::threads::world{4}.run([](fsdp::threads::communicator& host) {
//!     fsdp::cuda_device gpu{0};
//!     fsdp::threads::cuda_communicator comm{std::move(host), gpu};
//!     fsdp::shard_group<fsdp::buffer<float>, fsdp::threads::cuda_communicator> group{comm, gpu};
//!     ...
//!   });

#include <algorithm>
#include <array>
#include <cstddef>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "fsdp/comm/threads/communicator.hpp"
#include "fsdp/device/cuda.hpp"

namespace fsdp::threads {

namespace detail {

//! The most ranks the summing kernel takes (their pointers travel in the kernel's parameters).
inline constexpr int max_cuda_ranks = 64;

//! dst[i] = round_T(scale * ((src[0][i] + src[1][i]) + ...)): comm/rank_order_sum.hpp's order.
template <class T>
struct rank_order_sum_args {
  using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const T* src[max_cuda_ranks] = {};
  T* dst = nullptr;
  std::size_t count = 0;
  int n = 0;
  acc_t scale = 1;
};

//! The sum as a kernel of its own, its arguments a __grid_constant__: the loop indexes `src` by
//! a run-time rank, and a plain kernel parameter (or a functor handed to thrust::for_each) indexed
//! so is first copied into each thread's local memory: 544 bytes a thread (ptxas -v). On an H100
//! the sums of a GPT-2-small step took 650 us each on average that way, 21 us as this kernel
//! (Nsight Compute, docs/gpu.md). A __grid_constant__ parameter is read where it lies, and every thread
//! reads the same pointer (a broadcast).
template <class T>
__global__ void rank_order_sum(const __grid_constant__ rank_order_sum_args<T> a) {
  using acc_t = typename rank_order_sum_args<T>::acc_t;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < a.count; i += stride) {
    acc_t acc = convert<acc_t>(a.src[0][i]);
    for (int r = 1; r < a.n; ++r) acc += convert<acc_t>(a.src[r][i]);
    a.dst[i] = convert<T>(acc * a.scale);
  }
}

//! What one member shares with its peers during a collective: the events its stream records.
struct cuda_token {
  cuda_event ready;                 // its input is ready (recorded before it arrived)
  std::array<cuda_event, 3> done{};  // its stream has passed its part of data phase k
};

}  // namespace detail

//! One rank's handle on a group of thread ranks whose buffers are on a CUDA device. Wraps the
//! rank's host communicator (its rendezvous, issue order, failure state, collective front) and
//! the rank's cuda_device. Move-only. Its collectives are collective_methods' (comm/front.hpp);
//! send and recv are refused (errc::invalid_argument) until they are built over CUDA.
class cuda_communicator : public fsdp::detail::collective_methods<cuda_communicator, cuda_queue, cuda_event> {
 public:
  using device_type = cuda_device;

  //! Takes over `host` (do not use it afterwards: the issue order lives in it). Throws
  //! errc::invalid_argument when the world has a link model or more than 64 ranks.
  cuda_communicator(communicator&& host, cuda_device gpu) : host_(std::move(host)), gpu_(std::move(gpu)) {
    if (host_.link().enabled())
      throw error(errc::invalid_argument, "threads::cuda_communicator: the link model (world_options::link) is for the host "
                                          "device; a world over CUDA runs without one", {host_.world_rank()});
    if (host_.size() > detail::max_cuda_ranks)
      throw error(errc::invalid_argument, "threads::cuda_communicator: at most " + std::to_string(detail::max_cuda_ranks) +
                                              " ranks (the summing kernel takes their pointers), got " + std::to_string(host_.size()),
                  {host_.world_rank()});
  }
  cuda_communicator(cuda_communicator&&) noexcept = default;
  cuda_communicator& operator=(cuda_communicator&&) noexcept = default;

  int rank() const noexcept { return host_.rank(); }
  int size() const noexcept { return host_.size(); }
  int world_rank() const noexcept { return host_.world_rank(); }
  detail::group_state* native_handle() const noexcept { return host_.native_handle(); }
  milliseconds timeout() const noexcept { return host_.timeout(); }
  traffic_counters traffic() const noexcept { return host_.traffic(); }
  std::span<const int> hosts() const noexcept { return host_.hosts(); }
  const cuda_device& device() const noexcept { return gpu_; }

  //! Blocks until every rank of the group has arrived (bounded by timeout()). Host threads
  //! only: it does not order the ranks' streams.
  void barrier() { host_.barrier(); }
  //! Ends every rank's pending and future waits with errc::peer_failure, citing `why`.
  void abort(const std::string& why) { host_.abort(why); }
  //! Blocking: ranks with equal color form a new communicator, ordered by (key, rank).
  cuda_communicator split(int color, int key) { return cuda_communicator(host_.split(color, key), gpu_); }

 private:
  friend class fsdp::detail::collective_methods<cuda_communicator, cuda_queue, cuda_event>;
  using error_slot = std::exception_ptr;

  // The front (checks, liveness, traffic: comm/front.hpp), then the collective on the device,
  // through staging when a buffer is in host memory (device_resident's rule).
  cuda_event issue(const detail::collective& c, const void* send, void* recv, cuda_queue& q) {
    if (c.point_to_point())
      throw error(errc::invalid_argument, c.str() + ": threads::cuda_communicator has no send and recv yet (the host threads "
                                                    "backend, MPI and NCCL have them)", {world_rank()});
    if (fsdp::detail::capturing(q.native_handle()))
      throw error(errc::invalid_argument, c.str() + " inside a CUDA graph capture: threads::cuda_communicator meets its peers on the host "
                                                    "at every collective, which a graph's launch does not; capture with NCCL", {world_rank()});
    host_.front_.admit(c, send, recv, [&] { host_.rv_.ensure_alive(c); });
    if (fsdp::detail::device_resident(send) && fsdp::detail::device_resident(recv)) return run(c, send, recv, q);
    const auto [send_bytes, recv_bytes] = c.buffer_bytes(size());
    return staged(send, send_bytes, recv, recv_bytes, q, [&](const void* s, void* r) { run(c, s, r, q); });
  }

  // A collective on host memory: the bytes are copied into one device block (send and recv keep
  // their overlap: in place stays in place), collect(dsend, drecv) runs on it, recv is copied
  // back, and the call returns once it has (bounded by timeout()).
  template <class Collect>
  cuda_event staged(const void* send, std::size_t send_bytes, void* recv, std::size_t recv_bytes, cuda_queue& q, Collect collect) {
    const cudaStream_t st = q.native_handle();
    const auto* s = static_cast<const char*>(send);
    auto* r = static_cast<char*>(recv);
    const bool overlap = s < r + recv_bytes && r < s + send_bytes;
    const char* lo = overlap ? std::min<const char*>(s, r) : nullptr;
    const std::size_t bytes = overlap ? static_cast<std::size_t>(std::max<const char*>(s + send_bytes, r + recv_bytes) - lo)
                                      : send_bytes + recv_bytes;
    void* block = nullptr;
    fsdp::detail::cuda_check(cudaMallocAsync(&block, std::max<std::size_t>(bytes, 1), st), "cudaMallocAsync (staging host memory)");
    auto* base = static_cast<char*>(block);
    char* dsend = overlap ? base + (s - lo) : base;
    char* drecv = overlap ? base + (r - lo) : base + send_bytes;
    try {
      if (overlap)
        copy(base, lo, bytes, st);
      else if (send_bytes)
        copy(dsend, s, send_bytes, st);
      collect(dsend, drecv);
      if (recv_bytes) copy(r, drecv, recv_bytes, st);
      q.synchronize(timeout());
    } catch (...) {
      if (cudaFreeAsync(block, st) != cudaSuccess) (void)cudaGetLastError();
      throw;
    }
    fsdp::detail::cuda_check(cudaFreeAsync(block, st), "cudaFreeAsync (staging host memory)");
    return {};
  }

  // Issues one collective on device buffers: records this rank's ready event, meets the peers,
  // enqueues this rank's part (move_data, on q's stream), and returns an event after it. A CUDA
  // call that fails inside is kept and rethrown after the phases, so the peers are not left
  // waiting for this rank; the world then fails with it as the cause.
  cuda_event run(const detail::collective& c, const void* send, void* recv, cuda_queue& q) {
    gpu_.make_current();
    fsdp::detail::nvtx_range range(to_string(c.kind));
    detail::cuda_token token;
    token.ready = q.record();
    const cudaStream_t st = q.native_handle();
    error_slot err;
    host_.rv_.meet(host_.rv_.take_seq(), c, send, recv, {}, &token, [&](detail::slot& s, auto&& phase) {
      wait_all_ready(s, st, err);
      move_data(s, c, recv, phase, st, err);
      phase(2);  // every member's stream has waited on every token: the tokens may go
    });
    if (err) {
      try {
        std::rethrow_exception(err);
      } catch (const std::exception& e) {
        host_.rv_.fail(error(errc::internal, c.str() + " on " + host_.rv_.group().label + " (threads over CUDA): " + e.what(),
                             {world_rank()}));
      }
    }
    return q.record();
  }

  // This rank's part of collective c, enqueued on `st` between the phases (as on the host:
  // comm/threads/data_phases.hpp, whose chunking and aliasing rules it follows).
  template <class Phase>
  void move_data(const detail::slot& s, const detail::collective& c, void* recv, Phase& phase, cudaStream_t st, error_slot& err) {
    const int n = size(), me = rank();
    const std::size_t elem = size_of(c.type), count = c.count;
    switch (c.kind) {
      case detail::collective_kind::all_gather:
        attempt(err, [&] {
          for (int j = 0; j < n; ++j) {
            auto* dst = static_cast<char*>(recv) + static_cast<std::size_t>(j) * count * elem;
            const void* src = s.args[static_cast<std::size_t>(j)].send;
            if (src != dst && count) copy(dst, src, count * elem, st);
          }
        });
        finish_phase(s, phase, 0, st, err);  // peers have read my send buffer
        break;
      case detail::collective_kind::reduce_scatter: {
        // Summed straight into recv unless a peer reads it.
        const std::size_t mine = static_cast<std::size_t>(me) * count;
        const bool direct = detail::read_by_me_only(s, recv, count * elem, mine * elem, count * elem * static_cast<std::size_t>(n));
        void* scratch = nullptr;
        attempt(err, [&] {
          if (!direct) fsdp::detail::cuda_check(cudaMallocAsync(&scratch, count * elem, st), "cudaMallocAsync (reduce_scatter scratch)");
          sum(s, c, mine, count, direct ? recv : scratch, st);
        });
        finish_phase(s, phase, 0, st, err);  // everyone has read every send buffer
        attempt(err, [&] {
          if (scratch) {
            copy(recv, scratch, count * elem, st);
            fsdp::detail::cuda_check(cudaFreeAsync(scratch, st), "cudaFreeAsync (reduce_scatter scratch)");
          }
        });
        finish_phase(s, phase, 1, st, err);  // (my recv is mine alone; the phase keeps the tokens alive)
        break;
      }
      case detail::collective_kind::all_reduce: {
        // Rank r sums chunk r into its recv (or scratch), then copies it into every peer's recv.
        const auto [b, e] = detail::all_reduce_chunk(count, n, me);
        char* mine = static_cast<char*>(recv) + b * elem;
        const bool direct = detail::read_by_me_only(s, mine, (e - b) * elem, b * elem, count * elem);
        void* reduced = direct ? static_cast<void*>(mine) : nullptr;
        attempt(err, [&] {
          if (!direct && e > b) fsdp::detail::cuda_check(cudaMallocAsync(&reduced, (e - b) * elem, st), "cudaMallocAsync (all_reduce scratch)");
          if (e > b) sum(s, c, b, e - b, reduced, st);
        });
        finish_phase(s, phase, 0, st, err);  // every send buffer has been read
        attempt(err, [&] {
          for (int j = 0; j < n && e > b; ++j) {
            char* dst = static_cast<char*>(s.args[static_cast<std::size_t>(j)].recv) + b * elem;
            if (dst != reduced) copy(dst, reduced, (e - b) * elem, st);
          }
          if (!direct && reduced) fsdp::detail::cuda_check(cudaFreeAsync(reduced, st), "cudaFreeAsync (all_reduce scratch)");
        });
        finish_phase(s, phase, 1, st, err);  // every chunk of my recv has been written
        break;
      }
      case detail::collective_kind::broadcast:
        attempt(err, [&] {
          if (me != c.root && count) copy(recv, s.args[static_cast<std::size_t>(c.root)].send, count * elem, st);
        });
        finish_phase(s, phase, 0, st, err);  // the root's buffer has been read
        break;
      case detail::collective_kind::all_to_all:  // block j of my recv is block `me` of member j's send
        attempt(err, [&] {
          for (int j = 0; j < n && count; ++j)
            copy(static_cast<char*>(recv) + static_cast<std::size_t>(j) * count * elem,
                 static_cast<const char*>(s.args[static_cast<std::size_t>(j)].send) + static_cast<std::size_t>(me) * count * elem, count * elem, st);
        });
        finish_phase(s, phase, 0, st, err);  // peers have read my send buffer
        break;
      case detail::collective_kind::send:
      case detail::collective_kind::recv:  // refused in issue()
      case detail::collective_kind::barrier:
      case detail::collective_kind::split:
        break;
    }
  }

  template <class F>
  static void attempt(error_slot& err, F&& f) {
    if (err) return;
    try {
      f();
    } catch (...) {
      err = std::current_exception();
    }
  }
  static detail::cuda_token& token_of(const detail::slot& s, int j) {
    return *static_cast<detail::cuda_token*>(s.args[static_cast<std::size_t>(j)].token);
  }
  // This stream waits until every member's input is ready.
  void wait_all_ready(const detail::slot& s, cudaStream_t st, error_slot& err) const {
    attempt(err, [&] {
      for (int j = 0; j < size(); ++j)
        if (j != rank()) fsdp::detail::cuda_check(cudaStreamWaitEvent(st, token_of(s, j).ready.native_handle(), 0), "cudaStreamWaitEvent");
    });
  }
  // Records this member's done event of phase k, meets the peers (every done event is then
  // recorded), and makes this stream wait on all of them.
  template <class Phase>
  void finish_phase(const detail::slot& s, Phase& phase, int k, cudaStream_t st, error_slot& err) const {
    detail::cuda_token& mine = token_of(s, rank());
    attempt(err, [&] {
      mine.done[static_cast<std::size_t>(k)] = cuda_event::create();
      mine.done[static_cast<std::size_t>(k)].record_on(st);
    });
    phase(k);
    attempt(err, [&] {
      for (int j = 0; j < size(); ++j) {
        const cuda_event& e = token_of(s, j).done[static_cast<std::size_t>(k)];
        if (j != rank() && e.native_handle()) fsdp::detail::cuda_check(cudaStreamWaitEvent(st, e.native_handle(), 0), "cudaStreamWaitEvent");
      }
    });
  }
  static void copy(void* dst, const void* src, std::size_t bytes, cudaStream_t st) {
    fsdp::detail::cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, st), "cudaMemcpyAsync");
  }
  // out[0, count) = the rank-order sum of every member's send[offset, offset + count).
  void sum(const detail::slot& s, const detail::collective& c, std::size_t offset, std::size_t count, void* out, cudaStream_t st) const {
    visit_floating(c.type, [&](auto tag) {
      using T = decltype(tag);
      detail::rank_order_sum_args<T> a;
      a.n = size();
      for (int j = 0; j < size(); ++j) a.src[j] = static_cast<const T*>(s.args[static_cast<std::size_t>(j)].send) + offset;
      a.dst = static_cast<T*>(out);
      a.count = count;
      using acc_t = typename detail::rank_order_sum_args<T>::acc_t;
      a.scale = c.op == reduce_op::avg ? acc_t(1) / static_cast<acc_t>(size()) : acc_t(1);
      if (count == 0) return;
      // One element a thread; the grid is capped (65536 blocks of 256) and the loop covers the rest.
      constexpr unsigned threads = 256;
      const std::size_t blocks = std::min<std::size_t>((count + threads - 1) / threads, 65536);
      detail::rank_order_sum<T><<<static_cast<unsigned>(blocks), threads, 0, st>>>(a);
    });
    fsdp::detail::cuda_check(cudaGetLastError(), "the rank-order sum kernel");
  }

  communicator host_;
  cuda_device gpu_;
};

static_assert(full_communicator<cuda_communicator>);
static_assert(knows_hosts<cuda_communicator>);

}  // namespace fsdp::threads
