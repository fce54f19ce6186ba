#pragma once
//! \file One rank's part of a sharded checkpoint: the host copy of its master-shard slices and
//! their optimizer states (take_snapshot: the only part of a save that training waits for), and
//! the safetensors file written from that copy (write_snapshot: may run on another thread; it
//! touches no communicator and no device).
//!
//! A slice is the part of one parameter that lies in this rank's shard of one bucket: elements
//! [param_offset, param_offset + numel) of the parameter sit at shard_offset in the shard. The
//! first replica's ranks (world ranks 0 .. S-1) hold every shard once, so only they write.

#include <cstddef>
#include <cstdio>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/checkpoint/index.hpp"
#include "fsdp/checkpoint/safetensors.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/optim/state.hpp"

namespace fsdp::checkpoint {

//! An optimizer for a save or load without one.
struct no_optimizer {
  std::vector<optimizer_state> state(std::size_t) { return {}; }
  long steps() const { return 0; }
  void set_steps(long) {}
};

struct slice {
  std::string name;
  std::size_t param_numel, param_offset, shard_offset, numel;
  std::size_t bucket;
  bool frozen;  //!< a frozen parameter: values only, no optimizer state
};

//! This rank's slices, bucket by bucket.
template <class Group>
std::vector<slice> slices_of(const Group& g) {
  std::vector<slice> out;
  for (std::size_t b = 0; b < g.num_buckets(); ++b) {
    const auto& layout = g.layout(b);
    const auto params = g.parameters(b);
    for (std::size_t i = 0; i < layout.size(); ++i)
      if (auto s = layout.slice(i, g.shard_rank()))
        out.push_back({params[i].name, layout[i].numel, s->param_offset, s->shard_offset, s->numel, b, layout.frozen(i)});
  }
  return out;
}

//! A parameter of the model, as checkpoints describe it.
struct model_parameter {
  std::size_t numel = 0;
  std::vector<std::size_t> shape;
};

//! Every parameter of the group by name; refuses empty or repeated names.
template <class Group>
std::map<std::string, model_parameter> parameters_of(const Group& g) {
  std::map<std::string, model_parameter> out;
  for (std::size_t b = 0; b < g.num_buckets(); ++b) {
    const auto params = g.parameters(b);
    for (std::size_t i = 0; i < params.size(); ++i) {
      const std::string& name = params[i].name;
      if (name.empty() || name[0] == '#' || !out.emplace(name, model_parameter{g.layout(b)[i].numel, params[i].shape}).second)
        throw error(errc::checkpoint, "parameter names must be unique and given (param_traits::name) to checkpoint; '" + name + "' is not",
                    {g.rank()});
    }
  }
  return out;
}

//! The state names an optimizer keeps per element ("exp_avg", ...), or none.
template <class Opt>
std::vector<std::string> state_names(Opt& opt, std::size_t num_buckets) {
  std::vector<std::string> out;
  if (num_buckets > 0)
    for (const optimizer_state& st : opt.state(0)) out.emplace_back(st.name);
  return out;
}

//! One tensor of the rank's file: elements [begin, end) of `parameter`, values ("param") or a
//! state, as host bytes: a copy, or (a synchronous save from host memory) the shard itself.
struct snapshot_tensor {
  std::string parameter;
  std::size_t begin, end;
  std::string key;
  dtype type;
  std::vector<std::byte> copy;
  std::span<const std::byte> bytes;  //!< copy, or the shard's own memory
};

//! What a rank saves, copied to the host.
struct rank_snapshot {
  bool writes = false;  //!< the first replica's ranks write; the others only take part
  std::string file;     //!< "rank_00003.safetensors"
  std::vector<snapshot_tensor> tensors;
};

inline std::string rank_file_name(int shard_rank) {
  char name[32];
  std::snprintf(name, sizeof name, "rank_%05d.safetensors", shard_rank);
  return name;
}

//! Copies this rank's slices and their optimizer states to the host. With `in_place` (a
//! synchronous save on the host device, whose memory is this process's and does not change
//! while the save runs) it only points at them: the 256 MiB bench/checkpoint save took 2.3x a
//! plain write() with the copy (fresh pages faulted in and filled), 1.1-1.3x without.
template <class Group, class Opt>
rank_snapshot take_snapshot(Group& g, Opt& opt, bool in_place = false) {
  using master = typename Group::master_type;
  rank_snapshot s;
  s.writes = g.rank() < g.shard_size();
  s.file = rank_file_name(g.shard_rank());
  if (!s.writes) return s;
  g.finish_pending();
  auto add = [&](const slice& sl, std::string key, dtype type, const void* src) {
    snapshot_tensor& t = s.tensors.emplace_back(snapshot_tensor{sl.name, sl.param_offset, sl.param_offset + sl.numel, std::move(key), type, {}, {}});
    const std::size_t bytes = sl.numel * size_of(type);
    if (in_place) {
      t.bytes = {static_cast<const std::byte*>(src), bytes};
      return;
    }
    t.copy.resize(bytes);
    if (bytes) g.device().copy_to_host(t.copy.data(), src, bytes);
    t.bytes = t.copy;
  };
  for (const slice& sl : slices_of(g)) {
    add(sl, "param", dtype_of<master>, g.shard(sl.bucket).params + sl.shard_offset);
    if (sl.frozen) continue;
    for (const optimizer_state& st : opt.state(sl.bucket))
      add(sl, std::string(st.name), st.type, static_cast<const char*>(st.data) + sl.shard_offset * size_of(st.type));
  }
  return s;
}

//! Writes the snapshot as DIR/<file> (safetensors, fsync'ed; the checksums also in its
//! metadata, so the file checks itself) and returns the chunks it holds, for the index.
inline std::vector<written_chunk> write_snapshot(const rank_snapshot& s, const std::filesystem::path& dir) {
  if (!s.writes) return {};
  std::vector<tensor_decl> decls;
  std::map<std::string, std::string> meta;
  std::vector<std::string> sums;
  for (const auto& t : s.tensors) {
    std::string name = t.parameter + "@" + std::to_string(t.begin);
    if (t.key != "param") name += ":" + t.key;
    sums.push_back(xxh3_hex(t.bytes));
    meta["xxh3:" + name] = sums.back();
    decls.push_back({std::move(name), t.type, {t.end - t.begin}});
  }
  safetensors_writer out{dir / s.file, decls, meta};
  std::vector<written_chunk> chunks;
  std::uint64_t offset = out.data_start();
  for (std::size_t k = 0; k < s.tensors.size(); ++k) {
    const auto& t = s.tensors[k];
    out.write(t.bytes);
    if (chunks.empty() || chunks.back().parameter != t.parameter || chunks.back().where.begin != t.begin)
      chunks.push_back({t.parameter, {t.begin, t.end, {}}});
    chunks.back().where.tensors[t.key] = {s.file, offset, t.bytes.size(), sums[k]};
    offset += t.bytes.size();
  }
  out.close();
  return chunks;
}

}  // namespace fsdp::checkpoint
