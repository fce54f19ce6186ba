// safetensors_sample write FILE: the sample tests/checkpoint/interop.py checks with Python's
// safetensors package. safetensors_sample check FILE: checks the file interop.py wrote.
// safetensors_sample export DIR: a model on 4 thread ranks (hybrid_shard(2), two buckets)
// exported by checkpoint::export_full as DIR/model_f32.safetensors and DIR/model_bf16.safetensors,
// and its parameters gathered one by one (shard_group::full_parameter) as raw f32 in
// DIR/reference.f32 with their names, sizes and (2-D ones) shapes in DIR/reference.txt, for
// export_check.py to compare.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "fsdp/checkpoint/full.hpp"
#include "fsdp/checkpoint/safetensors.hpp"
#include "fsdp/fsdp.hpp"

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

int export_model(const char* dir) {
  const std::filesystem::path d = dir;
  std::filesystem::create_directories(d);
  const std::vector<std::string> names{"embed.weight", "block.0.attn.weight", "block.0.attn.bias", "head.weight"};
  const std::vector<std::size_t> sizes{1000, 333, 17, 2049};
  fsdp::threads::world{4}.run([&](fsdp::threads::communicator& comm) {
    std::vector<std::unique_ptr<fsdp::buffer<float>>> ps;
    for (std::size_t p = 0; p < names.size(); ++p) ps.push_back(std::make_unique<fsdp::buffer<float>>(sizes[p], names[p]));
    ps[0] = std::make_unique<fsdp::buffer<float>>(std::vector<std::size_t>{40, 25}, names[0]);  // 2-D, as an embedding is
    fsdp::shard_group<fsdp::buffer<float>, fsdp::fixed_bytes> g{comm, {}, {.sharding = fsdp::hybrid_shard(2), .bucket = {.bytes = 6000}}};
    g.add_unit({ps[0].get()});
    g.add_unit({ps[1].get(), ps[2].get()});
    g.add_unit({ps[3].get()});
    // Values with more mantissa than bf16 keeps, of both signs, so rounding is exercised.
    g.finalize(fsdp::init::per_shard([](const fsdp::param_slice& s, std::span<float> v) {
      for (std::size_t i = 0; i < v.size(); ++i)
        v[i] = std::sin(0.37f * static_cast<float>(s.offset + i) + static_cast<float>(s.unit * 3 + s.index)) * 1.7f;
    }));
    fsdp::checkpoint::export_full(g, d / "model_f32.safetensors");
    fsdp::checkpoint::export_full(g, d / "model_bf16.safetensors", fsdp::dtype::bf16);
    std::vector<std::vector<float>> full;
    for (int u = 0; u < g.num_units(); ++u)
      for (int i = 0; i < (u == 1 ? 2 : 1); ++i) full.push_back(g.full_parameter(u, i));
    if (comm.rank() != 0) return;
    std::ofstream raw(d / "reference.f32", std::ios::binary), list(d / "reference.txt");
    for (std::size_t p = 0; p < names.size(); ++p) {
      raw.write(reinterpret_cast<const char*>(full[p].data()), static_cast<std::streamsize>(full[p].size() * sizeof(float)));
      list << names[p] << " " << full[p].size() << (p == 0 ? " 40 25" : "") << "\n";
    }
  });
  std::printf("%s: exported\n", dir);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: safetensors_sample write|check FILE | export DIR\n");
    return 2;
  }
  try {
    const std::string mode = argv[1];
    return mode == "write" ? write(argv[2]) : mode == "export" ? export_model(argv[2]) : check(argv[2]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "safetensors_sample: %s\n", e.what());
    return 1;
  }
}
