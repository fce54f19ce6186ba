#pragma once
//! \file fsdp::file_store: a key-value rendezvous through a directory that every rank can read
//! (local disk for one host, a shared file system for several). The NCCL backend uses it to
//! hand rank 0's ncclUniqueId to the other ranks when there is no MPI to broadcast it.
//!
//! A value is written atomically: to a temporary file in the same directory, then renamed over
//! the key's file, so a reader sees either no file or the whole value. Each file starts with a
//! 16-byte header (magic "FSDPST01", then the payload length as 8 little-endian bytes); a file
//! whose size disagrees with its header was not written by set() and is rejected.
//!
//!   fsdp::file_store store{"/tmp/run42"};
//!   if (rank == 0) store.set("nccl_id", bytes);
//!   else bytes = store.get("nccl_id", std::chrono::seconds(60));   // polls until written
//!
//! A directory left behind by a crashed run still holds its values: give each run a fresh
//! directory (or remove the keys), or later readers may pick up a stale value.
//! Host-only; needs no CUDA.

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <unistd.h>

#include "fsdp/core/error.hpp"

namespace fsdp {

//! Key-value store in a directory; values are small byte strings written once and read by
//! polling. Copies refer to the same directory. Thread- and process-safe through rename().
class file_store {
 public:
  //! The store in `directory`, created if missing. Throws fsdp::error(errc::invalid_argument)
  //! when it cannot be created.
  explicit file_store(std::filesystem::path directory) : dir_(std::move(directory)) {
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    if (ec || !std::filesystem::is_directory(dir_, ec))
      throw error(errc::invalid_argument, "file store: cannot create directory '" + dir_.string() + "': " +
                                              (ec ? ec.message() : std::string("not a directory")));
  }

  const std::filesystem::path& directory() const noexcept { return dir_; }
  //! The file holding `key`.
  std::filesystem::path path(std::string_view key) const { return dir_ / std::string(checked(key)); }

  //! Writes `value` under `key` atomically (replacing an older value).
  void set(std::string_view key, std::span<const std::byte> value) const {
    const std::filesystem::path final_path = path(key);
    std::filesystem::path tmp = final_path;
    tmp += ".tmp." + unique_suffix();
    std::FILE* f = std::fopen(tmp.c_str(), "wb");
    if (!f) throw io_error("cannot create", tmp);
    const auto header = make_header(value.size());
    bool ok = std::fwrite(header.data(), 1, header.size(), f) == header.size() &&
              (value.empty() || std::fwrite(value.data(), 1, value.size(), f) == value.size());
    ok = (std::fclose(f) == 0) && ok;
    if (!ok) {
      const int e = errno;
      std::filesystem::remove(tmp);
      errno = e;
      throw io_error("cannot write", tmp);
    }
    std::error_code ec;
    std::filesystem::rename(tmp, final_path, ec);
    if (ec) {
      std::filesystem::remove(tmp);
      throw error(errc::invalid_argument, "file store: cannot rename '" + tmp.string() + "' to '" +
                                              final_path.string() + "': " + ec.message());
    }
  }

  //! The value under `key`, polling every `poll_interval` until it is written. Throws
  //! fsdp::error(errc::timeout) naming the file after `timeout`, and errc::invalid_argument for
  //! a file that is truncated or was not written by set().
  std::vector<std::byte> get(std::string_view key, std::chrono::milliseconds timeout,
                             std::chrono::milliseconds poll_interval = std::chrono::milliseconds(10)) const {
    const std::filesystem::path p = path(key);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      if (auto v = try_read(p)) return std::move(*v);
      if (std::chrono::steady_clock::now() >= deadline)
        throw error(errc::timeout, "file store: '" + p.string() + "' was not written within " +
                                       std::to_string(timeout.count()) +
                                       " ms (is the writer, e.g. rank 0, running with the same store directory?)");
      std::this_thread::sleep_for(poll_interval);
    }
  }

  //! Removes `key`; returns whether it existed.
  bool remove(std::string_view key) const {
    std::error_code ec;
    return std::filesystem::remove(path(key), ec);
  }

 private:
  static constexpr std::array<char, 8> magic{'F', 'S', 'D', 'P', 'S', 'T', '0', '1'};
  static constexpr std::size_t header_bytes = 16;

  // Keys name files directly: keep them to one plain path component.
  static std::string_view checked(std::string_view key) {
    const bool ok = !key.empty() && key != "." && key != ".." && key.find_first_not_of(
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-") == std::string_view::npos;
    if (!ok)
      throw error(errc::invalid_argument, "file store: key '" + std::string(key) +
                                              "' must be non-empty and use only letters, digits, '.', '_', '-'");
    return key;
  }

  static std::array<unsigned char, header_bytes> make_header(std::uint64_t n) {
    std::array<unsigned char, header_bytes> h{};
    std::memcpy(h.data(), magic.data(), magic.size());
    for (int i = 0; i < 8; ++i) h[8 + static_cast<std::size_t>(i)] = static_cast<unsigned char>(n >> (8 * i));
    return h;
  }

  // Distinct per process, thread and call: concurrent writers never share a temporary file.
  static std::string unique_suffix() {
    static std::atomic<std::uint64_t> counter{0};
    return std::to_string(::getpid()) + "." + std::to_string(std::hash<std::thread::id>{}(std::this_thread::get_id())) +
           "." + std::to_string(counter++);
  }

  static error io_error(const char* what, const std::filesystem::path& p) {
    return error(errc::invalid_argument, std::string("file store: ") + what + " '" + p.string() + "': " + std::strerror(errno));
  }

  // The whole value, or nothing when the file does not exist yet.
  static std::optional<std::vector<std::byte>> try_read(const std::filesystem::path& p) {
    std::FILE* f = std::fopen(p.c_str(), "rb");
    if (!f) {
      if (errno == ENOENT) return std::nullopt;
      throw io_error("cannot open", p);
    }
    std::vector<unsigned char> raw;
    unsigned char chunk[4096];
    for (std::size_t n; (n = std::fread(chunk, 1, sizeof chunk, f)) > 0;) raw.insert(raw.end(), chunk, chunk + n);
    const bool read_error = std::ferror(f) != 0;
    std::fclose(f);
    if (read_error) throw io_error("cannot read", p);
    std::uint64_t n = 0;
    const bool has_header = raw.size() >= header_bytes && std::memcmp(raw.data(), magic.data(), magic.size()) == 0;
    if (has_header)
      for (int i = 0; i < 8; ++i) n |= std::uint64_t{raw[8 + static_cast<std::size_t>(i)]} << (8 * i);
    if (!has_header || raw.size() - header_bytes != n)
      throw error(errc::invalid_argument,
                  "file store: '" + p.string() + "' is truncated or was not written by fsdp::file_store (" +
                      std::to_string(raw.size()) + " bytes" +
                      (has_header ? ", header announces " + std::to_string(n) + " bytes of value" : ", no valid header") + ")");
    std::vector<std::byte> out(raw.size() - header_bytes);
    if (!out.empty()) std::memcpy(out.data(), raw.data() + header_bytes, out.size());
    return out;
  }

  std::filesystem::path dir_;
};

}  // namespace fsdp
