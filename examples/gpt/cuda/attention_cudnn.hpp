#pragma once
// gpt/cuda/attention_cudnn.hpp: causal self-attention through cuDNN's fused scaled-dot-product
// attention (its flash-attention graphs, forward and backward), for `train_gpt --device cuda
// --attention cudnn`. Against kernels.cuh's attention (the plain one, which the tests compare
// with the CPU): no T x T matrix kept per layer (the plain one keeps B H T T floats per layer,
// about 200 MB at GPT-2 small's shape and 4 sequences; the deterministic backward's one shared
// workspace holds B H T T bf16), no head-layout shuffles (q, k and v are read
// out of the qkv rows through strides), bf16 operands on tensor cores with f32 softmax.
//
// Why cuDNN and not a kernel of our own: it is NVIDIA's tuned flash attention for each GPU
// generation, what llm.c uses on GPUs (+35% on its GPT-2 step) and what PyTorch's SDPA picks on
// Hopper; a hand-written flash kernel at that speed is thousands of lines.
//
// Plain C++ (no cuDNN type in it): attention_cudnn.cpp, compiled once into the programs that
// use it, holds the cuDNN frontend (a header-only C++ library from PyPI's nvidia-cudnn-frontend,
// which scripts/setup.sh unpacks into .pydeps/cudnn-frontend). cuDNN itself is loaded when the
// first cudnn_attention is made (dlopen of libcudnn.so.9), so a program built with this runs
// without cuDNN as long as nobody asks for it, and one that asks gets an error naming it.
//
// Not yet run on a GPU (docs/gpu.md, "Not yet run on a GPU").

#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <string>

#include <fsdp/core/dtype.hpp>

namespace gpt::cuda {

//! Whether attention_cudnn.cpp was built with cuDNN's frontend (CMake found cudnn_frontend.h
//! and cudnn.h); without, making a cudnn_attention throws.
bool cudnn_built() noexcept;

//! Points cuDNN's frontend at this program's libcudart (CUDNN_FRONTEND_CUDART_LIB_NAME, unless
//! set): it sets an environment variable, so a program with several threads calls it before
//! they start (cudnn_attention calls it too, a no-op then).
void choose_cudnn_cudart();

//! Causal multi-head self-attention of sequences of T >= 2 tokens, C wide, H heads (C / H a
//! multiple of 8, at most 256 on Hopper and Blackwell, 128 on older GPUs: cuDNN's bounds), on one
//! CUDA stream of the current device. Layouts (row-major, N = B T): qkv [N][3C] holds q | k | v
//! per token with head h at columns h C/H .. (h+1) C/H of each, as kernels.cuh's attention reads them; out [N][C] the heads' outputs side by side;
//! stats [B][H][T] f32, what forward keeps for backward (each row's softmax log-sum-exp).
//!
//! Built graphs are cached per batch size B. `workspace` is device memory of at least
//! workspace_bytes(B) bytes, not touched by anything else while the stream runs the call (the
//! deterministic backward's holds B x H x T x T bf16 scores: the .cpp says when not).
class cudnn_attention {
 public:
  //! Loads cuDNN and makes its handle, bound to `stream`. `deterministic`: the backward gives the
  //! same bits every run (its dQ summed without atomics), through a B H T T workspace (above);
  //! false lets cuDNN sum with atomics. Throws fsdp::error: errc::no_device ("cuDNN:
  //! ...") when libcudnn.so.9 cannot be loaded or finds no usable GPU, errc::invalid_argument for
  //! a shape cuDNN does not take or a build without cuDNN.
  cudnn_attention(cudaStream_t stream, int T, int C, int H, bool deterministic = true);
  ~cudnn_attention();
  cudnn_attention(const cudnn_attention&) = delete;
  cudnn_attention& operator=(const cudnn_attention&) = delete;

  //! The workspace the forward and backward graphs of B sequences need (builds them once).
  std::size_t workspace_bytes(int B);
  //! out = attention(qkv), stats for backward.
  void forward(fsdp::bf16* out, float* stats, const fsdp::bf16* qkv, int B, void* workspace, std::size_t workspace_size);
  //! dqkv [N][3C] = d loss / d qkv (overwritten, not added), given dout = d loss / d out and
  //! what forward read and wrote.
  void backward(fsdp::bf16* dqkv, const fsdp::bf16* dout, const fsdp::bf16* out, const float* stats, const fsdp::bf16* qkv,
                int B, void* workspace, std::size_t workspace_size);
  //! "cuDNN 9.19.0 (frontend 1.32.0)": the library loaded and the frontend compiled in.
  std::string version() const;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace gpt::cuda
