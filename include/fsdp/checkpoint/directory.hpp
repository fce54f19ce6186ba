#pragma once
//! \file How a checkpoint directory becomes complete, atomically, and how one is found.
//!
//!   1. rank 0 makes DIR.partial/ (an unfinished one left there by a killed save is removed);
//!   2. every rank writes its files into it and fsyncs them;
//!   3. after a collective (every rank's files are on disk), rank 0 writes index.json, fsyncs
//!      it and the directory, moves an older DIR aside to DIR.old, renames DIR.partial to DIR
//!      (the commit: one rename(2), atomic on POSIX file systems), fsyncs the parent and removes
//!      DIR.old.
//!
//! A save killed at any point therefore leaves either the old DIR (complete), or DIR.old
//! (complete, between the two renames: latest() and load name it), and perhaps a
//! DIR.partial that is never loaded. A directory is complete when it has an index.json.

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <optional>
#include <string>
#include <system_error>

#include "fsdp/checkpoint/safetensors.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp::checkpoint {

namespace fs = std::filesystem;

inline fs::path partial_of(const fs::path& dir) { return dir.string() + ".partial"; }
inline fs::path old_of(const fs::path& dir) { return dir.string() + ".old"; }
inline bool is_complete(const fs::path& dir) { return fs::is_regular_file(dir / "index.json"); }

namespace detail {
//! fsync of a directory: its entries (a new file, a rename) survive a crash.
inline void sync_dir(const fs::path& d) {
  const int fd = ::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw file_error(d, "cannot open the directory", errno);
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) throw file_error(d, "fsync failed", errno);
}
inline fs::path parent_or_here(const fs::path& dir) { return dir.has_parent_path() ? dir.parent_path() : fs::path("."); }
}  // namespace detail

//! Step 1 (rank 0): an empty DIR.partial/, or errc::checkpoint naming why it cannot be made
//! (an unwritable parent, a file in the way).
inline void begin_directory(const fs::path& dir) {
  const fs::path partial = partial_of(dir);
  std::error_code ec;
  if (fs::exists(partial, ec)) fs::remove_all(partial, ec);
  if (ec) throw error(errc::checkpoint, partial.string() + ": cannot remove an unfinished save: " + ec.message());
  fs::create_directories(partial, ec);
  if (ec) throw error(errc::checkpoint, partial.string() + ": cannot create the directory: " + ec.message());
  if (::access(partial.c_str(), W_OK) != 0) throw detail::file_error(partial, "cannot write into the directory", errno);
}

//! Step 3 (rank 0, after every rank's files are on disk): writes index.json and commits.
inline void commit_directory(const fs::path& dir, const std::string& index_text) {
  const fs::path partial = partial_of(dir);
  detail::fd_file f(partial / "index.json", O_WRONLY | O_CREAT | O_TRUNC);
  f.write_all(index_text.data(), index_text.size());
  f.sync_and_close();
  detail::sync_dir(partial);
  std::error_code ec;
  fs::remove_all(old_of(dir), ec);
  if (fs::exists(dir)) fs::rename(dir, old_of(dir), ec);
  if (!ec) fs::rename(partial, dir, ec);
  if (ec) throw error(errc::checkpoint, dir.string() + ": cannot move the finished save into place: " + ec.message());
  detail::sync_dir(detail::parent_or_here(dir));
  fs::remove_all(old_of(dir), ec);
}

//! The checkpoint a load of `dir` reads: DIR when complete, else DIR.old when a save was killed
//! between its two renames; else errc::checkpoint saying what is there instead.
inline fs::path complete_checkpoint(const fs::path& dir) {
  if (is_complete(dir)) return dir;
  if (!fs::exists(dir) && is_complete(old_of(dir))) return old_of(dir);
  const bool partial = fs::exists(partial_of(dir));
  throw error(errc::checkpoint, dir.string() + ": no complete checkpoint (no index.json)" +
                                    (partial ? "; " + partial_of(dir).string() + " is a save that did not finish" : std::string{}));
}

//! The latest complete checkpoint among `parent`'s subdirectories named prefix + digits (the
//! greatest number; "step_00000040" and its ".old" twin), or nullopt when there is none.
inline std::optional<fs::path> latest(const fs::path& parent, const std::string& prefix = "step_") {
  std::optional<fs::path> best;
  long best_n = -1;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(parent, ec)) {
    std::string name = e.path().filename().string();
    if (name.ends_with(".old")) name.resize(name.size() - 4);
    if (!name.starts_with(prefix) || name.size() == prefix.size()) continue;
    const std::string digits = name.substr(prefix.size());
    if (digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 18) continue;
    const long n = std::stol(digits);
    if (n > best_n && is_complete(e.path())) {
      best_n = n;
      best = e.path();
    }
  }
  return best;
}

}  // namespace fsdp::checkpoint
