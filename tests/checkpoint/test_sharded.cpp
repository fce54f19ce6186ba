// Sharded checkpoints (checkpoint/sharded.hpp): saved at one rank count, sharding and bucketing,
// loaded at others, the gathered parameters are bit-identical; the optimizer state resumes to a
// bit-identical next step; broken or mismatched checkpoints are refused and load nothing.
#include <doctest/doctest.h>

#include <sys/resource.h>

#include <csignal>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/catch_error.hpp"
#include "fsdp/checkpoint/sharded.hpp"
#include "fsdp/fsdp.hpp"

namespace {

using fsdp_test::checkpoint_error;

namespace fs = std::filesystem;
using per_unit_group = fsdp::shard_group<fsdp::buffer<float>>;
using bytes_group = fsdp::shard_group<fsdp::buffer<float>, fsdp::fixed_bytes>;

// Three parameters of awkward sizes (shards split them unevenly), in two units.
const std::vector<std::size_t> sizes{301, 77, 1000};
const std::vector<std::string> names{"block0.w", "block0.b", "block1.w"};

fs::path dir_for(const std::string& name) {
  // Per process: two test runs on one machine must not share directories.
  const fs::path d = fs::temp_directory_path() / ("fsdp_ckpt_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(d);
  fs::remove_all(d.string() + ".partial");
  return d;
}

// A value per (parameter, element), from a seed: different seeds give different models.
float value(int seed, std::size_t p, std::size_t i) { return 0.001f * static_cast<float>((i * 31 + p * 7 + static_cast<std::size_t>(seed) * 13) % 997) - 0.4f; }

struct model {
  std::vector<std::unique_ptr<fsdp::buffer<float>>> params;
  explicit model(const std::vector<std::string>& ns = names, const std::vector<std::size_t>& ss = sizes) {
    for (std::size_t p = 0; p < ns.size(); ++p) params.push_back(std::make_unique<fsdp::buffer<float>>(ss[p], ns[p]));
  }
  // With `freeze_first`, block0.w is frozen (it shares its unit with the trainable block0.b).
  template <class Group>
  void add_to(Group& g, int seed, bool freeze_first = false) {
    if (freeze_first) g.add_unit({params[0].get(), params[1].get()}, "block0", {params[0].get()});
    else g.add_unit({params[0].get(), params[1].get()});
    for (std::size_t p = 2; p < params.size(); ++p) g.add_unit({params[p].get()});
    g.finalize(fsdp::init::per_shard([seed](const fsdp::param_slice& s, std::span<float> v) {
      const std::size_t p = static_cast<std::size_t>(s.unit == 0 ? s.index : 1 + s.unit);
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = value(seed, p, s.offset + i);
    }));
  }
};

// Every parameter gathered (collective), on every rank.
template <class Group>
std::vector<std::vector<float>> gathered(Group& g) {
  std::vector<std::vector<float>> out;
  for (int u = 0; u < g.num_units(); ++u)
    for (int i = 0; i < (u == 0 ? 2 : 1); ++i) out.push_back(g.full_parameter(u, i));
  return out;
}

// Steps [first, first + steps) of a training whose gradients are the same on every rank and
// dyadic (k / 1024), so their mean is exact at any rank count; a frozen parameter gets none.
template <class Group, class Opt>
void train(Group& g, model& m, Opt& opt, int first, int steps) {
  auto grad = [](std::size_t p, std::size_t i, int step) { return static_cast<float>((i + p + static_cast<std::size_t>(step)) % 7) / 1024.0f; };
  for (int step = first; step < first + steps; ++step) {
    for (int u = 0; u < g.num_units(); ++u) auto s = g.forward(u);
    for (int u = g.num_units(); u-- > 0;) {
      auto s = g.backward(u);
      for (std::size_t p = (u == 0 ? 0 : static_cast<std::size_t>(u) + 1); p < (u == 0 ? 2 : static_cast<std::size_t>(u) + 2); ++p)
        if (float* gp = m.params[p]->grad())
          for (std::size_t i = 0; i < sizes[p]; ++i) gp[i] += grad(p, i, step);
    }
    opt.step();
    opt.zero_grad();
  }
}

// Saves a model of `seed` at 4 ranks, full_shard, a bucket per unit; returns its parameters.
std::vector<std::vector<float>> save_four(const fs::path& dir, int seed) {
  std::vector<std::vector<float>> saved;
  fsdp::threads::world{4}.run([&](fsdp::threads::communicator& comm) {
    model m;
    per_unit_group g{comm};
    m.add_to(g, seed);
    fsdp::checkpoint::save(g, dir);
    auto full = gathered(g);
    if (comm.rank() == 0) saved = full;
  });
  return saved;
}

enum class optimizer { none, adamw };

// Loads `from` on one rank into a model of seed 2 (parameters `ns` of sizes `ss`, with AdamW's
// state when asked), expecting errc::checkpoint; checks that nothing was loaded (the parameters,
// the optimizer's step count) and returns the message.
std::string refused_load(const fs::path& from, const std::vector<std::string>& ns = names, const std::vector<std::size_t>& ss = sizes,
                         optimizer with = optimizer::none) {
  std::string message;
  fsdp::threads::world{1}.run([&](fsdp::threads::communicator& comm) {
    model m(ns, ss);
    per_unit_group g{comm};
    m.add_to(g, 2);
    fsdp::adamw opt{g, {}};
    const auto before = gathered(g);
    message = with == optimizer::adamw ? checkpoint_error([&] { fsdp::checkpoint::load(g, from, opt); })
                                       : checkpoint_error([&] { fsdp::checkpoint::load(g, from); });
    CHECK(gathered(g) == before);  // nothing loaded
    CHECK(opt.steps() == 0);
  });
  return message;
}

}  // namespace

TEST_CASE("checkpoint: saved at 4 ranks full_shard, loaded at 3 full, 4 hybrid, 2 in 300-byte buckets and 1 no_shard: bit-identical") {
  const fs::path dir = dir_for("reshard");
  const auto saved = save_four(dir, 1);
  REQUIRE(fs::exists(dir / "index.json"));
  CHECK(!fs::exists(dir.string() + ".partial"));
  struct target {
    int ranks;
    fsdp::sharding sharding;
    bool bytes_buckets;
  };
  for (const target& t : {target{3, fsdp::full_shard(), false}, target{4, fsdp::hybrid_shard(2), false},
                          target{2, fsdp::full_shard(), true}, target{1, fsdp::no_shard(), false}}) {
    CAPTURE(t.ranks);
    CAPTURE(fsdp::to_string(t.sharding));
    std::vector<std::vector<std::vector<float>>> loaded(static_cast<std::size_t>(t.ranks));
    fsdp::threads::world{t.ranks}.run([&](fsdp::threads::communicator& comm) {
      model m;
      auto run = [&](auto& g) {
        m.add_to(g, 2);  // other values first: the load must replace them
        fsdp::checkpoint::load(g, dir);
        loaded[static_cast<std::size_t>(comm.rank())] = gathered(g);
      };
      if (t.bytes_buckets) {
        bytes_group g{comm, {}, {.sharding = t.sharding, .bucket = {.bytes = 300}}};
        run(g);
      } else {
        per_unit_group g{comm, {}, {.sharding = t.sharding}};
        run(g);
      }
    });
    for (const auto& l : loaded) {
      REQUIRE(l.size() == saved.size());
      for (std::size_t p = 0; p < saved.size(); ++p) CHECK(std::memcmp(l[p].data(), saved[p].data(), saved[p].size() * sizeof(float)) == 0);
    }
  }
  fs::remove_all(dir);
}

TEST_CASE("checkpoint: adamw's state and steps, saved at 4 ranks and loaded at 2 in other buckets, give a bit-identical next step") {
  const fs::path dir = dir_for("adamw");
  std::vector<std::vector<float>> straight, resumed;
  fsdp::threads::world{4}.run([&](fsdp::threads::communicator& comm) {
    model m;
    per_unit_group g{comm};
    m.add_to(g, 1);
    fsdp::adamw opt{g, {.lr = 0.01f}};
    train(g, m, opt, 0, 3);
    fsdp::checkpoint::save(g, dir, opt);
    train(g, m, opt, 3, 2);
    auto full = gathered(g);
    if (comm.rank() == 0) straight = full;
  });
  fsdp::threads::world{2}.run([&](fsdp::threads::communicator& comm) {
    model m;
    bytes_group g{comm, {}, {.bucket = {.bytes = 300}}};
    m.add_to(g, 2);
    fsdp::adamw opt{g, {.lr = 0.01f}};
    fsdp::checkpoint::load(g, dir, opt);
    CHECK(opt.steps() == 3);
    train(g, m, opt, 3, 2);
    auto full = gathered(g);
    if (comm.rank() == 0) resumed = full;
  });
  REQUIRE(straight.size() == resumed.size());
  for (std::size_t p = 0; p < straight.size(); ++p)
    CHECK(std::memcmp(straight[p].data(), resumed[p].data(), straight[p].size() * sizeof(float)) == 0);
  fs::remove_all(dir);
}

TEST_CASE("checkpoint: a frozen parameter is saved without optimizer state; resumed at 2 ranks in other buckets, bit-identical") {
  const fs::path dir = dir_for("frozen");
  std::vector<std::vector<float>> initial, straight, resumed;
  fsdp::threads::world{4}.run([&](fsdp::threads::communicator& comm) {
    model m;
    per_unit_group g{comm};
    m.add_to(g, 1, true);
    auto first = gathered(g);
    fsdp::adamw opt{g, {.lr = 0.01f}};
    train(g, m, opt, 0, 3);
    fsdp::checkpoint::save(g, dir, opt);
    train(g, m, opt, 3, 2);
    auto full = gathered(g);
    if (comm.rank() == 0) initial = first, straight = full;
  });
  const auto idx = fsdp::checkpoint::read_index(dir / "index.json");
  for (const auto& c : idx.parameters.at("block0.w").chunks) CHECK(c.tensors.size() == 1);  // "param" only
  for (const auto& c : idx.parameters.at("block0.b").chunks) CHECK(c.tensors.size() == 3);  // and the two moments
  fsdp::threads::world{2}.run([&](fsdp::threads::communicator& comm) {
    model m;
    bytes_group g{comm, {}, {.bucket = {.bytes = 300}}};
    m.add_to(g, 2, true);
    fsdp::adamw opt{g, {.lr = 0.01f}};
    fsdp::checkpoint::load(g, dir, opt);
    train(g, m, opt, 3, 2);
    auto full = gathered(g);
    if (comm.rank() == 0) resumed = full;
  });
  REQUIRE(straight.size() == resumed.size());
  CHECK(straight[0] == initial[0]);  // frozen: never moved
  CHECK(straight[1] != initial[1]);
  for (std::size_t p = 0; p < straight.size(); ++p)
    CHECK(std::memcmp(straight[p].data(), resumed[p].data(), straight[p].size() * sizeof(float)) == 0);
  fs::remove_all(dir);
}

TEST_CASE("checkpoint: mismatched models, corrupted and half-written checkpoints are refused by name, and load nothing") {
  const fs::path dir = dir_for("errors");
  save_four(dir, 1);
  CHECK(refused_load(dir, {"block0.w", "block0.b", "block9.w"}, sizes).find("no parameter 'block9.w' in the checkpoint") != std::string::npos);
  CHECK(refused_load(dir, names, {301, 78, 1000}).find("parameter 'block0.b' has 77 elements, the model 78") != std::string::npos);
  {  // as many elements, another shape (param_traits contract 8)
    std::string message;
    fsdp::threads::world{1}.run([&](fsdp::threads::communicator& comm) {
      model m;
      m.params[0] = std::make_unique<fsdp::buffer<float>>(std::vector<std::size_t>{7, 43}, "block0.w");
      per_unit_group g{comm};
      m.add_to(g, 2);
      message = checkpoint_error([&] { fsdp::checkpoint::load(g, dir); });
    });
    CHECK(message.find("parameter 'block0.w' has shape [301], the model [7,43]") != std::string::npos);
  }

  // One flipped byte in the last rank's file: its chunk's checksum no longer matches.
  const fs::path file = dir / "rank_00003.safetensors";
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-5, std::ios::end);
    char c = 0;
    f.read(&c, 1);
    f.seekp(-5, std::ios::end);
    c = static_cast<char>(c ^ 0x10);
    f.write(&c, 1);
  }
  // (1000 elements padded to 1024 over 4 ranks: rank 3 holds elements [768, 1000) of block1.w.)
  CHECK(refused_load(dir).find("rank_00003.safetensors: 'block1.w' elements [768, 1000) (param) is corrupted") !=
        std::string::npos);
  // Cut short: the read of the last chunk finds the end of the file.
  fs::resize_file(file, fs::file_size(file) - 100);
  CHECK(refused_load(dir).find("rank_00003.safetensors: truncated") != std::string::npos);

  // A save that never finished: DIR.partial without DIR.
  const fs::path half = dir_for("half");
  fs::create_directories(half.string() + ".partial");
  CHECK(refused_load(half).find(".partial is a save that did not finish") != std::string::npos);
  fs::remove_all(half.string() + ".partial");
  fs::remove_all(dir);
}

TEST_CASE("checkpoint: an index that is not this model's or not whole, and an optimizer the save lacked, are refused by name") {
  const fs::path dir = dir_for("index_errors");
  save_four(dir, 1);  // without an optimizer
  const fs::path index = dir / "index.json";
  const nlohmann::json saved = [&] {
    std::ifstream f(index);
    return nlohmann::json::parse(f);
  }();
  auto write_index = [&](const std::string& text) { std::ofstream(index, std::ios::trunc) << text; };

  CHECK(refused_load(dir, names, sizes, optimizer::adamw).find("the optimizer state saved ([]) is not this optimizer's ([\"exp_avg\",\"exp_avg_sq\"])") !=
        std::string::npos);

  nlohmann::json j = saved;
  j["master_dtype"] = "BF16";
  write_index(j.dump());
  CHECK(refused_load(dir).find("saved in BF16, the model's master dtype is F32") != std::string::npos);

  // block1.w's 1000 elements were saved by 4 ranks in chunks of 256: the second made to start
  // one element late leaves a hole.
  j = saved;
  j["parameters"]["block1.w"]["chunks"][1]["begin"] = 257;
  write_index(j.dump());
  CHECK(refused_load(dir).find("parameter 'block1.w': chunk [257, 512) does not follow the previous one (which ends at 256)") != std::string::npos);

  j = saved;
  j["parameters"]["block1.w"]["chunks"][1]["end"] = "512";
  write_index(j.dump());
  CHECK(refused_load(dir).find("index.json: malformed index: ") != std::string::npos);

  write_index(saved.dump().substr(0, 100));  // cut short: not JSON at all
  CHECK(refused_load(dir).find("index.json: not an fsdp checkpoint index") != std::string::npos);

  write_index(saved.dump());  // put back whole, it loads
  fsdp::threads::world{1}.run([&](fsdp::threads::communicator& comm) {
    model m;
    per_unit_group g{comm};
    m.add_to(g, 2);
    fsdp::checkpoint::load(g, dir);
  });
  fs::remove_all(dir);
}

TEST_CASE("checkpoint: one rank's bad chunk stops every rank's load, named, and no rank loads anything") {
  const fs::path dir = dir_for("agree");
  save_four(dir, 1);
  // Rank 1 of 2 (full_shard, a bucket per unit) needs block1.w [512, 1000): saved by ranks 2
  // and 3. Rank 0 needs nothing of rank 3's file.
  {
    std::fstream f(dir / "rank_00003.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-1, std::ios::end);
    f.put('\x7f');
  }
  std::vector<std::string> messages(2);
  std::vector<int> unchanged(2, 0);
  fsdp::threads::world{2}.run([&](fsdp::threads::communicator& comm) {
    model m;
    per_unit_group g{comm};
    m.add_to(g, 2);
    const auto before = gathered(g);
    messages[static_cast<std::size_t>(comm.rank())] = checkpoint_error([&] { fsdp::checkpoint::load(g, dir); });
    unchanged[static_cast<std::size_t>(comm.rank())] = gathered(g) == before ? 1 : 0;
  });
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    CHECK(messages[static_cast<std::size_t>(r)].find("checkpoint load from " + dir.string() + " failed on rank 1: ") != std::string::npos);
    CHECK(messages[static_cast<std::size_t>(r)].find("'block1.w' elements [768, 1000) (param) is corrupted") != std::string::npos);
    CHECK(unchanged[static_cast<std::size_t>(r)] == 1);
  }
  fs::remove_all(dir);
}

TEST_CASE("checkpoint: the index gives every chunk's file, byte range and checksum; the engine's bytes come back") {
  const fs::path dir = dir_for("index");
  const std::string user = "data-loader at batch 1234; rng 0xfeed";
  std::vector<std::vector<float>> saved;
  fsdp::threads::world{4}.run([&](fsdp::threads::communicator& comm) {
    model m;
    per_unit_group g{comm, {}, {.sharding = fsdp::hybrid_shard(2)}};
    m.add_to(g, 3);
    fsdp::adamw opt{g, {.lr = 0.01f}};
    // (rank 1's bytes differ: only rank 0's are saved)
    const std::string mine = comm.rank() == 0 ? user : "not saved";
    fsdp::checkpoint::save(g, dir, opt, std::as_bytes(std::span(mine)));
    auto full = gathered(g);
    if (comm.rank() == 0) saved = full;
  });
  // Hybrid(2) of 4: the first replica (ranks 0, 1) writes two files.
  CHECK(fs::exists(dir / "rank_00000.safetensors"));
  CHECK(fs::exists(dir / "rank_00001.safetensors"));
  CHECK(!fs::exists(dir / "rank_00002.safetensors"));
  // Read each parameter back through the index alone, with plain file reads, and through the
  // rank files' own safetensors headers: the same bytes, the saved values.
  const auto idx = fsdp::checkpoint::read_index(dir / "index.json");
  CHECK(idx.world_size == 4);
  CHECK(idx.shard_size == 2);
  CHECK(idx.optimizer_states == std::vector<std::string>{"exp_avg", "exp_avg_sq"});
  for (std::size_t p = 0; p < names.size(); ++p) {
    CAPTURE(names[p]);
    const auto& rec = idx.parameters.at(names[p]);
    CHECK(rec.numel == sizes[p]);
    std::vector<float> values;
    for (const auto& c : rec.chunks) {
      const auto& where = c.tensors.at("param");
      std::vector<float> part(c.end - c.begin);
      REQUIRE(where.bytes == part.size() * sizeof(float));
      std::ifstream f(dir / where.file, std::ios::binary);
      f.seekg(static_cast<std::streamoff>(where.offset));
      f.read(reinterpret_cast<char*>(part.data()), static_cast<std::streamsize>(where.bytes));
      REQUIRE(f.good());
      values.insert(values.end(), part.begin(), part.end());
      const auto header = fsdp::checkpoint::read_safetensors_header(dir / where.file);
      CHECK(header.at(names[p] + "@" + std::to_string(c.begin)).offset == where.offset);
      CHECK(header.at(names[p] + "@" + std::to_string(c.begin) + ":exp_avg").offset == c.tensors.at("exp_avg").offset);
    }
    CHECK(values == saved[p]);
  }
  fsdp::threads::world{1}.run([&](fsdp::threads::communicator& comm) {
    model m;
    per_unit_group g{comm};
    m.add_to(g, 1);
    const auto back = fsdp::checkpoint::load(g, dir);
    CHECK(std::string(reinterpret_cast<const char*>(back.data()), back.size()) == user);
  });
  // The engine's bytes are checked like the rest.
  {
    std::fstream f(dir / "user.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.put('D');
  }
  fsdp::threads::world{1}.run([&](fsdp::threads::communicator& comm) {
    model m;
    per_unit_group g{comm};
    m.add_to(g, 1);
    CHECK(checkpoint_error([&] { fsdp::checkpoint::load(g, dir); }).find("user.bin: the engine's bytes (user.bin) is corrupted") != std::string::npos);
  });
  fs::remove_all(dir);
}

TEST_CASE("checkpoint: an asynchronous save holds the values of its step while training goes on; a second save waits for the first") {
  const fs::path first = dir_for("async1"), second = dir_for("async2");
  std::vector<std::vector<float>> at_save, at_second;
  fsdp::threads::world{3}.run([&](fsdp::threads::communicator& comm) {
    model m;
    per_unit_group g{comm};
    m.add_to(g, 1);
    fsdp::checkpoint::async_saver saver;
    saver.save(g, first);
    auto full = gathered(g);
    if (comm.rank() == 0) at_save = full;
    // "Training": every master value changes while the writer may still run.
    for (std::size_t b = 0; b < g.num_buckets(); ++b) {
      auto sh = g.shard(b);
      for (std::size_t i = 0; i < sh.numel; ++i) sh.params[i] += 1.0f;
    }
    CHECK(saver.pending());
    saver.save(g, second);  // commits the first, then starts the second
    CHECK(fsdp::checkpoint::is_complete(first));
    full = gathered(g);
    if (comm.rank() == 0) at_second = full;
    while (!saver.commit_if_written(g)) std::this_thread::yield();
    CHECK(!saver.pending());
    CHECK(fsdp::checkpoint::is_complete(second));
  });
  REQUIRE(at_save != at_second);
  for (const auto& [dir, want] : {std::pair{first, at_save}, std::pair{second, at_second}}) {
    fsdp::threads::world{2}.run([&](fsdp::threads::communicator& comm) {
      model m;
      per_unit_group g{comm};
      m.add_to(g, 2);
      fsdp::checkpoint::load(g, dir);
      CHECK(gathered(g) == want);
    });
    fs::remove_all(dir);
  }
}

// Two ranks save the test model to `dir`; each rank's error text ("" when it saved).
static std::vector<std::string> save_errors_on_two_ranks(const fs::path& dir) {
  std::vector<std::string> messages(2);
  fsdp::threads::world{2}.run([&](fsdp::threads::communicator& comm) {
    model m;
    per_unit_group g{comm};
    m.add_to(g, 1);
    messages[static_cast<std::size_t>(comm.rank())] = checkpoint_error([&] { fsdp::checkpoint::save(g, dir); });
  });
  return messages;
}

TEST_CASE("checkpoint: an unwritable place fails the save on every rank, named; a save killed between its renames still loads") {
  // A regular file where the checkpoint's parent directory should be (root ignores permission bits).
  const fs::path blocker = dir_for("blocker");
  std::ofstream(blocker) << "a file";
  const fs::path dir = blocker / "step_00000001";
  const std::vector<std::string> messages = save_errors_on_two_ranks(dir);
  for (const auto& msg : messages) {
    CHECK(msg.find("checkpoint save to " + dir.string() + " failed on rank 0: ") != std::string::npos);
    CHECK(msg.find("step_00000001.partial: cannot create the directory: Not a directory") != std::string::npos);
  }
  fs::remove(blocker);

  // Killed after DIR moved to DIR.old and before DIR.partial became DIR: DIR.old is whole.
  const fs::path killed = dir_for("killed");
  const auto saved = save_four(killed, 4);
  fs::rename(killed, killed.string() + ".old");
  fs::create_directories(killed.string() + ".partial");
  fsdp::threads::world{1}.run([&](fsdp::threads::communicator& comm) {
    model m;
    per_unit_group g{comm};
    m.add_to(g, 1);
    fsdp::checkpoint::load(g, killed);
    CHECK(gathered(g) == saved);
  });
  CHECK(fsdp::checkpoint::latest(killed.parent_path(), killed.filename().string()) == std::nullopt);  // not a step_<digits> name
  fs::remove_all(killed.string() + ".old");
  fs::remove_all(killed.string() + ".partial");
}

TEST_CASE("checkpoint: a save whose files cannot be written fails on every rank and leaves no DIR.partial") {
  // A file-size limit of 64 bytes: the shards' files cannot be written (EFBIG; SIGXFSZ ignored),
  // after DIR.partial was made.
  const fs::path dir = dir_for("too_big");
  struct rlimit before {};
  REQUIRE(::getrlimit(RLIMIT_FSIZE, &before) == 0);
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = before;
  small.rlim_cur = 64;
  REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
  const std::vector<std::string> messages = save_errors_on_two_ranks(dir);
  ::setrlimit(RLIMIT_FSIZE, &before);
  std::signal(SIGXFSZ, old_handler);
  for (const auto& msg : messages) CHECK(msg.find("checkpoint save to " + dir.string() + " failed on rank ") != std::string::npos);
  CHECK(!fs::exists(dir.string() + ".partial"));
  CHECK(!fs::exists(dir));
}

TEST_CASE("checkpoint: saving needs unique parameter names") {
  const fs::path dir = dir_for("names");
  fsdp::threads::world{1}.run([&](fsdp::threads::communicator& comm) {
    model m({"w", "w", "v"}, sizes);
    per_unit_group g{comm};
    m.add_to(g, 1);
    CHECK(checkpoint_error([&] { fsdp::checkpoint::save(g, dir); }).find("names must be unique") != std::string::npos);
  });
}
