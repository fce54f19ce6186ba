#pragma once
//! \file The full (unsharded) parameters as one safetensors file, and initial values from a
//! checkpoint.
//!
//!   fsdp::checkpoint::export_full(group, "model.safetensors", fsdp::dtype::bf16);   // collective
//!   group.finalize(fsdp::init::from_checkpoint("model.safetensors"));    // or a sharded checkpoint dir
//!
//! export_full streams: the header is written first (names and sizes are known), then bucket
//! by bucket the first replica gathers one bucket and rank 0 appends its parameters, so no rank
//! ever holds more than one gathered bucket. Tensors are named as the engine names them
//! (param_traits::name), in their shapes (param_traits contract 8; 1-D without), in the order
//! of the buckets. The file appears under its name only
//! when complete (written as FILE.partial, then renamed).
//!
//! init::from_checkpoint(path) is an init::per_shard fill: each rank reads only the elements its
//! shards hold, from a full safetensors file (any of F32, BF16, F16, F64, converted to the
//! master dtype with one rounding) or from a sharded checkpoint directory (each chunk checked
//! against its XXH3). A parameter missing from the file, or of another size, is an
//! errc::checkpoint naming both; tensors of the file the model does not have are not looked at.

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "fsdp/checkpoint/directory.hpp"
#include "fsdp/checkpoint/index.hpp"
#include "fsdp/checkpoint/safetensors.hpp"
#include "fsdp/checkpoint/sharded.hpp"
#include "fsdp/checkpoint/snapshot.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/init.hpp"
#include "fsdp/core/param_traits.hpp"

namespace fsdp::checkpoint {

//! Collective: writes every parameter, unsharded, into the safetensors file `path`, in `type`
//! (f32, bf16 or f16). Failures (an unwritable path) reach every rank, naming rank 0's cause.
template <class Group>
void export_full(Group& g, const std::filesystem::path& path, dtype type = dtype::f32) {
  using master = typename Group::master_type;
  if (!is_shardable(type))
    throw error(errc::invalid_argument, "export_full: dtype " + std::string(to_string(type)) + " (f32, bf16 or f16)", {g.rank()});
  const std::filesystem::path partial = path.string() + ".partial";
  std::optional<safetensors_writer> out;
  std::string err = detail::error_text([&] {
    parameters_of(g);  // every parameter named, once
    if (g.rank() != 0) return;
    std::vector<tensor_decl> decls;
    for (std::size_t b = 0; b < g.num_buckets(); ++b) {
      for (const fsdp::parameter_info& p : g.parameters(b)) decls.push_back({p.name, type, {p.shape.begin(), p.shape.end()}});
    }
    out.emplace(partial, std::move(decls), std::map<std::string, std::string>{{"format", "pt"}, {"written_by", "fsdp::checkpoint::export_full"}});
  });
  detail::agree(g, err, "export of the full parameters to " + path.string());
  // Rank 0 keeps taking part in the gathers after a failed write, so no rank waits for it.
  const bool gathers = g.rank() < g.shard_size();
  for (std::size_t b = 0; b < g.num_buckets() && gathers; ++b) {
    const std::vector<master> full = g.full_bucket(b);
    if (g.rank() != 0 || !err.empty()) continue;
    err = detail::error_text([&] {
      const auto& layout = g.layout(b);
      visit_floating(type, [&](auto to) {
        using T = decltype(to);
        for (std::size_t i = 0; i < layout.size(); ++i) {
          std::vector<T> values(layout[i].numel);
          for (std::size_t k = 0; k < values.size(); ++k) values[k] = convert<T>(full[layout[i].offset + k]);
          out->write(std::as_bytes(std::span(values)));
        }
      });
    });
  }
  if (g.rank() == 0 && err.empty())
    err = detail::error_text([&] {
      out->close();
      std::filesystem::rename(partial, path);
      detail::sync_dir(detail::parent_or_here(path));
    });
  if (g.rank() == 0 && !err.empty()) {
    out.reset();
    std::error_code ec;
    std::filesystem::remove(partial, ec);
  }
  detail::agree(g, err, "export of the full parameters to " + path.string());
}

namespace detail {

//! What from_checkpoint's fill reads from: a full safetensors file or a sharded checkpoint,
//! opened at the first call (the fill is copied; they share this).
class checkpoint_source {
 public:
  explicit checkpoint_source(std::filesystem::path p) : path_(std::move(p)) {}

  void fill(const param_slice& s, std::span<float> out) {
    const std::lock_guard lock(mutex_);  // threads ranks share one source
    open();
    const std::string name(s.name);
    if (name.empty()) throw error(errc::checkpoint, "init::from_checkpoint: a parameter of unit " + std::to_string(s.unit) + " has no name");
    if (index_) return from_sharded(name, s, out);
    const tensor_entry& t = header_->at(name);
    std::uint64_t numel = 1;
    for (auto d : t.shape) numel *= d;
    if (numel != s.numel)
      throw error(errc::checkpoint, path_.string() + ": tensor '" + name + "' has " + std::to_string(numel) + " elements, the model's parameter " +
                                        std::to_string(s.numel));
    const std::size_t e = size_of(t.type);
    std::vector<std::byte> bytes(out.size() * e);
    read_bytes(path_, t.offset + s.offset * e, bytes);
    const bool known = visit_floating(t.type, [&](auto from) {
      using T = decltype(from);
      std::vector<T> v(out.size());
      std::memcpy(v.data(), bytes.data(), bytes.size());
      for (std::size_t k = 0; k < out.size(); ++k) out[k] = convert<float>(v[k]);
    });
    if (!known) throw error(errc::checkpoint, path_.string() + ": tensor '" + name + "' is " + std::string(safetensors_dtype(t.type)) + ", not a float type");
  }

 private:
  void open() {
    if (header_ || index_) return;
    if (std::filesystem::is_directory(path_)) {
      dir_ = complete_checkpoint(path_);
      index_ = read_index(dir_ / "index.json");
    } else {
      header_ = read_safetensors_header(path_);
    }
  }
  void from_sharded(const std::string& name, const param_slice& s, std::span<float> out) {
    const auto it = index_->parameters.find(name);
    if (it == index_->parameters.end()) throw error(errc::checkpoint, (dir_ / "index.json").string() + ": no parameter '" + name + "' in the checkpoint");
    if (it->second.numel != s.numel)
      throw error(errc::checkpoint, (dir_ / "index.json").string() + ": parameter '" + name + "' has " + std::to_string(it->second.numel) +
                                        " elements, the model " + std::to_string(s.numel));
    std::vector<std::byte> bytes(out.size() * size_of(index_->master));
    read_elements(dir_, name, it->second, "param", size_of(index_->master), s.offset, bytes);
    visit_floating(index_->master, [&](auto from) {
      using T = decltype(from);
      for (std::size_t k = 0; k < out.size(); ++k) {
        T v;
        std::memcpy(&v, bytes.data() + k * sizeof v, sizeof v);
        out[k] = convert<float>(v);
      }
    });
  }

  std::filesystem::path path_, dir_;
  std::mutex mutex_;
  std::optional<safetensors_header> header_;
  std::optional<checkpoint_index> index_;
};

}  // namespace detail
}  // namespace fsdp::checkpoint

namespace fsdp::init {

//! A finalize initializer: each rank's shards from a full safetensors file (export_full's, or
//! any with the engine's names) or from a sharded checkpoint directory.
inline auto from_checkpoint(const std::filesystem::path& path) {
  auto source = std::make_shared<checkpoint::detail::checkpoint_source>(path);
  return per_shard([source](const param_slice& s, std::span<float> out) { source->fill(s, out); });
}

}  // namespace fsdp::init
