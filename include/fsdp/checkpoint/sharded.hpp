#pragma once
//! \file Sharded checkpoints of a shard_group: every rank of the first replica writes the part of
//! each parameter its master shard holds (and the optimizer's states of those elements) into its
//! own safetensors file; rank 0 writes index.json, which names every parameter with its size,
//! dtype and the element ranges each file holds. Loading reads, for each parameter slice of this
//! rank's shards, the chunks that overlap it, so a checkpoint saved with N ranks and one sharding
//! or bucketing loads into M ranks with another (resharding).
//!
//!   DIR/index.json                 {"format": "fsdp-checkpoint", "version": 1, "parameters": {...}}
//!   DIR/rank_00000.safetensors     tensors "<param>@<first element>" and
//!                                  "<param>@<first element>:<state>", each with an XXH3 checksum
//!                                  in the file's __metadata__ ("xxh3:<tensor>")
//!
//! Atomic: ranks write into DIR.partial/ (every file fsync'ed); after a barrier rank 0 writes the
//! index, fsyncs the directory and renames DIR.partial to DIR (an older DIR is first renamed to
//! DIR.old and removed after). A save stopped before that rename leaves an older DIR whole; a
//! DIR.partial left behind is never loaded (load names it).
//!
//! Strict: load checks every name, size and dtype against the group before touching it, reads
//! and verifies every chunk it needs (checksums), and only then writes the shards, so a failed
//! load (errc::checkpoint naming the file and parameter) leaves the model as it was.
//!
//! Parameter names (param_traits::name) must be unique and non-empty to save.
//! Not yet: the user's blob (data-loader position, RNG), asynchronous save, a collective
//! agreement that every rank loaded (today each rank throws on its own), full export.

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#ifndef XXH_INLINE_ALL
#define XXH_INLINE_ALL
#endif
#include <xxhash.h>

#include "fsdp/checkpoint/safetensors.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/optim/state.hpp"

namespace fsdp::checkpoint {

namespace detail {

namespace fs = std::filesystem;

inline std::string rank_file(int r) {
  char name[32];
  std::snprintf(name, sizeof name, "rank_%05d.safetensors", r);
  return name;
}
inline std::string hex64(std::uint64_t x) {
  char s[17];
  std::snprintf(s, sizeof s, "%016llx", static_cast<unsigned long long>(x));
  return s;
}
inline std::uint64_t xxh3(std::span<const std::byte> b) { return XXH3_64bits(b.data(), b.size()); }
//! fsync of a directory: its entries (a new file, a rename) survive a crash.
inline void sync_dir(const fs::path& d) {
  const int fd = ::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw file_error(d, "cannot open the directory", errno);
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) throw file_error(d, "fsync failed", errno);
}

//! One parameter slice of one bucket shard: elements [param_offset, param_offset + numel) of
//! parameter `name` sit at shard_offset in the shard.
struct slice {
  std::string name;
  std::size_t param_numel, param_offset, shard_offset, numel;
  std::size_t bucket;
};

template <class Group>
std::vector<slice> my_slices(const Group& g) {
  std::vector<slice> out;
  for (std::size_t b = 0; b < g.num_buckets(); ++b) {
    const auto& layout = g.layout(b);
    const auto names = g.parameter_names(b);
    for (std::size_t i = 0; i < layout.size(); ++i)
      if (auto s = layout.slice(i, g.shard_rank()))
        out.push_back({names[i], layout[i].numel, s->param_offset, s->shard_offset, s->numel, b});
  }
  return out;
}

//! Every parameter of the group: name -> numel; refuses empty or repeated names.
template <class Group>
std::map<std::string, std::size_t> parameters_of(const Group& g) {
  std::map<std::string, std::size_t> out;
  for (std::size_t b = 0; b < g.num_buckets(); ++b) {
    const auto names = g.parameter_names(b);
    for (std::size_t i = 0; i < names.size(); ++i)
      if (names[i].empty() || names[i][0] == '#' || !out.emplace(names[i], g.layout(b)[i].numel).second)
        throw error(errc::checkpoint, "parameter names must be unique and given (param_traits::name) to checkpoint; '" +
                                          names[i] + "' is not", {g.rank()});
  }
  return out;
}

template <class Opt>
std::vector<optimizer_state> states_of(Opt* opt, std::size_t b) {
  if (!opt) return {};
  return opt->state(b);
}

// Copies `bytes` of device memory at `src` to the host.
template <class Group>
std::vector<std::byte> to_host(Group& g, const void* src, std::size_t bytes) {
  std::vector<std::byte> out(bytes);
  if (bytes) g.device().copy_to_host(out.data(), src, bytes);
  return out;
}

struct no_optimizer {
  std::vector<optimizer_state> state(std::size_t) { return {}; }
  long steps() const { return 0; }
  void set_steps(long) {}
};

template <class Group, class Opt>
void save_impl(Group& g, const fs::path& dir, Opt* opt) {
  using master = typename Group::master_type;
  const auto params = parameters_of(g);
  const fs::path partial = dir.string() + ".partial";
  const bool writer = g.rank() < g.shard_size();  // the first replica holds every shard once
  if (g.rank() == 0) {
    std::error_code ec;
    fs::remove_all(partial, ec);
    if (!fs::create_directories(partial, ec) && ec)
      throw error(errc::checkpoint, partial.string() + ": cannot create the directory: " + ec.message(), {g.rank()});
  }
  g.comm().barrier();  // the directory exists for everyone
  std::vector<std::string> state_names;
  if (writer) {
    const auto slices = my_slices(g);
    std::vector<tensor_decl> decls;
    std::vector<std::vector<std::byte>> blobs;
    std::map<std::string, std::string> meta;
    for (const auto& s : slices) {
      const auto sh = g.shard(s.bucket);
      const std::string base = s.name + "@" + std::to_string(s.param_offset);
      blobs.push_back(to_host(g, sh.params + s.shard_offset, s.numel * sizeof(master)));
      decls.push_back({base, dtype_of<master>, {s.numel}});
      for (const optimizer_state& st : states_of(opt, s.bucket)) {
        const std::size_t e = size_of(st.type);
        blobs.push_back(to_host(g, static_cast<const char*>(st.data) + s.shard_offset * e, s.numel * e));
        decls.push_back({base + ":" + std::string(st.name), st.type, {s.numel}});
      }
    }
    for (std::size_t k = 0; k < decls.size(); ++k) meta["xxh3:" + decls[k].name] = hex64(xxh3(blobs[k]));
    safetensors_writer out{partial / rank_file(g.rank()), decls, meta};
    for (const auto& bl : blobs) out.write(bl);
    out.close();
  }
  if (opt && g.num_buckets() > 0)
    for (const optimizer_state& st : opt->state(0)) state_names.emplace_back(st.name);
  g.comm().barrier();  // every file is written
  if (g.rank() == 0) {
    nlohmann::ordered_json index;
    index["format"] = "fsdp-checkpoint";
    index["version"] = 1;
    index["world_size"] = g.world_size();
    index["shard_size"] = g.shard_size();
    index["master_dtype"] = safetensors_dtype(dtype_of<master>);
    index["optimizer"] = {{"steps", opt ? opt->steps() : 0}, {"states", state_names}};
    // Which ranges each file holds follows from the layouts every rank of this save had; the
    // files' headers give the bytes. Written per parameter, as a reader expects.
    nlohmann::ordered_json ps = nlohmann::ordered_json::object();
    for (const auto& [name, numel] : params) ps[name] = {{"numel", numel}, {"dtype", safetensors_dtype(dtype_of<master>)}, {"chunks", nlohmann::ordered_json::array()}};
    for (int r = 0; r < g.shard_size(); ++r)
      for (std::size_t b = 0; b < g.num_buckets(); ++b) {
        const auto& layout = g.layout(b);
        const auto names = g.parameter_names(b);
        for (std::size_t i = 0; i < layout.size(); ++i)
          if (auto s = layout.slice(i, r))
            ps[names[i]]["chunks"].push_back({{"file", rank_file(r)}, {"begin", s->param_offset}, {"end", s->param_offset + s->numel}});
      }
    index["parameters"] = ps;
    const std::string text = index.dump(1) + "\n";
    fd_file f(partial / "index.json", O_WRONLY | O_CREAT | O_TRUNC);
    f.write_all(text.data(), text.size());
    f.sync_and_close();
    sync_dir(partial);
    // An older checkpoint at DIR steps aside only now, and is removed once DIR is the new one.
    const fs::path old = dir.string() + ".old";
    std::error_code ec;
    fs::remove_all(old, ec);
    if (fs::exists(dir)) fs::rename(dir, old, ec);
    if (!ec) fs::rename(partial, dir, ec);
    if (ec) throw error(errc::checkpoint, dir.string() + ": cannot move the finished save into place: " + ec.message(), {g.rank()});
    sync_dir(dir.has_parent_path() ? dir.parent_path() : fs::path("."));
    fs::remove_all(old, ec);
  }
  g.comm().barrier();  // the checkpoint is complete for everyone
}

template <class Group, class Opt>
void load_impl(Group& g, const fs::path& dir, Opt* opt) {
  using master = typename Group::master_type;
  const fs::path index_path = dir / "index.json";
  if (!fs::exists(index_path)) {
    const bool partial = fs::exists(dir.string() + ".partial");
    throw error(errc::checkpoint, dir.string() + ": no complete checkpoint (no index.json)" +
                                      (partial ? std::string("; ") + dir.string() + ".partial is a save that did not finish" : ""),
                {g.rank()});
  }
  nlohmann::json index;
  {
    std::ifstream f(index_path);
    index = nlohmann::json::parse(f, nullptr, false);
  }
  if (!index.is_object() || index.value("format", "") != "fsdp-checkpoint")
    throw error(errc::checkpoint, index_path.string() + ": not an fsdp checkpoint index", {g.rank()});
  // Names and sizes first: nothing is read, nothing written, until they all agree.
  const auto mine = parameters_of(g);
  const auto& saved = index.at("parameters");
  for (const auto& [name, numel] : mine) {
    if (!saved.contains(name)) throw error(errc::checkpoint, index_path.string() + ": no parameter '" + name + "' in the checkpoint", {g.rank()});
    if (saved.at(name).at("numel").template get<std::size_t>() != numel)
      throw error(errc::checkpoint, index_path.string() + ": parameter '" + name + "' has " +
                                        std::to_string(saved.at(name).at("numel").template get<std::size_t>()) + " elements, the model " +
                                        std::to_string(numel), {g.rank()});
  }
  for (const auto& [name, v] : saved.items())
    if (!mine.count(name)) throw error(errc::checkpoint, index_path.string() + ": parameter '" + name + "' is not in the model", {g.rank()});
  const auto saved_dtype = dtype_from_safetensors(index.value("master_dtype", ""));
  if (saved_dtype != dtype_of<master>)
    throw error(errc::checkpoint, index_path.string() + ": saved in " + index.value("master_dtype", "?") + ", the model's master dtype is " +
                                      std::string(safetensors_dtype(dtype_of<master>)), {g.rank()});
  std::vector<std::string> want_states;
  if (opt && g.num_buckets() > 0)
    for (const optimizer_state& st : opt->state(0)) want_states.emplace_back(st.name);
  const auto saved_states = index.at("optimizer").at("states").template get<std::vector<std::string>>();
  if (opt && saved_states != want_states)
    throw error(errc::checkpoint, index_path.string() + ": the optimizer state saved (" + nlohmann::json(saved_states).dump() +
                                      ") is not this optimizer's (" + nlohmann::json(want_states).dump() + ")", {g.rank()});

  // Stage every slice on the host, from verified chunks.
  std::map<std::string, safetensors_header> headers;
  auto header = [&](const std::string& file) -> const safetensors_header& {
    auto it = headers.find(file);
    if (it == headers.end()) it = headers.emplace(file, read_safetensors_header(dir / file)).first;
    return it->second;
  };
  struct staged {
    void* dst;
    std::vector<std::byte> bytes;
  };
  std::vector<staged> out;
  for (const auto& s : my_slices(g)) {
    std::vector<std::string> suffixes{""};
    std::vector<std::pair<void*, std::size_t>> targets{{g.shard(s.bucket).params + s.shard_offset, sizeof(master)}};
    for (const optimizer_state& st : states_of(opt, s.bucket)) {
      suffixes.push_back(":" + std::string(st.name));
      targets.push_back({static_cast<char*>(st.data) + s.shard_offset * size_of(st.type), size_of(st.type)});
    }
    for (std::size_t k = 0; k < suffixes.size(); ++k) {
      const std::size_t e = targets[k].second;
      staged st{targets[k].first, std::vector<std::byte>(s.numel * e)};
      std::size_t covered = 0;
      for (const auto& c : saved.at(s.name).at("chunks")) {
        const std::size_t cb = c.at("begin"), ce = c.at("end");
        const std::size_t lo = std::max(cb, s.param_offset), hi = std::min(ce, s.param_offset + s.numel);
        if (lo >= hi) continue;
        const std::string file = c.at("file");
        const auto& h = header(file);
        const std::string tname = s.name + "@" + std::to_string(cb) + suffixes[k];
        const tensor_entry& t = h.at(tname);
        if (t.bytes != (ce - cb) * e)
          throw error(errc::checkpoint, (dir / file).string() + ": tensor '" + tname + "' has " + std::to_string(t.bytes) + " bytes, the index says " +
                                            std::to_string((ce - cb) * e), {g.rank()});
        std::vector<std::byte> chunk(t.bytes);
        read_bytes(dir / file, t.offset, chunk);
        const auto sum = h.metadata.find("xxh3:" + tname);
        if (sum == h.metadata.end() || sum->second != hex64(xxh3(chunk)))
          throw error(errc::checkpoint, (dir / file).string() + ": tensor '" + tname + "' is corrupted (its XXH3 checksum differs)", {g.rank()});
        std::copy(chunk.begin() + static_cast<std::ptrdiff_t>((lo - cb) * e), chunk.begin() + static_cast<std::ptrdiff_t>((hi - cb) * e),
                  st.bytes.begin() + static_cast<std::ptrdiff_t>((lo - s.param_offset) * e));
        covered += hi - lo;
      }
      if (covered != s.numel)
        throw error(errc::checkpoint, index_path.string() + ": parameter '" + s.name + "': the chunks cover " + std::to_string(covered) +
                                          " of elements [" + std::to_string(s.param_offset) + ", " + std::to_string(s.param_offset + s.numel) + ")",
                    {g.rank()});
      out.push_back(std::move(st));
    }
  }
  // Everything read and verified: now write the shards (and the optimizer's step count).
  for (auto& st : out)
    if (!st.bytes.empty()) g.device().copy_from_host(st.dst, st.bytes.data(), st.bytes.size());
  if (opt) opt->set_steps(index.at("optimizer").at("steps").template get<long>());
}

}  // namespace detail

//! Collective: saves the group's master parameters into the checkpoint directory `dir`
//! (atomically: see the file comment).
template <class Group>
void save(Group& group, const std::filesystem::path& dir) {
  detail::save_impl(group, dir, static_cast<detail::no_optimizer*>(nullptr));
}
//! Collective: the master parameters and the optimizer's state and step count.
template <class Group, class Optimizer>
void save(Group& group, const std::filesystem::path& dir, Optimizer& opt) {
  detail::save_impl(group, dir, &opt);
}

//! Loads a checkpoint into a finalized group (any rank count, sharding or bucketing), and into
//! an optimizer built over it: all or nothing on this rank.
template <class Group>
void load(Group& group, const std::filesystem::path& dir) {
  detail::load_impl(group, dir, static_cast<detail::no_optimizer*>(nullptr));
}
template <class Group, class Optimizer>
void load(Group& group, const std::filesystem::path& dir, Optimizer& opt) {
  detail::load_impl(group, dir, &opt);
}

}  // namespace fsdp::checkpoint
