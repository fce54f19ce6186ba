// The safetensors format (checkpoint/safetensors.hpp): what fsdp writes reads back exactly, and
// every broken file is an errc::checkpoint naming the file and what is wrong. (That other
// readers read it: checkpoint.python_interop.)
#include <doctest/doctest.h>

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <vector>

#include "common/catch_error.hpp"
#include "fsdp/checkpoint/safetensors.hpp"

namespace {

using fsdp_test::checkpoint_error;

namespace ck = fsdp::checkpoint;
namespace fs = std::filesystem;

// Per process: two test runs on one machine must not share files.
fs::path temp(const std::string& name) { return fs::temp_directory_path() / ("fsdp_test_" + std::to_string(::getpid()) + "_" + name); }

// Two tensors: w (f32, 2x3) = 0..5 * 0.25, n (i64, [2]) = {-1, 1 << 40}.
fs::path write_sample(const std::string& name) {
  const fs::path p = temp(name);
  std::vector<float> w{0, 0.25f, 0.5f, 0.75f, 1, 1.25f};
  std::vector<std::int64_t> n{-1, std::int64_t{1} << 40};
  ck::safetensors_writer out{p, {{"w", fsdp::dtype::f32, {2, 3}}, {"n", fsdp::dtype::i64, {2}}}, {{"k", "v"}}};
  out.write(std::as_bytes(std::span(w)));
  out.write(std::as_bytes(std::span(n)));
  out.close();
  return p;
}

std::string bytes_of(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}
void put(const fs::path& p, const std::string& s) { std::ofstream(p, std::ios::binary) << s; }


}  // namespace

TEST_CASE("safetensors: what the writer wrote reads back exactly, header 8-byte aligned") {
  const fs::path p = write_sample("roundtrip.safetensors");
  const auto h = ck::read_safetensors_header(p);
  REQUIRE(h.tensors.size() == 2);
  CHECK(h.metadata.at("k") == "v");
  const auto& w = h.at("w");
  CHECK(w.type == fsdp::dtype::f32);
  CHECK(w.shape == std::vector<std::uint64_t>{2, 3});
  CHECK(w.bytes == 24);
  CHECK(w.offset % 8 == 0);  // 8 + the padded header
  std::vector<float> wv(6);
  ck::read_bytes(p, w.offset, std::as_writable_bytes(std::span(wv)));
  CHECK(wv == std::vector<float>{0, 0.25f, 0.5f, 0.75f, 1, 1.25f});
  const auto& n = h.at("n");
  CHECK(n.offset == w.offset + 24);
  std::vector<std::int64_t> nv(2);
  ck::read_bytes(p, n.offset, std::as_writable_bytes(std::span(nv)));
  CHECK(nv == std::vector<std::int64_t>{-1, std::int64_t{1} << 40});
  CHECK(checkpoint_error([&] { (void)h.at("nope"); }).find("no tensor 'nope'") != std::string::npos);
  fs::remove(p);
}

TEST_CASE("safetensors: broken files are refused by name") {
  const fs::path good = write_sample("good.safetensors");
  const std::string bytes = bytes_of(good);
  const fs::path bad = temp("bad.safetensors");

  put(bad, bytes.substr(0, bytes.size() - 3));  // truncated data
  CHECK(checkpoint_error([&] { ck::read_safetensors_header(bad); }).find("truncated or padded") != std::string::npos);
  CHECK(checkpoint_error([&] { ck::read_safetensors_header(bad); }).find(bad.string()) != std::string::npos);

  put(bad, bytes.substr(0, 5));  // not even a header length
  CHECK(checkpoint_error([&] { ck::read_safetensors_header(bad); }).find("truncated") != std::string::npos);

  std::string huge = bytes;
  huge[7] = '\x7f';  // a header length beyond the file
  put(bad, huge);
  CHECK(checkpoint_error([&] { ck::read_safetensors_header(bad); }).find("not a safetensors file") != std::string::npos);

  std::string not_json = bytes;
  not_json[8] = '[';  // the JSON no longer parses as an object
  put(bad, not_json);
  CHECK(checkpoint_error([&] { ck::read_safetensors_header(bad); }).find("not a JSON object") != std::string::npos);

  std::string shape = bytes;
  const auto at = shape.find("[2,3]");
  REQUIRE(at != std::string::npos);
  shape[at + 3] = '4';  // shape 2x4 no longer fits its 24 bytes
  put(bad, shape);
  CHECK(checkpoint_error([&] { ck::read_safetensors_header(bad); }).find("tensor 'w': data_offsets") != std::string::npos);

  std::string shape_text = bytes;
  shape_text.replace(at, 5, "\"2,3\"");  // the shape a string, of the same length: JSON of the wrong type
  put(bad, shape_text);
  CHECK(checkpoint_error([&] { ck::read_safetensors_header(bad); }).find("malformed header: ") != std::string::npos);

  std::string dtype = bytes;
  dtype.replace(dtype.find("\"F32\""), 5, "\"Q32\"");
  put(bad, dtype);
  CHECK(checkpoint_error([&] { ck::read_safetensors_header(bad); }).find("unknown dtype \"Q32\"") != std::string::npos);

  std::vector<std::byte> past(8);
  CHECK(checkpoint_error([&] { ck::read_bytes(good, bytes.size() - 4, past); }).find("truncated") != std::string::npos);
  CHECK(checkpoint_error([&] { ck::read_safetensors_header(temp("missing.safetensors")); }).find("cannot open") != std::string::npos);
  fs::remove(good);
  fs::remove(bad);
}

TEST_CASE("safetensors: the writer refuses bad names, too many or too few bytes, an unwritable path") {
  const fs::path p = temp("writer.safetensors");
  CHECK(checkpoint_error([&] { ck::safetensors_writer{p, {{"a", fsdp::dtype::f32, {1}}, {"a", fsdp::dtype::f32, {1}}}}; })
            .find("'a' is empty, reserved or used twice") != std::string::npos);
  CHECK(checkpoint_error([&] { ck::safetensors_writer{p, {{"__metadata__", fsdp::dtype::f32, {1}}}}; }).find("reserved") !=
        std::string::npos);
  {
    ck::safetensors_writer out{p, {{"a", fsdp::dtype::f32, {2}}}};
    const float x[3] = {1, 2, 3};
    CHECK(checkpoint_error([&] { out.write(std::as_bytes(std::span(x))); }).find("more bytes written than the 8 declared") !=
          std::string::npos);
    out.write(std::as_bytes(std::span(x, 1)));
    CHECK(checkpoint_error([&] { out.close(); }).find("4 bytes written, 8 declared") != std::string::npos);
  }
  CHECK(checkpoint_error([&] { ck::safetensors_writer{"/nonexistent/dir/x.safetensors", {}}; }).find("cannot open for writing") !=
        std::string::npos);
  fs::remove(p);
}
