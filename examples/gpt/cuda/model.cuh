#pragma once
// gpt/cuda/model.cuh: gpt/model.hpp's GPT on a CUDA device. The same parameters (a gpt::model<T>
// holds them: the same gpt::embedding<T> and gpt::block<T>, names, shapes and order, so
// gpt::add_units, gpt::parameter_names and gpt::initial_values work unchanged on
// parameters()), the same pieces of a step, the same hook calls in the same order; the work is
// the kernels of gpt/cuda/kernels.cuh on the device's compute stream.
//
// While a unit is in use, its parameters' data() and grad() must point at DEVICE memory (a
// shard_group on an fsdp::cuda_device does that; so does a test binding device arrays).
//
//   fsdp::cuda_device gpu{0};
//   gpt::cuda::model<float> m(cfg, gpu);
//   gpt::add_units(group, m.parameters());                  // group: a shard_group on `gpu`
//   group.finalize(...);
//   gpt::cuda::activations acts(gpu, cfg, batch);           // once; reused every step
//   double loss = gpt::cuda::forward_backward(group, m, acts, tokens, targets, batch);

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include <fsdp/device/cuda.hpp>
#include <fsdp/fsdp.hpp>

#include "gpt/cuda/attention_cudnn.hpp"
#include "gpt/cuda/kernels.cuh"
#include "gpt/cuda/token_rows.hpp"
#include "gpt/model.hpp"

namespace gpt::cuda {

//! How the blocks compute attention: kernels.cuh's plain kernels (T x T scores in f32, the
//! reference the tests compare with the CPU), or cuDNN's fused flash attention in bf16
//! (attention_cudnn.hpp).
enum class attention_kind { plain, cudnn };

//! How activations are kept and what the blocks compute with them (see activations).
struct activation_options {
  attention_kind attention = attention_kind::plain;
  //! cuDNN's backward the same bits every run (the default: through a B H T T workspace), or
  //! summed with atomics (cudnn_attention). The plain kernels are deterministic either way.
  bool deterministic_attention = true;
  //! Blocks share one set of buffers but their inputs; backward re-runs each block's forward.
  bool recompute = false;
  //! The elementwise work fused (train_gpt --elementwise fused): with bf16 parameters each matrix
  //! product's bf16 operands are written by the kernel that makes their values (layer norm, GELU,
  //! the loss's backward, cuDNN's attention) instead of by a cast before the product (the copies
  //! took 10% of an H200 step, docs/gpu.md); a product's bias is added in one pass with what
  //! follows it (the residual connection, GELU, the cast for cuDNN: kernels::bias_epilogue), and
  //! with the layer norm after the attention's residual connection (residual_layernorm_forward);
  //! GELU's backward sums the bias gradient before it (gelu_backward_bias). The same bits either
  //! way. Off by default until it has run on a GPU (docs/gpu.md).
  bool fused_elementwise = false;
  //! The products' elementwise work in cuBLASLt's epilogues (train_gpt --elementwise cublaslt;
  //! kernels.cuh's *_lt products): qkv's bias, with its bf16 output for cuDNN (the plain attention
  //! reads f32); the attention's projection and the MLP's output product each with its bias and
  //! residual connection, writing the residual stream; fc's bias and GELU with GELU's input kept
  //! in bf16 (no float fc); GELU's backward in the product before it, writing its bf16 gradient
  //! (no float d_fc_gelu). Needs bf16 parameters and fused_elementwise (whose other passes it
  //! keeps); either attention. Not the same bits as fused_elementwise (bf16 outputs rounded once,
  //! GELU's backward at bf16 input): bf16's tolerances. Off by default until it has run on a GPU
  //! (docs/gpu.md).
  bool cublaslt_epilogues = false;
};

//! What a forward pass keeps for backward, and the step's scratch: device buffers for up to
//! `batch()` sequences of `cfg.seq` tokens, allocated once through an fsdp::cuda_device (so
//! they count in its memory stats, as persistent: they live for the whole run, unlike what
//! fsdp gathers and frees each step) and reused every step. Shapes with N = B T, B = batch():
//! as gpt::activations, plus what the GPU needs besides. For GPT-2 small (12 layers, C = 768,
//! H = 12, T = 1024) and B = 8: 0.8 GB per layer (half of it att: 16 N C + B H T T floats) plus
//! 1.0 GB of shared scratch (0.1 GB more for bf16 parameters), about 10.7 GB in all (plain
//! attention, f32 parameters). With attention_kind::cudnn no T x T matrix per layer (cuDNN's one
//! workspace: B H T T bf16 for the deterministic backward): a layer keeps q, k, v
//! and the heads' outputs in bf16 as cuDNN reads and wrote them, and B H T floats of softmax
//! statistics; with bf16 parameters and fused_elementwise (below) that is 6 N C floats and 10 N C
//! bf16 a layer, about 0.28 GB at that shape.
//!
//! Throws errc::no_device (from the device) without a usable GPU, errc::invalid_argument for
//! batch < 1 or a config that does not describe a model (heads not dividing dim, ...); with
//! attention_kind::cudnn what cudnn_attention throws (cuDNN absent, a head size it does not take).
//!
//! With bf16 parameters and fused_elementwise, the float activations read only as a product's
//! operand (ln1, ln2, fc_gelu, lnf, and atty with cuDNN's attention) are null: their bf16 copies
//! are what the products read (6 N C floats a layer fewer, 7 with cuDNN: 24-28 N C bytes). With
//! cuDNN and fused_elementwise qkv's float product is one scratch for all blocks (3 N C a layer).
//!
//! With `recompute` (activation checkpointing, train_gpt --recompute) a block keeps only its
//! input x; the other per-block buffers are one set that every block uses in turn, and
//! forward_backward re-runs each block's forward inside its backward scope (shard_group's
//! recompute(u): the unit is still gathered there). At GPT-2 small's shape and B = 8 that is 25 MB
//! a layer instead of 0.8 GB (plain attention) or 0.28 GB (cudnn, fused), for one more forward
//! pass of the blocks: what lets a rank run bigger batches.
//!
//! With cublaslt_epilogues (and cuDNN) a layer keeps x and x_mid as floats and 14 N C bf16 (GELU's
//! input fc16 instead of the float fc, no float qkv scratch): the bytes of 9 N C floats where the
//! fused passes keep 11 (0.23 GB at that shape, 8 sequences), and the shared scratch has no float
//! d_fc_gelu.
class activations {
 public:
  struct per_block {
    float* x;                              // [N][C]: the block's input (residual stream)
    float *ln1, *ln1_mean, *ln1_rstd;      // [N][C], [N], [N]
    float* qkv;                            // [N][3C] (with cuDNN and fused passes the product's scratch, one for all blocks; null with cuBLASLt's epilogues)
    float* att;                            // [B][H][T][T]: softmax probabilities (plain attention)
    fsdp::bf16 *qkv16, *atty16;            // [N][3C], [N][C]: cuDNN's operands and output (cudnn)
    float* att_stats;                      // [B][H][T]: cuDNN's softmax statistics (cudnn)
    fsdp::bf16 *ln1_16, *ln2_16, *fc_gelu16;  // [N][C], [N][C], [N][4C]: bf16 GEMM operands (fused_elementwise)
    float* atty;                           // [N][C]: attention output, before proj
    float* x_mid;                          // [N][C]: x + proj(attention)
    float *ln2, *ln2_mean, *ln2_rstd;      // [N][C], [N], [N]
    float *fc, *fc_gelu;                   // [N][4C] (fc: with fused passes, the product before its bias)
    fsdp::bf16* fc16;                      // [N][4C]: GELU's input in bf16, instead of fc (cublaslt_epilogues)
  };
  std::vector<per_block> blocks;
  float* x_final;                          // [N][C]: the last block's output
  float *lnf, *lnf_mean, *lnf_rstd;        // [N][C], [N], [N]
  float* probs;                            // [N][V]: softmax of the logits
  float* losses;                           // [N]: -log p[target] per token
  double* loss;                            // [1]: their mean
  float* dx;                               // [N][C]: the gradient flowing down the residual stream
  // Backward scratch, shared by the blocks.
  float *d_fc_gelu, *d_fc;                 // [N][4C] (d_fc null where its bf16 copy d_fc16 is read; d_fc_gelu with cuBLASLt's epilogues)
  float *d_ln, *d_atty;                    // [N][C]
  float* d_qkv;                            // [N][3C] (null where cuDNN's bf16 d qkv is read instead)
  float* dlogits;                          // [N][V] (null where only its bf16 copy dlogits16 is read)
  std::uint8_t* batch_bytes;               // [2][N]: the tokens, then the targets (then the two below)
  std::int32_t *token_starts, *token_rows;  // [V + 1], [N]: the rows grouped by token (token_rows.hpp)
  // bf16 GEMM operands written by their producers (fused_elementwise; else null).
  fsdp::bf16 *lnf16 = nullptr, *dlogits16 = nullptr;  // [N][C], [N][V]
  fsdp::bf16 *dx16 = nullptr, *d_fc16 = nullptr;      // [N][C], [N][4C]

  //! For parameters of type `params` (f32, or bf16: then the GEMM operand copies are allocated).
  activations(const fsdp::cuda_device& dev, const config& c, int batch, fsdp::dtype params = fsdp::dtype::f32,
              activation_options opts = {})
      : dev_(dev), cfg_(c), batch_(batch), params_(params), opts_(opts) {
    check(c, batch, params, opts);
    const std::size_t B = z(batch), T = z(c.seq), C = z(c.dim), H = z(c.heads), V = z(c.vocab), N = B * T;
    const bool fused = opts.attention == attention_kind::cudnn, recompute = opts.recompute, lt = opts.cublaslt_epilogues;
    // The bf16 operands the producers write (null: a cast before the product).
    const bool in_producers = params == fsdp::dtype::bf16 && opts.fused_elementwise;
    auto operand = [&](std::size_t n) { return in_producers ? halves(n) : nullptr; };
    // A float activation read only as a product's operand is not kept where its bf16 copy is.
    auto unless_operand = [&](std::size_t n) { return in_producers ? nullptr : floats(n); };
    if (fused) {  // first: a missing cuDNN or a shape it does not take fails before any allocation
      dev_.make_current();
      fused_ = std::make_unique<cudnn_attention>(dev_.compute_stream(), c.seq, c.dim, c.heads, opts.deterministic_attention);
      workspace_size_ = fused_->workspace_bytes(batch);
    }
    // cuBLASLt's products share cuDNN's workspace: the one compute stream runs them one at a time.
    if (lt) workspace_size_ = std::max(workspace_size_, lt_matmul::workspace_bytes);
    if (fused || lt) workspace_ = bytes(std::max<std::size_t>(workspace_size_, 1), fsdp::mem_kind::persistent);
    const std::size_t att = fused ? 0 : B * H * T * T;
    // With cuDNN and fused passes qkv's product is read once, by the epilogue that writes its bf16
    // copy (what cuDNN reads and backward keeps): one scratch for every block, and with bf16
    // operands cuDNN's d qkv is read in bf16 too (no float d_qkv: attention_operands()).
    // With cuBLASLt's epilogues the product writes the bf16 copy itself: no float qkv at all.
    float* const qkv_scratch = fused && opts.fused_elementwise && !lt ? floats(N * 3 * C) : nullptr;
    blocks.resize(z(c.layers));
    for (std::size_t l = 0; l < blocks.size(); ++l) {
      per_block& s = blocks[l];
      if (recompute && l > 0) {  // every block's buffers are block 0's but its input: backward re-runs the block's forward
        s = blocks[0];
        s.x = floats(N * C);
        continue;
      }
      s.x = floats(N * C), s.ln1 = unless_operand(N * C), s.ln1_mean = floats(N), s.ln1_rstd = floats(N);
      s.qkv = lt && fused ? nullptr : qkv_scratch ? qkv_scratch : floats(N * 3 * C), s.att = fused ? nullptr : floats(att), s.x_mid = floats(N * C);
      s.atty = fused ? unless_operand(N * C) : floats(N * C);  // the plain attention writes it
      s.qkv16 = fused ? halves(N * 3 * C) : nullptr, s.atty16 = fused ? halves(N * C) : nullptr;
      s.att_stats = fused ? floats(B * H * T) : nullptr;
      s.ln1_16 = operand(N * C), s.ln2_16 = operand(N * C), s.fc_gelu16 = operand(N * 4 * C);
      s.ln2 = unless_operand(N * C), s.ln2_mean = floats(N), s.ln2_rstd = floats(N);
      s.fc = lt ? nullptr : floats(N * 4 * C), s.fc_gelu = unless_operand(N * 4 * C);
      s.fc16 = lt ? halves(N * 4 * C) : nullptr;
    }
    x_final = floats(N * C), lnf = unless_operand(N * C), lnf_mean = floats(N), lnf_rstd = floats(N);
    probs = floats(N * V), losses = floats(N), dx = floats(N * C);
    loss = static_cast<double*>(bytes(sizeof(double), fsdp::mem_kind::persistent));
    loss_host_ = static_cast<double*>(bytes(sizeof(double), fsdp::mem_kind::offloaded));  // pinned: an async read-back
    d_fc_gelu = lt ? nullptr : floats(N * 4 * C), d_fc = unless_operand(N * 4 * C), d_ln = floats(N * C), d_atty = floats(N * C);
    bias32_ = lt ? floats(4 * C) : nullptr;
    d_qkv = attention_operands() ? nullptr : floats(N * 3 * C), dlogits = unless_operand(N * V);
    // One upload a step: tokens and targets, then the rows grouped by token (copy_batch).
    batch_bytes = static_cast<std::uint8_t*>(bytes(batch_upload_bytes(), fsdp::mem_kind::persistent));
    token_starts = reinterpret_cast<std::int32_t*>(batch_bytes + rows_offset());
    token_rows = token_starts + V + 1;
    // kernels.cuh's scratch (see gpt::cuda::env); the cast areas only where a product's bf16
    // operand is not written by its producer (all are, with cuDNN's attention and fused passes).
    const std::size_t widest = std::max(4 * C, V);
    if (params == fsdp::dtype::bf16 && !(in_producers && fused)) {
      cast_a_ = static_cast<fsdp::bf16*>(bytes(N * widest * sizeof(fsdp::bf16), fsdp::mem_kind::persistent));
      cast_b_ = static_cast<fsdp::bf16*>(bytes(N * widest * sizeof(fsdp::bf16), fsdp::mem_kind::persistent));
    }
    partials_ = floats((N + detail::rows_per_chunk - 1) / detail::rows_per_chunk * 4 * C);
    lnf16 = operand(N * C), dlogits16 = operand(N * V), dx16 = operand(N * C), d_fc16 = operand(N * 4 * C);
    if (fused)
      dout16_ = halves(N * C), dqkv16_ = halves(N * 3 * C);
    else
      heads_ = floats(3 * N * C), dheads_ = floats(3 * N * C), head_rows_ = floats(N * C), dscores_ = floats(att);
  }
  //! The constructor's checks, before anything is allocated: throws errc::invalid_argument for
  //! batch < 1, a config that does not describe a model (heads not dividing dim, ...), parameters
  //! neither f32 nor bf16, or cublaslt_epilogues without bf16, fused_elementwise and a width that
  //! is a multiple of 8 (cuBLASLt's GELU input).
  static void check(const config& c, int batch, fsdp::dtype params, const activation_options& opts) {
    if (batch < 1 || c.seq < 1 || c.dim < 1 || c.heads < 1 || c.dim % c.heads != 0 || c.vocab < 1 || c.vocab > 256 || c.layers < 0)
      throw fsdp::error(fsdp::errc::invalid_argument, "gpt::cuda::activations: batch " + std::to_string(batch) +
                                                          " and a config with seq, dim, heads >= 1, heads dividing dim, "
                                                          "vocab in 1..256 expected");
    if (params != fsdp::dtype::f32 && params != fsdp::dtype::bf16)
      throw fsdp::error(fsdp::errc::invalid_argument, "gpt::cuda::activations: parameters are f32 or bf16");
    if (opts.cublaslt_epilogues && (params != fsdp::dtype::bf16 || !opts.fused_elementwise || c.dim % 8 != 0))
      throw fsdp::error(fsdp::errc::invalid_argument,
                        "gpt::cuda::activations: cuBLASLt's epilogues need bf16 parameters, the fused elementwise passes and a width "
                        "that is a multiple of 8 (got " + std::string(fsdp::to_string(params)) + ", fused " +
                            (opts.fused_elementwise ? "on" : "off") + ", width " + std::to_string(c.dim) + ")");
  }
  activations(const activations&) = delete;
  activations& operator=(const activations&) = delete;
  activations(activations&&) = default;  // the pointers are into owned_'s buffers, which do not move

  //! The most sequences a step may have.
  int batch() const noexcept { return batch_; }
  const config& cfg() const noexcept { return cfg_; }
  fsdp::dtype params() const noexcept { return params_; }
  const fsdp::cuda_device& device() const noexcept { return dev_; }
  const activation_options& options() const noexcept { return opts_; }
  //! Whether the blocks share one set of buffers (all but each block's input), so that backward
  //! must re-run a block's forward first (forward_backward does).
  bool recompute() const noexcept { return opts_.recompute; }
  //! cuDNN's bf16 attention output and d qkv as the products' operands (fused_elementwise).
  bool attention_operands() const noexcept { return fused_ && params_ == fsdp::dtype::bf16 && opts_.fused_elementwise; }
  //! The fused attention (attention_kind::cudnn), else null.
  cudnn_attention* fused() const noexcept { return fused_.get(); }
  //! Its scratch: bf16 d out [N][C] and d qkv [N][3C], and cuDNN's workspace.
  fsdp::bf16* dout16() const noexcept { return dout16_; }
  fsdp::bf16* dqkv16() const noexcept { return dqkv16_; }
  void* workspace() const noexcept { return workspace_; }
  std::size_t workspace_size() const noexcept { return workspace_size_; }
  //! Device bytes held (pinned host bytes not included).
  std::size_t bytes() const noexcept { return bytes_; }
  //! The kernels' environment: these buffers' scratch, `blas` (bound to the compute stream).
  //! With cublaslt_epilogues, `lt` (the model's) runs their products.
  env kernel_env(cublasHandle_t blas, lt_matmul* lt = nullptr) const {
    const bool with_lt = opts_.cublaslt_epilogues;
    return {.stream = dev_.compute_stream(), .blas = blas, .cast_a = cast_a_, .cast_b = cast_b_, .partials = partials_,
            .heads = heads_, .dheads = dheads_, .head_rows = head_rows_, .dscores = dscores_,
            .attention_compute = params_ == fsdp::dtype::bf16 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F,
            .lt = with_lt ? lt : nullptr, .lt_workspace = with_lt ? workspace_ : nullptr, .lt_workspace_bytes = with_lt ? workspace_size_ : 0,
            .bias32 = bias32_};
  }
  //! Reads the loss of the last head forward back to the host: the step's one synchronization
  //! (bounded by fsdp::default_timeout()).
  double read_loss() {
    fsdp::detail::cuda_check(cudaMemcpyAsync(loss_host_, loss, sizeof(double), cudaMemcpyDeviceToHost, dev_.compute_stream()),
                             "reading the loss back");
    dev_.synchronize(fsdp::default_timeout());
    return *loss_host_;
  }
  //! Copies tokens and targets ([B][T] bytes each, each < vocab: model::check_step checks them
  //! first) to batch_bytes, and the tokens' rows grouped by token to token_starts and token_rows:
  //! one async copy on the compute stream, from a host
  //! staging vector that stays alive (and is only rewritten after read_loss() has waited for the
  //! stream).
  void copy_batch(const std::vector<std::uint8_t>& tokens, const std::vector<std::uint8_t>& targets) {
    // int32 storage, so that the grouping is written as int32 objects; the bytes go in by memcpy.
    staging_.resize(batch_upload_bytes() / sizeof(std::int32_t));
    auto* raw = reinterpret_cast<std::uint8_t*>(staging_.data());
    std::memcpy(raw, tokens.data(), tokens.size());
    std::memcpy(raw + tokens.size(), targets.data(), targets.size());
    std::int32_t* starts = staging_.data() + rows_offset() / sizeof(std::int32_t);
    const std::size_t V = z(cfg_.vocab);
    group_rows_by_token(tokens, cfg_.vocab, {starts, V + 1}, {starts + V + 1, tokens.size()});
    fsdp::detail::cuda_check(cudaMemcpyAsync(batch_bytes, staging_.data(), batch_upload_bytes(), cudaMemcpyHostToDevice,
                                             dev_.compute_stream()),
                             "copying the batch to the device");
  }

 private:
  static std::size_t z(int x) { return static_cast<std::size_t>(x); }
  // The upload's layout: 2 N bytes of tokens and targets, then (4-aligned) V + 1 starts and N rows.
  std::size_t rows_offset() const { return (2 * z(batch_) * z(cfg_.seq) + 3) / 4 * 4; }
  std::size_t batch_upload_bytes() const { return rows_offset() + (z(cfg_.vocab) + 1 + z(batch_) * z(cfg_.seq)) * sizeof(std::int32_t); }
  void* bytes(std::size_t n, fsdp::mem_kind kind) {
    owned_.push_back(dev_.allocate(n, kind));
    if (kind != fsdp::mem_kind::offloaded) bytes_ += n;
    return owned_.back().data();
  }
  float* floats(std::size_t n) { return static_cast<float*>(bytes(n * sizeof(float), fsdp::mem_kind::persistent)); }
  fsdp::bf16* halves(std::size_t n) { return static_cast<fsdp::bf16*>(bytes(n * sizeof(fsdp::bf16), fsdp::mem_kind::persistent)); }

  fsdp::cuda_device dev_;
  config cfg_;
  int batch_ = 0;
  fsdp::dtype params_ = fsdp::dtype::f32;
  activation_options opts_;
  std::size_t bytes_ = 0;
  std::vector<fsdp::cuda_buffer> owned_;
  std::vector<std::int32_t> staging_;
  double* loss_host_ = nullptr;
  fsdp::bf16 *cast_a_ = nullptr, *cast_b_ = nullptr;
  float *partials_ = nullptr, *heads_ = nullptr, *dheads_ = nullptr, *head_rows_ = nullptr, *dscores_ = nullptr, *bias32_ = nullptr;
  std::unique_ptr<cudnn_attention> fused_;  // after owned_: destroyed first (its handle is on the stream)
  fsdp::bf16 *dout16_ = nullptr, *dqkv16_ = nullptr;
  void* workspace_ = nullptr;
  std::size_t workspace_size_ = 0;
};

//! The GPT of gpt/model.hpp on a CUDA device: its parameters (in a gpt::model<Param>, whose
//! CPU methods are not used), a cuBLAS handle bound to the device's compute stream, and the
//! pieces of a step. Throws errc::no_device without a usable GPU ("no CUDA device: ...").
template <class Param>
class model {
  static_assert(std::is_same_v<Param, float> || std::is_same_v<Param, fsdp::bf16>, "gpt::cuda::model: parameters are float or fsdp::bf16");

 public:
  model(const config& c, const fsdp::cuda_device& dev) : params_(c), dev_(dev) {
    dev_.make_current();
    cublasHandle_t h = nullptr;
    const cublasStatus_t s = cublasCreate(&h);
    if (s != CUBLAS_STATUS_SUCCESS)
      throw fsdp::error(fsdp::errc::no_device, std::string("no CUDA device: cublasCreate failed: ") + cublasGetStatusString(s));
    blas_.reset(h);
    detail::check_blas(cublasSetStream(h, dev_.compute_stream()), "cublasSetStream");
    // CUBLAS_DEFAULT_MATH: no TF32 for f32 products (the f32 path must match the CPU's).
    detail::check_blas(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
    lt_ = std::make_unique<lt_matmul>();  // here, before any step (the device current)
  }

  const config& cfg() const { return params_.cfg(); }
  int layers() const { return params_.layers(); }
  embedding<Param>& emb() { return params_.emb(); }
  block<Param>& layer(int l) { return params_.layer(l); }
  std::size_t numel() { return params_.numel(); }
  //! The parameters, for gpt::add_units(group, m.parameters()) and gpt::parameter_names.
  gpt::model<Param>& parameters() { return params_; }
  const fsdp::cuda_device& device() const { return dev_; }
  cublasHandle_t blas() const { return blas_.get(); }
  //! cuBLASLt's products (activations with cublaslt_epilogues): a.kernel_env(blas(), lt()).
  lt_matmul* lt() const { return lt_.get(); }

  // The pieces of a step, in the order forward_backward calls them; each enqueues its work on
  // the compute stream and returns. B <= a.batch(); the batch is on the device (copy_batch).

  //! x = wte[tokens] + wpe[positions].
  void embed_forward(activations& a, int B) {
    const env e = a.kernel_env(blas(), lt());
    float* x = cfg().layers > 0 ? a.blocks[0].x : a.x_final;
    kernels::embedding_forward(e, x, a.batch_bytes, emb().wte.data(), emb().wpe.data(), B, cfg().seq, cfg().dim);
  }

  //! Block l: reads a.blocks[l].x, writes the next block's x (or x_final).
  void block_forward(activations& a, int l, int B) {
    using namespace kernels;
    const env e = a.kernel_env(blas(), lt());
    const int T = cfg().seq, C = cfg().dim, H = cfg().heads, N = B * T;
    block<Param>& p = layer(l);
    auto& s = a.blocks[z(l)];
    cudnn_attention* fused = a.fused();
    float* next = l + 1 < layers() ? a.blocks[z(l + 1)].x : a.x_final;
    if constexpr (std::is_same_v<Param, fsdp::bf16>) {
      if (a.options().cublaslt_epilogues) {  // each product with the pass after it (bf16)
        layernorm_forward(e, s.ln1, s.ln1_mean, s.ln1_rstd, s.x, p.ln1_w.data(), p.ln1_b.data(), N, C, s.ln1_16);
        const fsdp::bf16* atty16 = s.atty16;
        if (fused) {
          matmul_bias_lt(e, s.qkv16, nullptr, nullptr, s.ln1_16, p.qkv_w.data(), p.qkv_b.data(), N, C, 3 * C);
          fused->forward(s.atty16, s.att_stats, s.qkv16, B, a.workspace(), a.workspace_size());
        } else {  // the plain attention reads and writes f32; its output is cast for the projection
          matmul_bias_lt(e, nullptr, s.qkv, nullptr, s.ln1_16, p.qkv_w.data(), p.qkv_b.data(), N, C, 3 * C);
          attention_forward(e, s.atty, s.att, s.qkv, B, T, C, H);
          to_bf16(e, e.cast_a, s.atty, z(N) * z(C));
          atty16 = e.cast_a;
        }
        matmul_bias_lt(e, nullptr, s.x_mid, s.x, atty16, p.proj_w.data(), p.proj_b.data(), N, C, C);  // + x
        layernorm_forward(e, s.ln2, s.ln2_mean, s.ln2_rstd, s.x_mid, p.ln2_w.data(), p.ln2_b.data(), N, C, s.ln2_16);
        matmul_gelu_lt(e, s.fc_gelu16, s.fc16, s.ln2_16, p.fc_w.data(), p.fc_b.data(), N, C, 4 * C);
        matmul_bias_lt(e, nullptr, next, s.x_mid, s.fc_gelu16, p.out_w.data(), p.out_b.data(), N, 4 * C, C);  // + x_mid
        return;
      }
    }
    // With fused_elementwise each product's bias goes into the pass after it (bias_epilogue);
    // else each step is its own pass: the same bits.
    const bool epilogues = a.options().fused_elementwise;
    auto bias = [&](const Param* b) { return epilogues ? nullptr : b; };
    layernorm_forward(e, s.ln1, s.ln1_mean, s.ln1_rstd, s.x, p.ln1_w.data(), p.ln1_b.data(), N, C, s.ln1_16);
    matmul_forward(e, s.qkv, s.ln1, p.qkv_w.data(), bias(p.qkv_b.data()), N, C, 3 * C, s.ln1_16);
    // cuDNN reads only qkv's bf16 copy: qkv is then the product's scratch, not written back.
    const bool keep_qkv = !fused;
    if (epilogues) bias_epilogue(e, s.qkv, p.qkv_b.data(), N, 3 * C, nullptr, false, nullptr, fused ? s.qkv16 : nullptr, keep_qkv);
    if (fused) {
      if (!epilogues) to_bf16(e, s.qkv16, s.qkv, 3 * z(N) * z(C));
      fused->forward(s.atty16, s.att_stats, s.qkv16, B, a.workspace(), a.workspace_size());
      if (s.atty) from_bf16(e, s.atty, s.atty16, z(N) * z(C), false);  // null: only its bf16 copy is read
    } else {
      attention_forward(e, s.atty, s.att, s.qkv, B, T, C, H);
    }
    // cuDNN's bf16 output is exactly atty rounded to bf16 (atty is its f32 copy).
    matmul_forward(e, s.x_mid, s.atty, p.proj_w.data(), bias(p.proj_b.data()), N, C, C, a.attention_operands() ? s.atty16 : nullptr);
    if (epilogues) {  // the bias, the residual connection and the layer norm after it: one pass
      residual_layernorm_forward(e, s.x_mid, p.proj_b.data(), s.x, s.ln2, s.ln2_mean, s.ln2_rstd, p.ln2_w.data(), p.ln2_b.data(), N, C,
                                 s.ln2_16);
    } else {
      residual_add(e, s.x_mid, s.x, z(N) * z(C));
      layernorm_forward(e, s.ln2, s.ln2_mean, s.ln2_rstd, s.x_mid, p.ln2_w.data(), p.ln2_b.data(), N, C, s.ln2_16);
    }
    matmul_forward(e, s.fc, s.ln2, p.fc_w.data(), bias(p.fc_b.data()), N, C, 4 * C, s.ln2_16);
    // fc keeps the product without its bias: GELU's backward adds it again (the same sum), so the
    // pass does not write fc back.
    if (epilogues) bias_epilogue(e, s.fc, p.fc_b.data(), N, 4 * C, nullptr, true, s.fc_gelu, s.fc_gelu16, false);
    else gelu_forward(e, s.fc_gelu, s.fc, z(N) * z(4 * C));
    matmul_forward(e, next, s.fc_gelu, p.out_w.data(), bias(p.out_b.data()), N, 4 * C, C, s.fc_gelu16);
    if (epilogues) bias_epilogue(e, next, p.out_b.data(), N, C, s.x_mid);
    else residual_add(e, next, s.x_mid, z(N) * z(C));
  }

  //! The final layer norm, the tied head and the loss of predicting the targets; the mean loss
  //! stays on the device (a.loss) until a.read_loss().
  void head_forward(activations& a, int B) {
    using namespace kernels;
    const env e = a.kernel_env(blas(), lt());
    const int T = cfg().seq, C = cfg().dim, V = cfg().vocab, N = B * T;
    layernorm_forward(e, a.lnf, a.lnf_mean, a.lnf_rstd, a.x_final, emb().lnf_w.data(), emb().lnf_b.data(), N, C, a.lnf16);
    matmul_forward(e, a.probs, a.lnf, emb().wte.data(), static_cast<const Param*>(nullptr), N, C, V, a.lnf16);
    crossentropy_forward(e, a.probs, a.losses, a.loss, a.batch_bytes + z(N), N, V);
  }

  //! Backward of head_forward: d loss / d logits = (probs - onehot(target)) / (N micro).
  void head_backward(activations& a, int B, int micro = 1) {
    using namespace kernels;
    const env e = a.kernel_env(blas(), lt());
    const int T = cfg().seq, C = cfg().dim, V = cfg().vocab, N = B * T;
    crossentropy_backward(e, a.dlogits, a.probs, a.batch_bytes + z(N), N, V, micro, a.dlogits16);
    matmul_backward(e, a.d_ln, emb().wte.grad(), static_cast<Param*>(nullptr), a.dlogits, a.lnf, emb().wte.data(), N, C, V, a.dlogits16,
                    a.lnf16);
    zero(e, a.dx, z(N) * z(C));
    // dx and its bf16 copy: the last block's first operand in its backward.
    layernorm_backward(e, a.dx, emb().lnf_w.grad(), emb().lnf_b.grad(), a.d_ln, a.x_final, emb().lnf_w.data(), a.lnf_mean,
                       a.lnf_rstd, N, C, a.dx16);
  }

  //! Backward of block l: a.dx holds d loss / d (block output) and becomes d loss / d (input).
  void block_backward(activations& a, int l, int B) {
    using namespace kernels;
    const env e = a.kernel_env(blas(), lt());
    const int T = cfg().seq, C = cfg().dim, H = cfg().heads, N = B * T;
    const std::size_t NC = z(N) * z(C);
    block<Param>& p = layer(l);
    auto& s = a.blocks[z(l)];
    // Fused: the kernels of this file that would add into zeros write instead (the same values,
    // without the zero fill): GELU's backward (with fc's bias gradient) into d_fc, cuDNN's d qkv
    // into d_qkv.
    const bool overwrite = a.options().fused_elementwise;
    // x_out = x_mid + out(gelu(fc(ln2(x_mid)))): the residual passes dx through unchanged.
    // (matmul_backward writes its din: d_fc_gelu, d_ln and d_atty need no zeros.)
    if (!overwrite) zero(e, a.d_fc, 4 * NC);
    if (a.options().cublaslt_epilogues) {
      if constexpr (std::is_same_v<Param, fsdp::bf16>) {
        // GELU's backward in the epilogue of the product that makes its input's gradient: d_fc16,
        // the fc product's operand and its bias gradient's source (bf16 only).
        matmul_dgelu_lt(e, a.d_fc16, a.dx16, p.out_w.data(), s.fc16, N, 4 * C, C);
        matmul_backward(e, static_cast<float*>(nullptr), p.out_w.grad(), p.out_b.grad(), a.dx, s.fc_gelu, p.out_w.data(), N, 4 * C, C,
                        a.dx16, s.fc_gelu16);
        matmul_backward(e, a.d_ln, p.fc_w.grad(), p.fc_b.grad(), static_cast<const float*>(nullptr), s.ln2, p.fc_w.data(), N, C, 4 * C,
                        a.d_fc16, s.ln2_16);
      }
    } else if (overwrite) {
      matmul_backward(e, a.d_fc_gelu, p.out_w.grad(), p.out_b.grad(), a.dx, s.fc_gelu, p.out_w.data(), N, 4 * C, C, a.dx16, s.fc_gelu16);
      // GELU's backward with fc's bias gradient; d_fc is null where only d_fc16 is read
      gelu_backward_bias(e, a.d_fc, a.d_fc16, s.fc, p.fc_b.data(), a.d_fc_gelu, N, 4 * C, p.fc_b.grad());
      matmul_backward(e, a.d_ln, p.fc_w.grad(), static_cast<Param*>(nullptr), a.d_fc, s.ln2, p.fc_w.data(), N, C, 4 * C, a.d_fc16, s.ln2_16);
    } else {
      matmul_backward(e, a.d_fc_gelu, p.out_w.grad(), p.out_b.grad(), a.dx, s.fc_gelu, p.out_w.data(), N, 4 * C, C, a.dx16, s.fc_gelu16);
      gelu_backward(e, a.d_fc, s.fc, a.d_fc_gelu, 4 * NC);
      matmul_backward(e, a.d_ln, p.fc_w.grad(), p.fc_b.grad(), a.d_fc, s.ln2, p.fc_w.data(), N, C, 4 * C, a.d_fc16, s.ln2_16);
    }
    // a.dx accumulates the second residual branch in place: it becomes d loss / d x_mid.
    layernorm_backward(e, a.dx, p.ln2_w.grad(), p.ln2_b.grad(), a.d_ln, s.x_mid, p.ln2_w.data(), s.ln2_mean, s.ln2_rstd, N, C, a.dx16);
    // x_mid = x + proj(attention(ln1(x))).
    if (!(overwrite && a.fused())) zero(e, a.d_qkv, 3 * NC);
    matmul_backward(e, a.d_atty, p.proj_w.grad(), p.proj_b.grad(), a.dx, s.atty, p.proj_w.data(), N, C, C, a.dx16,
                    a.attention_operands() ? s.atty16 : nullptr);
    if (cudnn_attention* fused = a.fused()) {
      to_bf16(e, a.dout16(), a.d_atty, NC);
      fused->backward(a.dqkv16(), a.dout16(), s.atty16, s.att_stats, s.qkv16, B, a.workspace(), a.workspace_size());
      // With bf16 operands the product below reads cuDNN's bf16 d qkv itself, and sums the bias
      // gradient from it: no float copy.
      if (!a.attention_operands()) from_bf16(e, a.d_qkv, a.dqkv16(), 3 * NC, !overwrite);
    } else {
      attention_backward(e, a.d_qkv, a.d_atty, s.qkv, s.att, B, T, C, H);
    }
    // With cuDNN, d qkv's values are bf16's (d_qkv is their f32 copy): its bf16 d qkv is the operand,
    // and the dout of the bias gradient (the same values, so the same bits).
    matmul_backward(e, a.d_ln, p.qkv_w.grad(), p.qkv_b.grad(), a.attention_operands() ? nullptr : a.d_qkv, s.ln1, p.qkv_w.data(), N, C,
                    3 * C, a.attention_operands() ? a.dqkv16() : nullptr, s.ln1_16);
    // dx and its bf16 copy: the block below's first operand in its backward.
    layernorm_backward(e, a.dx, p.ln1_w.grad(), p.ln1_b.grad(), a.d_ln, s.x, p.ln1_w.data(), s.ln1_mean, s.ln1_rstd, N, C, a.dx16);
  }

  //! Backward of embed_forward: rows of wte and wpe receive dx (wte's second use).
  void embed_backward(activations& a, int B) {
    const env e = a.kernel_env(blas(), lt());
    kernels::embedding_backward(e, emb().wte.grad(), emb().wpe.grad(), a.dx, a.token_starts, a.token_rows, B, cfg().seq, cfg().dim,
                                cfg().vocab);
  }

  //! The checks at the door of forward_backward / forward_only: throws errc::invalid_argument
  //! unless `a` was made for this model's config, device and parameter type, 1 <= B <= a.batch(),
  //! tokens and targets hold B x seq bytes each, all < vocab.
  void check_step(const activations& a, const std::vector<std::uint8_t>& tokens, const std::vector<std::uint8_t>& targets, int B) const {
    const config& c = cfg();
    const config& ac = a.cfg();
    auto fail = [](const std::string& what) { throw fsdp::error(fsdp::errc::invalid_argument, "gpt::cuda: " + what); };
    if (ac.vocab != c.vocab || ac.seq != c.seq || ac.layers != c.layers || ac.dim != c.dim || ac.heads != c.heads)
      fail("the activations were made for another config");
    if (a.device().ordinal() != dev_.ordinal())
      fail("the activations are on CUDA device " + std::to_string(a.device().ordinal()) + ", the model on " + std::to_string(dev_.ordinal()));
    if (a.params() != fsdp::dtype_of<Param>)
      fail("the activations were made for " + std::string(fsdp::to_string(a.params())) + " parameters, the model has " +
           std::string(fsdp::to_string(fsdp::dtype_of<Param>)));
    if (B < 1 || B > a.batch()) fail("batch " + std::to_string(B) + " outside 1.." + std::to_string(a.batch()) + " (the activations' batch)");
    const std::size_t n = z(B) * z(c.seq);
    if (tokens.size() != n || targets.size() != n)
      fail(std::to_string(tokens.size()) + " tokens and " + std::to_string(targets.size()) + " targets for " + std::to_string(n) + " positions");
    for (std::size_t i = 0; i < n; ++i)
      if (tokens[i] >= c.vocab || targets[i] >= c.vocab) fail("a token or target >= vocab " + std::to_string(c.vocab));
  }

 private:
  static std::size_t z(int x) { return static_cast<std::size_t>(x); }
  struct blas_deleter {
    void operator()(cublasHandle_t h) const noexcept { (void)cublasDestroy(h); }
  };

  gpt::model<Param> params_;
  fsdp::cuda_device dev_;
  std::unique_ptr<cublasContext, blas_deleter> blas_;
  std::unique_ptr<lt_matmul> lt_;  // cuBLASLt's products (activation_options::cublaslt_epilogues)
};

namespace detail {
//! The forward of a step (or of an evaluation) through the hooks: unit 0 (the embedding, with
//! the tied head) gathered around the blocks, as gpt::forward_backward does.
template <class Hooks, class T>
void forward_pass(Hooks& hooks, model<T>& m, activations& a, int B) {
  auto embedding_in_use = hooks.forward(0);
  m.embed_forward(a, B);
  for (int l = 0; l < m.layers(); ++l) {
    auto in_use = hooks.forward(1 + l);
    m.block_forward(a, l, B);
  }
  m.head_forward(a, B);
}
}  // namespace detail

//! One training step's forward and backward through the hooks (a shard_group on the model's
//! device, or anything with forward(u) / backward(u) scopes, and recompute(u) when the activations
//! recompute): the same hook calls in the same order as gpt::forward_backward (unit 0 the
//! embedding, unit 1 + l block l), with recompute(1 + l) inside backward(1 + l). tokens and
//! targets are host [B][T] bytes, copied to the device in one async copy. Everything runs on
//! the device's compute stream; the one host synchronization is reading the loss back at the
//! end. Returns this rank's mean loss; with `micro` > 1 the gradients are scaled so that the
//! micro-batches' add up to the whole batch's. Throws errc::invalid_argument (check_step).
template <class Hooks, class T>
double forward_backward(Hooks& hooks, model<T>& m, activations& a, const std::vector<std::uint8_t>& tokens,
                        const std::vector<std::uint8_t>& targets, int B, int micro = 1) {
  m.check_step(a, tokens, targets, B);
  if (micro < 1) throw fsdp::error(fsdp::errc::invalid_argument, "gpt::cuda: micro " + std::to_string(micro) + " < 1");
  m.device().make_current();
  a.copy_batch(tokens, targets);
  detail::forward_pass(hooks, m, a, B);
  {
    auto embedding_in_use = hooks.backward(0);
    m.head_backward(a, B, micro);
    for (int l = m.layers() - 1; l >= 0; --l) {
      auto in_use = hooks.backward(1 + l);
      if (a.recompute()) {
        // Rewrites the next block's input (or x_final) with the same values: nothing reads it
        // again in this backward.
        auto again = hooks.recompute(1 + l);
        m.block_forward(a, l, B);
      }
      m.block_backward(a, l, B);
    }
    m.embed_backward(a, B);
  }
  return a.read_loss();
}

//! Forward only (evaluation): the loss of predicting targets. The same hook calls as
//! gpt::forward_only.
template <class Hooks, class T>
double forward_only(Hooks& hooks, model<T>& m, activations& a, const std::vector<std::uint8_t>& tokens,
                    const std::vector<std::uint8_t>& targets, int B) {
  m.check_step(a, tokens, targets, B);
  m.device().make_current();
  a.copy_batch(tokens, targets);
  detail::forward_pass(hooks, m, a, B);
  return a.read_loss();
}

}  // namespace gpt::cuda
