#pragma once
// gpt/model.hpp: a small GPT-2-style decoder in plain C++, forward and hand-written backward.
//
// Shapes (B sequences of T tokens, C channels, H heads of C/H, vocabulary V = 256 bytes):
//   tokens [B][T] -> x = wte[token] + wpe[position]                      (embedding)
//   L blocks:  x += proj(attention(ln1(x)))                              (causal, H heads)
//              x += out(gelu(fc(ln2(x))))                                (MLP, 4C wide)
//   logits [B][T][V] = lnf(x) . wte^T                                    (tied head)
//   loss = mean over tokens of -log softmax(logits)[next byte]
//
// The token embedding wte is one parameter used twice: to embed the input and, transposed, as
// the LM head. Its gradient is the sum of both uses (the head's adds first in backward).
//
// Parameters are fsdp::buffer<T> handles: while a unit is in use, data() points at the gathered
// parameters and grad() at the unsharded gradient buffer, whatever T is (float, or bf16 for
// mixed precision). Activations and arithmetic are float; the arithmetic is gpt/kernels.hpp's.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include <fsdp/fsdp.hpp>

#include "gpt/kernels.hpp"
#include "gpt/moe.hpp"

namespace gpt {

struct config {
  int vocab = 256;  // bytes
  int seq = 64;     // T: context length
  int layers = 4;   // L
  int dim = 64;     // C
  int heads = 4;    // H (divides C)
  int experts = 0;  // E > 0: each block's MLP is a mixture of E experts (gpt/moe.hpp), 4C wide each
  int top_k = 2;    // with experts: the experts each token goes to
};

//! This rank's slice of the model under Megatron-style tensor parallelism (size 1: the whole
//! model). Heads split over the TP ranks: rank r holds heads [r·H/size, (r+1)·H/size), so the
//! rows of qkv_w (of q, of k and of v) and of fc_w are sliced (column-parallel), and the columns
//! of proj_w and out_w (row-parallel). Layer norms, the biases of the row-parallel products and
//! the embedding unit (wte, tied to the head, wpe, lnf) are replicated on every TP rank: they
//! see the same inputs there and so get the same gradients.
struct tensor_parallel {
  int rank = 0;
  int size = 1;

  //! The element of the full parameter `name` that element i of this rank's slice of it is.
  std::size_t full_index(std::string_view name, std::size_t i, const config& c) const {
    if (size == 1) return i;
    const auto ends = [&](std::string_view s) { return name.size() >= s.size() && name.substr(name.size() - s.size()) == s; };
    const auto C = static_cast<std::size_t>(c.dim), part = C / static_cast<std::size_t>(size), r = static_cast<std::size_t>(rank);
    if (ends("qkv_w") || ends("qkv_b")) {  // [3 · part] rows (of C or 1): q, k, v each sliced
      const std::size_t row_len = ends("qkv_w") ? C : 1, row = i / row_len, which = row / part;
      return ((which * C + r * part + row % part) * row_len) + i % row_len;
    }
    if (ends("fc_w") || ends("fc_b")) return r * 4 * part * (ends("fc_w") ? C : 1) + i;  // rows sliced
    if (ends("proj_w")) return i / part * C + r * part + i % part;                     // columns sliced
    if (ends("out_w")) return i / (4 * part) * 4 * C + r * 4 * part + i % (4 * part);
    return i;  // replicated
  }
};

//! One transformer block: 12 parameters.
template <class T>
struct block {
  fsdp::buffer<T> ln1_w, ln1_b;    // [C], [C]
  fsdp::buffer<T> qkv_w, qkv_b;    // [3C][C], [3C]: query, key, value projections stacked
  fsdp::buffer<T> proj_w, proj_b;  // [C][C], [C]
  fsdp::buffer<T> ln2_w, ln2_b;    // [C], [C]
  fsdp::buffer<T> fc_w, fc_b;      // [4C][C], [4C]
  fsdp::buffer<T> out_w, out_b;    // [C][4C], [C]
  std::unique_ptr<moe::router<T>> router;  // with experts: [E][C], in place of the four above

  //! Block l, or this TP rank's slice of it (tensor_parallel: C/size of the heads' width).
  block(const config& c, int l, int tp = 1)
      : ln1_w(n(c.dim), name(l, "ln1_w")), ln1_b(n(c.dim), name(l, "ln1_b")),
        qkv_w({n(3 * c.dim / tp), n(c.dim)}, name(l, "qkv_w")), qkv_b(n(3 * c.dim / tp), name(l, "qkv_b")),
        proj_w({n(c.dim), n(c.dim / tp)}, name(l, "proj_w")), proj_b(n(c.dim), name(l, "proj_b")),
        ln2_w(n(c.dim), name(l, "ln2_w")), ln2_b(n(c.dim), name(l, "ln2_b")),
        fc_w({n(4 * c.dim / tp), n(c.dim)}, name(l, "fc_w")), fc_b(n(4 * c.dim / tp), name(l, "fc_b")),
        out_w({n(c.dim), n(4 * c.dim / tp)}, name(l, "out_w")), out_b(n(c.dim), name(l, "out_b")) {
    if (c.experts > 0) router = std::make_unique<moe::router<T>>(moe::shape{c.experts, c.top_k, c.dim, 4 * c.dim}, l);
  }

  //! The block's dense parameters (its experts are model::experts(l)'s).
  std::vector<fsdp::buffer<T>*> params() {
    if (router) return {&ln1_w, &ln1_b, &qkv_w, &qkv_b, &proj_w, &proj_b, &ln2_w, &ln2_b, &router->w};
    return {&ln1_w, &ln1_b, &qkv_w, &qkv_b, &proj_w, &proj_b, &ln2_w, &ln2_b, &fc_w, &fc_b, &out_w, &out_b};
  }
  static std::size_t n(int x) { return static_cast<std::size_t>(x); }
  static std::string name(int l, const char* p) { return "block" + std::to_string(l) + "." + p; }
};

//! Whether `name` is one of the model's parameters ("wte", "wpe", "lnf_w", "lnf_b",
//! "block<l>.<one of block's>"), for options that name parameters.
inline bool is_parameter_name(const config& c, const std::string& name) {
  static const char* const own[] = {"wte", "wpe", "lnf_w", "lnf_b"};
  static const char* const per_block[] = {"ln1_w", "ln1_b", "qkv_w", "qkv_b", "proj_w", "proj_b", "ln2_w", "ln2_b", "fc_w", "fc_b", "out_w", "out_b"};
  for (const char* o : own)
    if (name == o) return true;
  for (int l = 0; l < c.layers; ++l)
    for (const char* p : per_block)
      if (name == block<float>::name(l, p)) return true;
  return false;
}

//! The embeddings and everything after the last block: 4 parameters.
template <class T>
struct embedding {
  fsdp::buffer<T> wte;           // [V][C]: token embedding, and the LM head (tied)
  fsdp::buffer<T> wpe;           // [T][C]: position embedding
  fsdp::buffer<T> lnf_w, lnf_b;  // [C], [C]: final layer norm

  explicit embedding(const config& c)
      : wte({n(c.vocab), n(c.dim)}, "wte"), wpe({n(c.seq), n(c.dim)}, "wpe"), lnf_w(n(c.dim), "lnf_w"), lnf_b(n(c.dim), "lnf_b") {}
  std::vector<fsdp::buffer<T>*> params() { return {&wte, &wpe, &lnf_w, &lnf_b}; }
  static std::size_t n(int x) { return static_cast<std::size_t>(x); }
};

//! GPT-2's initialization, as a pure function of (parameter name, element index) so that any
//! number of ranks, each filling only its shard, builds the same model: weights ~ N(0, 0.02)
//! (residual projections 0.02 / sqrt(2L)), biases 0, layer-norm gains 1.
inline float initial_value(std::string_view name, std::size_t i, const config& c, std::uint64_t seed) {
  const auto ends = [&](std::string_view s) { return name.size() >= s.size() && name.substr(name.size() - s.size()) == s; };
  if (ends("_b")) return 0.0f;
  if (ends("ln1_w") || ends("ln2_w") || ends("lnf_w")) return 1.0f;
  std::uint64_t h = seed * 0x9E3779B97F4A7C15ull;
  for (char ch : name) h = (h ^ static_cast<unsigned char>(ch)) * 0x100000001B3ull;
  auto mix = [](std::uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  // Box-Muller from two uniforms in (0, 1].
  const double u1 = (static_cast<double>(mix(h + 2 * i) >> 11) + 1.0) / 9007199254740992.0;
  const double u2 = static_cast<double>(mix(h + 2 * i + 1) >> 11) / 9007199254740992.0;
  const double normal = std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  const double stddev = ends("proj_w") || ends("out_w") ? 0.02 / std::sqrt(2.0 * c.layers) : 0.02;
  return static_cast<float>(stddev * normal);
}


// ---- the model ----------------------------------------------------------------------------

//! What a forward pass keeps for backward (float, this rank's B sequences).
struct activations {
  struct per_block {
    std::vector<float> x;                // [B*T][C]: the block's input (residual stream)
    std::vector<float> ln1, ln1_mean, ln1_rstd;
    std::vector<float> qkv;              // [B*T][3C]
    std::vector<float> att;              // [B][H][T][T]
    std::vector<float> atty;             // [B*T][C]: attention output, before proj
    std::vector<float> x_mid;            // [B*T][C]: x + proj(attention)
    std::vector<float> ln2, ln2_mean, ln2_rstd;
    std::vector<float> fc, fc_gelu;      // [B*T][4C]
    moe::activations moe;                // with experts, in place of fc and fc_gelu
  };
  std::vector<per_block> blocks;
  std::vector<float> x_final;            // [B*T][C]: the last block's output
  std::vector<float> lnf, lnf_mean, lnf_rstd;
  std::vector<float> probs;              // [B*T][V]: softmax of the logits (head_backward: their gradient)
  std::vector<float> dx;                 // [B*T][C]: the gradient flowing down the residual stream
};

template <class Param>
class model {
 public:
  //! The whole model, or one TP rank's slice of it: then every block needs `all_reduce_tp` set
  //! before it runs (a sum over the TP group, in place).
  //! With c.experts > 0, each block's experts are those of ep rank ep.rank (all of them when
  //! ep.size is 1); ep.all_to_all must be set before a block runs when ep.size > 1.
  explicit model(const config& c, tensor_parallel tp = {}, moe::ep_group ep = {}) : cfg_(c), tp_(tp), ep_(std::move(ep)), emb_(c) {
    for (int l = 0; l < c.layers; ++l) {
      blocks_.push_back(std::make_unique<block<Param>>(c, l, tp.size));
      if (c.experts > 0) experts_.push_back(std::make_unique<moe::experts<Param>>(moe_shape(), l, ep_.size, ep_.rank));
    }
  }

  //! Megatron's two all-reduces per block and pass: after each row-parallel product in forward
  //! (proj, out) and for the input gradient of each column-parallel one in backward (qkv, fc).
  std::function<void(float*, std::size_t)> all_reduce_tp;
  const tensor_parallel& tp() const { return tp_; }
  moe::ep_group& ep() { return ep_; }
  bool has_experts() const { return cfg_.experts > 0; }
  moe::shape moe_shape() const { return {cfg_.experts, cfg_.top_k, cfg_.dim, 4 * cfg_.dim}; }
  //! Block l's experts on this rank (has_experts()).
  moe::experts<Param>& experts(int l) { return *experts_[static_cast<std::size_t>(l)]; }

  const config& cfg() const { return cfg_; }
  embedding<Param>& emb() { return emb_; }
  block<Param>& layer(int l) { return *blocks_[static_cast<std::size_t>(l)]; }
  int layers() const { return cfg_.layers; }
  //! Parameter count (wte counted once).
  std::size_t numel() {
    std::size_t n = 0;
    for (auto* p : emb_.params()) n += p->size();
    for (auto& b : blocks_)
      for (auto* p : b->params()) n += p->size();
    for (auto& e : experts_)
      for (auto* p : e->params()) n += p->size();
    return n;
  }

  // The pieces of a step, in the order a training loop calls them (see step() below).

  //! x = wte[tokens] + wpe[positions]. tokens is [B][T].
  void embed_forward(activations& a, const std::vector<std::uint8_t>& tokens, int B) {
    const int T = cfg_.seq, C = cfg_.dim;
    a.blocks.resize(static_cast<std::size_t>(cfg_.layers));
    auto& x = cfg_.layers > 0 ? a.blocks[0].x : a.x_final;
    x.assign(z(B) * z(T) * z(C), 0.0f);
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < T; ++t) {
        const std::size_t row = z(b) * z(T) + z(t), tok = tokens[row];
        for (int c = 0; c < C; ++c) x[row * z(C) + z(c)] = f(emb_.wte.data()[tok * z(C) + z(c)]) + f(emb_.wpe.data()[z(t) * z(C) + z(c)]);
      }
  }

  //! Block l: reads a.blocks[l].x, writes the next block's x (or x_final).
  void block_forward(activations& a, int l, int B) {
    using namespace kernels;
    // Under TP this rank computes its heads (Cl = C/size wide) and its slice of the MLP.
    const int T = cfg_.seq, C = cfg_.dim, Cl = C / tp_.size, Hl = cfg_.heads / tp_.size, N = B * T;
    block<Param>& p = layer(l);
    auto& s = a.blocks[z(l)];
    s.ln1.resize(z(N) * z(C)), s.ln1_mean.resize(z(N)), s.ln1_rstd.resize(z(N));
    layernorm_forward(s.ln1.data(), s.ln1_mean.data(), s.ln1_rstd.data(), s.x.data(), p.ln1_w.data(), p.ln1_b.data(), N, C);
    s.qkv.resize(z(N) * z(3 * Cl));
    matmul_forward(s.qkv.data(), s.ln1.data(), p.qkv_w.data(), p.qkv_b.data(), N, C, 3 * Cl);
    s.att.resize(z(B) * z(Hl) * z(T) * z(T)), s.atty.resize(z(N) * z(Cl));
    attention_forward(s.atty.data(), s.att.data(), s.qkv.data(), B, T, Cl, Hl);
    s.x_mid.resize(z(N) * z(C));
    row_parallel_forward(s.x_mid, s.atty.data(), p.proj_w, p.proj_b, N, Cl);
    for (std::size_t i = 0; i < s.x_mid.size(); ++i) s.x_mid[i] += s.x[i];
    s.ln2.resize(z(N) * z(C)), s.ln2_mean.resize(z(N)), s.ln2_rstd.resize(z(N));
    layernorm_forward(s.ln2.data(), s.ln2_mean.data(), s.ln2_rstd.data(), s.x_mid.data(), p.ln2_w.data(), p.ln2_b.data(), N, C);
    auto& next = l + 1 < cfg_.layers ? a.blocks[z(l + 1)].x : a.x_final;
    next.resize(z(N) * z(C));
    if (has_experts()) {
      moe::forward(next.data(), s.moe, s.ln2.data(), N, *p.router, experts(l), moe_shape(), ep_);
    } else {
      s.fc.resize(z(N) * z(4 * Cl)), s.fc_gelu.resize(z(N) * z(4 * Cl));
      matmul_forward(s.fc.data(), s.ln2.data(), p.fc_w.data(), p.fc_b.data(), N, C, 4 * Cl);
      gelu_forward(s.fc_gelu.data(), s.fc.data(), s.fc.size());
      row_parallel_forward(next, s.fc_gelu.data(), p.out_w, p.out_b, N, 4 * Cl);
    }
    for (std::size_t i = 0; i < next.size(); ++i) next[i] += s.x_mid[i];
  }

  //! The final layer norm, the tied head and the loss: returns the mean cross-entropy of
  //! predicting targets[B][T] (the next byte of each position).
  double head_forward(activations& a, const std::vector<std::uint8_t>& targets, int B) {
    using namespace kernels;
    const int T = cfg_.seq, C = cfg_.dim, V = cfg_.vocab, N = B * T;
    a.lnf.resize(z(N) * z(C)), a.lnf_mean.resize(z(N)), a.lnf_rstd.resize(z(N));
    layernorm_forward(a.lnf.data(), a.lnf_mean.data(), a.lnf_rstd.data(), a.x_final.data(), emb_.lnf_w.data(), emb_.lnf_b.data(), N, C);
    a.probs.resize(z(N) * z(V));
    matmul_forward(a.probs.data(), a.lnf.data(), emb_.wte.data(), static_cast<const Param*>(nullptr), N, C, V);
    double loss = 0;
    for (int n = 0; n < N; ++n) {
      float* p = a.probs.data() + z(n) * z(V);
      const float mx = *std::max_element(p, p + V);
      float sum = 0;
      for (int v = 0; v < V; ++v) sum += (p[v] = std::exp(p[v] - mx));
      for (int v = 0; v < V; ++v) p[v] /= sum;
      loss -= std::log(std::max(p[targets[z(n)]], 1e-30f));
    }
    return loss / N;
  }

  //! Backward of head_forward: d loss / d logits = (probs - onehot(target)) / (N · micro): one
  //! of `micro` micro-batches, whose gradients add up to the whole batch's mean.
  void head_backward(activations& a, const std::vector<std::uint8_t>& targets, int B, int micro = 1) {
    using namespace kernels;
    const int T = cfg_.seq, C = cfg_.dim, V = cfg_.vocab, N = B * T;
    std::vector<float>& dlogits = a.probs;  // in place: the probabilities are not read again
    for (int n = 0; n < N; ++n) dlogits[z(n) * z(V) + targets[z(n)]] -= 1.0f;
    for (auto& d : dlogits) d /= static_cast<float>(N * micro);
    std::vector<float>& dlnf = scratch_.dln;
    dlnf.assign(z(N) * z(C), 0.0f);
    matmul_backward(dlnf.data(), emb_.wte.grad(), static_cast<Param*>(nullptr), dlogits.data(), a.lnf.data(), emb_.wte.data(), N, C, V);
    a.dx.assign(z(N) * z(C), 0.0f);
    layernorm_backward(a.dx.data(), emb_.lnf_w.grad(), emb_.lnf_b.grad(), dlnf.data(), a.x_final.data(), emb_.lnf_w.data(),
                       a.lnf_mean.data(), a.lnf_rstd.data(), N, C);
  }

  //! Backward of block l: a.dx holds d loss / d (block output) and becomes d loss / d (input).
  void block_backward(activations& a, int l, int B) {
    using namespace kernels;
    const int T = cfg_.seq, C = cfg_.dim, Cl = C / tp_.size, Hl = cfg_.heads / tp_.size, N = B * T;
    block<Param>& p = layer(l);
    auto& s = a.blocks[z(l)];
    // x_out = x_mid + out(gelu(fc(ln2(x_mid)))) (or the experts'): the residual passes dx through unchanged.
    std::vector<float>& dln2 = scratch_.dln;
    dln2.assign(z(N) * z(C), 0.0f);
    if (has_experts()) {
      moe::backward(dln2.data(), s.moe, a.dx.data(), s.ln2.data(), *p.router, experts(l), moe_shape(), ep_);
    } else {
      std::vector<float>& dgelu = scratch_.dgelu;  // then, in place, the gradient of fc's output
      dgelu.assign(z(N) * z(4 * Cl), 0.0f);
      matmul_backward(dgelu.data(), p.out_w.grad(), p.out_b.grad(), a.dx.data(), s.fc_gelu.data(), p.out_w.data(), N, 4 * Cl, C);
      gelu_backward(dgelu.data(), s.fc.data(), dgelu.size());
      matmul_backward(dln2.data(), p.fc_w.grad(), p.fc_b.grad(), dgelu.data(), s.ln2.data(), p.fc_w.data(), N, C, 4 * Cl);
      if (tp_.size > 1) all_reduce_tp(dln2.data(), dln2.size());  // each TP rank's part of the input gradient
    }
    std::vector<float>& dx_mid = a.dx;  // accumulates the second residual branch in place
    layernorm_backward(dx_mid.data(), p.ln2_w.grad(), p.ln2_b.grad(), dln2.data(), s.x_mid.data(), p.ln2_w.data(),
                       s.ln2_mean.data(), s.ln2_rstd.data(), N, C);
    // x_mid = x + proj(attention(ln1(x))).
    std::vector<float>&datty = scratch_.datty, &dqkv = scratch_.dqkv, &dln1 = scratch_.dln1;
    datty.assign(z(N) * z(Cl), 0.0f), dqkv.assign(z(N) * z(3 * Cl), 0.0f), dln1.assign(z(N) * z(C), 0.0f);
    matmul_backward(datty.data(), p.proj_w.grad(), p.proj_b.grad(), dx_mid.data(), s.atty.data(), p.proj_w.data(), N, Cl, C);
    attention_backward(dqkv.data(), datty.data(), s.qkv.data(), s.att.data(), B, T, Cl, Hl);
    matmul_backward(dln1.data(), p.qkv_w.grad(), p.qkv_b.grad(), dqkv.data(), s.ln1.data(), p.qkv_w.data(), N, C, 3 * Cl);
    if (tp_.size > 1) all_reduce_tp(dln1.data(), dln1.size());
    layernorm_backward(a.dx.data(), p.ln1_w.grad(), p.ln1_b.grad(), dln1.data(), s.x.data(), p.ln1_w.data(), s.ln1_mean.data(),
                       s.ln1_rstd.data(), N, C);
  }

  //! Backward of embed_forward: rows of wte and wpe receive dx (wte's second use).
  void embed_backward(activations& a, const std::vector<std::uint8_t>& tokens, int B) {
    const int T = cfg_.seq, C = cfg_.dim, V = cfg_.vocab;
    std::vector<float> gte(z(V) * z(C), 0.0f), gpe(z(T) * z(C), 0.0f);
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < T; ++t) {
        const std::size_t row = z(b) * z(T) + z(t), tok = tokens[row];
        for (int c = 0; c < C; ++c) {
          gte[tok * z(C) + z(c)] += a.dx[row * z(C) + z(c)];
          gpe[z(t) * z(C) + z(c)] += a.dx[row * z(C) + z(c)];
        }
      }
    kernels::accumulate(emb_.wte.grad(), gte.data(), gte.size());
    kernels::accumulate(emb_.wpe.grad(), gpe.data(), gpe.size());
  }

 private:
  static std::size_t z(int x) { return static_cast<std::size_t>(x); }

  //! out[N][C] = in[N][K] . w^T + b, a row-parallel product under TP: each rank's partial
  //! product over its K columns, summed over the TP group, then the (replicated) bias once.
  void row_parallel_forward(std::vector<float>& out, const float* in, const fsdp::buffer<Param>& w, const fsdp::buffer<Param>& b,
                            int N, int K) {
    const int C = cfg_.dim;
    if (tp_.size == 1) return kernels::matmul_forward(out.data(), in, w.data(), b.data(), N, K, C);
    kernels::matmul_forward(out.data(), in, w.data(), static_cast<const Param*>(nullptr), N, K, C);
    all_reduce_tp(out.data(), out.size());
    for (int n = 0; n < N; ++n)
      for (int c = 0; c < C; ++c) out[z(n) * z(C) + z(c)] += f(b.data()[c]);
  }

  config cfg_;
  tensor_parallel tp_;
  moe::ep_group ep_;
  embedding<Param> emb_;
  // Backward's scratch, kept from step to step so that a step allocates nothing (fresh
  // multi-MiB vectors each block cost page faults and TLB shootdowns: docs/benchmarks.md). The
  // model's, not a micro-batch's activations: a rank runs one backward at a time, and pipeline
  // micro-batches in flight then need no copy each.
  struct {
    std::vector<float> dln, dgelu, datty, dqkv, dln1;
  } scratch_;
  std::vector<std::unique_ptr<block<Param>>> blocks_;
  std::vector<std::unique_ptr<moe::experts<Param>>> experts_;  // per block, with experts
};

//! One training step's forward and backward through a shard_group's hooks (or anything with
//! forward(u) / backward(u) scopes). Unit 0 is the embedding (wte, wpe, lnf): it stays gathered
//! from the embedding to the tied head, around the blocks (units 1..L), and in backward from the
//! head's backward to the embedding's, so wte's two gradients meet in one buffer before it is
//! reduced. Returns this rank's mean loss. With `micro` > 1 the batch is one of that many
//! micro-batches: its gradients are scaled so that they add up to the whole batch's.
template <class Hooks, class T>
double forward_backward(Hooks& hooks, model<T>& m, activations& a, const std::vector<std::uint8_t>& tokens,
                        const std::vector<std::uint8_t>& targets, int B, int micro = 1) {
  double loss = 0;
  {
    auto embedding_in_use = hooks.forward(0);
    m.embed_forward(a, tokens, B);
    for (int l = 0; l < m.layers(); ++l) {
      auto in_use = hooks.forward(1 + l);
      m.block_forward(a, l, B);
    }
    loss = m.head_forward(a, targets, B);
  }
  {
    auto embedding_in_use = hooks.backward(0);
    m.head_backward(a, targets, B, micro);
    for (int l = m.layers() - 1; l >= 0; --l) {
      auto in_use = hooks.backward(1 + l);
      m.block_backward(a, l, B);
    }
    m.embed_backward(a, tokens, B);
  }
  return loss;
}

//! Forward only (evaluation): the loss of predicting targets.
template <class Hooks, class T>
double forward_only(Hooks& hooks, model<T>& m, activations& a, const std::vector<std::uint8_t>& tokens,
                    const std::vector<std::uint8_t>& targets, int B) {
  auto embedding_in_use = hooks.forward(0);
  m.embed_forward(a, tokens, B);
  for (int l = 0; l < m.layers(); ++l) {
    auto in_use = hooks.forward(1 + l);
    m.block_forward(a, l, B);
  }
  return m.head_forward(a, targets, B);
}

//! Registers the model with a shard_group: unit 0 the embedding, unit 1 + l block l; the
//! parameters named in `frozen` (e.g. "wte", "block0.qkv_w") frozen: no gradient, no update.
template <class Group, class T>
void add_units(Group& group, model<T>& m, const std::vector<std::string>& frozen = {}) {
  auto add = [&](std::vector<fsdp::buffer<T>*> params, std::string name) {
    std::vector<fsdp::buffer<T>*> mine;
    for (auto* p : params)
      if (std::find(frozen.begin(), frozen.end(), p->name()) != frozen.end()) mine.push_back(p);
    group.add_unit(params, std::move(name), mine);
  };
  add(m.emb().params(), "embedding");
  for (int l = 0; l < m.layers(); ++l) add(m.layer(l).params(), "block" + std::to_string(l));
}

}  // namespace gpt
