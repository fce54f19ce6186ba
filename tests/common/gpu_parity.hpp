#pragma once
// For the CUDA tests (nvcc): what one rank computes with a GPU backend and with the host threads
// backend on the same inputs, so that test_threads_cuda (thread ranks on one GPU) and
// test_nccl_ranks (NCCL process ranks on one GPU) compare the same things against the same
// independent reference: every collective's output, and the parameters after three SGD steps of
// a two-unit shard_group.

#include "fsdp/device/cuda.hpp"
#include "fsdp/fsdp.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <cstddef>
#include <cstring>
#include <vector>

#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>

namespace fsdp_test {

// Rank r's input element i: distinct per rank and element, not exactly summable in bf16.
inline float input(int r, std::size_t i) { return 0.37f * static_cast<float>(r + 1) + 0.011f * static_cast<float>(i % 97); }
// Rank r's n * count inputs of every collective below.
template <class T>
std::vector<T> inputs(int r, int n, std::size_t count) {
  std::vector<T> in(count * static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = fsdp::convert<T>(input(r, i));
  return in;
}

// Where each collective's output sits in a rank's result, for `count` elements of `elem` bytes
// per rank on n ranks: all_gather, reduce_scatter, all_reduce, in-place all_reduce, broadcast
// from the last rank, all_to_all, concatenated.
struct collective_parts {
  std::size_t full, part;  // n * count and count elements, in bytes
  collective_parts(int n, std::size_t count, std::size_t elem) : full(static_cast<std::size_t>(n) * count * elem), part(count * elem) {}
  std::size_t all_gather() const { return 0; }
  std::size_t reduce_scatter() const { return full; }
  std::size_t all_reduce() const { return full + part; }
  std::size_t all_reduce_in_place() const { return 2 * full + part; }
  std::size_t broadcast() const { return 3 * full + part; }
  std::size_t all_to_all() const { return 3 * full + 2 * part; }
  std::size_t total() const { return 4 * full + 2 * part; }
};

// Every collective of `count` elements of T per rank on the host threads backend: rank
// host.rank()'s outputs as bytes (collective_parts's layout).
template <class T>
std::vector<std::byte> host_collectives(fsdp::threads::communicator& host, std::size_t count, fsdp::reduce_op op) {
  using namespace std::chrono_literals;
  const int n = host.size(), r = host.rank();
  const fsdp::dtype t = fsdp::dtype_of<T>;
  const collective_parts at(n, count, sizeof(T));
  std::vector<T> in = inputs<T>(r, n, count);
  fsdp::host_queue q;
  std::vector<T> gathered(in.size()), scattered(count), reduced(in.size()), inplace = in, exchanged(in.size());
  std::vector<T> bcast(in.begin(), in.begin() + static_cast<std::ptrdiff_t>(count));
  host.all_gather(in.data(), gathered.data(), count, t, q).wait(20s);
  host.reduce_scatter(in.data(), scattered.data(), count, t, op, q).wait(20s);
  host.all_reduce(in.data(), reduced.data(), in.size(), t, op, q).wait(20s);
  host.all_reduce(inplace.data(), inplace.data(), in.size(), t, op, q).wait(20s);
  host.broadcast(bcast.data(), count, t, n - 1, q).wait(20s);
  host.all_to_all(in.data(), exchanged.data(), count, t, q).wait(20s);
  std::vector<std::byte> out(at.total());
  std::memcpy(out.data() + at.all_gather(), gathered.data(), at.full);
  std::memcpy(out.data() + at.reduce_scatter(), scattered.data(), at.part);
  std::memcpy(out.data() + at.all_reduce(), reduced.data(), at.full);
  std::memcpy(out.data() + at.all_reduce_in_place(), inplace.data(), at.full);
  std::memcpy(out.data() + at.broadcast(), bcast.data(), at.part);
  std::memcpy(out.data() + at.all_to_all(), exchanged.data(), at.full);
  return out;
}

// The same collectives on a GPU backend (threads::cuda_communicator, nccl::communicator), issued
// back to back on one queue; only the last event is waited for (the stream orders them).
template <class T, class Comm>
std::vector<std::byte> gpu_collectives(Comm& comm, const fsdp::cuda_device& gpu, std::size_t count, fsdp::reduce_op op) {
  using namespace std::chrono_literals;
  const int n = comm.size(), r = comm.rank();
  const fsdp::dtype t = fsdp::dtype_of<T>;
  const collective_parts at(n, count, sizeof(T));
  const std::vector<T> in = inputs<T>(r, n, count);
  fsdp::cuda_queue q{"collectives"};
  auto dev_in = gpu.allocate(at.full, fsdp::mem_kind::transient);
  auto gathered = gpu.allocate(at.full, fsdp::mem_kind::transient);
  auto scattered = gpu.allocate(at.part, fsdp::mem_kind::transient);
  auto reduced = gpu.allocate(at.full, fsdp::mem_kind::transient);
  auto inplace = gpu.allocate(at.full, fsdp::mem_kind::transient);
  auto bcast = gpu.allocate(at.part, fsdp::mem_kind::transient);
  auto exchanged = gpu.allocate(at.full, fsdp::mem_kind::transient);
  gpu.copy_from_host(dev_in.data(), in.data(), at.full);
  gpu.copy_from_host(inplace.data(), in.data(), at.full);
  gpu.copy_from_host(bcast.data(), in.data(), at.part);
  const auto before = comm.traffic().collectives;
  comm.all_gather(dev_in.data(), gathered.data(), count, t, q);
  comm.reduce_scatter(dev_in.data(), scattered.data(), count, t, op, q);
  comm.all_reduce(dev_in.data(), reduced.data(), in.size(), t, op, q);
  comm.all_reduce(inplace.data(), inplace.data(), in.size(), t, op, q);
  comm.broadcast(bcast.data(), count, t, n - 1, q);
  comm.all_to_all(dev_in.data(), exchanged.data(), count, t, q).wait(60s, "all_to_all");
  std::vector<std::byte> out(at.total());
  gpu.copy_to_host(out.data() + at.all_gather(), gathered.data(), at.full);
  gpu.copy_to_host(out.data() + at.reduce_scatter(), scattered.data(), at.part);
  gpu.copy_to_host(out.data() + at.all_reduce(), reduced.data(), at.full);
  gpu.copy_to_host(out.data() + at.all_reduce_in_place(), inplace.data(), at.full);
  gpu.copy_to_host(out.data() + at.broadcast(), bcast.data(), at.part);
  gpu.copy_to_host(out.data() + at.all_to_all(), exchanged.data(), at.full);
  CHECK(comm.traffic().collectives - before == 6);
  return out;
}

// A gradient a rank computes from its parameters: exact in float (a halving and a small
// integer added), so the host and the GPU give the same bits.
template <class T>
struct gradient_of {
  const T* w;
  T* g;
  float rank;
  FSDP_HOST_DEVICE void operator()(std::size_t i) const { g[i] = fsdp::convert<T>(fsdp::convert<float>(w[i]) * 0.5f + rank); }
};

// What a training run of train_three_steps uses beside its sharding.
struct run_config {
  bool offload = false;    // every bucket's sharded state in host memory (pinned, on the GPU)
  bool freeze_b1 = false;  // b1 frozen: gathered like the others, never given a gradient
};

// Three SGD steps of a two-unit model (w1, b1 | w2) on `group`, whose gradients `fill(f, size)`
// computes (a Thrust loop on the GPU, a plain one on the host); the full parameters after them,
// as the master type.
template <class Group, class Fill>
std::vector<float> train_three_steps(Group& group, Fill fill, run_config c = {}) {
  using P = typename Group::param_type;
  fsdp::buffer<P> w1(300, "w1"), b1(7, "b1"), w2(129, "w2");
  if (c.freeze_b1)
    group.add_unit({&w1, &b1}, "u0", {&b1});
  else
    group.add_unit({&w1, &b1});
  group.add_unit({&w2});
  group.finalize(fsdp::init::per_shard([](const fsdp::param_slice& p, std::span<float> v) {
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.01f * static_cast<float>((p.offset + i) % 101) - 0.3f * static_cast<float>(p.index);
  }));
  fsdp::sgd opt{group, {.lr = 0.25f}};
  for (int step = 0; step < 3; ++step) {
    for (std::size_t u = 0; u < 2; ++u) auto scope = group.forward(u);
    for (std::size_t u = 2; u-- > 0;) {
      auto scope = group.backward(u);
      for (auto* p : u == 0 ? std::vector<fsdp::buffer<P>*>{&w1, &b1} : std::vector<fsdp::buffer<P>*>{&w2})
        if (!(c.freeze_b1 && p == &b1)) fill(gradient_of<P>{p->data(), p->grad(), static_cast<float>(group.rank())}, p->size());
    }
    opt.step();
    opt.zero_grad();
  }
  std::vector<float> full;
  for (int u = 0; u < 2; ++u)
    for (int k = 0; k < (u == 0 ? 2 : 1); ++k) {
      const auto v = group.full_parameter(u, k);
      for (const auto& x : v) full.push_back(fsdp::convert<float>(x));
    }
  return full;
}

// fill for train_three_steps on a GPU: a Thrust loop on the device's stream.
inline auto gpu_fill(const fsdp::cuda_device& gpu) {
  return [&gpu](auto f, std::size_t size) {
    thrust::for_each_n(gpu.execution_policy(), thrust::counting_iterator<std::size_t>(0), size, f);
  };
}
// fill on the host: a plain loop.
inline auto host_fill() {
  return [](auto f, std::size_t size) {
    for (std::size_t i = 0; i < size; ++i) f(i);
  };
}

}  // namespace fsdp_test
