// train_torch_gpt: a small GPT built from LibTorch's torch::nn modules, trained byte by byte on
// the main job's text and sharded with fsdp through the LibTorch adapter
// (fsdp/adapters/libtorch.hpp). LibTorch's C++ frontend has no DDP or FSDP of its own.
//
//   train_torch_gpt                                  4 thread ranks, full sharding
//   train_torch_gpt --ranks 2 --sharding none
//   mpiexec -n 4 train_torch_gpt --backend mpi       4 processes (when built with MPI)
//
// What fsdp changes in a LibTorch training loop (docs/guide.md, "LibTorch", shows it as a
// diff): a sharded_module built over the units, each unit's forward run through it, and
// fsdp's AdamW stepping the shards instead of torch::optim::AdamW. Autograd drives the rest.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <limits>
#include <mutex>
#include <cstdio>
#include <string>
#include <vector>

#include <fsdp/adapters/libtorch.hpp>
#include <fsdp/fsdp.hpp>

#include "common/launch.hpp"
#include "common/options.hpp"
#include "gpt/data.hpp"

namespace {

struct options {
  int ranks = 4, steps = 100, batch = 16, seq = 64, layers = 2, dim = 64, heads = 4;
  int torch_threads = 0;  // LibTorch's intra-op threads (0: its default)
  int print_every = 10;
  float lr = 3e-3f;
  std::string backend = "threads", sharding = "full", data = gpt::default_corpus_dir;
  std::string save_init;  // the initial parameters, for a peer to start from (bench/fsdp2_gpt.py)
  fsdp::sharding shards = fsdp::full_shard();  // what --sharding says
};

// A pre-norm transformer block from torch::nn modules.
struct block_impl : torch::nn::Module {
  block_impl(int dim, int heads)
      : ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})))),
        attn(register_module("attn", torch::nn::MultiheadAttention(torch::nn::MultiheadAttentionOptions(dim, heads)))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})))),
        fc1(register_module("fc1", torch::nn::Linear(dim, 4 * dim))),
        fc2(register_module("fc2", torch::nn::Linear(4 * dim, dim))) {}
  // x: (sequence, batch, dim), as MultiheadAttention takes it; mask: causal (-inf above the diagonal).
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& mask) {
    auto h = ln1(x);
    x = x + std::get<0>(attn->forward(h, h, h, torch::Tensor(), false, mask));
    return x + fc2(torch::gelu(fc1(ln2(x))));
  }
  torch::nn::LayerNorm ln1;
  torch::nn::MultiheadAttention attn;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE_IMPL(block, block_impl);

// The token and position embeddings and the final norm: one unit (the token table is also the
// output head, so this unit stays gathered around the blocks).
struct embed_impl : torch::nn::Module {
  embed_impl(int seq, int dim)
      : wte(register_module("wte", torch::nn::Embedding(256, dim))),
        wpe(register_module("wpe", torch::nn::Embedding(seq, dim))),
        lnf(register_module("lnf", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})))) {
    // GPT-2's initialisation: with Embedding's N(0, 1) the tied head's logits start ~8x too large.
    torch::NoGradGuard no_grad;
    torch::nn::init::normal_(wte->weight, 0.0, 0.02);
    torch::nn::init::normal_(wpe->weight, 0.0, 0.02);
  }
  torch::nn::Embedding wte, wpe;
  torch::nn::LayerNorm lnf;
};
TORCH_MODULE_IMPL(embed, embed_impl);

struct gpt_model {
  gpt_model(const options& o) : emb(o.seq, o.dim) {
    for (int l = 0; l < o.layers; ++l) blocks.emplace_back(o.dim, o.heads);
  }
  embed emb;
  std::vector<block> blocks;
};

// Logits (batch, sequence, 256) of the tokens (batch, sequence), each unit's forward run
// through `unit(u, f)`: the sharded module's forward, or just f() for an unsharded model.
template <class Unit>
torch::Tensor forward(gpt_model& m, const torch::Tensor& tokens, Unit&& unit) {
  const auto seq = tokens.size(1);
  const auto mask = torch::full({seq, seq}, -std::numeric_limits<float>::infinity()).triu(1);
  return unit(0, [&] {
    auto x = (m.emb->wte(tokens) + m.emb->wpe(torch::arange(seq))).transpose(0, 1);
    for (std::size_t l = 0; l < m.blocks.size(); ++l)
      x = unit(static_cast<int>(l) + 1, [&] { return m.blocks[l]->forward(x, mask); });
    return torch::matmul(m.emb->lnf(x.transpose(0, 1)), m.emb->wte->weight.t());
  });
}

// Writes every parameter of the units, in order, as: u32 name length, name ("emb." or
// "blocks.<l>." then the module's own name), u32 dims, i64 sizes, f32 values (little-endian):
// what bench/fsdp2_gpt.py loads so that FSDP2's model starts from the very same values.
void save_parameters(const gpt_model& m, const std::string& path) {
  std::ofstream out(path, std::ios::binary);
  auto put = [&](const auto& x) { out.write(reinterpret_cast<const char*>(&x), sizeof x); };
  auto save = [&](const std::string& prefix, const torch::nn::Module& mod) {
    for (const auto& p : mod.named_parameters()) {
      const std::string name = prefix + p.key();
      const torch::Tensor v = p.value().detach().contiguous().to(torch::kFloat32);
      put(static_cast<std::uint32_t>(name.size()));
      out.write(name.data(), static_cast<std::streamsize>(name.size()));
      put(static_cast<std::uint32_t>(v.dim()));
      for (const auto d : v.sizes()) put(static_cast<std::int64_t>(d));
      out.write(static_cast<const char*>(v.data_ptr()), static_cast<std::streamsize>(v.numel() * sizeof(float)));
    }
  };
  save("emb.", *m.emb);
  for (std::size_t l = 0; l < m.blocks.size(); ++l) save("blocks." + std::to_string(l) + ".", *m.blocks[l]);
  if (!out) throw fsdp::error(fsdp::errc::invalid_argument, "--save-init: cannot write '" + path + "'");
}

torch::Tensor as_tensor(const std::vector<std::uint8_t>& bytes, int rows) {
  std::vector<std::int64_t> v(bytes.begin(), bytes.end());
  return torch::tensor(v).view({rows, -1});
}

template <class Comm>
void train(Comm& comm, const options& o, const gpt::corpus& text) {
  using group_t = fsdp::shard_group<fsdp::libtorch::param, Comm>;
  if (o.batch % comm.size() != 0)
    throw fsdp::error(fsdp::errc::invalid_argument, "--batch (" + std::to_string(o.batch) + ") must be a multiple of the ranks (" +
                                                        std::to_string(comm.size()) + ")");
  // Every rank builds the same model (rank 0's values are broadcast anyway), one at a time:
  // thread ranks share LibTorch's generator, and drawing from it together would make rank 0's
  // initial values differ from run to run.
  static std::mutex init_m;
  std::unique_lock init_lock(init_m);
  torch::manual_seed(1);
  gpt_model m(o);
  init_lock.unlock();
  if (comm.rank() == 0 && !o.save_init.empty()) save_parameters(m, o.save_init);
  std::vector<fsdp::libtorch::unit> units{m.emb};
  for (auto& b : m.blocks) units.emplace_back(b);
  fsdp::libtorch::sharded_module<group_t> sharded{comm, units, {.group = {.sharding = o.shards}}};
  fsdp::adamw<group_t> opt{sharded.group(), {.lr = o.lr, .weight_decay = 0.0f}};
  const int local = o.batch / comm.size();
  std::vector<double> rates;  // tokens/s of every step after the first
  for (int step = 0; step < o.steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto sent0 = sharded.group().traffic().total();
    const gpt::batch b = gpt::make_batch(text, false, 1, static_cast<std::uint64_t>(step), comm.rank() * local, local, o.seq);
    const torch::Tensor logits = forward(m, as_tensor(b.tokens, local), [&](int u, auto&& f) { return sharded.forward(u, f); });
    torch::Tensor loss = torch::nn::functional::cross_entropy(logits.reshape({-1, 256}), as_tensor(b.targets, local).reshape({-1}));
    loss.backward();
    opt.step();
    opt.zero_grad();
    double mean = loss.item<double>();  // every rank's loss, averaged (equal local batches)
    fsdp::host_queue q;
    comm.all_reduce(&mean, &mean, 1, fsdp::dtype::f64, fsdp::reduce_op::avg, q).wait(comm.timeout(), "loss");
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (step > 0) rates.push_back(o.batch * o.seq / s);
    if (comm.rank() == 0 && (step % o.print_every == 0 || step + 1 == o.steps))
      std::printf("step %4d | loss %.6f | %7.0f tok/s | rank 0: peak MiB %.2f, sent KiB %llu\n", step, mean,
                  o.batch * o.seq / s, static_cast<double>(sharded.group().memory().peak) / (1 << 20),
                  static_cast<unsigned long long>((sharded.group().traffic().total() - sent0 + 512) / 1024));
  }
  if (comm.rank() == 0 && !rates.empty()) {
    std::sort(rates.begin(), rates.end());
    std::printf("median after the first step: %.0f tok/s\n", rates[rates.size() / 2]);
  }
}

const char* usage =
    "usage: train_torch_gpt [options]\n"
    "  --ranks N      thread ranks (default 4; with mpi: the number of processes)\n"
    "  --backend B    threads | mpi (run under mpiexec)\n"
    "  --sharding S   full | grad_op | hybrid | hybrid:SHARD_SIZE | none (default full)\n"
    "  --steps N      (default 100)   --batch N  global sequences, a multiple of the ranks (default 16)\n"
    "  --seq N        (default 64)    --layers N (default 2)   --dim N (default 64)   --heads N (default 4)\n"
    "  --lr X         AdamW (default 0.003)   --data PATH  a text file or directory (default the fortunes)\n"
    "  --torch-threads N  LibTorch's intra-op threads (default: its own; 1 for one thread per rank)\n"
    "  --print-every N    the loss every N steps and after the last (default 10)\n"
    "  --save-init FILE   the initial parameters, for bench/fsdp2_gpt.py to start FSDP2 from\n";

}  // namespace

int main(int argc, char** argv) {
  options o;
  example::parser p{"train_torch_gpt", usage};
  p.flag("--ranks", o.ranks, example::in(1, 1024))
      .flag("--backend", o.backend)
      .flag("--sharding", o.sharding)
      .flag("--steps", o.steps, example::in(1, 1 << 20))
      .flag("--batch", o.batch, example::in(1, 1 << 20))
      .flag("--seq", o.seq, example::in(2, 4096))
      .flag("--layers", o.layers, example::in(1, 256))
      .flag("--dim", o.dim, example::in(1, 8192))
      .flag("--heads", o.heads, example::in(1, 256))
      .flag("--lr", o.lr, example::positive())
      .flag("--data", o.data)
      .flag("--torch-threads", o.torch_threads, example::in(0, 1024))
      .flag("--print-every", o.print_every, example::in(1, 1 << 20))
      .flag("--save-init", o.save_init);
  p.parse(argc, argv);
  if (o.torch_threads > 0) torch::set_num_threads(o.torch_threads);
  o.shards = example::parse_sharding(p, o.sharding);
  if (o.dim % o.heads != 0) p.fail("--dim must be a multiple of --heads");
  if (o.backend != "threads" && !(o.backend == "mpi" && example::have_mpi)) p.fail("--backend must be threads or mpi (an MPI build)");
  try {
    const gpt::corpus text = gpt::load_corpus(o.data, o.seq);
    example::launch(
        argc, argv, {.backend = o.backend, .ranks = o.ranks},
        [&](int ranks, const char* kind) {
          std::printf("train_torch_gpt: %d %s, sharding %s; LibTorch modules, %d layers, dim %d; %d steps\n", ranks, kind,
                      o.sharding.c_str(), o.layers, o.dim, o.steps);
        },
        [&](auto& comm) { train(comm, o, text); });
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "train_torch_gpt: %s\n", e.what());
    return 1;
  }
  return 0;
}
