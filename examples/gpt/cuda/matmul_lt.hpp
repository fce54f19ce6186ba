#pragma once
// gpt/cuda/matmul_lt.hpp: one bf16 matrix product through cuBLASLt with its elementwise work done
// in the product's epilogue (train_gpt --elementwise cublaslt, activation_options::
// cublaslt_epilogues): the bias, GELU (keeping its input for backward), GELU's backward, and a
// residual connection as the product's C. kernels.cuh's bias_epilogue does the same work in a pass
// of its own after a product that wrote f32: here the product writes its result once, in bf16
// where a bf16 operand is what is read next (issue 36: llm.c's cuBLASLt epilogues).
//
// Why cuBLASLt and not cublasGemmEx: only cuBLASLt has epilogues, and its handle, unlike cuBLAS's,
// takes the workspace and the stream per call. The heuristic query that picks an algorithm costs
// host time, so each call's shape, types, epilogue and pointer alignments pick one once (cached).
//
// Column-major, as cuBLAS: D[m][n] = op(A)[m][k] op(B)[k][n] (+ C) + bias[m] per row, then the
// epilogue; kernels.cuh's row-major instances say how each product of the model maps onto this.
// Not yet run on a GPU (docs/gpu.md, "Not yet run on a GPU").

#include <cublasLt.h>  // with cublas_api.h: cublasGetStatusName, cublasGetStatusString
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>

#include <fsdp/core/error.hpp>

namespace gpt::cuda {

class lt_matmul {
 public:
  //! What follows the product: + bias; + bias then GELU (tanh, GPT-2's) keeping GELU's input in
  //! aux; the product times GELU's derivative at aux (GELU's backward).
  enum class epilogue { bias, gelu_aux_bias, dgelu };

  //! One product: A and B are bf16; D is bf16 or f32 (d_type); C, when given, is added (beta = 1)
  //! and has D's type and layout; bias has D's type (cuBLASLt's rule), `m` elements; aux is bf16
  //! (D must then be bf16, cuBLASLt's rule for GELU's input), its leading dimension a multiple of 8.
  struct product {
    epilogue ep = epilogue::bias;
    cublasOperation_t op_a = CUBLAS_OP_N, op_b = CUBLAS_OP_N;
    int m = 0, n = 0, k = 0;
    const void* a = nullptr;
    int lda = 0;
    const void* b = nullptr;
    int ldb = 0;
    const void* c = nullptr;  // null: beta = 0
    void* d = nullptr;
    cudaDataType_t d_type = CUDA_R_16BF;
    int ldd = 0;
    const void* bias = nullptr;  // bias, gelu_aux_bias
    void* aux = nullptr;         // gelu_aux_bias (written), dgelu (read)
    int ld_aux = 0;
  };

  //! Makes the cuBLASLt handle (on the current device). Throws errc::no_device when it cannot.
  lt_matmul() {
    cublasLtHandle_t h = nullptr;
    const cublasStatus_t s = cublasLtCreate(&h);
    if (s != CUBLAS_STATUS_SUCCESS)
      throw fsdp::error(fsdp::errc::no_device, std::string("no CUDA device: cublasLtCreate failed: ") + cublasGetStatusString(s));
    handle_.reset(h);
  }

  //! Enqueues p on `stream`, with `workspace` (device memory of `workspace_bytes`, used by nothing
  //! else until the stream has run the product). Throws errc::internal naming the product when
  //! cuBLASLt has no algorithm for it or fails.
  void run(const product& p, cudaStream_t stream, void* workspace, std::size_t workspace_bytes) {
    descriptors ds(p);
    const cublasLtMatmulAlgo_t algo = algorithm(p, ds, workspace_bytes);
    const float one = 1.0f, beta = p.c ? 1.0f : 0.0f;
    check(cublasLtMatmul(handle_.get(), ds.matmul, &one, p.a, ds.a, p.b, ds.b, &beta, p.c ? p.c : p.d, ds.d, p.d, ds.d, &algo, workspace,
                         workspace_bytes, stream),
          "cublasLtMatmul", p);
  }

  //! The workspace a product may use: 32 MiB, cuBLAS's recommendation for Hopper (its
  //! documentation of cublasSetWorkspace; llm.c uses the same).
  static constexpr std::size_t workspace_bytes = std::size_t{32} << 20;

 private:
  struct handle_deleter {
    void operator()(cublasLtHandle_t h) const noexcept { (void)cublasLtDestroy(h); }
  };
  static std::string describe(const product& p) {
    const char* ep = p.ep == epilogue::bias ? "bias" : p.ep == epilogue::gelu_aux_bias ? "gelu_aux_bias" : "dgelu";
    return std::string(ep) + " product " + std::to_string(p.m) + " x " + std::to_string(p.n) + " x " + std::to_string(p.k) + " (" +
           (p.d_type == CUDA_R_32F ? "f32" : "bf16") + " out" + (p.c ? ", + C" : "") + ")";
  }
  static void check(cublasStatus_t s, const char* what, const product& p) {
    if (s != CUBLAS_STATUS_SUCCESS)
      throw fsdp::error(fsdp::errc::internal, std::string("cuBLASLt: ") + what + " of the " + describe(p) + " failed: " +
                                                  cublasGetStatusName(s) + " (" + cublasGetStatusString(s) + ")");
  }
  // The largest power of two (at most 256, cuBLASLt's default assumption) dividing the address:
  // a gathered unit's parameters are 64-byte aligned (core/layout.hpp), not 256.
  static std::uint32_t alignment(const void* ptr) {
    const auto at = reinterpret_cast<std::uintptr_t>(ptr);
    std::uint32_t a = 256;
    while (a > 1 && at % a != 0) a /= 2;
    return a;
  }

  // The descriptors of one call, made and freed around it (host calls of a few microseconds).
  struct descriptors {
    cublasLtMatmulDesc_t matmul = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    descriptors() = default;
    // Delegating: once the default constructor has run, the destructor frees what the body made
    // before a failing call threw.
    explicit descriptors(const product& p) : descriptors() {
      check(cublasLtMatmulDescCreate(&matmul, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate", p);
      set(CUBLASLT_MATMUL_DESC_TRANSA, p.op_a, p);
      set(CUBLASLT_MATMUL_DESC_TRANSB, p.op_b, p);
      const cublasLtEpilogue_t ep = p.ep == epilogue::bias            ? CUBLASLT_EPILOGUE_BIAS
                                    : p.ep == epilogue::gelu_aux_bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS
                                                                      : CUBLASLT_EPILOGUE_DGELU;
      set(CUBLASLT_MATMUL_DESC_EPILOGUE, ep, p);
      if (p.ep != epilogue::dgelu) set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, p.bias, p);
      if (p.ep != epilogue::bias) {
        set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, p.aux, p);
        set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, static_cast<std::int64_t>(p.ld_aux), p);
      }
      // A is m x k as op(A) reads it: stored k x m when transposed.
      const bool ta = p.op_a != CUBLAS_OP_N, tb = p.op_b != CUBLAS_OP_N;
      check(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, ta ? p.k : p.m, ta ? p.m : p.k, p.lda), "cublasLtMatrixLayoutCreate (A)", p);
      check(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, tb ? p.n : p.k, tb ? p.k : p.n, p.ldb), "cublasLtMatrixLayoutCreate (B)", p);
      check(cublasLtMatrixLayoutCreate(&d, p.d_type, p.m, p.n, p.ldd), "cublasLtMatrixLayoutCreate (D)", p);
    }
    ~descriptors() {
      if (d) (void)cublasLtMatrixLayoutDestroy(d);
      if (b) (void)cublasLtMatrixLayoutDestroy(b);
      if (a) (void)cublasLtMatrixLayoutDestroy(a);
      if (matmul) (void)cublasLtMatmulDescDestroy(matmul);
    }
    descriptors(const descriptors&) = delete;
    descriptors& operator=(const descriptors&) = delete;
    template <class V>
    void set(cublasLtMatmulDescAttributes_t attr, const V& v, const product& p) {
      check(cublasLtMatmulDescSetAttribute(matmul, attr, &v, sizeof(v)), "cublasLtMatmulDescSetAttribute", p);
    }
  };

  // What picks an algorithm: everything of a product but its pointers' values, and the workspace
  // it may use.
  using key = std::tuple<int, int, int, int, int, int, int, int, int, int, bool, int, std::uint32_t, std::uint32_t, std::uint32_t,
                         std::uint32_t, std::uint32_t, std::size_t>;

  cublasLtMatmulAlgo_t algorithm(const product& p, const descriptors& ds, std::size_t workspace_size) {
    const std::uint32_t al_a = alignment(p.a), al_b = alignment(p.b), al_d = std::min(alignment(p.d), p.c ? alignment(p.c) : 256u);
    const key k{static_cast<int>(p.ep), static_cast<int>(p.op_a), static_cast<int>(p.op_b), p.m, p.n, p.k, p.lda, p.ldb, p.ldd, p.ld_aux,
                p.c != nullptr, static_cast<int>(p.d_type), al_a, al_b, al_d, alignment(p.bias), alignment(p.aux), workspace_size};
    if (auto it = algorithms_.find(k); it != algorithms_.end()) return it->second;
    cublasLtMatmulPreference_t pref = nullptr;
    check(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate", p);
    std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, decltype(&cublasLtMatmulPreferenceDestroy)> owned(pref, cublasLtMatmulPreferenceDestroy);
    auto set = [&](cublasLtMatmulPreferenceAttributes_t attr, const auto& v) {
      check(cublasLtMatmulPreferenceSetAttribute(pref, attr, &v, sizeof(v)), "cublasLtMatmulPreferenceSetAttribute", p);
    };
    set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<std::uint64_t>(workspace_size));
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, al_a);
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, al_b);
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, al_d);
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, al_d);
    // Split-K's partial sums: kept in f32 in the workspace and reduced in a pass of their own, or
    // (f32 output) in the output's type, never "in place", which would round a bf16 output's
    // partial sums to bf16 and keeps counters in the workspace that cuDNN's attention also uses.
    const std::uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE |
                                  (p.d_type == CUDA_R_32F ? CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE : 0);
    set(CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, schemes);
    cublasLtMatmulHeuristicResult_t found{};
    int count = 0;
    // No heuristic for a configuration comes back as CUBLAS_STATUS_NOT_SUPPORTED (cublasLt.h).
    const cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(handle_.get(), ds.matmul, ds.a, ds.b, ds.d, ds.d, pref, 1, &found, &count);
    if (s != CUBLAS_STATUS_NOT_SUPPORTED) check(s, "cublasLtMatmulAlgoGetHeuristic", p);
    if (s == CUBLAS_STATUS_NOT_SUPPORTED || count < 1 || found.state != CUBLAS_STATUS_SUCCESS)
      throw fsdp::error(fsdp::errc::internal, "cuBLASLt has no algorithm for the " + describe(p) + " (alignments: A " + std::to_string(al_a) +
                                                  ", B " + std::to_string(al_b) + ", D " + std::to_string(al_d) + " bytes)");
    return algorithms_.emplace(k, found.algo).first->second;
  }

  std::unique_ptr<cublasLtContext, handle_deleter> handle_;
  std::map<key, cublasLtMatmulAlgo_t> algorithms_;
};

}  // namespace gpt::cuda
