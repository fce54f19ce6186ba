// Full export and initial values from a checkpoint (checkpoint/full.hpp): a sharded model's
// parameters in one safetensors file, equal to the parameters gathered one by one; a model
// started from that file, or from a sharded checkpoint, at other rank counts and shardings, holds
// the same values bit for bit.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cstring>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "common/catch_error.hpp"
#include "fsdp/checkpoint/full.hpp"
#include "fsdp/fsdp.hpp"

namespace {

namespace fs = std::filesystem;
using fsdp_test::checkpoint_error;
using group_t = fsdp::shard_group<fsdp::buffer<float>, fsdp::fixed_bytes>;

const std::vector<std::string> names{"tok.w", "l0.w", "l0.b", "out.w"};
const std::vector<std::size_t> sizes{515, 130, 9, 1201};

fs::path path_for(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("fsdp_full_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(p);
  return p;
}

struct model {
  std::vector<std::unique_ptr<fsdp::buffer<float>>> params;
  explicit model(const std::vector<std::size_t>& ss = sizes) {
    for (std::size_t p = 0; p < names.size(); ++p) params.push_back(std::make_unique<fsdp::buffer<float>>(ss[p], names[p]));
    if (ss[1] == 130) params[1] = std::make_unique<fsdp::buffer<float>>(std::vector<std::size_t>{10, 13}, names[1]);  // a 2-D one
  }
  template <class Group, class Init>
  void add_to(Group& g, Init init) {
    g.add_unit({params[0].get()});
    g.add_unit({params[1].get(), params[2].get()});
    g.add_unit({params[3].get()});
    g.finalize(std::move(init));
  }
};

auto seeded(int seed) {
  return fsdp::init::per_shard([seed](const fsdp::param_slice& s, std::span<float> v) {
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = std::cos(0.11f * static_cast<float>(s.offset + i + 7 * static_cast<std::size_t>(seed)) + static_cast<float>(s.unit + s.index));
  });
}

template <class Group>
std::vector<std::vector<float>> gathered(Group& g) {
  std::vector<std::vector<float>> out;
  for (int u = 0; u < g.num_units(); ++u)
    for (int i = 0; i < (u == 1 ? 2 : 1); ++i) out.push_back(g.full_parameter(u, i));
  return out;
}

bool bit_equal(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t p = 0; p < a.size(); ++p)
    if (a[p].size() != b[p].size() || std::memcmp(a[p].data(), b[p].data(), a[p].size() * sizeof(float)) != 0) return false;
  return true;
}

}  // namespace

TEST_CASE("export_full: one file of every full parameter, f32 exact and bf16 rounded, read back as plain safetensors") {
  const fs::path f32 = path_for("f32.safetensors"), bf16 = path_for("bf16.safetensors");
  std::vector<std::vector<float>> saved;
  fsdp::threads::world{4}.run([&](fsdp::threads::communicator& comm) {
    model m;
    group_t g{comm, {}, {.sharding = fsdp::hybrid_shard(2), .bucket = {.bytes = 2500}}};
    m.add_to(g, seeded(1));
    fsdp::checkpoint::export_full(g, f32);
    fsdp::checkpoint::export_full(g, bf16, fsdp::dtype::bf16);
    auto full = gathered(g);
    if (comm.rank() == 0) saved = full;
  });
  CHECK(!fs::exists(f32.string() + ".partial"));
  for (const auto& [file, type] : {std::pair{f32, fsdp::dtype::f32}, std::pair{bf16, fsdp::dtype::bf16}}) {
    const auto h = fsdp::checkpoint::read_safetensors_header(file);
    REQUIRE(h.tensors.size() == names.size());
    for (std::size_t p = 0; p < names.size(); ++p) {
      CAPTURE(names[p]);
      const auto& t = h.at(names[p]);
      CHECK(t.type == type);
      CHECK(t.shape == (p == 1 ? std::vector<std::uint64_t>{10, 13} : std::vector<std::uint64_t>{sizes[p]}));
      if (type == fsdp::dtype::f32) {
        std::vector<float> v(sizes[p]);
        fsdp::checkpoint::read_bytes(file, t.offset, std::as_writable_bytes(std::span(v)));
        CHECK(std::memcmp(v.data(), saved[p].data(), v.size() * sizeof(float)) == 0);
      } else {
        std::vector<fsdp::bf16> v(sizes[p]);
        fsdp::checkpoint::read_bytes(file, t.offset, std::as_writable_bytes(std::span(v)));
        std::size_t wrong = 0;
        for (std::size_t i = 0; i < v.size(); ++i) {
          const fsdp::bf16 want = fsdp::convert<fsdp::bf16>(saved[p][i]);
          wrong += std::memcmp(&v[i], &want, sizeof want) != 0 ? 1 : 0;
        }
        CHECK(wrong == 0);
      }
    }
  }
  fs::remove(f32);
  fs::remove(bf16);
}

TEST_CASE("init::from_checkpoint: from an exported file or a sharded checkpoint, at other rank counts and shardings, bit for bit") {
  const fs::path file = path_for("init.safetensors"), dir = path_for("init_dir");
  std::vector<std::vector<float>> saved;
  fsdp::threads::world{4}.run([&](fsdp::threads::communicator& comm) {
    model m;
    group_t g{comm, {}, {.bucket = {.bytes = 1}}};  // a bucket per unit
    m.add_to(g, seeded(2));
    fsdp::checkpoint::export_full(g, file);
    fsdp::checkpoint::save(g, dir);
    auto full = gathered(g);
    if (comm.rank() == 0) saved = full;
  });
  struct target {
    int ranks;
    fsdp::sharding sharding;
    std::size_t bucket_bytes;
  };
  for (const fs::path& from : {file, dir})
    for (const target& t : {target{3, fsdp::full_shard(), 1}, target{4, fsdp::hybrid_shard(2), 100000}, target{1, fsdp::no_shard(), 3000}}) {
      CAPTURE(from);
      CAPTURE(t.ranks);
      std::vector<int> same(static_cast<std::size_t>(t.ranks), 0);
      fsdp::threads::world{t.ranks}.run([&](fsdp::threads::communicator& comm) {
        model m;
        group_t g{comm, {}, {.sharding = t.sharding, .bucket = {.bytes = t.bucket_bytes}}};
        m.add_to(g, fsdp::init::from_checkpoint(from));
        same[static_cast<std::size_t>(comm.rank())] = bit_equal(gathered(g), saved) ? 1 : 0;
      });
      CHECK(same == std::vector<int>(static_cast<std::size_t>(t.ranks), 1));
    }

  // A parameter the file lacks, or of another size: named.
  for (const fs::path& from : {file, dir}) {
    CAPTURE(from);
    fsdp::threads::world{1}.run([&](fsdp::threads::communicator& comm) {
      model m({515, 130, 10, 1201});
      group_t g{comm};
      const std::string msg = checkpoint_error([&] { m.add_to(g, fsdp::init::from_checkpoint(from)); });
      CHECK(msg.find("'l0.b' has 9 elements") != std::string::npos);
    });
  }
  fsdp::threads::world{1}.run([&](fsdp::threads::communicator& comm) {
    std::vector<std::unique_ptr<fsdp::buffer<float>>> ps;
    ps.push_back(std::make_unique<fsdp::buffer<float>>(515, "tok.w"));
    ps.push_back(std::make_unique<fsdp::buffer<float>>(20, "extra.w"));
    group_t g{comm};
    g.add_unit({ps[0].get(), ps[1].get()});
    CHECK(checkpoint_error([&] { g.finalize(fsdp::init::from_checkpoint(file)); }).find("no tensor 'extra.w'") != std::string::npos);
  });
  fs::remove(file);
  fs::remove_all(dir);
}

TEST_CASE("export_full: an unwritable path fails on every rank with rank 0's cause; no file is left") {
  const fs::path blocker = path_for("blocker");
  std::ofstream(blocker) << "a file";
  const fs::path file = blocker / "model.safetensors";
  std::vector<std::string> messages(2);
  fsdp::threads::world{2}.run([&](fsdp::threads::communicator& comm) {
    model m;
    group_t g{comm};
    m.add_to(g, seeded(3));
    messages[static_cast<std::size_t>(comm.rank())] = checkpoint_error([&] { fsdp::checkpoint::export_full(g, file); });
  });
  for (const auto& msg : messages) {
    CHECK(msg.find("export of the full parameters to " + file.string() + " failed on rank 0") != std::string::npos);
    CHECK(msg.find("cannot open for writing") != std::string::npos);
  }
  fs::remove(blocker);
}

TEST_CASE("export_full: a dtype other than f32, bf16 or f16 is refused by name, writing nothing") {
  const fs::path file = path_for("i64.safetensors");
  fsdp::threads::world{1}.run([&](fsdp::threads::communicator& comm) {
    model m;
    group_t g{comm};
    m.add_to(g, seeded(3));
    fsdp_test::check_error([&] { fsdp::checkpoint::export_full(g, file, fsdp::dtype::i64); }, fsdp::errc::invalid_argument,
                           "export_full: dtype i64 (f32, bf16 or f16)");
  });
  CHECK_FALSE(fs::exists(file));
  CHECK_FALSE(fs::exists(file.string() + ".partial"));
}
