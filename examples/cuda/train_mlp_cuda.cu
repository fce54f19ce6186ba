// train_mlp_cuda: examples/train_mlp.cpp on GPUs. One process per GPU; NCCL moves the shards;
// each layer's forward and backward are small CUDA kernels on the device's compute stream.
//
// Each layer is one fsdp unit (weight and bias). A rank holds only its shard of each layer:
// forward gathers a layer just before it runs and frees it after, backward gathers it again and
// reduce-scatters its gradient into the gradient shard, AdamW steps the local shards on the GPU.
// The task: fit a fixed smooth function of 16 inputs.
//
//   train_mlp_cuda                                       one GPU
//   RANK=0 WORLD_SIZE=2 train_mlp_cuda --store /tmp/r1 & RANK=1 WORLD_SIZE=2 train_mlp_cuda --store /tmp/r1
//   mpirun -n 4 train_mlp_cuda --store /shared/r1        (ranks from OMPI_COMM_WORLD_RANK/SIZE)
//
// Rank 0 passes NCCL's unique id to the others through the --store directory (use a fresh one
// per run). The GPU is LOCAL_RANK (or OMPI_COMM_WORLD_LOCAL_RANK, else the rank).

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <fsdp/comm/file_store.hpp>
#include <fsdp/comm/nccl.hpp>
#include <fsdp/device/cuda.hpp>
#include <fsdp/fsdp.hpp>

#include "../common/options.hpp"

namespace {

struct config {
  int steps = 60;
  int layers = 6;
  int width = 128;
  int batch = 64;  // global batch: split evenly over the ranks
  float lr = 2e-3f;
  std::string store = "/tmp/fsdp_train_mlp_cuda";
};

constexpr int kInputs = 16;

const char* usage =
    "usage: train_mlp_cuda [options]   (rank and world size from RANK/WORLD_SIZE or OMPI_COMM_WORLD_RANK/SIZE)\n"
    "  --store DIR        directory shared by the ranks for NCCL's bootstrap (default /tmp/fsdp_train_mlp_cuda)\n"
    "  --steps N          training steps (default 60)\n"
    "  --layers N         hidden layers, one fsdp unit each (default 6)\n"
    "  --width N          hidden width (default 128)\n"
    "  --batch N          global batch, a multiple of the world size (default 64)\n"
    "  --lr X             AdamW learning rate (default 0.002)\n";

config parse(int argc, char** argv) {
  config c;
  using example::at_least;
  example::parser p{"train_mlp_cuda", usage};
  p.flag("--steps", c.steps, at_least(1))
      .flag("--layers", c.layers, at_least(1))
      .flag("--width", c.width, at_least(1))
      .flag("--batch", c.batch, at_least(1))
      .flag("--lr", [&](const char* v) { c.lr = std::strtof(v, nullptr); })  // checked below
      .flag("--store", c.store);
  p.parse(argc, argv);
  if (!(c.lr > 0)) p.fail("--lr must be > 0");
  return c;
}

// The first of the environment variables that is set, as an integer >= 0.
int env_int(std::initializer_list<const char*> names, int fallback) {
  const example::parser p{"train_mlp_cuda", usage};  // its message and exit on a bad value
  for (const char* n : names)
    if (const char* v = std::getenv(n)) return static_cast<int>(p.integer(n, v, example::at_least(0)));
  return fallback;
}

// The function the network learns, and deterministic noise in [-1, 1): as in train_mlp.cpp.
float target(const float* x) {
  float y = 0;
  for (int i = 0; i < kInputs; ++i) y += std::sin(1.5f * x[i] + 0.3f * static_cast<float>(i)) * (i % 2 ? 0.5f : -0.25f);
  return y;
}
float noise(std::uint64_t a, std::uint64_t b) {
  std::uint64_t z = a * 0x9E3779B97F4A7C15ull + b + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return static_cast<float>(((z ^ (z >> 31)) >> 40) * (2.0 / (1ull << 24)) - 1.0);
}

// ---- kernels: one thread per output element; row-major, x is [batch][in], W is [out][in] ----

__global__ void dense_forward(const float* w, const float* b, const float* x, float* y, int batch, int in, int out, bool act) {
  const int k = blockIdx.x * blockDim.x + threadIdx.x;
  if (k >= batch * out) return;
  const int s = k / out, o = k % out;
  float acc = b[o];
  for (int i = 0; i < in; ++i) acc += w[o * in + i] * x[s * in + i];
  y[k] = act ? tanhf(acc) : acc;
}

// dz = dL/d(pre-activation), from dL/dy and y (tanh' = 1 - y^2).
__global__ void activation_backward(const float* y, const float* dy, float* dz, int n, bool act) {
  const int k = blockIdx.x * blockDim.x + threadIdx.x;
  if (k < n) dz[k] = act ? dy[k] * (1 - y[k] * y[k]) : dy[k];
}

// gw[o][i] += sum_s dz[s][o] x[s][i]; gb[o] += sum_s dz[s][o] (one thread per weight; thread i == in adds the bias).
__global__ void dense_grad_params(const float* dz, const float* x, float* gw, float* gb, int batch, int in, int out) {
  const int k = blockIdx.x * blockDim.x + threadIdx.x;
  if (k >= out * (in + 1)) return;
  const int o = k / (in + 1), i = k % (in + 1);
  float acc = 0;
  for (int s = 0; s < batch; ++s) acc += dz[s * out + o] * (i == in ? 1.0f : x[s * in + i]);
  if (i == in) gb[o] += acc;
  else gw[o * in + i] += acc;
}

// dx[s][i] = sum_o dz[s][o] w[o][i].
__global__ void dense_grad_input(const float* dz, const float* w, float* dx, int batch, int in, int out) {
  const int k = blockIdx.x * blockDim.x + threadIdx.x;
  if (k >= batch * in) return;
  const int s = k / in, i = k % in;
  float acc = 0;
  for (int o = 0; o < out; ++o) acc += dz[s * out + o] * w[o * in + i];
  dx[k] = acc;
}

std::string mib(std::size_t bytes) {
  char s[32];
  std::snprintf(s, sizeof s, "%.2f MiB", static_cast<double>(bytes) / (1 << 20));
  return s;
}

unsigned blocks(int n) { return static_cast<unsigned>((n + 255) / 256); }

void check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw fsdp::error(fsdp::errc::internal, std::string(what) + ": " + cudaGetErrorString(e));
}

struct layer {
  int in, out;
  bool act;  // tanh on hidden layers, identity on the last
  fsdp::buffer<float> w, b;
  layer(int i, int o, bool a, int index)
      : in(i), out(o), act(a), w(static_cast<std::size_t>(i) * o, "layer" + std::to_string(index) + ".w"),
        b(static_cast<std::size_t>(o), "layer" + std::to_string(index) + ".b") {}
};

using group_type = fsdp::shard_group<fsdp::buffer<float>, fsdp::nccl::communicator>;

void train(fsdp::cuda_device& gpu, fsdp::nccl::communicator& comm, const config& c) {
  const int ranks = comm.size();
  if (c.batch % ranks != 0) throw fsdp::error(fsdp::errc::invalid_argument, "--batch must be a multiple of the world size");
  const int local = c.batch / ranks;
  const cudaStream_t stream = gpu.compute_stream();
  auto floats = [&](std::size_t n) { return gpu.allocate(n * sizeof(float), fsdp::mem_kind::transient); };

  // 1. The model, sharded: one unit per layer, initial values computed per shard and copied to
  //    the GPU by shard_group (no rank ever holds a full copy).
  std::vector<std::unique_ptr<layer>> layers;
  for (int l = 0; l <= c.layers; ++l)
    layers.push_back(std::make_unique<layer>(l == 0 ? kInputs : c.width, l == c.layers ? 1 : c.width, l < c.layers, l));
  group_type group{comm, gpu};
  for (auto& l : layers) group.add_unit({&l->w, &l->b});
  group.finalize(fsdp::init::per_shard([&](const fsdp::param_slice& s, std::span<float> out) {
    const float scale = 1.0f / std::sqrt(static_cast<float>(layers[static_cast<std::size_t>(s.unit)]->in));
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = scale * noise(static_cast<std::uint64_t>(s.unit * 2 + s.index), s.offset + i);
  }));
  fsdp::adamw opt{group, {.lr = c.lr, .weight_decay = 0.0f}};
  fsdp::cuda_queue report{"report"};

  for (int step = 0; step < c.steps; ++step) {
    gpu.reset_peak_memory();
    // 2. This rank's slice of the global batch, copied to the GPU.
    std::vector<float> x(static_cast<std::size_t>(local) * kInputs), t(static_cast<std::size_t>(local));
    for (int s = 0; s < local; ++s) {
      const int sample = comm.rank() * local + s;
      for (int i = 0; i < kInputs; ++i)
        x[static_cast<std::size_t>(s) * kInputs + i] = noise(static_cast<std::uint64_t>(step) + 1000, static_cast<std::uint64_t>(sample * kInputs + i));
      t[static_cast<std::size_t>(s)] = target(&x[static_cast<std::size_t>(s) * kInputs]);
    }
    std::vector<fsdp::cuda_buffer> acts;
    acts.push_back(floats(x.size()));
    gpu.copy_from_host(acts[0].data(), x.data(), x.size() * sizeof(float));

    // 3. Forward: group.forward(u) gathers unit u onto the GPU; its scope's end frees it.
    for (std::size_t u = 0; u < layers.size(); ++u) {
      layer& l = *layers[u];
      auto in_use = group.forward(static_cast<int>(u));
      acts.push_back(floats(static_cast<std::size_t>(local) * l.out));
      dense_forward<<<blocks(local * l.out), 256, 0, stream>>>(l.w.data(), l.b.data(), acts[u].as<float>(), acts[u + 1].as<float>(),
                                                                local, l.in, l.out, l.act);
      check_launch("dense_forward");
    }

    // 4. Loss (mean squared error) on the host: the output is one float per sample.
    std::vector<float> y(static_cast<std::size_t>(local)), dy(static_cast<std::size_t>(local));
    gpu.copy_to_host(y.data(), acts.back().data(), y.size() * sizeof(float));
    double loss = 0;
    for (std::size_t s = 0; s < y.size(); ++s) {
      const float d = y[s] - t[s];
      loss += 0.5 * d * d / local;
      dy[s] = d / static_cast<float>(local);
    }
    fsdp::cuda_buffer grad = floats(dy.size());
    gpu.copy_from_host(grad.data(), dy.data(), dy.size() * sizeof(float));

    // 5. Backward in reverse: group.backward(u) gathers u and binds zeroed gradient storage;
    //    its scope's end reduce-scatters the gradients into the shard.
    for (std::size_t u = layers.size(); u-- > 0;) {
      layer& l = *layers[u];
      auto in_use = group.backward(static_cast<int>(u));
      const int n_out = local * l.out, n_in = local * l.in;
      fsdp::cuda_buffer dz = floats(static_cast<std::size_t>(n_out)), dx = floats(static_cast<std::size_t>(n_in));
      activation_backward<<<blocks(n_out), 256, 0, stream>>>(acts[u + 1].as<float>(), grad.as<float>(), dz.as<float>(), n_out, l.act);
      dense_grad_params<<<blocks(l.out * (l.in + 1)), 256, 0, stream>>>(dz.as<float>(), acts[u].as<float>(), l.w.grad(), l.b.grad(),
                                                                        local, l.in, l.out);
      dense_grad_input<<<blocks(n_in), 256, 0, stream>>>(dz.as<float>(), l.w.data(), dx.as<float>(), local, l.in, l.out);
      check_launch("backward kernels");
      grad = std::move(dx);
    }
    // 6. AdamW on the local shards (Thrust on the compute stream).
    opt.step();
    opt.zero_grad();

    // 7. Report the mean loss over ranks (a host value: the communicator stages it through
    //    device memory and returns when done).
    double mean_loss = loss / ranks;
    comm.all_reduce(&mean_loss, &mean_loss, 1, fsdp::dtype::f64, fsdp::reduce_op::sum, report);
    if (comm.rank() == 0) {
      const fsdp::memory_stats m = group.memory();
      std::printf("step %3d  loss %.5f  rank 0: peak %s, sharded state %s, %llu bytes sent\n", step, mean_loss, mib(m.peak).c_str(),
                  mib(m.persistent_live).c_str(), static_cast<unsigned long long>(group.traffic().total()));
      std::fflush(stdout);
    }
  }
  if (comm.rank() != 0) return;
  std::size_t model_bytes = 0;
  for (auto& l : layers) model_bytes += (l->w.size() + l->b.size()) * sizeof(float);
  std::printf("\nunsharded (DDP) state per rank: %s (params + grads + AdamW moments, fp32)\n", mib(4 * model_bytes).c_str());
}

}  // namespace

int main(int argc, char** argv) {
  const config c = parse(argc, argv);
  const int rank = env_int({"RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"}, 0);
  const int world = env_int({"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}, 1);
  const int local_rank = env_int({"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"}, rank);
  try {
    fsdp::cuda_device gpu{local_rank};  // fails here, clearly, on a machine without a usable GPU
    auto comm = fsdp::nccl::communicator::from_file_store(gpu, rank, world, fsdp::file_store{c.store});
    if (rank == 0)
      std::printf("train_mlp_cuda: %d GPU ranks, %d layers of width %d, global batch %d, full sharding, fp32\n\n", world,
                  c.layers, c.width, c.batch);
    train(gpu, comm, c);
  } catch (const fsdp::error& e) {
    std::fprintf(stderr, "train_mlp_cuda: rank %d: %s\n", rank, e.what());
    return 1;
  }
  return 0;
}
