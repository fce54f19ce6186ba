// train_gpt: a small GPT trained byte by byte on real English text, sharded with fsdp.
//
// The model (gpt/model.hpp) is a GPT-2-style decoder written in plain C++ with a hand-written
// backward pass; fsdp shards it over N ranks: one unit for the embedding (whose token table is
// also the LM head), one per transformer block. Every rank holds only its shard of each unit;
// a unit is all-gathered just before it runs and freed after, its gradient reduce-scattered
// into the gradient shard, and AdamW steps the shards.
//
//   train_gpt                                    4 thread ranks, full sharding, fp32
//   train_gpt --ranks 8 --sharding hybrid:4 --precision bf16
//   train_gpt --trace trace.json --loss-csv loss.csv --loss-plot loss.svg
//   mpiexec -n 4 train_gpt --backend mpi         4 processes (when built with MPI)
//
// It prints a line per step (loss, tokens/s, each rank's peak memory, bytes sent and time spent
// waiting for communication), the validation loss every --eval-every steps, and a summary
// comparing each rank's memory with what an unsharded copy of the model needs.

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <type_traits>
#include <vector>

#include <fsdp/fsdp.hpp>

#include "common/launch.hpp"
#include "common/options.hpp"
#include "gpt/train.hpp"

namespace {

struct options {
  gpt::run_options run{};
  int ranks = 4;
  std::string backend = "threads";
  std::string sharding = "full";
  fsdp::sharding shards = fsdp::full_shard();  // what --sharding says
  std::string precision = "fp32";
  int prefetch = 1;
  std::string bucket = "unit";
  std::size_t bucket_bytes = 0;  // --bucket BYTES; 0: one bucket per unit (unit, and auto until its plan)
  double link_latency_ms = 0, link_mbps = 0;  // threads backend: a modelled link (0: none)
  std::string data = gpt::default_corpus_dir;
  std::string trace, loss_csv, loss_plot;
};

const char* usage =
    "usage: train_gpt [options]\n"
    "  --ranks N          thread ranks (default 4; with mpi: the number of processes)\n"
    "  --backend B        threads | mpi (run under mpiexec) | nccl (GPUs; see docs/gpu.md)\n"
    "  --sharding S       full | grad_op | hybrid:SHARD_SIZE | none (default full)\n"
    "  --precision P      fp32 | bf16 (bf16 params and compute, fp32 reduce and master; default fp32)\n"
    "  --prefetch N       units gathered ahead in forward and backward (default 1; 0: none)\n"
    "  --bucket B         unit (one collective per unit) | BYTES (merge units up to BYTES) |\n"
    "                     auto[:MiB] (profile 3 steps, then the planner's buckets and issue points\n"
    "                     under a per-rank memory limit; default unit)\n"
    "  --steps N          training steps (default 200)\n"
    "  --batch N          global batch in sequences, a multiple of the ranks (default 16)\n"
    "  --seq N            sequence length in bytes (default 64)\n"
    "  --layers N         transformer blocks (default 4)\n"
    "  --dim N            model width (default 64)\n"
    "  --heads N          attention heads, dividing --dim (default 4)\n"
    "  --lr X             AdamW learning rate (default 0.003)\n"
    "  --seed N           initial values and batches (default 1)\n"
    "  --data PATH        a text file or directory (default /usr/share/games/fortunes)\n"
    "  --eval-every N     validation loss every N steps and after the last (default 25; 0: never)\n"
    "  --link-latency-ms X, --link-mbps Y\n"
    "                     threads backend: a modelled network link per rank (latency, MB/s), so that\n"
    "                     communication takes time and its overlap with compute shows\n"
    "  --trace FILE       write a Chrome/Perfetto trace (JSON) of every rank's compute and communication\n"
    "  --loss-csv FILE    write the loss curve as CSV (step,train_loss,val_loss)\n"
    "  --loss-plot FILE   write the loss curve as an SVG plot\n";

options parse(int argc, char** argv) {
  options o;
  auto& r = o.run;
  using example::in;
  example::parser p{"train_gpt", usage};
  p.flag("--ranks", o.ranks, in(1, 1024))
      .flag("--backend", o.backend)
      .flag("--sharding", o.sharding)
      .flag("--precision", o.precision)
      .flag("--prefetch", o.prefetch, in(0, 64))
      .flag("--bucket", o.bucket)
      .flag("--steps", r.steps, in(1, 1 << 20))
      .flag("--batch", r.batch, in(1, 1 << 20))
      .flag("--seq", r.model.seq, in(2, 4096))
      .flag("--layers", r.model.layers, in(1, 256))
      .flag("--dim", r.model.dim, in(1, 8192))
      .flag("--heads", r.model.heads, in(1, 256))
      .flag("--seed", r.seed, in(0, 1L << 62))
      .flag("--eval-every", r.eval_every, in(0, 1 << 20))
      .flag("--data", o.data)
      .flag("--trace", o.trace)
      .flag("--loss-csv", o.loss_csv)
      .flag("--loss-plot", o.loss_plot)
      .flag("--link-latency-ms", o.link_latency_ms, example::non_negative())
      .flag("--link-mbps", o.link_mbps, example::non_negative())
      .flag("--lr", r.lr, example::positive());
  p.parse(argc, argv);

  if (o.precision != "fp32" && o.precision != "bf16") p.fail("--precision must be fp32 or bf16, got '" + o.precision + "'");
  if (o.backend != "threads" && o.backend != "mpi" && o.backend != "nccl")
    p.fail("--backend must be threads, mpi or nccl, got '" + o.backend + "'");
  o.shards = example::parse_sharding(p, o.sharding);
  if (o.bucket.rfind("auto", 0) == 0) {
    if (o.bucket.size() > 4 && o.bucket[4] != ':') p.fail("--bucket auto takes an optional :MiB limit, got '" + o.bucket + "'");
    const long mib = o.bucket.size() > 5 ? p.integer("--bucket auto:", o.bucket.c_str() + 5, in(1, 1L << 30)) : 0;
    r.auto_plan = fsdp::auto_bucket{.memory_limit = static_cast<std::size_t>(mib) << 20};
  } else if (o.bucket != "unit") {
    o.bucket_bytes = static_cast<std::size_t>(p.integer("--bucket", o.bucket.c_str(), in(1, 1L << 40)));
  }
  if ((o.link_latency_ms > 0) != (o.link_mbps > 0)) p.fail("--link-latency-ms and --link-mbps go together");
  if (o.link_mbps > 0 && o.backend != "threads") p.fail("--link-* models the threads backend's link; it has no effect on " + o.backend);
  if (r.model.dim % r.model.heads != 0)
    p.fail("--dim (" + std::to_string(r.model.dim) + ") must be a multiple of --heads (" + std::to_string(r.model.heads) + ")");
  if (o.backend == "mpi" && !example::have_mpi) p.fail("this build has no MPI (install libopenmpi-dev and rebuild)");
  return o;
}

std::string mib(double bytes) {
  char s[32];
  std::snprintf(s, sizeof s, "%.2f", bytes / (1 << 20));
  return s;
}

// "[a b c d]" of one figure per rank.
template <class F>
std::string per_rank(const gpt::step_report& s, F figure) {
  std::string out = "[";
  for (std::size_t r = 0; r < s.ranks.size(); ++r) out.append(r ? " " : "").append(figure(s.ranks[r]));
  return out + "]";
}

void print_step(const gpt::step_report& s, int global_tokens) {
  char head[160];
  std::snprintf(head, sizeof head, "step %4d | loss %.4f | %7.0f tok/s", s.step, s.loss(), global_tokens / s.step_s());
  std::printf("%s | peak MiB %s | sent KiB %s | comm wait ms %s\n", head,
              per_rank(s, [](const gpt::rank_step& r) { return mib(static_cast<double>(r.peak)); }).c_str(),
              per_rank(s, [](const gpt::rank_step& r) { return std::to_string((r.sent + 512) / 1024); }).c_str(),
              per_rank(s, [](const gpt::rank_step& r) {
                char b[16];
                std::snprintf(b, sizeof b, "%.1f", r.wait_s * 1e3);
                return std::string(b);
              }).c_str());
  if (!std::isnan(s.ranks[0].val_loss)) std::printf("           validation loss %.4f\n", s.val_loss());
  std::fflush(stdout);
}

void write_csv(const std::string& path, const std::vector<gpt::step_report>& steps) {
  std::ofstream out(path);
  out << "step,train_loss,val_loss\n";
  for (const auto& s : steps) {
    out << s.step << ',' << s.loss() << ',';
    if (!std::isnan(s.ranks[0].val_loss)) out << s.val_loss();
    out << '\n';
  }
  if (!out) throw fsdp::error(fsdp::errc::invalid_argument, "cannot write " + path);
}

// The loss curve as a self-contained SVG: training loss as a line, validation loss as dots.
void write_svg(const std::string& path, const std::vector<gpt::step_report>& steps) {
  const double w = 720, h = 420, left = 60, right = 20, top = 30, bottom = 50;
  double lo = 1e30, hi = -1e30;
  for (const auto& s : steps) {
    lo = std::min(lo, s.loss()), hi = std::max(hi, s.loss());
    if (!std::isnan(s.ranks[0].val_loss)) lo = std::min(lo, s.val_loss()), hi = std::max(hi, s.val_loss());
  }
  lo = std::floor(lo * 2) / 2, hi = std::ceil(hi * 2) / 2;
  if (hi <= lo) hi = lo + 1;
  const double last = std::max(1, steps.back().step);
  auto x = [&](double step) { return left + (w - left - right) * step / last; };
  auto y = [&](double loss) { return top + (h - top - bottom) * (hi - loss) / (hi - lo); };
  std::ofstream out(path);
  out << "<svg xmlns='http://www.w3.org/2000/svg' width='" << w << "' height='" << h << "' font-family='sans-serif' font-size='12'>\n"
      << "<rect width='100%' height='100%' fill='white'/>\n"
      << "<text x='" << left << "' y='18' font-size='14'>train_gpt loss (nats per byte)</text>\n";
  for (double v = lo; v <= hi + 1e-9; v += 0.5)  // horizontal grid every 0.5 nats
    out << "<line x1='" << left << "' x2='" << w - right << "' y1='" << y(v) << "' y2='" << y(v) << "' stroke='#ddd'/>"
        << "<text x='" << left - 8 << "' y='" << y(v) + 4 << "' text-anchor='end'>" << v << "</text>\n";
  for (int k = 0; k <= 4; ++k) {
    const int step = static_cast<int>(last * k / 4);
    out << "<text x='" << x(step) << "' y='" << h - bottom + 18 << "' text-anchor='middle'>" << step << "</text>\n";
  }
  out << "<text x='" << (w + left) / 2 << "' y='" << h - 10 << "' text-anchor='middle'>step</text>\n<polyline fill='none' stroke='#1f77b4' stroke-width='1.5' points='";
  for (const auto& s : steps) out << x(s.step) << ',' << y(s.loss()) << ' ';
  out << "'/>\n";
  for (const auto& s : steps)
    if (!std::isnan(s.ranks[0].val_loss)) out << "<circle cx='" << x(s.step) << "' cy='" << y(s.val_loss()) << "' r='3.5' fill='#ff7f0e'/>\n";
  out << "<text x='" << w - right - 150 << "' y='" << top + 14 << "' fill='#1f77b4'>training</text>"
      << "<text x='" << w - right - 80 << "' y='" << top + 14 << "' fill='#ff7f0e'>validation</text>\n</svg>\n";
  if (!out) throw fsdp::error(fsdp::errc::invalid_argument, "cannot write " + path);
}

// What one rank holds without sharding: parameters and gradients in the parameter dtype, an
// fp32 master copy when that differs, and AdamW's two fp32 moments.
std::size_t unsharded_bytes(std::size_t numel, bool bf16) {
  return numel * (bf16 ? 2 + 2 + 4 : 4 + 4) + numel * 8;
}

void print_summary(const options& o, const gpt::run_result& r) {
  const auto& first = r.steps.front();
  const std::size_t n = first.ranks.size();
  std::vector<std::uint64_t> peak(n, 0);
  double tokens_per_s = 0, wait = 0, total = 0;
  for (const auto& s : r.steps) {
    for (std::size_t k = 0; k < n; ++k) peak[k] = std::max(peak[k], s.ranks[k].peak);
    total += s.step_s();
    for (const auto& x : s.ranks) wait += x.wait_s / static_cast<double>(n);
  }
  tokens_per_s = static_cast<double>(o.run.batch) * o.run.model.seq * static_cast<double>(r.steps.size()) / total;
  const std::size_t full = unsharded_bytes(r.model_numel, o.precision == "bf16");
  char val[48] = "";
  if (!std::isnan(r.steps.back().ranks[0].val_loss)) std::snprintf(val, sizeof val, ", validation %.4f", r.steps.back().val_loss());
  std::printf("\nloss %.4f -> %.4f (train)%s; %zu parameters; %.0f tokens/s; %.1f%% of step time waiting on communication\n",
              first.loss(), r.steps.back().loss(), val, r.model_numel, tokens_per_s, 100 * wait / total);
  std::printf("\nper-rank memory (MiB)   sharded state   peak (with gathered units)   unsharded (DDP) needs\n");
  for (std::size_t k = 0; k < n; ++k)
    std::printf("  rank %-4zu             %13s   %26s   %21s\n", k, mib(static_cast<double>(r.steps.back().ranks[k].persistent)).c_str(),
                mib(static_cast<double>(peak[k])).c_str(), mib(static_cast<double>(full)).c_str());
  std::printf("(model state only: parameters, gradients, AdamW moments; activations are the engine's own)\n");
}

// Writes what was asked for, on rank 0.
void write_outputs(const options& o, const gpt::run_result& r, const std::vector<std::string>& events) {
  if (!o.loss_csv.empty()) write_csv(o.loss_csv, r.steps), std::printf("wrote %s\n", o.loss_csv.c_str());
  if (!o.loss_plot.empty()) write_svg(o.loss_plot, r.steps), std::printf("wrote %s\n", o.loss_plot.c_str());
  if (!o.trace.empty()) {
    std::string joined;
    for (const auto& e : events)
      if (!e.empty()) joined.append(joined.empty() ? "" : ",\n").append(e);
    std::ofstream(o.trace) << fsdp::timeline::chrome_document(joined);
    std::printf("wrote %s (open in ui.perfetto.dev or chrome://tracing)\n", o.trace.c_str());
  }
}

// One rank: train, then rank 0 reports.
template <class Group>
void run_rank(typename Group::comm_type& comm, const options& o, const gpt::corpus& text, fsdp::timeline::clock::time_point epoch) {
  typename Group::options opts{.sharding = o.shards, .prefetch = {.forward = o.prefetch, .backward = o.prefetch}};
  if constexpr (std::is_same_v<typename Group::bucket_type, fsdp::fixed_bytes>) opts.bucket.bytes = o.bucket_bytes;
  fsdp::timeline tl(epoch);
  const int tokens = o.run.batch * o.run.model.seq;
  const gpt::run_result r = gpt::train_rank<Group>(comm, o.run, opts, text,
                                                   {.on_step = [&](const gpt::step_report& s) { print_step(s, tokens); },
                                                    .on_note = [](const std::string& note) { std::fputs(note.c_str(), stdout); },
                                                    .timeline = o.trace.empty() ? nullptr : &tl});
  const std::vector<std::string> events = o.trace.empty() ? std::vector<std::string>{} : gpt::gather_strings(comm, r.events);
  if (comm.rank() != 0) return;
  print_summary(o, r);
  write_outputs(o, r, events);
}

// The group's type holds what changes code: the precision, the bucket policy (fixed_bytes for
// --bucket BYTES; else per_unit, which auto's plan needs) and the communicator. The sharding,
// the prefetch depths and auto's plan are values in its options.
template <class Precision, class Comm>
void train_with(Comm& comm, const options& o, const gpt::corpus& text, fsdp::timeline::clock::time_point epoch) {
  using P = typename Precision::param_type;
  if (o.bucket_bytes > 0)
    run_rank<fsdp::shard_group<fsdp::buffer<P>, Precision, fsdp::fixed_bytes, Comm>>(comm, o, text, epoch);
  else
    run_rank<fsdp::shard_group<fsdp::buffer<P>, Precision, Comm>>(comm, o, text, epoch);
}

// One rank, on either backend. Thread ranks share `epoch`; processes take theirs together.
template <class Comm>
void train(Comm& comm, const options& o, const gpt::corpus& text, fsdp::timeline::clock::time_point epoch) {
  if constexpr (!std::is_same_v<Comm, fsdp::threads::communicator>) {
    comm.barrier();  // processes start their clocks together (one host: one monotonic clock)
    epoch = fsdp::timeline::clock::now();
  }
  if (o.precision == "bf16")
    train_with<fsdp::mixed_precision<fsdp::bf16, float, float>>(comm, o, text, epoch);
  else
    train_with<fsdp::full_precision<float>>(comm, o, text, epoch);
}

void banner(const options& o, int ranks, const char* ranks_kind, const gpt::corpus& text) {
  const auto& m = o.run.model;
  std::printf("train_gpt: %d %s, sharding %s, precision %s, prefetch %d, bucket %s\n", ranks, ranks_kind, o.sharding.c_str(),
              o.precision.c_str(), o.prefetch, o.bucket.c_str());
  if (o.link_mbps > 0) std::printf("link model: %.3g ms latency, %.4g MB/s per rank\n", o.link_latency_ms, o.link_mbps);
  std::printf("model: %d layers, dim %d, %d heads, context %d bytes; global batch %d sequences; %d steps, AdamW lr %g\n", m.layers,
              m.dim, m.heads, m.seq, o.run.batch, o.run.steps, static_cast<double>(o.run.lr));
  std::printf("data: %s (%zu bytes: %zu train, %zu validation)\n\n", text.name.c_str(), text.text.size(), text.train_end,
              text.text.size() - text.train_end);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  try {
    if (o.backend == "nccl") {
      // The model's kernels in this program are host loops; NCCL moves device memory. Say so
      // plainly instead of failing somewhere inside.
      throw fsdp::error(fsdp::errc::no_device,
                        "--backend nccl: this program computes on the host; GPU training with NCCL is "
                        "examples/cuda/train_mlp_cuda (built with -DFSDP_CUDA=ON, see docs/gpu.md)");
    }
    const gpt::corpus text = gpt::load_corpus(o.data, o.run.model.seq);
    const example::launch_options where{
        .backend = o.backend,
        .ranks = o.ranks,
        .world = {.link = {.alpha_s = o.link_latency_ms * 1e-3, .beta_bytes_per_s = o.link_mbps * 1e6}}};
    const auto epoch = fsdp::timeline::clock::now();  // one clock for every thread rank
    example::launch(
        argc, argv, where, [&](int ranks, const char* kind) { banner(o, ranks, kind, text); },
        [&](auto& comm) { train(comm, o, text, epoch); });
    return 0;
  } catch (const fsdp::error& e) {
    std::fprintf(stderr, "train_gpt: %s\n", e.what());
    return 1;
  }
}
