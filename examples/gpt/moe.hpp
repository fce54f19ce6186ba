#pragma once
// gpt/moe.hpp: a Mixture-of-Experts feed-forward layer for the example GPT (Mixtral-style
// routing), forward and hand-written backward, with the experts spread over an expert-parallel
// (ep) group and the tokens' rows moved between its ranks by all-to-all.
//
// Shapes (N tokens of C = dim channels, E experts, K = top_k, H = hidden, 4C in the GPT):
//   logits [N][E] = x . router_w^T                               (router_w [E][C], no bias)
//   chosen [N][K] = the K experts of largest logit, best first    (ties: the lower index)
//   gates  [N][K] = softmax over the chosen K logits
//   y      [N][C] = sum over j = 0..K-1 of gates[j] * expert_{chosen[j]}(x)
//   expert(x)     = out(gelu(fc(x)))                              (fc_w [H][C], out_w [C][H])
// The selection itself is not differentiated: backward reaches router_w and x through the gates.
//
// Expert parallelism: expert e lives on ep rank e / (E / ep). Forward sends every (token, chosen
// expert) row to the expert's rank (dispatch), that rank runs its experts on the rows it got and
// sends the outputs back (return), and the token's rank adds them up with its gates (combine).
// Backward is the same trip with gradients: the output gradients go out, the input gradients
// come back. With ep = 1 the rows never leave the rank and no all-to-all is called.
//
// All-to-all needs one count for every pair of ranks, but how many rows a rank sends to a peer
// depends on the routing. Each peer's block is therefore sized for the worst case: a token
// picks K different experts and a peer owns E / ep of them, so at most N * min(K, E / ep) rows
// go from one rank to one peer. Since that capacity is a function of N, every rank of the ep
// group must pass the same N (a rank that does not makes the all-to-all counts disagree, which
// the communicator reports). A dispatched block starts with a one-float header, its row count,
// so the receiver knows where the padding begins without a separate exchange. The worst-case
// capacity costs bandwidth (most of each block is padding); it buys exchanges that need no
// agreement on sizes first, and a layout that backward can reuse as it is.
//
// Determinism: rows reach an expert in (source rank, token, j) order, which for ranks holding
// consecutive slices of a batch is the batch's token order, and every row is computed on its own
// (the kernels' per-row sums do not depend on the other rows). Combine adds the K outputs in the
// fixed order j = 0..K-1. So outputs, dx and expert gradients do not depend on the number of ep
// ranks, bit for bit; only router_w's gradient, a sum over each rank's own tokens, is summed
// across ranks in another order. (That holds for the plain loops; OpenBLAS, with use_blas, may
// block its sums differently for different row counts.)

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <fsdp/fsdp.hpp>

#include "gpt/kernels.hpp"

namespace gpt::moe {

struct shape {
  int experts;  // E
  int top_k;    // K: experts per token
  int dim;      // C
  int hidden;   // H: the experts' inner width (4C in the GPT)
};

//! Throws errc::invalid_argument unless the shape is usable on an ep group of `ep_size` ranks.
inline void check(const shape& s, int ep_size) {
  const auto bad = [](const std::string& m) { throw fsdp::error(fsdp::errc::invalid_argument, "moe: " + m); };
  if (s.experts < 1 || s.top_k < 1 || s.dim < 1 || s.hidden < 1)
    bad("experts " + std::to_string(s.experts) + ", top_k " + std::to_string(s.top_k) + ", dim " + std::to_string(s.dim) +
        ", hidden " + std::to_string(s.hidden) + ": all must be >= 1");
  if (s.top_k > s.experts)
    bad("top_k " + std::to_string(s.top_k) + " > experts " + std::to_string(s.experts) + ": a token picks top_k different experts");
  if (ep_size < 1) bad("ep size " + std::to_string(ep_size) + " must be >= 1");
  if (s.experts % ep_size != 0)
    bad(std::to_string(s.experts) + " experts do not divide over an ep group of " + std::to_string(ep_size) + " ranks");
}

//! Experts per ep rank, and the ep rank that owns expert e.
inline int per_rank(const shape& s, int ep_size) { return s.experts / ep_size; }
inline int owner(const shape& s, int ep_size, int e) { return e / per_rank(s, ep_size); }

//! The most rows one rank can send to one peer with N tokens: the size of every block.
inline int capacity(const shape& s, int ep_size, int N) { return N * std::min(s.top_k, per_rank(s, ep_size)); }

//! The dense part: the router's weight [E][C]. Every rank holds it (it goes with the block's
//! other dense parameters into the block's unit).
template <class T>
struct router {
  fsdp::buffer<T> w;

  router(const shape& s, int l) : w({z(s.experts), z(s.dim)}, "block" + std::to_string(l) + ".router_w") {}
  std::vector<fsdp::buffer<T>*> params() { return {&w}; }
  static std::size_t z(int x) { return static_cast<std::size_t>(x); }
};

//! One expert: the GPT's MLP, fc [H][C] then out [C][H].
template <class T>
struct expert {
  fsdp::buffer<T> fc_w, fc_b, out_w, out_b;

  expert(const shape& s, int l, int e)
      : fc_w({z(s.hidden), z(s.dim)}, name(l, e, "fc_w")), fc_b(z(s.hidden), name(l, e, "fc_b")),
        out_w({z(s.dim), z(s.hidden)}, name(l, e, "out_w")), out_b(z(s.dim), name(l, e, "out_b")) {}
  std::vector<fsdp::buffer<T>*> params() { return {&fc_w, &fc_b, &out_w, &out_b}; }
  static std::size_t z(int x) { return static_cast<std::size_t>(x); }
  static std::string name(int l, int e, const char* p) { return "block" + std::to_string(l) + ".expert" + std::to_string(e) + "." + p; }
};

//! The experts [first, first + count) of layer l that one ep rank owns (all E when ep = 1).
//! Their parameters form one fsdp unit, sharded over the ranks that hold the same experts.
template <class T>
class experts {
 public:
  experts(const shape& s, int l, int ep_size = 1, int ep_rank = 0) {
    check(s, ep_size);
    if (ep_rank < 0 || ep_rank >= ep_size)
      throw fsdp::error(fsdp::errc::invalid_argument,
                        "moe: ep rank " + std::to_string(ep_rank) + " outside an ep group of " + std::to_string(ep_size));
    count_ = per_rank(s, ep_size);
    first_ = ep_rank * count_;
    for (int e = first_; e < first_ + count_; ++e) list_.push_back(std::make_unique<expert<T>>(s, l, e));
  }

  int first() const { return first_; }
  int count() const { return count_; }
  bool owns(int e) const { return e >= first_ && e < first_ + count_; }
  //! Expert e by its global index (owns(e) must hold).
  expert<T>& at(int e) { return *list_[static_cast<std::size_t>(e - first_)]; }
  std::vector<fsdp::buffer<T>*> params() {
    std::vector<fsdp::buffer<T>*> all;
    for (auto& x : list_)
      for (auto* p : x->params()) all.push_back(p);
    return all;
  }

 private:
  int first_ = 0, count_ = 0;
  std::vector<std::unique_ptr<expert<T>>> list_;  // unique_ptr: fsdp keeps the buffers' addresses
};

//! This rank's place in the ep group and how to exchange with it. all_to_all(send, recv, count)
//! sends block j of `send` (count floats) to ep rank j and receives rank j's block for this
//! rank into block j of `recv`; only called when size > 1.
struct ep_group {
  int size = 1;
  int rank = 0;
  std::function<void(const float* send, float* recv, std::size_t count_per_peer)> all_to_all{};
};

//! What forward keeps for backward.
struct activations {
  int tokens = 0;            // N
  int capacity = 0;          // rows per peer block (capacity() above)
  std::vector<float> logits;  // [N][E]
  std::vector<int> chosen;    // [N][K]: expert indices, best first
  std::vector<float> gates;   // [N][K]
  std::vector<int> slot;      // [N][K]: the row's place in the block sent to the expert's rank
  std::vector<float> outs;    // [N][K][C]: the chosen experts' outputs (the gates' gradients need them)
  //! The expert side, one per local expert: the rows it received, in arrival order.
  struct per_expert {
    std::vector<int> rows;          // where each row sits in the exchanged blocks: peer * capacity + slot
    std::vector<float> in;          // [rows][C]
    std::vector<float> fc, fc_gelu;  // [rows][H]
  };
  std::vector<per_expert> local;
};

namespace detail {

inline std::size_t z(int x) { return static_cast<std::size_t>(x); }

//! The top K of each row of logits[N][E], best first (a strictly larger logit wins, so ties go to
//! the lower index), and the softmax of those K logits.
inline void route(activations& a, const shape& s) {
  const int N = a.tokens, E = s.experts, K = s.top_k;
  a.chosen.assign(z(N) * z(K), -1);
  a.gates.assign(z(N) * z(K), 0.0f);
  for (int n = 0; n < N; ++n) {
    const float* l = a.logits.data() + z(n) * z(E);
    int* c = a.chosen.data() + z(n) * z(K);
    float* g = a.gates.data() + z(n) * z(K);
    for (int j = 0; j < K; ++j) {
      int best = -1;
      for (int e = 0; e < E; ++e)
        if (std::find(c, c + j, e) == c + j && (best < 0 || l[e] > l[best])) best = e;
      c[j] = best;
    }
    float sum = 0;  // c[0] has the largest logit: subtracting it keeps exp() <= 1
    for (int j = 0; j < K; ++j) sum += (g[j] = std::exp(l[c[j]] - l[c[0]]));
    for (int j = 0; j < K; ++j) g[j] /= sum;
  }
}

//! One all-to-all of equal blocks over the ep group; with one rank the blocks stay here.
inline void exchange(const ep_group& ep, const std::vector<float>& send, std::vector<float>& recv) {
  recv.resize(send.size());
  if (ep.size == 1) {
    recv = send;
    return;
  }
  ep.all_to_all(send.data(), recv.data(), send.size() / z(ep.size));
}

template <class T>
void check_call(const shape& s, const ep_group& ep, const experts<T>& ex, int N) {
  check(s, ep.size);
  const auto bad = [](const std::string& m) { throw fsdp::error(fsdp::errc::invalid_argument, "moe: " + m); };
  if (ep.rank < 0 || ep.rank >= ep.size)
    bad("ep rank " + std::to_string(ep.rank) + " outside an ep group of " + std::to_string(ep.size));
  const int first = ep.rank * per_rank(s, ep.size), count = per_rank(s, ep.size);
  if (ex.first() != first || ex.count() != count)
    bad("ep rank " + std::to_string(ep.rank) + " of " + std::to_string(ep.size) + " owns experts " + std::to_string(first) + ".." +
        std::to_string(first + count - 1) + " but was given experts " + std::to_string(ex.first()) + ".." +
        std::to_string(ex.first() + ex.count() - 1));
  if (ep.size > 1 && !ep.all_to_all) bad("an ep group of " + std::to_string(ep.size) + " ranks needs an all_to_all");
  if (N < 0) bad("token count " + std::to_string(N) + " < 0");
}

}  // namespace detail

//! y[N][C] = the layer applied to x[N][C] (y is overwritten). Every rank of the ep group calls
//! it with the same N; `ex` must be this ep rank's experts.
template <class T>
void forward(float* y, activations& a, const float* x, int N, router<T>& r, experts<T>& ex, const shape& s, const ep_group& ep) {
  using detail::z;
  detail::check_call(s, ep, ex, N);
  const int E = s.experts, K = s.top_k, C = s.dim, H = s.hidden, P = ep.size;
  const int cap = capacity(s, P, N);
  a.tokens = N, a.capacity = cap;
  a.logits.resize(z(N) * z(E));
  kernels::matmul_forward(a.logits.data(), x, r.w.data(), static_cast<const T*>(nullptr), N, C, E);
  detail::route(a, s);

  // Dispatch: block p = [row count][cap rows of (expert index, x[C])]; rows in (token, j) order.
  // The expert index travels as a float: exact for any E below 2^24.
  const std::size_t row = 1 + z(C), block = 1 + z(cap) * row;
  std::vector<float> send(z(P) * block, 0.0f), recv;
  std::vector<int> used(z(P), 0);
  a.slot.assign(z(N) * z(K), 0);
  for (int n = 0; n < N; ++n)
    for (int j = 0; j < K; ++j) {
      const int e = a.chosen[z(n) * z(K) + z(j)], p = owner(s, P, e);
      const int at = used[z(p)]++;
      a.slot[z(n) * z(K) + z(j)] = at;
      float* dst = send.data() + z(p) * block + 1 + z(at) * row;
      dst[0] = static_cast<float>(e);
      std::copy(x + z(n) * z(C), x + z(n + 1) * z(C), dst + 1);
    }
  for (int p = 0; p < P; ++p) send[z(p) * block] = static_cast<float>(used[z(p)]);
  detail::exchange(ep, send, recv);

  // The expert side: sort the received rows by expert (keeping arrival order), run each expert.
  a.local.assign(z(ex.count()), {});
  for (int p = 0; p < P; ++p) {
    const float* b = recv.data() + z(p) * block;
    const int rows = static_cast<int>(b[0]);
    if (rows < 0 || rows > cap)
      throw fsdp::error(fsdp::errc::internal, "moe: ep rank " + std::to_string(p) + " sent " + std::to_string(rows) +
                                                  " rows, capacity " + std::to_string(cap));
    for (int i = 0; i < rows; ++i) {
      const float* src = b + 1 + z(i) * row;
      const int e = static_cast<int>(src[0]);
      if (!ex.owns(e))
        throw fsdp::error(fsdp::errc::internal, "moe: a row for expert " + std::to_string(e) + " reached ep rank " +
                                                    std::to_string(ep.rank) + ", which does not own it");
      auto& le = a.local[z(e - ex.first())];
      le.rows.push_back(p * cap + i);
      le.in.insert(le.in.end(), src + 1, src + 1 + C);
    }
  }
  std::vector<float> ret(z(P) * z(cap) * z(C), 0.0f), back;  // block p: the rows of peer p, at its slots
  std::vector<float> out;
  for (int i = 0; i < ex.count(); ++i) {
    auto& le = a.local[z(i)];
    expert<T>& w = ex.at(ex.first() + i);
    const int M = static_cast<int>(le.rows.size());
    le.fc.resize(z(M) * z(H)), le.fc_gelu.resize(z(M) * z(H)), out.resize(z(M) * z(C));
    kernels::matmul_forward(le.fc.data(), le.in.data(), w.fc_w.data(), w.fc_b.data(), M, C, H);
    kernels::gelu_forward(le.fc_gelu.data(), le.fc.data(), le.fc.size());
    kernels::matmul_forward(out.data(), le.fc_gelu.data(), w.out_w.data(), w.out_b.data(), M, H, C);
    for (int m = 0; m < M; ++m) std::copy(&out[z(m) * z(C)], &out[z(m + 1) * z(C)], &ret[z(le.rows[z(m)]) * z(C)]);
  }
  detail::exchange(ep, ret, back);

  // Combine, in the fixed order j = 0..K-1 whichever ranks the experts live on.
  a.outs.resize(z(N) * z(K) * z(C));
  for (int n = 0; n < N; ++n) {
    float* yr = y + z(n) * z(C);
    std::fill(yr, yr + C, 0.0f);
    for (int j = 0; j < K; ++j) {
      const std::size_t nj = z(n) * z(K) + z(j);
      const int p = owner(s, P, a.chosen[nj]);
      const float* o = back.data() + (z(p) * z(cap) + z(a.slot[nj])) * z(C);
      std::copy(o, o + C, a.outs.data() + nj * z(C));
      for (int c = 0; c < C; ++c) yr[c] += a.gates[nj] * o[c];
    }
  }
}

//! Backward of forward(): given dy[N][C], adds d loss / d x into dx[N][C] and the gradients of
//! router_w and of this rank's experts into their grad() (null grads are skipped, as frozen).
//! x is forward's input; `a` is what that forward kept.
template <class T>
void backward(float* dx, activations& a, const float* dy, const float* x, router<T>& r, experts<T>& ex, const shape& s,
              const ep_group& ep) {
  using detail::z;
  const int N = a.tokens;
  detail::check_call(s, ep, ex, N);
  const int E = s.experts, K = s.top_k, C = s.dim, H = s.hidden, P = ep.size, cap = a.capacity;

  // y = sum_j g_j o_j: d o_j = g_j dy goes to the expert; d g_j = dy . o_j stays for the router.
  std::vector<float> send(z(P) * z(cap) * z(C), 0.0f), recv, dgate(z(N) * z(K), 0.0f);
  for (int n = 0; n < N; ++n)
    for (int j = 0; j < K; ++j) {
      const std::size_t nj = z(n) * z(K) + z(j);
      const float* d = dy + z(n) * z(C);
      const float* o = a.outs.data() + nj * z(C);
      float* dst = send.data() + (z(owner(s, P, a.chosen[nj])) * z(cap) + z(a.slot[nj])) * z(C);
      float dot = 0;
      for (int c = 0; c < C; ++c) {
        dst[c] = a.gates[nj] * d[c];
        dot += d[c] * o[c];
      }
      dgate[nj] = dot;
    }
  // Same blocks, same slots as forward's dispatch: the expert side finds each row where it was.
  detail::exchange(ep, send, recv);

  std::vector<float> ret(send.size(), 0.0f), back, dout, dgelu, din;
  for (int i = 0; i < ex.count(); ++i) {
    auto& le = a.local[z(i)];
    expert<T>& w = ex.at(ex.first() + i);
    const int M = static_cast<int>(le.rows.size());
    dout.resize(z(M) * z(C));
    for (int m = 0; m < M; ++m) {
      const float* src = recv.data() + z(le.rows[z(m)]) * z(C);
      std::copy(src, src + C, dout.data() + z(m) * z(C));
    }
    dgelu.assign(z(M) * z(H), 0.0f), din.assign(z(M) * z(C), 0.0f);
    kernels::matmul_backward(dgelu.data(), w.out_w.grad(), w.out_b.grad(), dout.data(), le.fc_gelu.data(), w.out_w.data(), M, H, C);
    kernels::gelu_backward(dgelu.data(), le.fc.data(), dgelu.size());  // in place
    kernels::matmul_backward(din.data(), w.fc_w.grad(), w.fc_b.grad(), dgelu.data(), le.in.data(), w.fc_w.data(), M, C, H);
    for (int m = 0; m < M; ++m) std::copy(&din[z(m) * z(C)], &din[z(m + 1) * z(C)], &ret[z(le.rows[z(m)]) * z(C)]);
  }
  detail::exchange(ep, ret, back);

  // dx: the experts' input gradients in the order j = 0..K-1, then the router's path.
  // Through the softmax over the chosen logits: d l_j = g_j (d g_j - sum_i g_i d g_i); the
  // logits of the experts not chosen get nothing.
  std::vector<float> dlogits(z(N) * z(E), 0.0f);
  for (int n = 0; n < N; ++n) {
    float* d = dx + z(n) * z(C);
    float mean = 0;
    for (int j = 0; j < K; ++j) {
      const std::size_t nj = z(n) * z(K) + z(j);
      const float* g = back.data() + (z(owner(s, P, a.chosen[nj])) * z(cap) + z(a.slot[nj])) * z(C);
      for (int c = 0; c < C; ++c) d[c] += g[c];
      mean += a.gates[nj] * dgate[nj];
    }
    for (int j = 0; j < K; ++j) {
      const std::size_t nj = z(n) * z(K) + z(j);
      dlogits[z(n) * z(E) + z(a.chosen[nj])] = a.gates[nj] * (dgate[nj] - mean);
    }
  }
  kernels::matmul_backward(dx, r.w.grad(), static_cast<T*>(nullptr), dlogits.data(), x, r.w.data(), N, C, E);
}

}  // namespace gpt::moe
