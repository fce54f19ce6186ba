#pragma once
// gpt/cuda/kernels.cuh: gpt/model.hpp's kernels on the GPU. Every function of model.hpp's
// `kernels` namespace (and the embedding, residual and loss loops of gpt::model's methods) has
// a counterpart here with the same arguments and the same semantics, plus a first argument, the
// env: the stream everything is launched on, the cuBLAS handle bound to that stream, and the
// scratch areas some kernels need. All pointers are DEVICE pointers. Nothing here synchronizes
// with the host.
//
// Plain on purpose (llm.c's first CUDA version, not its tuned one): one thread per element, or
// one warp per row for row reductions; cuBLAS for the matrix products. Nothing is tuned.
//
// Types: activations and arithmetic are float; parameters and their gradients have type P
// (float, or fsdp::bf16 for mixed precision). As in model.hpp, every "backward" ADDS (+=) into
// the input gradient and into the parameter gradients, but matmul_backward and gelu_backward_bias,
// which write their input gradient (the model's are all scratch; see there); a null parameter
// gradient (a frozen parameter) is skipped.
//
// Determinism: no atomics. Sums over rows (bias, layer-norm and embedding gradients) run in a
// fixed order: each thread owns one output element and loops over rows, or over fixed chunks
// of rows whose partial sums a second kernel adds up in order. Two runs give the same bits.
//
// Row-major matrices and cuBLAS (column-major). A row-major matrix M[r][c] (leading dimension
// c) is, read by cuBLAS, the column-major matrix M^T (c x r, same leading dimension). So the
// row-major product C[m][n] = A[m][k] . B[k][n] is computed as the column-major product
// C^T = B^T . A^T: cuBLAS gets (m := n, n := m), the operands swapped, and each operand's
// transposition as the row-major formula says. Each call below spells out its instance.
//
// Kernels are templates (on the parameter type P, or on the activation type F, always float):
// nvcc rejects `inline __global__`, and a non-template kernel in a header would be defined
// once per translation unit.

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include <fsdp/core/dtype.hpp>
#include <fsdp/core/error.hpp>
#include <fsdp/device/cuda.hpp>

#include "gpt/cuda/matmul_lt.hpp"

namespace gpt::cuda {

//! What every launch needs: the stream, the cuBLAS handle bound to it, and scratch areas (all
//! device memory, sized by gpt::cuda::activations for its batch; a kernel that needs an area
//! assumes it is large enough for the shapes it is given).
struct env {
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  //! Two areas of bf16 copies of GEMM operands (P = bf16 only): each N x max(4C, V).
  fsdp::bf16* cast_a = nullptr;
  fsdp::bf16* cast_b = nullptr;
  //! Per-chunk column sums of the bias and layer-norm gradients: ceil(N / 32) x 4C.
  float* partials = nullptr;
  //! Attention: q, k, v in head-major order [3][B][H][T][hs]; their gradients, the same; one
  //! head-major [B][H][T][hs] (the heads' outputs, or their gradient); d scores [B][H][T][T].
  float* heads = nullptr;
  float* dheads = nullptr;
  float* head_rows = nullptr;
  float* dscores = nullptr;
  //! The attention products' (q.k, att.v and their backward) compute type. Their operands stay
  //! f32; with bf16 parameters they run on TF32 tensor cores (CUBLAS_COMPUTE_32F_FAST_TF32:
  //! 10-bit mantissas, finer than the bf16 operands of every other product), since as plain f32
  //! FFMA products they took 38% of a GPT-2-small step's GPU time on an H100 (Nsight Compute,
  //! docs/gpu.md). f32 parameters keep plain f32, the mode compared with the CPU at 1e-5.
  cublasComputeType_t attention_compute = CUBLAS_COMPUTE_32F;
  //! The products with cuBLASLt's epilogues (activation_options::cublaslt_epilogues), else null:
  //! the model's lt_matmul, its workspace (shared with cuDNN's attention: one stream runs both),
  //! and 4C floats for a bias as f32 (cuBLASLt's bias has the product's output type).
  lt_matmul* lt = nullptr;
  void* lt_workspace = nullptr;
  std::size_t lt_workspace_bytes = 0;
  float* bias32 = nullptr;
};

namespace detail {

constexpr int threads = 256;        // per block: 8 warps
constexpr int rows_per_chunk = 32;  // rows summed by one thread of the column-sum kernels

inline unsigned blocks_for(std::size_t n, std::size_t per_block = threads) {
  return static_cast<unsigned>((n + per_block - 1) / per_block);
}
FSDP_HOST_DEVICE inline std::size_t z(int x) { return static_cast<std::size_t>(x); }

//! Throws fsdp::error naming `what` if the last launch failed (and clears the error).
inline void check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw fsdp::error(fsdp::errc::internal, std::string(what) + ": launch failed: " + fsdp::detail::cuda_error_text(e));
}
inline void check_blas(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw fsdp::error(fsdp::errc::internal, std::string(what) + " failed: " + cublasGetStatusName(s) + " (" + cublasGetStatusString(s) + ")");
}

template <class P>
constexpr cudaDataType_t blas_type() {
  static_assert(std::is_same_v<P, float> || std::is_same_v<P, fsdp::bf16>, "gpt::cuda: parameters are float or fsdp::bf16");
  return std::is_same_v<P, float> ? CUDA_R_32F : CUDA_R_16BF;
}

template <class P>
__device__ float to_f(P v) {
  return fsdp::convert<float>(v);
}
__device__ inline float warp_sum(float v) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ inline float warp_max(float v) {
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ inline std::size_t global_index() { return std::size_t{blockIdx.x} * blockDim.x + threadIdx.x; }
//! One warp per row: this thread's row, and its lane.
__device__ inline int warp_row() { return static_cast<int>(blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32); }
__device__ inline int lane() { return static_cast<int>(threadIdx.x % 32); }

// ---- kernels --------------------------------------------------------------------------------

template <class P>
__global__ void embedding_forward_kernel(float* x, const std::uint8_t* tokens, const P* wte, const P* wpe, int N, int T, int C) {
  const std::size_t i = global_index();
  if (i >= z(N) * z(C)) return;
  const std::size_t n = i / z(C), c = i % z(C), t = n % z(T);
  x[i] = to_f(wte[z(tokens[n]) * z(C) + c]) + to_f(wpe[t * z(C) + c]);
}

// One thread per element of wte (v, c): the sum over the rows whose token is v, in row order
// (rows[starts[v] .. starts[v + 1]), token_rows.hpp), so N C reads of dx in all, not V N.
template <class P>
__global__ void wte_backward_kernel(P* dwte, const float* dx, const std::int32_t* starts, const std::int32_t* rows, int C, int V) {
  const std::size_t i = global_index();
  if (i >= z(V) * z(C)) return;
  const std::size_t v = i / z(C), c = i % z(C);
  float s = 0;
  for (int k = starts[v]; k < starts[v + 1]; ++k) s += dx[z(rows[k]) * z(C) + c];
  dwte[i] = fsdp::convert<P>(to_f(dwte[i]) + s);
}

// One thread per element of wpe (t, c): the sum over the B sequences.
template <class P>
__global__ void wpe_backward_kernel(P* dwpe, const float* dx, int B, int T, int C) {
  const std::size_t i = global_index();
  if (i >= z(T) * z(C)) return;
  const std::size_t t = i / z(C), c = i % z(C);
  float s = 0;
  for (int b = 0; b < B; ++b) s += dx[(z(b) * z(T) + t) * z(C) + c];
  dwpe[i] = fsdp::convert<P>(to_f(dwpe[i]) + s);
}

template <class F>
__global__ void to_bf16_kernel(fsdp::bf16* out, const F* in, std::size_t n) {
  const std::size_t i = global_index();
  if (i < n) out[i] = fsdp::convert<fsdp::bf16>(in[i]);
}

template <class F>
__global__ void from_bf16_kernel(F* out, const fsdp::bf16* in, std::size_t n, bool add) {
  const std::size_t i = global_index();
  if (i < n) out[i] = (add ? out[i] : F{0}) + fsdp::convert<F>(in[i]);
}

template <class P>
__global__ void add_bias_kernel(float* out, const P* b, int N, int OC) {
  const std::size_t i = global_index();
  if (i < z(N) * z(OC)) out[i] += to_f(b[i % z(OC)]);
}

// GELU, tanh approximation (GPT-2's): one definition for every kernel that applies it, so that
// they round alike.
__device__ inline float gelu_of(float x) {
  const float k = sqrtf(2.0f / 3.14159265358979f);
  return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
}

// out += b per column, then + residual, GELU (into gelu_out when given), a bf16 copy (each when
// asked): see kernels::bias_epilogue.
template <class P>
__global__ void bias_epilogue_kernel(float* out, const P* b, int N, int OC, const float* residual, bool gelu, float* gelu_out,
                                     fsdp::bf16* out16, bool keep_out) {
  const std::size_t i = global_index();
  if (i >= z(N) * z(OC)) return;
  float y = out[i] + to_f(b[i % z(OC)]);
  if (residual) y = y + residual[i];
  if (keep_out) out[i] = y;
  if (gelu) {
    const float g = gelu_of(y);
    if (gelu_out) gelu_out[i] = g;
    if (out16) out16[i] = fsdp::convert<fsdp::bf16>(g);
  } else if (out16) {
    out16[i] = fsdp::convert<fsdp::bf16>(y);
  }
}

template <class F>
__global__ void add_kernel(F* out, const F* in, std::size_t n) {
  const std::size_t i = global_index();
  if (i < n) out[i] += in[i];
}

// partials[k][c] = sum of in[n][c] over the rows n of chunk k. Grid (columns / 256, chunks).
template <class F>
__global__ void column_partials_kernel(float* partials, const F* in, int N, int cols) {
  const int c = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x), k = static_cast<int>(blockIdx.y);
  if (c >= cols) return;
  const int end = min(N, (k + 1) * rows_per_chunk);
  float s = 0;
  for (int n = k * rows_per_chunk; n < end; ++n) s += to_f(in[z(n) * z(cols) + z(c)]);
  partials[z(k) * z(cols) + z(c)] = s;
}

// grad[j] += sum over chunks k of partials[k * stride + j], in chunk order, j < count.
template <class P>
__global__ void add_column_sums_kernel(P* grad, const float* partials, int chunks, int stride, int count) {
  const std::size_t j = global_index();
  if (j >= z(count)) return;
  float s = 0;
  for (int k = 0; k < chunks; ++k) s += partials[z(k) * z(stride) + j];
  grad[j] = fsdp::convert<P>(to_f(grad[j]) + s);
}

// Row n's layer norm by one warp, each lane reading the columns c = lane() + 32 k of x (its row);
// the same two passes (mean, then variance) as model.hpp.
template <class P>
__device__ void layernorm_row(float* out, float* mean, float* rstd, const float* x, const P* w, const P* b, int n, int C,
                              fsdp::bf16* out16) {
  float m = 0, v = 0;
  for (int c = lane(); c < C; c += 32) m += x[c];
  m = warp_sum(m) / static_cast<float>(C);
  for (int c = lane(); c < C; c += 32) v += (x[c] - m) * (x[c] - m);
  v = warp_sum(v) / static_cast<float>(C);
  const float s = 1.0f / sqrtf(v + 1e-5f);
  for (int c = lane(); c < C; c += 32) {
    const float y = (x[c] - m) * s * to_f(w[c]) + to_f(b[c]);
    if (out) out[z(n) * z(C) + z(c)] = y;
    if (out16) out16[z(n) * z(C) + z(c)] = fsdp::convert<fsdp::bf16>(y);
  }
  if (lane() == 0) mean[n] = m, rstd[n] = s;
}

template <class P>
__global__ void layernorm_forward_kernel(float* out, float* mean, float* rstd, const float* in, const P* w, const P* b, int N, int C,
                                         fsdp::bf16* out16) {
  const int n = warp_row();
  if (n < N) layernorm_row(out, mean, rstd, in + z(n) * z(C), w, b, n, C, out16);
}

// One warp per row: x = x + bias + residual (bias_epilogue_kernel's order), then its layer norm;
// each lane reads back only the columns it wrote.
template <class P>
__global__ void residual_layernorm_forward_kernel(float* x, const P* bias, const float* residual, float* out, float* mean, float* rstd,
                                                  const P* w, const P* b, int N, int C, fsdp::bf16* out16) {
  const int n = warp_row();
  if (n >= N) return;
  float* row = x + z(n) * z(C);
  const float* r = residual + z(n) * z(C);
  for (int c = lane(); c < C; c += 32) {
    const float y = row[c] + to_f(bias[c]);
    row[c] = y + r[c];
  }
  layernorm_row(out, mean, rstd, row, w, b, n, C, out16);
}

// din += rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), one warp per row.
template <class P>
__global__ void layernorm_backward_kernel(float* din, const float* dout, const float* in, const P* w, const float* mean,
                                          const float* rstd, int N, int C, fsdp::bf16* din16) {
  const int n = warp_row();
  if (n >= N) return;
  const float* d = dout + z(n) * z(C);
  const float* x = in + z(n) * z(C);
  float mean_d = 0, mean_dx = 0;
  for (int c = lane(); c < C; c += 32) {
    const float xhat = (x[c] - mean[n]) * rstd[n], dxhat = d[c] * to_f(w[c]);
    mean_d += dxhat;
    mean_dx += dxhat * xhat;
  }
  mean_d = warp_sum(mean_d) / static_cast<float>(C);
  mean_dx = warp_sum(mean_dx) / static_cast<float>(C);
  for (int c = lane(); c < C; c += 32) {
    const float xhat = (x[c] - mean[n]) * rstd[n], dxhat = d[c] * to_f(w[c]);
    const float y = din[z(n) * z(C) + z(c)] + rstd[n] * (dxhat - mean_d - xhat * mean_dx);
    din[z(n) * z(C) + z(c)] = y;
    if (din16) din16[z(n) * z(C) + z(c)] = fsdp::convert<fsdp::bf16>(y);
  }
}

// partials[k][c] = sum of dout * xhat (the gain's gradient), partials[k][C + c] = sum of dout
// (the bias's), over the rows of chunk k. Grid (C / 256, chunks).
template <class F>
__global__ void layernorm_param_partials_kernel(float* partials, const F* dout, const F* in, const F* mean, const F* rstd, int N, int C) {
  const int c = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x), k = static_cast<int>(blockIdx.y);
  if (c >= C) return;
  const int end = min(N, (k + 1) * rows_per_chunk);
  float gw = 0, gb = 0;
  for (int n = k * rows_per_chunk; n < end; ++n) {
    const float d = dout[z(n) * z(C) + z(c)];
    gw += d * (in[z(n) * z(C) + z(c)] - mean[n]) * rstd[n];
    gb += d;
  }
  partials[z(k) * z(2 * C) + z(c)] = gw;
  partials[z(k) * z(2 * C) + z(C + c)] = gb;
}

// Where element i of a head-major [B][H][T][hs] array sits in the rows [(b T + t)][stride] it
// comes from: (b T + t) stride + h hs + d.
__device__ inline std::size_t row_offset_of_head_element(std::size_t i, int stride, int T, int H, int hs) {
  std::size_t r = i / z(hs);
  const std::size_t d = i % z(hs), t = r % z(T);
  r /= z(T);
  const std::size_t h = r % z(H), b = r / z(H);
  return (b * z(T) + t) * z(stride) + h * z(hs) + d;
}

// dst[b][h][t][i] = src[(b T + t) stride + h hs + i]: one head's slice of each row, head-major.
template <class F>
__global__ void heads_from_rows_kernel(F* dst, const F* src, int stride, int B, int T, int H, int hs) {
  const std::size_t i = global_index();
  if (i >= z(B) * z(H) * z(T) * z(hs)) return;
  dst[i] = src[row_offset_of_head_element(i, stride, T, H, hs)];
}

// The inverse: dst[(b T + t) stride + h hs + i] = (or +=) src[b][h][t][i].
template <class F>
__global__ void rows_from_heads_kernel(F* dst, int stride, const F* src, bool add, int B, int T, int H, int hs) {
  const std::size_t i = global_index();
  if (i >= z(B) * z(H) * z(T) * z(hs)) return;
  F& out = dst[row_offset_of_head_element(i, stride, T, H, hs)];
  out = add ? out + src[i] : src[i];
}

// att[r][0..T) holds the raw scores q.k of row r = (b, h, t); becomes the causal softmax of
// scale * scores (zero beyond t). One warp per row; the same steps as model.hpp.
template <class F>
__global__ void attention_softmax_kernel(F* att, int rows, int T, float scale) {
  const int r = warp_row();
  if (r >= rows) return;
  const int t = r % T;
  F* p = att + z(r) * z(T);
  float mx = -INFINITY;
  for (int t2 = lane(); t2 <= t; t2 += 32) mx = fmaxf(mx, p[t2] * scale);
  mx = warp_max(mx);
  float sum = 0;
  for (int t2 = lane(); t2 <= t; t2 += 32) sum += (p[t2] = expf(p[t2] * scale - mx));
  sum = warp_sum(sum);
  for (int t2 = lane(); t2 < T; t2 += 32) p[t2] = t2 <= t ? p[t2] / sum : 0.0f;
}

// d[r][..] holds dp = d(output) . v; becomes d(scores) = p (dp - sum(p dp)) scale (zero
// beyond t). One warp per row.
template <class F>
__global__ void attention_softmax_backward_kernel(F* d, const F* att, int rows, int T, float scale) {
  const int r = warp_row();
  if (r >= rows) return;
  const int t = r % T;
  const F* p = att + z(r) * z(T);
  F* dp = d + z(r) * z(T);
  float dot = 0;
  for (int t2 = lane(); t2 <= t; t2 += 32) dot += p[t2] * dp[t2];
  dot = warp_sum(dot);
  for (int t2 = lane(); t2 < T; t2 += 32) dp[t2] = t2 <= t ? p[t2] * (dp[t2] - dot) * scale : 0.0f;
}

template <class F>
__global__ void gelu_forward_kernel(F* out, const F* in, std::size_t n, fsdp::bf16* out16) {
  const std::size_t i = global_index();
  if (i >= n) return;
  const float y = gelu_of(in[i]);
  out[i] = y;
  if (out16) out16[i] = fsdp::convert<fsdp::bf16>(y);
}

// dout gelu'(x): one definition for both of GELU's backward kernels, so that they round alike.
__device__ inline float gelu_backward_of(float x, float dout) {
  const float k = sqrtf(2.0f / 3.14159265358979f);
  const float th = tanhf(k * (x + 0.044715f * x * x * x)), sech2 = 1.0f - th * th;
  return dout * (0.5f * (1.0f + th) + 0.5f * x * sech2 * k * (1.0f + 3.0f * 0.044715f * x * x));
}

template <class F>
__global__ void gelu_backward_kernel(F* din, const F* in, const F* dout, std::size_t n) {
  const std::size_t i = global_index();
  if (i < n) din[i] += gelu_backward_of(in[i], dout[i]);
}

// GELU's backward by columns, as column_partials_kernel reads them (grid (cols / 256, chunks)):
// din = dout gelu'(in + bias) into din and din16 (each when given), and partials[k][c] = the sum
// of column c of din over chunk k's rows, in row order: the bias gradient's first pass, without
// reading din back.
template <class F, class P>
__global__ void gelu_backward_partials_kernel(float* partials, F* din, fsdp::bf16* din16, const F* in, const P* bias, const F* dout, int N,
                                              int cols) {
  const int c = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x), k = static_cast<int>(blockIdx.y);
  if (c >= cols) return;
  const int end = min(N, (k + 1) * rows_per_chunk);
  float s = 0;
  for (int n = k * rows_per_chunk; n < end; ++n) {
    const std::size_t i = z(n) * z(cols) + z(c);
    const float y = gelu_backward_of(in[i] + to_f(bias[c]), dout[i]);  // bias_epilogue_kernel's sum
    if (din) din[i] = y;
    if (din16) din16[i] = fsdp::convert<fsdp::bf16>(y);
    s = __fadd_rn(s, y);  // never contracted with y's product into an FMA: column_partials_kernel adds y as stored
  }
  partials[z(k) * z(cols) + z(c)] = s;
}

// probs[n][..] holds the logits of row n; becomes their softmax, and losses[n] = -log p[target].
// One warp per row.
template <class F>
__global__ void crossentropy_forward_kernel(F* probs, F* losses, const std::uint8_t* targets, int N, int V) {
  const int n = warp_row();
  if (n >= N) return;
  F* p = probs + z(n) * z(V);
  float mx = -INFINITY;
  for (int v = lane(); v < V; v += 32) mx = fmaxf(mx, p[v]);
  mx = warp_max(mx);
  float sum = 0;
  for (int v = lane(); v < V; v += 32) sum += (p[v] = expf(p[v] - mx));
  sum = warp_sum(sum);
  for (int v = lane(); v < V; v += 32) p[v] /= sum;
  __syncwarp();  // lane 0 reads another lane's p[target]
  if (lane() == 0) losses[n] = -logf(fmaxf(p[targets[n]], 1e-30f));
}

// *loss = mean of losses[0..N), in double, in a fixed order: one block of `threads` threads.
template <class F>
__global__ void mean_loss_kernel(double* loss, const F* losses, int N) {
  __shared__ double part[threads];
  double s = 0;
  for (int n = static_cast<int>(threadIdx.x); n < N; n += threads) s += static_cast<double>(losses[n]);
  part[threadIdx.x] = s;
  __syncthreads();
  for (int w = threads / 2; w > 0; w /= 2) {
    if (static_cast<int>(threadIdx.x) < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) *loss = part[0] / N;
}

// dlogits = (probs - onehot(target)) / denom, denom = N * micro.
template <class F>
__global__ void crossentropy_backward_kernel(F* dlogits, const F* probs, const std::uint8_t* targets, int N, int V, float denom,
                                             fsdp::bf16* dlogits16) {
  const std::size_t i = global_index();
  if (i >= z(N) * z(V)) return;
  const std::size_t n = i / z(V), v = i % z(V);
  const float y = (probs[i] - (v == targets[n] ? 1.0f : 0.0f)) / denom;
  if (dlogits) dlogits[i] = y;
  if (dlogits16) dlogits16[i] = fsdp::convert<fsdp::bf16>(y);
}

// ---- cuBLAS ---------------------------------------------------------------------------------

//! Column-major C = op(A) op(B) + beta C, accumulated in f32 (CUBLAS_COMPUTE_32F: with f32
//! operands that is plain fp32, no TF32, since the handle keeps CUBLAS_DEFAULT_MATH).
inline void gemm(const env& e, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void* A, cudaDataType_t at,
                 int lda, const void* B, cudaDataType_t bt, int ldb, float beta, void* C, cudaDataType_t ct, int ldc,
                 const char* what) {
  const float alpha = 1.0f;
  check_blas(cublasGemmEx(e.blas, ta, tb, m, n, k, &alpha, A, at, lda, B, bt, ldb, &beta, C, ct, ldc, CUBLAS_COMPUTE_32F,
                          CUBLAS_GEMM_DEFAULT),
             what);
}

//! The same for `batch` float matrices at fixed strides (elements), beta = 0, in the attention's
//! compute type (env::attention_compute).
inline void gemm_batched(const env& e, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const float* A, int lda,
                         long long sa, const float* B, int ldb, long long sb, float* C, int ldc, long long sc, int batch,
                         const char* what) {
  const float alpha = 1.0f, beta = 0.0f;
  check_blas(cublasGemmStridedBatchedEx(e.blas, ta, tb, m, n, k, &alpha, A, CUDA_R_32F, lda, sa, B, CUDA_R_32F, ldb, sb, &beta, C,
                                        CUDA_R_32F, ldc, sc, batch, e.attention_compute, CUBLAS_GEMM_DEFAULT),
             what);
}

//! Operand `x` (float, n elements) as P for a GEMM: itself for P = float, else `ready` (x's bf16
//! copy, made where x was) or a bf16 copy in `scratch`.
template <class P>
const void* gemm_operand(const env& e, const float* x, std::size_t n, fsdp::bf16* scratch, const fsdp::bf16* ready) {
  if constexpr (std::is_same_v<P, float>) {
    return x;
  } else if (ready) {
    return ready;
  } else {
    to_bf16_kernel<<<blocks_for(n), threads, 0, e.stream>>>(scratch, x, n);
    check_launch("to_bf16");
    return scratch;
  }
}

//! grad[0..cols) += the column sums of in[N][cols] (deterministic: chunks, then their sum).
template <class P, class F>
void add_column_sums(const env& e, P* grad, const F* in, int N, int cols) {
  const int chunks = (N + rows_per_chunk - 1) / rows_per_chunk;
  column_partials_kernel<<<dim3(blocks_for(z(cols)), static_cast<unsigned>(chunks)), threads, 0, e.stream>>>(e.partials, in, N, cols);
  check_launch("column_partials");
  add_column_sums_kernel<<<blocks_for(z(cols)), threads, 0, e.stream>>>(grad, e.partials, chunks, cols, cols);
  check_launch("add_column_sums");
}

}  // namespace detail

// ---- the functions of gpt/model.hpp, on the GPU ---------------------------------------------

namespace kernels {

using detail::blocks_for;
using detail::threads;
using detail::z;

//! Sets n floats at p to zero (on the stream).
inline void zero(const env& e, float* p, std::size_t n) {
  fsdp::detail::cuda_check(cudaMemsetAsync(p, 0, n * sizeof(float), e.stream), "cudaMemsetAsync");
}

//! x[N][C] = wte[tokens[n]] + wpe[n % T], N = B T; tokens is [N] bytes (< V) on the device.
template <class P>
void embedding_forward(const env& e, float* x, const std::uint8_t* tokens, const P* wte, const P* wpe, int B, int T, int C) {
  detail::embedding_forward_kernel<<<blocks_for(z(B) * z(T) * z(C)), threads, 0, e.stream>>>(x, tokens, wte, wpe, B * T, T, C);
  detail::check_launch("embedding_forward");
}

//! dwte[V][C] += rows of dx[N][C] by token, dwpe[T][C] += rows of dx by position (either may be
//! null: frozen). The batch's rows grouped by token (token_rows.hpp) are on the device: starts
//! [V + 1], rows [N]. Deterministic, no atomics: one thread per gradient element, each adding its
//! rows in row order.
template <class P>
void embedding_backward(const env& e, P* dwte, P* dwpe, const float* dx, const std::int32_t* starts, const std::int32_t* rows, int B,
                        int T, int C, int V) {
  if (dwte) {
    detail::wte_backward_kernel<<<blocks_for(z(V) * z(C)), threads, 0, e.stream>>>(dwte, dx, starts, rows, C, V);
    detail::check_launch("wte_backward");
  }
  if (dwpe) {
    detail::wpe_backward_kernel<<<blocks_for(z(T) * z(C)), threads, 0, e.stream>>>(dwpe, dx, B, T, C);
    detail::check_launch("wpe_backward");
  }
}

//! The elementwise work after a matrix product, in one pass (activation_options::fused_elementwise):
//! out[N][OC] += b (the product's bias, per column), then + residual[N][OC] when given (a residual
//! connection), GELU of the result with `gelu` (into gelu_out when given), and out16 = the last
//! value (GELU's, else out's) rounded to bf16 when given. The same arithmetic in the same order as
//! add_bias, residual_add, gelu_forward and a cast one after the other: the same bits, reading and
//! writing out once. Without keep_out, out is read but not written back (only its bf16 copy is
//! wanted, as qkv's for cuDNN: out is then the product's scratch).
template <class P>
void bias_epilogue(const env& e, float* out, const P* b, int N, int OC, const float* residual = nullptr, bool gelu = false,
                   float* gelu_out = nullptr, fsdp::bf16* out16 = nullptr, bool keep_out = true) {
  detail::bias_epilogue_kernel<<<blocks_for(z(N) * z(OC)), threads, 0, e.stream>>>(out, b, N, OC, residual, gelu, gelu_out, out16,
                                                                                  keep_out);
  detail::check_launch("bias_epilogue");
}

//! out[n] += in[n] (the residual connections).
inline void residual_add(const env& e, float* out, const float* in, std::size_t n) {
  detail::add_kernel<<<blocks_for(n), threads, 0, e.stream>>>(out, in, n);
  detail::check_launch("residual_add");
}

//! out[N][OC] = in[N][C] . w[OC][C]^T + b[OC]   (b may be null). For P = bf16, `in` is rounded to
//! bf16 for the product: `in16` when given (that copy, made where `in` was), else in e.cast_a; the
//! output stays float.
template <class P>
void matmul_forward(const env& e, float* out, const float* in, const P* w, const P* b, int N, int C, int OC,
                    const fsdp::bf16* in16 = nullptr) {
  // Row-major out = in . w^T is column-major out^T (OC x N) = w' . in', where cuBLAS reads the
  // buffer w as w^T (C x OC, ld C), so op T, and in as in^T (C x N, ld C), op N.
  const void* a = detail::gemm_operand<P>(e, in, z(N) * z(C), e.cast_a, in16);
  constexpr cudaDataType_t pt = detail::blas_type<P>();
  detail::gemm(e, CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, w, pt, C, a, pt, C, 0.0f, out, CUDA_R_32F, OC, "matmul_forward");
  if (b) {
    detail::add_bias_kernel<<<blocks_for(z(N) * z(OC)), threads, 0, e.stream>>>(out, b, N, OC);
    detail::check_launch("add_bias");
  }
}

//! Given dout[N][OC]: din[N][C] = dout . w, dw[OC][C] += dout^T . in, db[OC] += the column
//! sums of dout (din, dw, db may be null). For P = bf16, dout and in are rounded to bf16 for the
//! products (dout16 and in16 when given, else copies in e.cast_b, e.cast_a); din stays float, dw
//! accumulates in bf16 (beta = 1: one rounding of old + new, as model.hpp's accumulate).
//! din is written (beta = 0), where model.hpp's adds into a buffer its caller zeroed: every din
//! of the model is such a buffer, so writing spares a fill of it (7 N C floats a block).
//! With P = bf16, dout may be null when dout16 is given and exact (dout's values are bf16's, as
//! cuDNN's d qkv): db then sums dout16, the same values, so the same bits, without a float copy.
template <class P>
void matmul_backward(const env& e, float* din, P* dw, P* db, const float* dout, const float* in, const P* w, int N, int C, int OC,
                     const fsdp::bf16* dout16 = nullptr, const fsdp::bf16* in16 = nullptr) {
  constexpr cudaDataType_t pt = detail::blas_type<P>();
  const void* d = detail::gemm_operand<P>(e, dout, z(N) * z(OC), e.cast_b, dout16);
  // din = dout . w: column-major din^T (C x N) = w^T (the buffer w as read, C x OC, ld C, op N)
  // . dout^T (the buffer dout, OC x N, ld OC, op N). Null: made elsewhere (matmul_dgelu_lt).
  if (din) detail::gemm(e, CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, w, pt, C, d, pt, OC, 0.0f, din, CUDA_R_32F, C, "matmul_backward (din)");
  if (dw) {
    // dw = dout^T . in: column-major dw^T (C x OC) = in^T (the buffer in, C x N, ld C, op N)
    // . dout (the buffer dout read as dout^T, OC x N, ld OC, so op T).
    const void* x = detail::gemm_operand<P>(e, in, z(N) * z(C), e.cast_a, in16);
    detail::gemm(e, CUBLAS_OP_N, CUBLAS_OP_T, C, OC, N, x, pt, C, d, pt, OC, 1.0f, dw, pt, C, "matmul_backward (dw)");
  }
  if (db && dout) detail::add_column_sums(e, db, dout, N, OC);
  else if (db) detail::add_column_sums(e, db, dout16, N, OC);
}

// cuBLASLt's products (activation_options::cublaslt_epilogues: bf16 parameters and operands). Each
// is matmul_forward's or matmul_backward's column-major instance, with the pass after it done in
// the product's epilogue. Their rounding differs from the separate passes' (a bf16 output is the
// product's f32 value rounded once, where the passes round after adding the bias in f32; GELU's
// backward reads its bf16 input): bf16's tolerances, not the same bits.

//! out[N][OC] = in16[N][C] . w[OC][C]^T + b[OC] (+ residual[N][OC] when given), written either as
//! bf16 (out16) or as float (out32; the only one that takes a residual, which has its type; qkv's
//! for the plain attention). For
//! out32 the bias goes through e.bias32 first, as f32 (cuBLASLt's bias has the output's type): OC
//! at most 4C, the model's widest product.
inline void matmul_bias_lt(const env& e, fsdp::bf16* out16, float* out32, const float* residual, const fsdp::bf16* in16,
                           const fsdp::bf16* w, const fsdp::bf16* b, int N, int C, int OC) {
  const void* bias = b;
  if (out32) {
    detail::from_bf16_kernel<float><<<blocks_for(z(OC)), threads, 0, e.stream>>>(e.bias32, b, z(OC), false);
    detail::check_launch("bias to f32");
    bias = e.bias32;
  }
  // As matmul_forward: column-major out^T (OC x N) = w^T (the buffer w read as C x OC, ld C, op T)
  // . in^T (C x N, ld C, op N); the bias is per row of out^T.
  e.lt->run({.ep = lt_matmul::epilogue::bias, .op_a = CUBLAS_OP_T, .op_b = CUBLAS_OP_N, .m = OC, .n = N, .k = C, .a = w, .lda = C,
             .b = in16, .ldb = C, .c = residual, .d = out32 ? static_cast<void*>(out32) : static_cast<void*>(out16),
             .d_type = out32 ? CUDA_R_32F : CUDA_R_16BF, .ldd = OC, .bias = bias},
            e.stream, e.lt_workspace, e.lt_workspace_bytes);
}

//! The product before GELU and GELU itself: pre16[N][OC] = in16 . w^T + b (GELU's input, kept for
//! its backward), out16 = GELU of that sum (before its rounding to pre16's bf16), both bf16.
inline void matmul_gelu_lt(const env& e, fsdp::bf16* out16, fsdp::bf16* pre16, const fsdp::bf16* in16, const fsdp::bf16* w,
                           const fsdp::bf16* b, int N, int C, int OC) {
  e.lt->run({.ep = lt_matmul::epilogue::gelu_aux_bias, .op_a = CUBLAS_OP_T, .op_b = CUBLAS_OP_N, .m = OC, .n = N, .k = C, .a = w,
             .lda = C, .b = in16, .ldb = C, .d = out16, .d_type = CUDA_R_16BF, .ldd = OC, .bias = b, .aux = pre16, .ld_aux = OC},
            e.stream, e.lt_workspace, e.lt_workspace_bytes);
}

//! GELU's backward through the product after it: din16[N][C] = (dout16[N][OC] . w[OC][C]) times
//! GELU's derivative at pre16[N][C] (matmul_gelu_lt's), bf16; matmul_backward with a null din then
//! makes w's and its bias's gradients.
inline void matmul_dgelu_lt(const env& e, fsdp::bf16* din16, const fsdp::bf16* dout16, const fsdp::bf16* w, const fsdp::bf16* pre16,
                            int N, int C, int OC) {
  // As matmul_backward's din: column-major din^T (C x N) = w^T (the buffer w read as C x OC, ld C,
  // op N) . dout^T (OC x N, ld OC, op N); GELU's input has din's layout.
  e.lt->run({.ep = lt_matmul::epilogue::dgelu, .op_a = CUBLAS_OP_N, .op_b = CUBLAS_OP_N, .m = C, .n = N, .k = OC, .a = w, .lda = C,
             .b = dout16, .ldb = OC, .d = din16, .d_type = CUDA_R_16BF, .ldd = C, .aux = const_cast<fsdp::bf16*>(pre16), .ld_aux = C},
            e.stream, e.lt_workspace, e.lt_workspace_bytes);
}

//! Layer norm over the last axis of in[N][C]; keeps mean[N] and rstd[N] (1/stddev) for backward.
//! With out16, also out rounded to bf16 there (a GEMM's operand, made in the same pass); out may
//! then be null (the f32 values not kept).
template <class P>
void layernorm_forward(const env& e, float* out, float* mean, float* rstd, const float* in, const P* w, const P* b, int N, int C,
                       fsdp::bf16* out16 = nullptr) {
  detail::layernorm_forward_kernel<<<blocks_for(z(N), threads / 32), threads, 0, e.stream>>>(out, mean, rstd, in, w, b, N, C, out16);
  detail::check_launch("layernorm_forward");
}

//! The residual connection and the layer norm after it in one pass (activation_options::
//! fused_elementwise): x[N][C] += bias + residual (x holds a product's output and becomes the
//! residual stream), then layernorm_forward of x. The same bits as bias_epilogue(x, bias, N, C,
//! residual) then layernorm_forward, reading x once instead of twice, in one launch.
template <class P>
void residual_layernorm_forward(const env& e, float* x, const P* bias, const float* residual, float* out, float* mean, float* rstd,
                                const P* w, const P* b, int N, int C, fsdp::bf16* out16 = nullptr) {
  detail::residual_layernorm_forward_kernel<<<blocks_for(z(N), threads / 32), threads, 0, e.stream>>>(x, bias, residual, out, mean, rstd,
                                                                                                      w, b, N, C, out16);
  detail::check_launch("residual_layernorm_forward");
}

//! din[N][C] += d in, dw[C] += sum dout xhat, db[C] += sum dout (dw, db may be null). With
//! din16, also the new din rounded to bf16 there.
template <class P>
void layernorm_backward(const env& e, float* din, P* dw, P* db, const float* dout, const float* in, const P* w, const float* mean,
                        const float* rstd, int N, int C, fsdp::bf16* din16 = nullptr) {
  detail::layernorm_backward_kernel<<<blocks_for(z(N), threads / 32), threads, 0, e.stream>>>(din, dout, in, w, mean, rstd, N, C, din16);
  detail::check_launch("layernorm_backward");
  if (!dw && !db) return;
  const int chunks = (N + detail::rows_per_chunk - 1) / detail::rows_per_chunk;
  detail::layernorm_param_partials_kernel<<<dim3(blocks_for(z(C)), static_cast<unsigned>(chunks)), threads, 0, e.stream>>>(
      e.partials, dout, in, mean, rstd, N, C);
  detail::check_launch("layernorm_param_partials");
  if (dw) detail::add_column_sums_kernel<<<blocks_for(z(C)), threads, 0, e.stream>>>(dw, e.partials, chunks, 2 * C, C);
  if (db) detail::add_column_sums_kernel<<<blocks_for(z(C)), threads, 0, e.stream>>>(db, e.partials + C, chunks, 2 * C, C);
  detail::check_launch("add_column_sums (layernorm)");
}

//! Causal multi-head self-attention. qkv[B][T][3C] holds q | k | v; att[B][H][T][T] keeps the
//! softmax probabilities for backward (zero above the diagonal); out[B][T][C] is the heads'
//! outputs side by side. Uses e.heads and e.head_rows.
inline void attention_forward(const env& e, float* out, float* att, const float* qkv, int B, int T, int C, int H) {
  const int hs = C / H, BH = B * H;
  const std::size_t per = z(B) * z(T) * z(C);  // elements of one of q, k, v in [B][H][T][hs]
  float *q = e.heads, *k = e.heads + per, *v = e.heads + 2 * per, *y = e.head_rows;
  for (int part = 0; part < 3; ++part) {
    detail::heads_from_rows_kernel<<<blocks_for(per), threads, 0, e.stream>>>(e.heads + z(part) * per, qkv + z(part) * z(C), 3 * C, B, T, H, hs);
    detail::check_launch("attention: q, k, v to heads");
  }
  const long long shs = static_cast<long long>(T) * hs, stt = static_cast<long long>(T) * T;
  // scores[t][t2] = q[t] . k[t2] per (b, h): row-major S = Q K^T is column-major S^T = K Q^T,
  // where the buffers K, Q read as K^T, Q^T (hs x T, ld hs): op(K) = T, op(Q) = N.
  detail::gemm_batched(e, CUBLAS_OP_T, CUBLAS_OP_N, T, T, hs, k, hs, shs, q, hs, shs, att, T, stt, BH, "attention: q.k");
  detail::attention_softmax_kernel<<<blocks_for(z(BH) * z(T), threads / 32), threads, 0, e.stream>>>(
      att, BH * T, T, 1.0f / sqrtf(static_cast<float>(hs)));
  detail::check_launch("attention_softmax");
  // y = P V: column-major y^T (hs x T) = V^T (buffer V, ld hs, op N) . P^T (buffer P, ld T, op N).
  detail::gemm_batched(e, CUBLAS_OP_N, CUBLAS_OP_N, hs, T, T, v, hs, shs, att, T, stt, y, hs, shs, BH, "attention: att.v");
  detail::rows_from_heads_kernel<<<blocks_for(per), threads, 0, e.stream>>>(out, C, y, false, B, T, H, hs);
  detail::check_launch("attention: heads to rows");
}

//! Given dout[B][T][C]: dqkv[B][T][3C] += d qkv, from qkv and att as attention_forward left
//! them. Uses e.heads, e.dheads, e.head_rows and e.dscores.
inline void attention_backward(const env& e, float* dqkv, const float* dout, const float* qkv, const float* att, int B, int T, int C, int H) {
  const int hs = C / H, BH = B * H;
  const std::size_t per = z(B) * z(T) * z(C);
  const float *q = e.heads, *k = e.heads + per, *v = e.heads + 2 * per;
  float *dq = e.dheads, *dk = e.dheads + per, *dv = e.dheads + 2 * per, *dy = e.head_rows, *ds = e.dscores;
  for (int part = 0; part < 3; ++part) {
    detail::heads_from_rows_kernel<<<blocks_for(per), threads, 0, e.stream>>>(e.heads + z(part) * per, qkv + z(part) * z(C), 3 * C, B, T, H, hs);
    detail::check_launch("attention backward: q, k, v to heads");
  }
  detail::heads_from_rows_kernel<<<blocks_for(per), threads, 0, e.stream>>>(dy, dout, C, B, T, H, hs);
  detail::check_launch("attention backward: dout to heads");
  const long long shs = static_cast<long long>(T) * hs, stt = static_cast<long long>(T) * T;
  // dp = dy V^T (as q.k in forward, with dy for Q and V for K).
  detail::gemm_batched(e, CUBLAS_OP_T, CUBLAS_OP_N, T, T, hs, v, hs, shs, dy, hs, shs, ds, T, stt, BH, "attention backward: dy.v");
  // dV = P^T dy: column-major dV^T (hs x T) = dy^T (buffer dy, ld hs, op N) . P (buffer P read
  // as P^T, ld T, so op T).
  detail::gemm_batched(e, CUBLAS_OP_N, CUBLAS_OP_T, hs, T, T, dy, hs, shs, att, T, stt, dv, hs, shs, BH, "attention backward: att^T.dy");
  detail::attention_softmax_backward_kernel<<<blocks_for(z(BH) * z(T), threads / 32), threads, 0, e.stream>>>(
      ds, att, BH * T, T, 1.0f / sqrtf(static_cast<float>(hs)));
  detail::check_launch("attention_softmax_backward");
  // dQ = dS K (as y = P V in forward); dK = dS^T Q (as dV = P^T dy).
  detail::gemm_batched(e, CUBLAS_OP_N, CUBLAS_OP_N, hs, T, T, k, hs, shs, ds, T, stt, dq, hs, shs, BH, "attention backward: ds.k");
  detail::gemm_batched(e, CUBLAS_OP_N, CUBLAS_OP_T, hs, T, T, q, hs, shs, ds, T, stt, dk, hs, shs, BH, "attention backward: ds^T.q");
  for (int part = 0; part < 3; ++part) {
    detail::rows_from_heads_kernel<<<blocks_for(per), threads, 0, e.stream>>>(dqkv + z(part) * z(C), 3 * C, e.dheads + z(part) * per, true, B, T, H, hs);
    detail::check_launch("attention backward: heads to rows");
  }
}

//! out[i] = in[i] rounded to bf16 (the fused attention's operands, attention_cudnn.hpp).
inline void to_bf16(const env& e, fsdp::bf16* out, const float* in, std::size_t n) {
  detail::to_bf16_kernel<<<blocks_for(n), threads, 0, e.stream>>>(out, in, n);
  detail::check_launch("to_bf16");
}

//! out[i] = in[i], or out[i] += in[i] with `add`, in float.
inline void from_bf16(const env& e, float* out, const fsdp::bf16* in, std::size_t n, bool add) {
  detail::from_bf16_kernel<<<blocks_for(n), threads, 0, e.stream>>>(out, in, n, add);
  detail::check_launch("from_bf16");
}

//! GELU, tanh approximation (GPT-2's), on n elements (and, with out16, out rounded to bf16 there).
inline void gelu_forward(const env& e, float* out, const float* in, std::size_t n, fsdp::bf16* out16 = nullptr) {
  detail::gelu_forward_kernel<<<blocks_for(n), threads, 0, e.stream>>>(out, in, n, out16);
  detail::check_launch("gelu_forward");
}

//! din[i] += dout[i] gelu'(in[i]) (fused_elementwise: gelu_backward_bias).
inline void gelu_backward(const env& e, float* din, const float* in, const float* dout, std::size_t n) {
  detail::gelu_backward_kernel<<<blocks_for(n), threads, 0, e.stream>>>(din, in, dout, n);
  detail::check_launch("gelu_backward");
}

//! GELU's backward and the bias gradient of the product before GELU in one pass
//! (activation_options::fused_elementwise): din[N][cols] = dout gelu'(in + b), where `in` is the
//! product without its bias b (bias_epilogue without keep_out), written to din and to its bf16
//! copy din16 (each may be null: with bf16 operands only din16 is read, by the product's
//! backward), and db[cols] += din's column sums (db may be null: frozen). The same bits as
//! gelu_backward (of in + b, the same float sum as the forward's) into zeros, then
//! matmul_backward's bias gradient of din, without din's float values written and read back (8
//! bytes an element).
template <class P>
void gelu_backward_bias(const env& e, float* din, fsdp::bf16* din16, const float* in, const P* b, const float* dout, int N, int cols,
                        P* db) {
  const int chunks = (N + detail::rows_per_chunk - 1) / detail::rows_per_chunk;
  detail::gelu_backward_partials_kernel<<<dim3(blocks_for(z(cols)), static_cast<unsigned>(chunks)), threads, 0, e.stream>>>(
      e.partials, din, din16, in, b, dout, N, cols);
  detail::check_launch("gelu_backward_partials");
  if (db) {
    detail::add_column_sums_kernel<<<blocks_for(z(cols)), threads, 0, e.stream>>>(db, e.partials, chunks, cols, cols);
    detail::check_launch("add_column_sums (gelu)");
  }
}

//! probs[N][V] holds logits and becomes their softmax; losses[N] = -log max(p[target], 1e-30);
//! *loss (one device double) = their mean, summed in double in a fixed order. targets: [N] bytes.
inline void crossentropy_forward(const env& e, float* probs, float* losses, double* loss, const std::uint8_t* targets, int N, int V) {
  detail::crossentropy_forward_kernel<<<blocks_for(z(N), threads / 32), threads, 0, e.stream>>>(probs, losses, targets, N, V);
  detail::check_launch("crossentropy_forward");
  detail::mean_loss_kernel<<<1, threads, 0, e.stream>>>(loss, losses, N);
  detail::check_launch("mean_loss");
}

//! dlogits[N][V] = (probs - onehot(target)) / (N micro): model.hpp's head_backward scaling (one
//! of `micro` micro-batches, whose gradients add up to the whole batch's mean), and its bf16 copy
//! dlogits16 when given; dlogits may then be null (only the copy is read).
inline void crossentropy_backward(const env& e, float* dlogits, const float* probs, const std::uint8_t* targets, int N, int V, int micro,
                                  fsdp::bf16* dlogits16 = nullptr) {
  detail::crossentropy_backward_kernel<<<blocks_for(z(N) * z(V)), threads, 0, e.stream>>>(dlogits, probs, targets, N, V,
                                                                                         static_cast<float>(N * micro), dlogits16);
  detail::check_launch("crossentropy_backward");
}

}  // namespace kernels

}  // namespace gpt::cuda
