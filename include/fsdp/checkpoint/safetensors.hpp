#pragma once
//! \file The safetensors file format (huggingface/safetensors): an 8-byte little-endian header
//! length N, N bytes of JSON, then the tensors' bytes. The JSON maps each tensor's name to
//! {"dtype", "shape", "data_offsets": [begin, end]} (byte offsets in the data section, which the
//! tensors cover without gaps), and "__metadata__" to a string → string map. The header is
//! padded with spaces to a multiple of 8 bytes, as the reference writer does. Any safetensors
//! reader (Python's `safetensors` package, tests/checkpoint) reads what this writes.
//!
//! The writer streams: every tensor is declared up front (the header needs the offsets), then
//! the bytes are appended in declaration order, so a rank never holds more than it writes. The
//! JSON goes through nlohmann-json (a well-kept parser; see docs/design.md, Dependencies).
//! Every failure is an fsdp::error(errc::checkpoint) naming the file.
//!
//!   fsdp::checkpoint::safetensors_writer out{"w.safetensors", {{"w", fsdp::dtype::f32, {2, 3}}}};
//!   out.write(std::as_bytes(std::span(values)));   // 24 bytes
//!   out.close();                                   // flushed and fsync'ed
//!   auto h = fsdp::checkpoint::read_safetensors_header("w.safetensors");
//!   h.at("w").shape;                               // {2, 3}

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp::checkpoint {

//! The dtype names of the safetensors format ("F32", "BF16", ...).
constexpr std::string_view safetensors_dtype(dtype t) noexcept {
  switch (t) {
    case dtype::f32: return "F32";
    case dtype::bf16: return "BF16";
    case dtype::f16: return "F16";
    case dtype::f64: return "F64";
    case dtype::i32: return "I32";
    case dtype::i64: return "I64";
    case dtype::u8: return "U8";
  }
  return "?";
}
inline std::optional<dtype> dtype_from_safetensors(std::string_view s) noexcept {
  for (dtype t : {dtype::f32, dtype::bf16, dtype::f16, dtype::f64, dtype::i32, dtype::i64, dtype::u8})
    if (safetensors_dtype(t) == s) return t;
  return std::nullopt;
}

//! A tensor to write: its bytes are numel(shape) * size_of(type).
struct tensor_decl {
  std::string name;
  dtype type = dtype::f32;
  std::vector<std::uint64_t> shape;
  std::uint64_t numel() const noexcept {
    std::uint64_t n = 1;
    for (std::uint64_t d : shape) n *= d;
    return n;
  }
  std::uint64_t bytes() const noexcept { return numel() * size_of(type); }
};

//! A tensor of a file read back: where its bytes lie, from the start of the file.
struct tensor_entry {
  std::string name;
  dtype type = dtype::f32;
  std::vector<std::uint64_t> shape;
  std::uint64_t offset = 0;  //!< in the file (header included)
  std::uint64_t bytes = 0;
};

//! A safetensors file's header, read back.
struct safetensors_header {
  std::filesystem::path file;
  std::vector<tensor_entry> tensors;  //!< in the order of their bytes
  std::map<std::string, std::string> metadata;
  std::uint64_t file_bytes = 0;

  //! The tensor called `name`, or errc::checkpoint naming the file and the tensor.
  const tensor_entry& at(std::string_view name) const {
    for (const auto& t : tensors)
      if (t.name == name) return t;
    throw error(errc::checkpoint, file.string() + ": no tensor '" + std::string(name) + "'");
  }
};

namespace detail {

inline error file_error(const std::filesystem::path& p, const std::string& what, int err = 0) {
  return error(errc::checkpoint, p.string() + ": " + what + (err ? ": " + std::generic_category().message(err) : std::string{}));
}

//! A file descriptor that closes itself; every write is checked.
class fd_file {
 public:
  fd_file(const std::filesystem::path& p, int flags) : path_(p), fd_(::open(p.c_str(), flags | O_CLOEXEC, 0644)) {
    if (fd_ < 0) throw file_error(p, (flags & O_WRONLY) ? "cannot open for writing" : "cannot open", errno);
  }
  fd_file(const fd_file&) = delete;
  fd_file& operator=(const fd_file&) = delete;
  ~fd_file() {
    if (fd_ >= 0) ::close(fd_);
  }
  void write_all(const void* data, std::size_t n) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t k = ::write(fd_, p, n);
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) throw file_error(path_, "write failed", k < 0 ? errno : ENOSPC);
      p += k;
      n -= static_cast<std::size_t>(k);
    }
  }
  //! Reads exactly n bytes at `offset`, or errc::checkpoint ("truncated") when the file ends first.
  void read_at(void* data, std::size_t n, std::uint64_t offset) const {
    char* p = static_cast<char*>(data);
    while (n > 0) {
      const ssize_t k = ::pread(fd_, p, n, static_cast<off_t>(offset));
      if (k < 0 && errno == EINTR) continue;
      if (k < 0) throw file_error(path_, "read failed", errno);
      if (k == 0) throw file_error(path_, "truncated (ends before byte " + std::to_string(offset + n) + ")");
      p += k;
      n -= static_cast<std::size_t>(k);
      offset += static_cast<std::uint64_t>(k);
    }
  }
  void sync_and_close() {
    if (::fsync(fd_) != 0) throw file_error(path_, "fsync failed", errno);
    const int fd = std::exchange(fd_, -1);
    if (::close(fd) != 0) throw file_error(path_, "close failed", errno);
  }
  std::uint64_t size() const {
    const off_t end = ::lseek(fd_, 0, SEEK_END);
    if (end < 0) throw file_error(path_, "cannot size", errno);
    return static_cast<std::uint64_t>(end);
  }

 private:
  std::filesystem::path path_;
  int fd_ = -1;
};

}  // namespace detail

//! Writes one safetensors file: the header at construction, then the declared tensors' bytes in
//! declaration order through write(), then close() (checks the count, flushes and fsyncs).
class safetensors_writer {
 public:
  safetensors_writer(std::filesystem::path path, std::vector<tensor_decl> tensors,
                     const std::map<std::string, std::string>& metadata = {})
      : path_(std::move(path)), file_(path_, O_WRONLY | O_CREAT | O_TRUNC) {
    nlohmann::ordered_json header = nlohmann::ordered_json::object();
    if (!metadata.empty()) header["__metadata__"] = metadata;
    for (const auto& t : tensors) {
      if (t.name.empty() || t.name == "__metadata__" || header.contains(t.name))
        throw detail::file_error(path_, "tensor name '" + t.name + "' is empty, reserved or used twice");
      header[t.name] = {{"dtype", safetensors_dtype(t.type)}, {"shape", t.shape}, {"data_offsets", {total_, total_ + t.bytes()}}};
      total_ += t.bytes();
    }
    std::string text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' ');
    const std::uint64_t n = text.size();
    unsigned char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
    file_.write_all(len, 8);
    file_.write_all(text.data(), text.size());
    data_start_ = 8 + n;
  }
  //! Where the data section starts in the file: a tensor's bytes lie at data_start() plus its
  //! first data offset.
  std::uint64_t data_start() const noexcept { return data_start_; }

  //! Appends the next bytes of the data section.
  void write(std::span<const std::byte> bytes) {
    if (written_ + bytes.size() > total_)
      throw detail::file_error(path_, "more bytes written than the " + std::to_string(total_) + " declared");
    file_.write_all(bytes.data(), bytes.size());
    written_ += bytes.size();
  }

  void close() {
    if (written_ != total_)
      throw detail::file_error(path_, std::to_string(written_) + " bytes written, " + std::to_string(total_) + " declared");
    file_.sync_and_close();
  }

 private:
  std::filesystem::path path_;
  detail::fd_file file_;
  std::uint64_t total_ = 0, written_ = 0, data_start_ = 0;
};

//! Reads and checks a safetensors header: the length, the JSON, each entry's dtype, shape and
//! offsets (inside the file, matching the shape, covering the data section without gaps).
inline safetensors_header read_safetensors_header(const std::filesystem::path& path) {
  const detail::fd_file f(path, O_RDONLY);
  safetensors_header h;
  h.file = path;
  h.file_bytes = f.size();
  unsigned char len[8];
  f.read_at(len, 8, 0);
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<std::uint64_t>(len[i]) << (8 * i);
  if (n > h.file_bytes - 8 || n > (std::uint64_t{100} << 20))
    throw detail::file_error(path, "not a safetensors file (header length " + std::to_string(n) + " in a file of " +
                                       std::to_string(h.file_bytes) + " bytes)");
  std::string text(n, '\0');
  f.read_at(text.data(), n, 8);
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) throw detail::file_error(path, "the header is not a JSON object");
  const std::uint64_t data_start = 8 + n;
  std::uint64_t expect = 0;
  std::vector<std::pair<std::uint64_t, tensor_entry>> by_offset;
  try {
    for (const auto& [name, v] : j.items()) {
      if (name == "__metadata__") {
        for (const auto& [k, s] : v.items()) h.metadata[k] = s.get<std::string>();
        continue;
      }
      tensor_entry e;
      e.name = name;
      const auto t = dtype_from_safetensors(v.at("dtype").get<std::string>());
      if (!t) throw detail::file_error(path, "tensor '" + name + "': unknown dtype " + v.at("dtype").dump());
      e.type = *t;
      e.shape = v.at("shape").get<std::vector<std::uint64_t>>();
      const auto off = v.at("data_offsets").get<std::vector<std::uint64_t>>();
      std::uint64_t numel = 1;
      for (std::uint64_t d : e.shape) numel *= d;
      if (off.size() != 2 || off[1] < off[0] || off[1] - off[0] != numel * size_of(e.type))
        throw detail::file_error(path, "tensor '" + name + "': data_offsets " + v.at("data_offsets").dump() +
                                           " do not hold its shape and dtype");
      e.offset = data_start + off[0];
      e.bytes = off[1] - off[0];
      by_offset.emplace_back(off[0], std::move(e));
    }
  } catch (const nlohmann::json::exception& x) {
    throw detail::file_error(path, std::string("malformed header: ") + x.what());
  }
  std::sort(by_offset.begin(), by_offset.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (auto& [off, e] : by_offset) {
    if (off != expect) throw detail::file_error(path, "tensor '" + e.name + "' does not start where the previous one ends");
    expect += e.bytes;
    h.tensors.push_back(std::move(e));
  }
  if (data_start + expect != h.file_bytes)
    throw detail::file_error(path, "truncated or padded: the header describes " + std::to_string(data_start + expect) +
                                       " bytes, the file has " + std::to_string(h.file_bytes));
  return h;
}

//! Reads `out.size()` bytes at `offset` of the file (errc::checkpoint if it is shorter).
inline void read_bytes(const std::filesystem::path& path, std::uint64_t offset, std::span<std::byte> out) {
  const detail::fd_file f(path, O_RDONLY);
  f.read_at(out.data(), out.size(), offset);
}

}  // namespace fsdp::checkpoint
