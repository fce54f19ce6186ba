#pragma once
//! \file Sharded checkpoints of a shard_group: save, asynchronous save, and load with resharding.
//!
//!   fsdp::checkpoint::save(group, "ckpt/step_00000040", opt);             // collective
//!   fsdp::checkpoint::save(group, dir, opt, std::as_bytes(std::span(my_state)));  // + the engine's bytes
//!   std::vector<std::byte> mine = fsdp::checkpoint::load(group, dir, opt);  // any ranks, sharding, buckets
//!
//!   fsdp::checkpoint::async_saver saver;   // training goes on while the files are written
//!   saver.save(group, dir, opt);           // waits only for the host copy (and a previous save)
//!   ... steps ...; saver.commit_if_written(group); ...   // collective: commits once every rank wrote
//!   saver.wait();                          // collective: the save is complete
//!
//! What lies where:
//!   DIR/index.json                (index.hpp) every parameter by name: size, dtype, and per
//!                                 chunk the file, byte range and XXH3 of its values and states
//!   DIR/rank_<5 digits>.safetensors   (snapshot.hpp) one per rank of the first replica
//!   DIR/user.bin                  the engine's bytes (rank 0's), when it gave some
//! and how a directory becomes complete atomically: directory.hpp.
//!
//! Every step that can fail on one rank (making the directory, writing, loading) ends in an
//! agreement (one all-gather of each rank's error text): either every rank goes on, or every
//! rank throws errc::checkpoint naming the first rank that failed and why. A load is all or
//! nothing on every rank: nothing is written into a shard until every rank has read and checked
//! everything it needs.
//!
//! The engine's bytes (its data-loader position, RNG state) are rank 0's; an engine that needs
//! per-rank state saves it from rank 0 for all ranks (the GPT example saves its step and seed).

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "fsdp/checkpoint/directory.hpp"
#include "fsdp/checkpoint/index.hpp"
#include "fsdp/checkpoint/snapshot.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/device/host.hpp"

namespace fsdp::checkpoint {

namespace detail {

//! Collective: every rank passes its error text ("" when it is fine); if any is not empty, every
//! rank throws errc::checkpoint with the first failing rank's text.
template <class Group>
void agree(Group& g, const std::string& mine, const std::string& what) {
  const auto all = g.all_gather_host(std::as_bytes(std::span(mine)));
  for (std::size_t r = 0; r < all.size(); ++r)
    if (!all[r].empty()) {
      const std::string text(reinterpret_cast<const char*>(all[r].data()), all[r].size());
      throw error(errc::checkpoint, what + " failed on rank " + std::to_string(r) + ": " + text, {g.rank()});
    }
}

//! Runs f; returns its exception's text, or "" when it returned.
template <class F>
std::string error_text(F&& f) {
  try {
    f();
    return {};
  } catch (const std::exception& e) {
    std::string w = e.what();
    if (w.starts_with("fsdp: checkpoint: ")) w.erase(0, 18);  // agree() says it again
    return w.empty() ? std::string("an exception without a message") : w;
  }
}

}  // namespace detail

//! Collective: saves the group's master parameters (and `opt`'s state, and the engine's `user`
//! bytes) into the checkpoint directory `dir`, atomically. Returns when it is complete.
template <class Group, class Opt>
void save(Group& group, const std::filesystem::path& dir, Opt& opt, std::span<const std::byte> user = {});

//! Saves in the background: save() copies the shards to the host (what the step waits for) and
//! a thread writes them; commit_if_written() or wait() (both collective, called by every rank at
//! the same point of training) make the checkpoint complete. A second save() first waits for the
//! first. A saver destroyed with a save still pending joins its thread and leaves DIR.partial,
//! which is never loaded.
class async_saver {
 public:
  async_saver() = default;
  async_saver(const async_saver&) = delete;
  async_saver& operator=(const async_saver&) = delete;
  ~async_saver() {
    if (writer_.joinable()) writer_.join();
  }

  //! Collective: starts saving the group's master parameters, `opt`'s state and the engine's
  //! `user` bytes (rank 0's) into `dir`.
  template <class Group, class Opt>
  void save(Group& group, const std::filesystem::path& dir, Opt& opt, std::span<const std::byte> user = {}) {
    start(group, dir, opt, user, /*in_place=*/false);
  }
  template <class Group>
  void save(Group& group, const std::filesystem::path& dir) {
    no_optimizer none;
    save(group, dir, none);
  }

  //! Collective: when every rank's files are written, commits the save and returns true; else
  //! returns false at once (training goes on). One small all-gather.
  template <class Group>
  bool commit_if_written(Group& group) {
    if (!commit_) return true;
    const std::string mine = done_.finished.load(std::memory_order_acquire) ? "1" : "0";
    for (const auto& r : group.all_gather_host(std::as_bytes(std::span(mine))))
      if (r.empty() || static_cast<char>(r[0]) != '1') return false;
    wait();
    return true;
  }

  //! Collective: waits for the pending save's files and commits it (nothing when none pends).
  //! Throws errc::checkpoint on every rank when any rank failed to write.
  void wait() {
    if (!commit_) return;
    auto c = std::exchange(commit_, nullptr);
    c();
  }
  bool pending() const noexcept { return static_cast<bool>(commit_); }

 private:
  template <class Group, class Opt>
  friend void save(Group&, const std::filesystem::path&, Opt&, std::span<const std::byte>);

  template <class Group, class Opt>
  void start(Group& group, const std::filesystem::path& dir, Opt& opt, std::span<const std::byte> user, bool in_place) {
    wait();
    const std::string err = detail::error_text([&] {
      parameters_of(group);  // every parameter named, once
      if (group.rank() == 0) begin_directory(dir);
    });
    detail::agree(group, err, "checkpoint save to " + dir.string());
    rank_snapshot snap = take_snapshot(group, opt, in_place);
    std::vector<std::byte> user_copy;
    if (group.rank() == 0) user_copy.assign(user.begin(), user.end());
    checkpoint_index head;
    head.world_size = group.world_size();
    head.shard_size = group.shard_size();
    head.master = dtype_of<typename Group::master_type>;
    head.optimizer_steps = opt.steps();
    head.optimizer_states = state_names(opt, group.num_buckets());
    const bool user_given = !user.empty();
    const std::filesystem::path partial = partial_of(dir);
    done_.reset();
    writer_ = std::thread([this, partial, snap = std::move(snap), user_copy = std::move(user_copy), user_given, rank0 = group.rank() == 0] {
      done_.error = detail::error_text([&] {
        done_.chunks = write_snapshot(snap, partial);
        if (rank0 && user_given) {
          detail::fd_file f(partial / "user.bin", O_WRONLY | O_CREAT | O_TRUNC);
          f.write_all(user_copy.data(), user_copy.size());
          f.sync_and_close();
          done_.user = stored_bytes{"user.bin", 0, user_copy.size(), xxh3_hex(user_copy)};
        }
      });
      done_.finished.store(true, std::memory_order_release);
    });
    commit_ = [this, &group, dir, head = std::move(head)]() mutable { commit(group, dir, std::move(head)); };
  }

  struct written {
    std::atomic<bool> finished{false};
    std::string error;
    std::vector<written_chunk> chunks;
    std::optional<stored_bytes> user;
    void reset() {
      finished.store(false);
      error.clear();
      chunks.clear();
      user.reset();
    }
  };

  template <class Group>
  void commit(Group& g, const std::filesystem::path& dir, checkpoint_index head) {
    writer_.join();
    try {
      commit_written(g, dir, std::move(head));
    } catch (...) {
      // A save that failed leaves nothing behind: its DIR.partial would only fill the disk (a
      // killed save's is removed by the next save or ignored by load). Every rank has joined
      // its writer, so rank 0 removes it alone.
      if (g.rank() == 0) {
        std::error_code ec;
        std::filesystem::remove_all(partial_of(dir), ec);
      }
      throw;
    }
  }

  template <class Group>
  void commit_written(Group& g, const std::filesystem::path& dir, checkpoint_index head) {
    detail::agree(g, done_.error, "checkpoint save to " + dir.string());
    // Every rank's chunks (and rank 0's user bytes) to rank 0, which writes the index and commits.
    const std::string mine = chunks_to_text(done_.chunks);
    const auto all = g.all_gather_host(std::as_bytes(std::span(mine)));
    std::string err;
    if (g.rank() == 0)
      err = detail::error_text([&] {
        for (const auto& [name, p] : parameters_of(g)) {
          head.parameters[name].numel = p.numel;
          head.parameters[name].shape = p.shape;
        }
        for (const auto& bytes : all)
          for (auto& c : chunks_from_text(std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size())))
            head.parameters.at(c.parameter).chunks.push_back(std::move(c.where));
        for (auto& [name, p] : head.parameters)
          std::sort(p.chunks.begin(), p.chunks.end(), [](const chunk& a, const chunk& b) { return a.begin < b.begin; });
        head.user = done_.user;
        commit_directory(dir, index_to_text(head));
      });
    detail::agree(g, err, "checkpoint save to " + dir.string());
  }

  std::thread writer_;
  written done_;
  std::function<void()> commit_;
};

template <class Group, class Opt>
void save(Group& group, const std::filesystem::path& dir, Opt& opt, std::span<const std::byte> user) {
  async_saver s;
  // The host device's shards are this process's memory, unchanged until save returns: written
  // from where they are (snapshot.hpp). Other devices' are copied to the host first.
  s.start(group, dir, opt, user, std::is_same_v<typename Group::device_type, host_device>);
  s.wait();
}
template <class Group>
void save(Group& group, const std::filesystem::path& dir) {
  no_optimizer none;
  save(group, dir, none);
}

namespace detail {

struct staged_write {
  void* dst;
  std::vector<std::byte> bytes;
};

//! Checks the index against the group and the optimizer, then reads and checks every byte this
//! rank's slices need (whole chunks: a checksum covers a chunk). Writes nothing.
template <class Group, class Opt>
std::vector<staged_write> stage_load(Group& g, const std::filesystem::path& dir, const checkpoint_index& idx, Opt& opt) {
  using master = typename Group::master_type;
  const std::string index_name = (dir / "index.json").string();
  auto fail = [&](const std::string& what) { return error(errc::checkpoint, index_name + ": " + what); };
  const auto mine = parameters_of(g);
  for (const auto& [name, p] : mine) {
    const auto it = idx.parameters.find(name);
    if (it == idx.parameters.end()) throw fail("no parameter '" + name + "' in the checkpoint");
    if (it->second.numel != p.numel)
      throw fail("parameter '" + name + "' has " + std::to_string(it->second.numel) + " elements, the model " + std::to_string(p.numel));
    if (it->second.shape != p.shape)
      throw fail("parameter '" + name + "' has shape " + nlohmann::json(it->second.shape).dump() + ", the model " + nlohmann::json(p.shape).dump());
  }
  for (const auto& [name, p] : idx.parameters)
    if (!mine.count(name)) throw fail("parameter '" + name + "' is not in the model");
  if (idx.master != dtype_of<master>)
    throw fail("saved in " + std::string(safetensors_dtype(idx.master)) + ", the model's master dtype is " +
               std::string(safetensors_dtype(dtype_of<master>)));
  const auto want = state_names(opt, g.num_buckets());
  if (!std::is_same_v<Opt, no_optimizer> && idx.optimizer_states != want)
    throw fail("the optimizer state saved (" + nlohmann::json(idx.optimizer_states).dump() + ") is not this optimizer's (" +
               nlohmann::json(want).dump() + ")");

  std::vector<staged_write> out;
  for (const slice& s : slices_of(g)) {
    std::vector<std::pair<std::string, std::pair<void*, std::size_t>>> targets{
        {"param", {g.shard(s.bucket).params + s.shard_offset, sizeof(master)}}};
    for (const optimizer_state& st : s.frozen ? std::vector<optimizer_state>{} : opt.state(s.bucket))
      targets.push_back({std::string(st.name), {static_cast<char*>(st.data) + s.shard_offset * size_of(st.type), size_of(st.type)}});
    for (const auto& [key, target] : targets) {
      staged_write w{target.first, std::vector<std::byte>(s.numel * target.second)};
      read_elements(dir, s.name, idx.parameters.at(s.name), key, target.second, s.param_offset, w.bytes);
      out.push_back(std::move(w));
    }
  }
  return out;
}

}  // namespace detail

//! Collective: loads a checkpoint into a finalized group (any rank count, sharding, bucketing or
//! parameter precision) and into `opt` (built over the group), all or nothing on every rank.
//! `dir` may be a save killed between its two renames (its DIR.old is read). Returns the
//! engine's bytes saved with it (empty when none were).
template <class Group, class Opt>
std::vector<std::byte> load(Group& group, const std::filesystem::path& dir, Opt& opt) {
  std::vector<detail::staged_write> writes;
  checkpoint_index idx;
  std::vector<std::byte> user;
  const std::string err = detail::error_text([&] {
    const std::filesystem::path from = complete_checkpoint(dir);
    idx = read_index(from / "index.json");
    writes = detail::stage_load(group, from, idx, opt);
    if (idx.user) user = read_checked(from, *idx.user, "the engine's bytes (user.bin)");
  });
  detail::agree(group, err, "checkpoint load from " + dir.string());
  // Every rank read and checked everything: now write the shards and the step count.
  for (auto& w : writes)
    if (!w.bytes.empty()) group.device().copy_from_host(w.dst, w.bytes.data(), w.bytes.size());
  opt.set_steps(idx.optimizer_steps);
  return user;
}
template <class Group>
std::vector<std::byte> load(Group& group, const std::filesystem::path& dir) {
  no_optimizer none;
  return load(group, dir, none);
}

}  // namespace fsdp::checkpoint
