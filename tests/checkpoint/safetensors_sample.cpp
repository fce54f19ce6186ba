// safetensors_sample write FILE: the sample tests/checkpoint/interop.py checks with Python's
// safetensors package. safetensors_sample check FILE: checks the file interop.py wrote.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "fsdp/checkpoint/safetensors.hpp"

namespace ck = fsdp::checkpoint;

namespace {

int write(const char* file) {
  std::vector<float> w(6);
  for (int i = 0; i < 6; ++i) w[static_cast<std::size_t>(i)] = static_cast<float>(i) * 0.5f - 1.0f;
  std::vector<double> b(5);
  for (int i = 0; i < 5; ++i) b[static_cast<std::size_t>(i)] = i / 3.0;
  const std::int64_t step = 42;
  ck::safetensors_writer out{file,
                             {{"layer.0.w", fsdp::dtype::f32, {2, 3}}, {"layer.0.b", fsdp::dtype::f64, {5}}, {"step", fsdp::dtype::i64, {1}}},
                             {{"format", "fsdp-sample"}, {"ranks", "1"}}};
  out.write(std::as_bytes(std::span(w)));
  out.write(std::as_bytes(std::span(b)));
  out.write(std::as_bytes(std::span(&step, 1)));
  out.close();
  return 0;
}

template <class T>
std::vector<T> values(const ck::safetensors_header& h, const char* name) {
  const auto& e = h.at(name);
  std::vector<T> v(e.bytes / sizeof(T));
  ck::read_bytes(h.file, e.offset, std::as_writable_bytes(std::span(v)));
  return v;
}

int check(const char* file) {
  const auto h = ck::read_safetensors_header(file);
  const auto& x = h.at("x");
  const auto& n = h.at("n");
  bool ok = h.tensors.size() == 2 && h.metadata.at("by") == "python" && x.type == fsdp::dtype::f32 &&
            x.shape == std::vector<std::uint64_t>{3, 4} && n.type == fsdp::dtype::i32 && n.shape == std::vector<std::uint64_t>{2};
  const auto xv = values<float>(h, "x");
  for (std::size_t i = 0; i < xv.size(); ++i) ok = ok && xv[i] == static_cast<float>(i) * 0.25f;
  const auto nv = values<std::int32_t>(h, "n");
  ok = ok && nv == std::vector<std::int32_t>{7, -7};
  std::printf("%s: %s\n", file, ok ? "fsdp read every value" : "values differ");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: safetensors_sample write|check FILE\n");
    return 2;
  }
  try {
    return std::string(argv[1]) == "write" ? write(argv[2]) : check(argv[2]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "safetensors_sample: %s\n", e.what());
    return 1;
  }
}
