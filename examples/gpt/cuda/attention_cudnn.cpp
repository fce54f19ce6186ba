// gpt/cuda/attention_cudnn.cpp: gpt::cuda::cudnn_attention (attention_cudnn.hpp) over cuDNN's
// frontend graph API: one SDPA graph forward (with the softmax statistics as an output) and one
// backward per batch size, built on first use and cached. Host code only (the kernels are
// cuDNN's), compiled by the host compiler; GPT_CUDNN=1 where CMake found the frontend and cudnn.h.
//
// cuDNN is loaded with dlopen when the first object is made (the frontend's dynamic loading:
// NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING, every cuDNN call through dlsym on the handle set
// here), so that train_gpt_cuda starts, and runs --attention plain, where cuDNN is absent.

#include "gpt/cuda/attention_cudnn.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fsdp/core/error.hpp>

#ifndef GPT_CUDNN
#define GPT_CUDNN 0
#endif

#if GPT_CUDNN
#include <dlfcn.h>

// JSON (the frontend's serialisation of graphs) is not used: leaving out its bundled
// nlohmann-json keeps this file's compile time down and its copy out of the program.
#define CUDNN_FRONTEND_SKIP_JSON_LIB
#define NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING
#include <cudnn_frontend.h>

namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;  // the frontend's calls into cuDNN resolve against this handle
}
#endif

namespace gpt::cuda {

bool cudnn_built() noexcept { return GPT_CUDNN != 0; }

// The frontend loads a cudart of its own (for device queries while it validates), the first of
// libcudart.so.12 and .so.13 it finds: where both are on the path (a CUDA 12 package beside CUDA
// 13), it would take 12. This program's runtime major, where that one loads. setenv is not safe
// beside other threads' getenv, hence once, before the ranks' threads start.
void choose_cudnn_cudart() {
#if GPT_CUDNN
  static std::once_flag once;
  std::call_once(once, [] {
    const std::string cudart = "libcudart.so." + std::to_string(CUDART_VERSION / 1000);
    if (std::getenv("CUDNN_FRONTEND_CUDART_LIB_NAME")) return;
    if (void* rt = dlopen(cudart.c_str(), RTLD_NOW)) {
      setenv("CUDNN_FRONTEND_CUDART_LIB_NAME", cudart.c_str(), 0);
      dlclose(rt);
    }
  });
#endif
}

namespace {
// The door, with or without cuDNN in the build: a shape cuDNN's fused attention does not take.
void check_shape(int T, int C, int H) {
  const int hs = H > 0 ? C / H : 0;
  // The backward's bounds in frontend 1.32 (node/scaled_dot_product_flash_attention.h): head
  // sizes up to 256 on Hopper, and on Blackwell with cuDNN 9.23 on (128 on other GPUs, where
  // building the graph refuses more), and more than one token.
  if (T < 2 || H < 1 || C % H != 0 || hs < 8 || hs % 8 != 0 || hs > 256)
    throw fsdp::error(fsdp::errc::invalid_argument, "cuDNN: attention of " + std::to_string(H) + " heads over width " + std::to_string(C) +
                                                        " (head size " + std::to_string(hs) + ") and " + std::to_string(T) +
                                                        " tokens: cuDNN's fused attention needs a head size that is a multiple of 8, "
                                                        "at most 256, and at least 2 tokens");
}
}  // namespace

#if GPT_CUDNN
namespace {

namespace fe = cudnn_frontend;

[[noreturn]] void fail(fsdp::errc code, const std::string& what) { throw fsdp::error(code, "cuDNN: " + what); }

// A frontend call's failure: `code` says whose (a graph cuDNN does not take: invalid_argument;
// an execution: internal).
void check(fe::error_t e, const char* what, fsdp::errc code) {
  if (e.is_bad()) fail(code, std::string(what) + ": " + e.get_message());
}
// The frontend also throws (a symbol missing from the cuDNN loaded, cudart not loadable, no
// engine for a graph): as fsdp::error, naming what was being done.
template <class F>
decltype(auto) translated(const char* what, F f) {
  try {
    return f();
  } catch (const fsdp::error&) {
    throw;
  } catch (const std::exception& e) {
    fail(fsdp::errc::internal, std::string(what) + ": " + e.what());
  }
}

// libcudnn.so.9, once per process, from the dynamic loader's path (the CUDA toolkit's lib64, or
// PyPI's nvidia-cudnn-cu13 lib folder on LD_LIBRARY_PATH).
void load_cudnn() {
  static std::once_flag once;
  static std::string error;
  std::call_once(once, [] {
    void* h = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_GLOBAL);
    if (!h) {
      const char* why = dlerror();
      error = "cannot load libcudnn.so.9 (" + std::string(why ? why : "no reason given") +
              "); install cuDNN 9 (the CUDA toolkit's, or PyPI's nvidia-cudnn-cu13 with its lib folder on LD_LIBRARY_PATH), "
              "or run --attention plain";
      return;
    }
    fe::cudnn_dlhandle = h;
  });
  choose_cudnn_cudart();  // a no-op after train()'s call
  if (!error.empty()) fail(fsdp::errc::no_device, error);
}

// Tensor uids in the variant packs.
enum uid : std::int64_t { q_uid = 1, k_uid, v_uid, o_uid, stats_uid, do_uid, dq_uid, dk_uid, dv_uid };

}  // namespace

struct cudnn_attention::impl {
  struct graphs {
    std::shared_ptr<fe::graph::Graph> forward, backward;
    std::size_t workspace = 0;
  };
  cudnnHandle_t handle = nullptr;
  int T, C, H, hs;
  bool deterministic;
  std::map<int, graphs> by_batch;

  impl(cudaStream_t stream, int t, int c, int h, bool det) : T(t), C(c), H(h), hs(c / h), deterministic(det) {  // check_shape ran first
    load_cudnn();
    if (const cudnnStatus_t s = fe::detail::create_handle(&handle); s != CUDNN_STATUS_SUCCESS)
      fail(fsdp::errc::no_device, std::string("cudnnCreate failed: ") + fe::detail::get_error_string(s) + " (no usable GPU?)");
    if (const cudnnStatus_t s = fe::detail::set_stream(handle, stream); s != CUDNN_STATUS_SUCCESS) {
      (void)fe::detail::destroy_handle(handle);
      fail(fsdp::errc::internal, std::string("cudnnSetStream failed: ") + fe::detail::get_error_string(s));
    }
  }
  ~impl() {
    by_batch.clear();  // the plans before the handle they were built with
    if (handle) (void)fe::detail::destroy_handle(handle);
  }

  // q, k and v read out of qkv [B][T][3][H][hs] (their base pointers differ by C): dims (b, h,
  // t, d), strides (T 3C, hs, 3C, 1). out and dout are [B][T][H][hs]: strides (T C, hs, C, 1).
  std::vector<std::int64_t> dims(int B) const { return {B, H, T, hs}; }
  std::vector<std::int64_t> qkv_strides() const { return {std::int64_t{T} * 3 * C, hs, 3 * C, 1}; }
  std::vector<std::int64_t> row_strides() const { return {std::int64_t{T} * C, hs, C, 1}; }
  std::vector<std::int64_t> stats_dims(int B) const { return {B, H, T, 1}; }
  std::vector<std::int64_t> stats_strides() const { return {std::int64_t{H} * T, T, 1, 1}; }
  float scale() const { return 1.0f / std::sqrt(static_cast<float>(hs)); }

  std::shared_ptr<fe::graph::Graph> new_graph() const {
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(fe::DataType_t::BFLOAT16).set_intermediate_data_type(fe::DataType_t::FLOAT).set_compute_data_type(fe::DataType_t::FLOAT);
    return g;
  }
  std::shared_ptr<fe::graph::Tensor_attributes> input(fe::graph::Graph& g, const char* name, std::int64_t id, std::vector<std::int64_t> d,
                                                       std::vector<std::int64_t> s) const {
    return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(id).set_dim(std::move(d)).set_stride(std::move(s)));
  }
  std::size_t finish(fe::graph::Graph& g, const char* what) const {
    return translated(what, [&] {
      constexpr auto bad = fsdp::errc::invalid_argument;
      check(g.validate(), what, bad);
      check(g.build_operation_graph(handle), what, bad);
      // Heuristic A's engines, then the fallback list's where A has none for a shape (the tests'
      // small ones: llm.c never ran below T = 64).
      check(g.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}), what, bad);
      check(g.check_support(handle), what, bad);
      check(g.build_plans(handle), what, bad);
      std::int64_t bytes = 0;
      check(g.get_workspace_size(bytes), what, bad);
      return static_cast<std::size_t>(bytes);
    });
  }

  graphs& of(int B) {
    if (B < 1) fail(fsdp::errc::invalid_argument, "batch " + std::to_string(B) + " < 1");
    if (auto it = by_batch.find(B); it != by_batch.end()) return it->second;
    graphs made;
    {
      auto g = new_graph();
      auto q = input(*g, "q", q_uid, dims(B), qkv_strides()), k = input(*g, "k", k_uid, dims(B), qkv_strides()),
           v = input(*g, "v", v_uid, dims(B), qkv_strides());
      auto options = fe::graph::SDPA_attributes().set_name("attention").set_generate_stats(true).set_causal_mask(true).set_attn_scale(scale());
      auto [o, stats] = g->sdpa(q, k, v, options);
      o->set_output(true).set_uid(o_uid).set_dim(dims(B)).set_stride(row_strides());
      stats->set_output(true).set_uid(stats_uid).set_data_type(fe::DataType_t::FLOAT).set_dim(stats_dims(B)).set_stride(stats_strides());
      made.workspace = finish(*g, "building the attention forward graph");
      made.forward = std::move(g);
    }
    {
      auto g = new_graph();
      auto q = input(*g, "q", q_uid, dims(B), qkv_strides()), k = input(*g, "k", k_uid, dims(B), qkv_strides()),
           v = input(*g, "v", v_uid, dims(B), qkv_strides()), o = input(*g, "o", o_uid, dims(B), row_strides()),
           dout = input(*g, "dout", do_uid, dims(B), row_strides());
      auto stats = input(*g, "stats", stats_uid, stats_dims(B), stats_strides());
      stats->set_data_type(fe::DataType_t::FLOAT);
      // Deterministic by default: two runs give the same bits, as every other kernel of the model (a
      // dQ summed without atomics across the key blocks; llm.c asks for the same). Its price
      // (frontend 1.32, node/scaled_dot_product_flash_attention.h): the backward goes through a dP
      // workspace of bf16 B x H x T x T (T rounded up to 64), 192 MiB at 8 sequences of
      // GPT-2-small's shape, one workspace for every layer (a scratch, not an activation); only on
      // Hopper with cuDNN 9.25 or later, and CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT set below that,
      // does it take a path with a workspace linear in T. What it costs in time against the
      // atomics is gpu-check.sh's ab variant to measure.
      auto options = fe::graph::SDPA_backward_attributes()
                         .set_name("attention_backward")
                         .set_causal_mask(true)
                         .set_attn_scale(scale())
                         .set_deterministic_algorithm(deterministic);
      auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dout, stats, options);
      dq->set_output(true).set_uid(dq_uid).set_dim(dims(B)).set_stride(qkv_strides());
      dk->set_output(true).set_uid(dk_uid).set_dim(dims(B)).set_stride(qkv_strides());
      dv->set_output(true).set_uid(dv_uid).set_dim(dims(B)).set_stride(qkv_strides());
      made.workspace = std::max(made.workspace, finish(*g, "building the attention backward graph"));
      made.backward = std::move(g);
    }
    return by_batch.emplace(B, std::move(made)).first->second;
  }

  void run(const fe::graph::Graph& g, std::unordered_map<std::int64_t, void*>& pack, void* workspace, std::size_t have,
           std::size_t need, const char* what) const {
    if (have < need)
      fail(fsdp::errc::invalid_argument, std::string(what) + ": a workspace of " + std::to_string(have) + " bytes, the graph needs " +
                                             std::to_string(need));
    translated(what, [&] { check(g.execute(handle, pack, workspace), what, fsdp::errc::internal); });
  }
};

cudnn_attention::cudnn_attention(cudaStream_t stream, int T, int C, int H, bool deterministic) {
  check_shape(T, C, H);
  impl_ = std::make_unique<impl>(stream, T, C, H, deterministic);
}
cudnn_attention::~cudnn_attention() = default;

std::size_t cudnn_attention::workspace_bytes(int B) { return impl_->of(B).workspace; }

void cudnn_attention::forward(fsdp::bf16* out, float* stats, const fsdp::bf16* qkv, int B, void* workspace, std::size_t workspace_size) {
  auto& g = impl_->of(B);
  auto* base = const_cast<fsdp::bf16*>(qkv);  // the variant pack takes void*; cuDNN only reads inputs
  std::unordered_map<std::int64_t, void*> pack{
      {q_uid, base}, {k_uid, base + impl_->C}, {v_uid, base + 2 * impl_->C}, {o_uid, out}, {stats_uid, stats}};
  impl_->run(*g.forward, pack, workspace, workspace_size, g.workspace, "attention forward");
}

void cudnn_attention::backward(fsdp::bf16* dqkv, const fsdp::bf16* dout, const fsdp::bf16* out, const float* stats,
                               const fsdp::bf16* qkv, int B, void* workspace, std::size_t workspace_size) {
  auto& g = impl_->of(B);
  auto* base = const_cast<fsdp::bf16*>(qkv);
  const int C = impl_->C;
  std::unordered_map<std::int64_t, void*> pack{{q_uid, base},
                                               {k_uid, base + C},
                                               {v_uid, base + 2 * C},
                                               {o_uid, const_cast<fsdp::bf16*>(out)},
                                               {do_uid, const_cast<fsdp::bf16*>(dout)},
                                               {stats_uid, const_cast<float*>(stats)},
                                               {dq_uid, dqkv},
                                               {dk_uid, dqkv + C},
                                               {dv_uid, dqkv + 2 * C}};
  impl_->run(*g.backward, pack, workspace, workspace_size, g.workspace, "attention backward");
}

std::string cudnn_attention::version() const {
  const std::size_t v = fe::detail::get_backend_version();  // cuDNN 9: major * 10000 + minor * 100 + patch
  return "cuDNN " + std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100) + " (frontend " +
         std::to_string(CUDNN_FRONTEND_MAJOR_VERSION) + "." + std::to_string(CUDNN_FRONTEND_MINOR_VERSION) + "." +
         std::to_string(CUDNN_FRONTEND_PATCH_VERSION) + ")";
}

#else  // built without cuDNN's frontend: the class exists, and says so when made

struct cudnn_attention::impl {};

cudnn_attention::cudnn_attention(cudaStream_t, int T, int C, int H, bool) {
  check_shape(T, C, H);
  throw fsdp::error(fsdp::errc::invalid_argument,
                    "cuDNN: this program was built without cuDNN's frontend (CMake found no cudnn_frontend.h or cudnn.h; "
                    "scripts/setup.sh unpacks the frontend into .pydeps/cudnn-frontend): use --attention plain");
}
cudnn_attention::~cudnn_attention() = default;
std::size_t cudnn_attention::workspace_bytes(int) { return 0; }
void cudnn_attention::forward(fsdp::bf16*, float*, const fsdp::bf16*, int, void*, std::size_t) {}
void cudnn_attention::backward(fsdp::bf16*, const fsdp::bf16*, const fsdp::bf16*, const float*, const fsdp::bf16*, int, void*, std::size_t) {}
std::string cudnn_attention::version() const { return "none"; }

#endif

}  // namespace gpt::cuda
