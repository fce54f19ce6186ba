#pragma once
//! \file A sharded checkpoint's index.json: every parameter by the engine's name, with its size
//! shape and dtype and, for each chunk (an element range one rank saved), the file and byte range of
//! the parameter's values and of each optimizer state, with an XXH3 checksum of those bytes.
//! A loader needs nothing else: it reads only the byte ranges of the chunks it needs.
//!
//!   {"format": "fsdp-checkpoint", "version": 2,
//!    "saved_by": {"world_size": 4, "shard_size": 4},
//!    "master_dtype": "F32",
//!    "optimizer": {"steps": 20, "states": ["exp_avg", "exp_avg_sq"]},
//!    "user": {"file": "user.bin", "offset": 0, "bytes": 16, "xxh3": "..."},      (or null)
//!    "parameters": {"wte": {"numel": 8192, "shape": [256, 32], "dtype": "F32", "chunks": [
//!        {"begin": 0, "end": 2048, "tensors": {
//!            "param":   {"file": "rank_00000.safetensors", "offset": 312, "bytes": 8192, "xxh3": "..."},
//!            "exp_avg": {...}, "exp_avg_sq": {...}}}, ...]}}}
//!
//! Every file is also a plain safetensors file whose tensors are named "<param>@<begin>" and
//! "<param>@<begin>:<state>", so any safetensors reader can look inside.
//! JSON through nlohmann-json (docs/design.md, Dependencies); checksums through xxHash.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fsdp/checkpoint/safetensors.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/detail/xxhash.hpp"

namespace fsdp::checkpoint {

//! The XXH3-64 of bytes, as the index writes it (16 hex digits).
inline std::string xxh3_hex(std::span<const std::byte> b) {
  char s[17];
  std::snprintf(s, sizeof s, "%016llx", static_cast<unsigned long long>(XXH3_64bits(b.data(), b.size())));
  return s;
}

//! Where some bytes of a checkpoint lie, and their checksum.
struct stored_bytes {
  std::string file;  //!< relative to the checkpoint directory
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
  std::string xxh3;
  friend bool operator==(const stored_bytes&, const stored_bytes&) = default;
};

//! Elements [begin, end) of one parameter as one rank saved them: the values under "param",
//! each optimizer state under its name.
struct chunk {
  std::size_t begin = 0, end = 0;
  std::map<std::string, stored_bytes> tensors;
};

struct parameter_record {
  std::size_t numel = 0;
  std::vector<std::size_t> shape;  //!< its product is numel
  std::vector<chunk> chunks;       //!< sorted by begin; together they cover [0, numel)
};

struct checkpoint_index {
  int world_size = 0, shard_size = 0;  //!< of the save
  dtype master = dtype::f32;
  long optimizer_steps = 0;
  std::vector<std::string> optimizer_states;  //!< empty: saved without an optimizer
  std::optional<stored_bytes> user;           //!< the engine's own bytes, when it gave some
  std::map<std::string, parameter_record> parameters;
};

inline void to_json(nlohmann::ordered_json& j, const stored_bytes& s) {
  j = {{"file", s.file}, {"offset", s.offset}, {"bytes", s.bytes}, {"xxh3", s.xxh3}};
}
inline void from_json(const nlohmann::json& j, stored_bytes& s) {
  s.file = j.at("file").get<std::string>();
  s.offset = j.at("offset").get<std::uint64_t>();
  s.bytes = j.at("bytes").get<std::uint64_t>();
  s.xxh3 = j.at("xxh3").get<std::string>();
}

//! One chunk a rank wrote, as it reports it to rank 0 (which gathers them into the index).
struct written_chunk {
  std::string parameter;
  chunk where;
};

inline std::string chunks_to_text(const std::vector<written_chunk>& cs) {
  nlohmann::ordered_json a = nlohmann::ordered_json::array();
  for (const auto& c : cs) {
    nlohmann::ordered_json t = nlohmann::ordered_json::object();
    for (const auto& [k, s] : c.where.tensors) t[k] = s;
    a.push_back({{"parameter", c.parameter}, {"begin", c.where.begin}, {"end", c.where.end}, {"tensors", t}});
  }
  return a.dump();
}
inline std::vector<written_chunk> chunks_from_text(const std::string& text) {
  std::vector<written_chunk> out;
  for (const auto& c : nlohmann::json::parse(text)) {
    written_chunk w{c.at("parameter").get<std::string>(), {c.at("begin").get<std::size_t>(), c.at("end").get<std::size_t>(), {}}};
    for (const auto& [k, s] : c.at("tensors").items()) w.where.tensors[k] = s.get<stored_bytes>();
    out.push_back(std::move(w));
  }
  return out;
}

inline std::string index_to_text(const checkpoint_index& x) {
  nlohmann::ordered_json j;
  j["format"] = "fsdp-checkpoint";
  j["version"] = 2;
  j["saved_by"] = {{"world_size", x.world_size}, {"shard_size", x.shard_size}};
  j["master_dtype"] = safetensors_dtype(x.master);
  j["optimizer"] = {{"steps", x.optimizer_steps}, {"states", x.optimizer_states}};
  j["user"] = nullptr;
  if (x.user) j["user"] = *x.user;
  nlohmann::ordered_json ps = nlohmann::ordered_json::object();
  for (const auto& [name, p] : x.parameters) {
    nlohmann::ordered_json chunks = nlohmann::ordered_json::array();
    for (const auto& c : p.chunks) {
      nlohmann::ordered_json t = nlohmann::ordered_json::object();
      for (const auto& [k, s] : c.tensors) t[k] = s;
      chunks.push_back({{"begin", c.begin}, {"end", c.end}, {"tensors", t}});
    }
    ps[name] = {{"numel", p.numel}, {"shape", p.shape}, {"dtype", safetensors_dtype(x.master)}, {"chunks", chunks}};
  }
  j["parameters"] = ps;
  return j.dump(1) + "\n";
}

//! Reads and checks an index: its format, and that each parameter's chunks cover it exactly,
//! in order, each with a "param" tensor. Errors name the file and the parameter.
inline checkpoint_index read_index(const std::filesystem::path& path) {
  auto fail = [&](const std::string& what) { return error(errc::checkpoint, path.string() + ": " + what); };
  std::ifstream f(path);
  if (!f) throw fail("cannot open");
  const nlohmann::json j = nlohmann::json::parse(f, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || j.value("format", "") != "fsdp-checkpoint") throw fail("not an fsdp checkpoint index");
  if (j.value("version", 0) != 2) throw fail("index version " + j.value("version", nlohmann::json(nullptr)).dump() + ", this fsdp reads 2");
  checkpoint_index x;
  try {
    x.world_size = j.at("saved_by").at("world_size").get<int>();
    x.shard_size = j.at("saved_by").at("shard_size").get<int>();
    const auto master = dtype_from_safetensors(j.at("master_dtype").get<std::string>());
    if (!master) throw fail("unknown master dtype " + j.at("master_dtype").dump());
    x.master = *master;
    x.optimizer_steps = j.at("optimizer").at("steps").get<long>();
    x.optimizer_states = j.at("optimizer").at("states").get<std::vector<std::string>>();
    if (!j.at("user").is_null()) x.user = j.at("user").get<stored_bytes>();
    for (const auto& [name, p] : j.at("parameters").items()) {
      parameter_record r;
      r.numel = p.at("numel").get<std::size_t>();
      r.shape = p.at("shape").get<std::vector<std::size_t>>();
      std::size_t product = 1;
      for (std::size_t d : r.shape) product *= d;
      if (product != r.numel) throw fail("parameter '" + name + "': shape " + p.at("shape").dump() + " does not hold its " + std::to_string(r.numel) + " elements");
      std::size_t next = 0;
      for (const auto& c : p.at("chunks")) {
        chunk k{c.at("begin").get<std::size_t>(), c.at("end").get<std::size_t>(), {}};
        for (const auto& [t, s] : c.at("tensors").items()) k.tensors[t] = s.get<stored_bytes>();
        if (k.begin != next || k.end <= k.begin || !k.tensors.count("param"))
          throw fail("parameter '" + name + "': chunk [" + std::to_string(k.begin) + ", " + std::to_string(k.end) +
                     ") does not follow the previous one (which ends at " + std::to_string(next) + ") or has no values");
        next = k.end;
        r.chunks.push_back(std::move(k));
      }
      if (next != r.numel) throw fail("parameter '" + name + "': the chunks cover " + std::to_string(next) + " of " + std::to_string(r.numel) + " elements");
      x.parameters.emplace(name, std::move(r));
    }
  } catch (const nlohmann::json::exception& e) {
    throw fail(std::string("malformed index: ") + e.what());
  }
  return x;
}

//! Reads bytes the index points to into `out` (s.bytes long) and checks their checksum; errors
//! name the file and `what`.
inline void read_checked(const std::filesystem::path& dir, const stored_bytes& s, const std::string& what, std::span<std::byte> out) {
  read_bytes(dir / s.file, s.offset, out.first(s.bytes));
  if (xxh3_hex(out.first(s.bytes)) != s.xxh3)
    throw error(errc::checkpoint, (dir / s.file).string() + ": " + what + " is corrupted (its XXH3 checksum differs from the index's)");
}
inline std::vector<std::byte> read_checked(const std::filesystem::path& dir, const stored_bytes& s, const std::string& what) {
  std::vector<std::byte> out(s.bytes);
  read_checked(dir, s, what, out);
  return out;
}

//! Reads elements [begin, begin + out.size() / elem) of parameter `name`'s tensor `key` ("param"
//! or an optimizer state, `elem` bytes each) into `out`, from every chunk that overlaps them.
//! A chunk is read and checked whole (one checksum covers it), straight into `out` when all of
//! it is wanted. Errors name the file or the index, the parameter, the chunk and the key.
inline void read_elements(const std::filesystem::path& dir, const std::string& name, const parameter_record& p, const std::string& key,
                          std::size_t elem, std::size_t begin, std::span<std::byte> out) {
  const std::size_t end = begin + out.size() / elem;
  for (const chunk& c : p.chunks) {
    const std::size_t lo = std::max(c.begin, begin), hi = std::min(c.end, end);
    if (lo >= hi) continue;
    const std::string what = "'" + name + "' elements [" + std::to_string(c.begin) + ", " + std::to_string(c.end) + ") (" + key + ")";
    const auto t = c.tensors.find(key);
    if (t == c.tensors.end()) throw error(errc::checkpoint, (dir / "index.json").string() + ": " + what + " is missing");
    if (t->second.bytes != (c.end - c.begin) * elem)
      throw error(errc::checkpoint, (dir / "index.json").string() + ": " + what + " has " + std::to_string(t->second.bytes) +
                                        " bytes, expected " + std::to_string((c.end - c.begin) * elem));
    const auto into = out.subspan((lo - begin) * elem, (hi - lo) * elem);
    if (lo == c.begin && hi == c.end) {  // the whole chunk is wanted (no resharding): no second copy
      read_checked(dir, t->second, what, into);
      continue;
    }
    const std::vector<std::byte> bytes = read_checked(dir, t->second, what);
    std::copy(bytes.begin() + static_cast<std::ptrdiff_t>((lo - c.begin) * elem), bytes.begin() + static_cast<std::ptrdiff_t>((hi - c.begin) * elem),
              into.begin());
  }
}

}  // namespace fsdp::checkpoint
