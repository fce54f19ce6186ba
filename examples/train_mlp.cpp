// train_mlp: a small multi-layer perceptron trained with fsdp on N thread ranks.
//
// Each layer is one fsdp unit (its weight and bias). Every rank holds only its shard of each
// layer; the forward pass gathers a layer just before it runs and frees it right after, the
// backward pass gathers it again and reduce-scatters its gradient into the gradient shard,
// and AdamW steps the local shards. The task: fit a fixed smooth function of 16 inputs.
//
//   train_mlp                                   4 thread ranks, full sharding, fp32
//   train_mlp --ranks 8 --sharding hybrid:4 --precision bf16
//   mpiexec -n 4 train_mlp --backend mpi        4 processes (when built with MPI)
//
// Per step it prints the loss, each rank's peak memory and the bytes each rank sent; at the
// end it compares per-rank memory with what an unsharded (DDP) copy of the model needs.

#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <fsdp/fsdp.hpp>

#include "common/launch.hpp"
#include "common/options.hpp"

namespace {

struct config {
  int ranks = 4;
  int steps = 60;
  int layers = 6;
  int width = 128;
  int batch = 64;  // global batch: split evenly over the ranks
  float lr = 2e-3f;
  std::string sharding = "full";
  fsdp::sharding shards = fsdp::full_shard();  // what --sharding says
  std::string precision = "fp32";
  std::string backend = "threads";
};

constexpr int kInputs = 16;

const char* usage =
    "usage: train_mlp [options]\n"
    "  --backend B        threads | mpi (run under mpiexec; default threads)\n"
    "  --ranks N          thread ranks (default 4; with mpi: the number of processes)\n"
    "  --steps N          training steps (default 60)\n"
    "  --layers N         hidden layers, one fsdp unit each (default 6)\n"
    "  --width N          hidden width (default 128)\n"
    "  --batch N          global batch, a multiple of --ranks (default 64)\n"
    "  --lr X             AdamW learning rate (default 0.002)\n"
    "  --sharding S       full | grad_op | hybrid:SHARD_SIZE | none (default full)\n"
    "  --precision P      fp32 | bf16 (bf16 compute, fp32 reduce and master; default fp32)\n";

config parse(int argc, char** argv) {
  config c;
  using example::at_least;
  example::parser p{"train_mlp", usage};
  p.flag("--ranks", c.ranks, at_least(1))
      .flag("--steps", c.steps, at_least(1))
      .flag("--layers", c.layers, at_least(1))
      .flag("--width", c.width, at_least(1))
      .flag("--batch", c.batch, at_least(1))
      .flag("--lr", [&](const char* v) { c.lr = std::strtof(v, nullptr); })  // checked below
      .flag("--sharding", c.sharding)
      .flag("--precision", c.precision)
      .flag("--backend", c.backend);
  p.parse(argc, argv);
  if (c.precision != "fp32" && c.precision != "bf16") p.fail("--precision must be fp32 or bf16");
  if (c.backend != "threads" && c.backend != "mpi") p.fail("--backend must be threads or mpi");
  if (c.backend == "mpi" && !example::have_mpi) p.fail("this build has no MPI (install libopenmpi-dev and rebuild)");
  if (!(c.lr > 0)) p.fail("--lr must be > 0");
  c.shards = example::parse_sharding(p, c.sharding);
  return c;
}

// The function the network learns: a smooth function of the 16 inputs.
float target(const float* x) {
  float y = 0;
  for (int i = 0; i < kInputs; ++i) y += std::sin(1.5f * x[i] + 0.3f * static_cast<float>(i)) * (i % 2 ? 0.5f : -0.25f);
  return y;
}

// Deterministic pseudo-random numbers in [-1, 1) from a counter (same on every rank).
float noise(std::uint64_t a, std::uint64_t b) {
  std::uint64_t z = a * 0x9E3779B97F4A7C15ull + b + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return static_cast<float>(((z ^ (z >> 31)) >> 40) * (2.0 / (1ull << 24)) - 1.0);
}

// One dense layer: y = act(W x + b), W is [out][in].
template <class T>
struct layer {
  int in, out;
  bool act;  // tanh on hidden layers, identity on the last
  fsdp::buffer<T> w, b;
  layer(int i, int o, bool a, int index)
      : in(i), out(o), act(a), w(static_cast<std::size_t>(i) * o, "layer" + std::to_string(index) + ".w"),
        b(static_cast<std::size_t>(o), "layer" + std::to_string(index) + ".b") {}
};

template <class T>
float f(const T& v) {
  return fsdp::convert<float>(v);
}

// Forward over a batch; x is [batch][in]. Returns y [batch][out].
template <class T>
std::vector<float> forward(const layer<T>& l, const std::vector<float>& x, int batch) {
  std::vector<float> y(static_cast<std::size_t>(batch) * l.out);
  for (int s = 0; s < batch; ++s)
    for (int o = 0; o < l.out; ++o) {
      float acc = f(l.b.data()[o]);
      const T* row = l.w.data() + static_cast<std::size_t>(o) * l.in;
      for (int i = 0; i < l.in; ++i) acc += f(row[i]) * x[static_cast<std::size_t>(s) * l.in + i];
      y[static_cast<std::size_t>(s) * l.out + o] = l.act ? std::tanh(acc) : acc;
    }
  return y;
}

// Backward: given the layer's input x, output y and dL/dy, adds dL/dW and dL/db into the
// gradient storage fsdp exposes, and returns dL/dx.
template <class T>
std::vector<float> backward(layer<T>& l, const std::vector<float>& x, const std::vector<float>& y, const std::vector<float>& dy,
                            int batch) {
  std::vector<float> dx(static_cast<std::size_t>(batch) * l.in, 0.0f);
  std::vector<float> dw(static_cast<std::size_t>(l.in) * l.out, 0.0f), db(static_cast<std::size_t>(l.out), 0.0f);
  for (int s = 0; s < batch; ++s)
    for (int o = 0; o < l.out; ++o) {
      const std::size_t k = static_cast<std::size_t>(s) * l.out + o;
      const float dz = l.act ? dy[k] * (1 - y[k] * y[k]) : dy[k];
      db[static_cast<std::size_t>(o)] += dz;
      const T* row = l.w.data() + static_cast<std::size_t>(o) * l.in;
      for (int i = 0; i < l.in; ++i) {
        dw[static_cast<std::size_t>(o) * l.in + i] += dz * x[static_cast<std::size_t>(s) * l.in + i];
        dx[static_cast<std::size_t>(s) * l.in + i] += dz * f(row[i]);
      }
    }
  for (std::size_t i = 0; i < dw.size(); ++i) l.w.grad()[i] = fsdp::convert<T>(f(l.w.grad()[i]) + dw[i]);
  for (std::size_t i = 0; i < db.size(); ++i) l.b.grad()[i] = fsdp::convert<T>(f(l.b.grad()[i]) + db[i]);
  return dx;
}

std::string mib(std::size_t bytes) {
  char s[32];
  std::snprintf(s, sizeof s, "%.2f MiB", static_cast<double>(bytes) / (1 << 20));
  return s;
}

// Per-rank figures of one step, all-gathered so that rank 0 can print every rank's.
struct rank_stats {
  double loss = 0;
  std::uint64_t peak = 0, persistent = 0, sent = 0;
};

// One rank's whole run, on any backend's communicator.
template <class Group>
void train_rank(typename Group::comm_type& comm, const config& c, typename Group::options opts) {
  using T = typename Group::param_type;
  const int ranks = comm.size();
  if (c.batch % ranks != 0) throw fsdp::error(fsdp::errc::invalid_argument, "--batch must be a multiple of the number of ranks");

  // 1. The model: layer l is [width x in], the last maps to one output.
  std::vector<std::unique_ptr<layer<T>>> layers;
  for (int l = 0; l <= c.layers; ++l)
    layers.push_back(std::make_unique<layer<T>>(l == 0 ? kInputs : c.width, l == c.layers ? 1 : c.width, l < c.layers, l));

  // 2. Shard it: one unit per layer, initial values computed per shard (no rank ever holds a
  //    full copy), scaled like PyTorch's default uniform(-1/sqrt(in), 1/sqrt(in)).
  Group group{comm, {}, opts};
  for (auto& l : layers) group.add_unit({&l->w, &l->b});
  group.finalize(fsdp::init::per_shard([&](const fsdp::param_slice& s, std::span<float> out) {
    const float scale = 1.0f / std::sqrt(static_cast<float>(layers[static_cast<std::size_t>(s.unit)]->in));
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = scale * noise(static_cast<std::uint64_t>(s.unit * 2 + s.index), s.offset + i);
  }));
  fsdp::adamw opt{group, {.lr = c.lr, .weight_decay = 0.0f}};

  const int local = c.batch / ranks;
  std::vector<rank_stats> all(static_cast<std::size_t>(ranks));
  fsdp::host_queue stats_queue;
  for (int step = 0; step < c.steps; ++step) {
    const auto sent_before = group.traffic().total();
    group.device().reset_peak_memory();
    // 3. This rank's slice of the global batch.
    std::vector<float> x(static_cast<std::size_t>(local) * kInputs), t(static_cast<std::size_t>(local));
    for (int s = 0; s < local; ++s) {
      const int sample = comm.rank() * local + s;
      for (int i = 0; i < kInputs; ++i)
        x[static_cast<std::size_t>(s) * kInputs + i] = noise(static_cast<std::uint64_t>(step) + 1000, static_cast<std::uint64_t>(sample * kInputs + i));
      t[static_cast<std::size_t>(s)] = target(&x[static_cast<std::size_t>(s) * kInputs]);
    }
    // 4. Forward, layer by layer: group.forward(u) gathers unit u (and prefetches the next);
    //    its scope's end frees it again.
    std::vector<std::vector<float>> acts{x};
    for (std::size_t u = 0; u < layers.size(); ++u) {
      auto in_use = group.forward(static_cast<int>(u));
      acts.push_back(forward(*layers[u], acts.back(), local));
    }
    // 5. Loss: mean squared error over this rank's samples.
    std::vector<float> dy(static_cast<std::size_t>(local));
    double loss = 0;
    for (int s = 0; s < local; ++s) {
      const float d = acts.back()[static_cast<std::size_t>(s)] - t[static_cast<std::size_t>(s)];
      loss += 0.5 * d * d / local;
      dy[static_cast<std::size_t>(s)] = d / static_cast<float>(local);
    }
    // 6. Backward in reverse: group.backward(u) gathers u and exposes zeroed gradient storage;
    //    its scope's end reduce-scatters the gradients into the shard.
    for (std::size_t u = layers.size(); u-- > 0;) {
      auto in_use = group.backward(static_cast<int>(u));
      dy = backward(*layers[u], acts[u], acts[u + 1], dy, local);
    }
    // 7. AdamW on the local shards only.
    opt.step();
    opt.zero_grad();

    // 8. Report: every rank's figures, gathered through the same communicator.
    const rank_stats mine{loss, group.memory().peak, group.memory().persistent_live, group.traffic().total() - sent_before};
    comm.all_gather(&mine, all.data(), sizeof(rank_stats), fsdp::dtype::u8, stats_queue).wait(comm.timeout());
    if (comm.rank() == 0) {
      double mean_loss = 0;
      std::string peaks, sent;
      for (const auto& r : all) {
        mean_loss += r.loss / ranks;
        // (append, not "" + string: GCC 12 at -O3 warns falsely on the latter, PR 105651)
        peaks.append(peaks.empty() ? "" : " ").append(mib(r.peak));
        sent.append(sent.empty() ? "" : " ").append(std::to_string(r.sent));
      }
      std::printf("step %3d  loss %.5f  peak/rank [%s]  bytes sent/rank [%s]\n", step, mean_loss, peaks.c_str(), sent.c_str());
      std::fflush(stdout);
    }
  }
  if (comm.rank() != 0) return;
  // What one rank would hold without sharding: fp32 params + grads + two AdamW moments.
  std::size_t model_bytes = 0;
  for (auto& l : layers) model_bytes += (l->w.size() + l->b.size()) * sizeof(float);
  std::printf("\nper-rank memory      sharded state   peak (with gathered layers)\n");
  for (int r = 0; r < ranks; ++r)
    std::printf("  rank %-3d           %-15s %s\n", r, mib(all[static_cast<std::size_t>(r)].persistent).c_str(),
                mib(all[static_cast<std::size_t>(r)].peak).c_str());
  std::printf("unsharded (DDP) state per rank: %s (params + grads + AdamW moments, fp32)\n", mib(4 * model_bytes).c_str());
}

// The group's type holds the precision and the communicator; the sharding is a value.
template <class Comm>
void train(Comm& comm, const config& c) {
  if (c.precision == "bf16")
    train_rank<fsdp::shard_group<fsdp::buffer<fsdp::bf16>, fsdp::mixed_precision<fsdp::bf16, float, float>, Comm>>(
        comm, c, {.sharding = c.shards});
  else
    train_rank<fsdp::shard_group<fsdp::buffer<float>, Comm>>(comm, c, {.sharding = c.shards});
}

}  // namespace

int main(int argc, char** argv) {
  const config c = parse(argc, argv);
  try {
    example::launch(
        argc, argv, {.backend = c.backend, .ranks = c.ranks},
        [&](int ranks, const char* kind) {
          std::printf("train_mlp: %d %s, %d layers of width %d, global batch %d, sharding %s, precision %s\n\n", ranks, kind,
                      c.layers, c.width, c.batch, c.sharding.c_str(), c.precision.c_str());
        },
        [&](auto& comm) { train(comm, c); });
  } catch (const fsdp::error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
