// checkpoint: the cost of fsdp's sharded checkpoints against plain file I/O of the same bytes,
// and how long a step is blocked by an asynchronous save against a synchronous one, measured in
// the same run, interleaved (the machine is shared and noisy: compare ratios).
//
//   build/release/bench/checkpoint [--mib 64] [--ranks 4] [--reps 7] [--dir /tmp]
//
// The model: 16 parameters of --mib MiB of f32 in all, one unit each, full_shard over --ranks
// thread ranks, with AdamW (a save writes the parameters and both moments: 3 x the model).
// Per repetition, alternating which goes first:
//   save        checkpoint::save (host copy, XXH3 of every chunk, safetensors files, index,
//               fsync of files and directories, rename)
//   plain write every rank write()s the same bytes of its shard into one file and fsyncs it
//   load        checkpoint::load (index, pread of the chunks, XXH3 check, copy into the shards)
//   plain read  every rank pread()s the same bytes back
//   blocked     the time save() keeps the caller: checkpoint::save against async_saver::save
//               (the host copy; the writing overlaps what the caller does next)
// Times are the slowest rank's (a barrier before, an all-gather of the times after), medians
// over the repetitions; ratio = the median of the repetitions' fsdp time / plain time (below 1:
// fsdp faster). Reads come from the page cache when
// the files are still there: both sides alike.

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <fsdp/fsdp.hpp>

namespace {

using clock_type = std::chrono::steady_clock;
namespace fs = std::filesystem;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double seconds_since(clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); }

// Every rank's bytes of one save: its shard of the parameters and of both moments.
template <class Group, class Opt>
std::vector<std::pair<const void*, std::size_t>> shard_bytes(Group& g, Opt& opt) {
  std::vector<std::pair<const void*, std::size_t>> out;
  for (std::size_t b = 0; b < g.num_buckets(); ++b) {
    const auto sh = g.shard(b);
    out.push_back({sh.params, sh.numel * sizeof(float)});
    for (const auto& st : opt.state(b)) out.push_back({st.data, st.numel * fsdp::size_of(st.type)});
  }
  return out;
}

void plain_write(const fs::path& file, const std::vector<std::pair<const void*, std::size_t>>& parts) {
  const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) std::abort();
  for (const auto& [p, n] : parts) {
    const char* c = static_cast<const char*>(p);
    for (std::size_t done = 0; done < n;) {
      const ssize_t k = ::write(fd, c + done, n - done);
      if (k <= 0) std::abort();
      done += static_cast<std::size_t>(k);
    }
  }
  if (::fsync(fd) != 0) std::abort();
  ::close(fd);
}

void plain_read(const fs::path& file, std::vector<char>& into) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) std::abort();
  for (std::size_t done = 0; done < into.size();) {
    const ssize_t k = ::pread(fd, into.data() + done, into.size() - done, static_cast<off_t>(done));
    if (k <= 0) std::abort();
    done += static_cast<std::size_t>(k);
  }
  ::close(fd);
}

}  // namespace

int main(int argc, char** argv) {
  long mib = 64;
  int ranks = 4, reps = 7;
  fs::path dir = fs::temp_directory_path();
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--mib") mib = std::max(1L, std::atol(argv[i + 1]));
    else if (a == "--ranks") ranks = std::max(1, std::atoi(argv[i + 1]));
    else if (a == "--reps") reps = std::max(3, std::atoi(argv[i + 1]));
    else if (a == "--dir") dir = argv[i + 1];
  }
  dir /= "fsdp_bench_checkpoint_" + std::to_string(::getpid());
  fs::create_directories(dir);
  const std::size_t params = 16, numel = static_cast<std::size_t>(mib) * (1 << 20) / sizeof(float) / params;
  std::vector<double> save_t, write_t, load_t, read_t, sync_blocked, async_blocked;
  std::size_t bytes_per_save = 0;

  fsdp::threads::world{ranks}.run([&](fsdp::threads::communicator& comm) {
    std::vector<std::unique_ptr<fsdp::buffer<float>>> ps;
    fsdp::shard_group<fsdp::buffer<float>> g{comm};
    for (std::size_t p = 0; p < params; ++p) {
      ps.push_back(std::make_unique<fsdp::buffer<float>>(numel, "layer" + std::to_string(p) + ".w"));
      g.add_unit({ps.back().get()});
    }
    g.finalize(fsdp::init::per_shard([](const fsdp::param_slice& s, std::span<float> v) {
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = std::sin(static_cast<float>(s.offset + i) * 0.001f + static_cast<float>(s.unit));
    }));
    fsdp::adamw opt{g, {.lr = 1e-3f}};
    const auto parts = shard_bytes(g, opt);
    std::size_t mine = 0;
    for (const auto& [p, n] : parts) mine += n;
    std::vector<char> back(mine);
    const fs::path ckpt = dir / "ckpt", plain = dir / ("plain_" + std::to_string(comm.rank()));
    // The slowest rank's time of f (every rank runs it between two barriers).
    auto timed = [&](auto f) {
      comm.barrier();
      const auto t0 = clock_type::now();
      f();
      const double s = seconds_since(t0);
      std::vector<double> all(static_cast<std::size_t>(comm.size()));
      fsdp::host_queue q;
      comm.all_gather(&s, all.data(), 1, fsdp::dtype::f64, q).wait(comm.timeout());
      return *std::max_element(all.begin(), all.end());
    };
    for (int rep = 0; rep < reps; ++rep) {
      const bool fsdp_first = rep % 2 == 0;
      for (int side = 0; side < 2; ++side) {
        if ((side == 0) == fsdp_first) {
          const double ts = timed([&] { fsdp::checkpoint::save(g, ckpt, opt); });
          const double tl = timed([&] { fsdp::checkpoint::load(g, ckpt, opt); });
          if (comm.rank() == 0) save_t.push_back(ts), load_t.push_back(tl);
        } else {
          const double tw = timed([&] { plain_write(plain, parts); });
          const double tr = timed([&] { plain_read(plain, back); });
          if (comm.rank() == 0) write_t.push_back(tw), read_t.push_back(tr);
        }
      }
      // Blocked: the same save, synchronous or started in the background.
      fsdp::checkpoint::async_saver saver;
      for (int side = 0; side < 2; ++side) {
        if ((side == 0) == fsdp_first) {
          const double t = timed([&] { fsdp::checkpoint::save(g, ckpt, opt); });
          if (comm.rank() == 0) sync_blocked.push_back(t);
        } else {
          const double t = timed([&] { saver.save(g, ckpt, opt); });
          saver.wait();
          if (comm.rank() == 0) async_blocked.push_back(t);
        }
      }
    }
    const double total = static_cast<double>(mine) * comm.size();
    if (comm.rank() == 0) bytes_per_save = static_cast<std::size_t>(total);
  });
  fs::remove_all(dir);

  const double gib = static_cast<double>(bytes_per_save) / (1 << 30);
  std::printf("checkpoint: %d thread ranks, %ld MiB of f32 parameters + AdamW moments = %.0f MiB per save, %d repetitions, medians\n", ranks,
              mib, gib * 1024, reps);
  std::printf("%-28s %10s %10s %8s\n", "", "fsdp s", "plain s", "ratio");
  auto paired = [](const std::vector<double>& a, const std::vector<double>& b) {
    std::vector<double> r;
    for (std::size_t i = 0; i < a.size(); ++i) r.push_back(a[i] / b[i]);
    return median(r);
  };
  auto row = [&](const char* name, const std::vector<double>& a, const std::vector<double>& b) {
    std::printf("%-28s %10.4f %10.4f %8.2f   (%.2f vs %.2f GiB/s)\n", name, median(a), median(b), paired(a, b), gib / median(a),
                gib / median(b));
  };
  row("save vs write+fsync", save_t, write_t);
  row("load vs pread", load_t, read_t);
  std::printf("%-28s %10.4f %10.4f %8.2f   (async save() / sync save(): the step's wait)\n", "blocked: async vs sync", median(async_blocked),
              median(sync_blocked), paired(async_blocked, sync_blocked));
  std::printf("ratio = fsdp time / plain time (below 1: fsdp faster)\n");
  return 0;
}
