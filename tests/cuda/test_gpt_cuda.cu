// The GPT example's CUDA model (examples/gpt/cuda) against the plain C++ one (gpt/model.hpp):
// each kernel on random inputs against its CPU function, then one whole forward/backward of a
// tiny model (2 layers, dim 32, 4 heads, seq 16, batch 3) for f32 and bf16 parameters, with
// identical parameter values bound on both sides through trivial hooks (no shard_group).
// Without a usable GPU (the build machines) only the no-device failure runs.
//
// Tolerances (relative: max |gpu - cpu| over max |cpu|, the reference's scale):
//   f32: 1e-5 for forward values and the loss, 1e-4 for gradients (sums over many rows in
//        another order; cuBLAS without TF32).
//   bf16: the GPU rounds each GEMM's activation operand (and, in backward, the upstream
//        gradient) to bf16, which the CPU keeps in float: each rounding is a relative error of
//        at most 2^-9 ~ 2e-3 per element; a gradient's path crosses a few of them (and both
//        sides round the bf16 gradient itself), so 1e-2 per kernel and 3e-2 per parameter
//        gradient after the whole model leave a ~5x margin. The loss barely moves (the logits
//        of an initial model are ~0.1 and change by ~1e-4): 1e-3. With bf16 parameters the
//        attention's products also run on TF32 tensor cores (10-bit mantissas, finer than bf16):
//        the same tolerances, which held on an H100 (docs/gpu.md).
//   cuDNN's fused attention (attention_kind::cudnn): bf16 q, k, v, output and output gradient
//        (each rounded once, 2^-9 relative), softmax and accumulation in f32: 1e-2 for its
//        output and 2e-2 for d qkv against the CPU's f32 attention; the whole model with it at
//        bf16's tolerances, for f32 parameters too.

#include "fsdp/device/cuda.hpp"
#include "fsdp/fsdp.hpp"

#include <doctest/doctest.h>

#include "common/catch_error.hpp"
#include "common/gpu.hpp"
#include "gpt/cuda/model.cuh"
#include "gpt/model.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

namespace gk = gpt::cuda::kernels;

using fsdp_test::contains;
using fsdp_test::has_gpu;

const gpt::config tiny{.vocab = 256, .seq = 16, .layers = 2, .dim = 32, .heads = 4};
// With cuDNN's attention: head size 32, where tiny's is 8 (a multiple of 8, which cuDNN takes,
// but the smallest; its engines are built and tuned for 32-256).
const gpt::config tiny_cudnn{.vocab = 256, .seq = 16, .layers = 2, .dim = 64, .heads = 2};
const gpt::config& config_for(const gpt::cuda::activation_options& o) {
  return o.attention == gpt::cuda::attention_kind::cudnn ? tiny_cudnn : tiny;
}
constexpr int batch = 3;

std::vector<float> randn(std::size_t n, float scale, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(gen);
  return v;
}
std::vector<std::uint8_t> random_bytes(std::size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::vector<std::uint8_t> v(n);
  for (auto& x : v) x = static_cast<std::uint8_t>(gen() % 256);
  return v;
}
template <class P>
std::vector<P> to(const std::vector<float>& v) {
  std::vector<P> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = fsdp::convert<P>(v[i]);
  return out;
}
template <class X>
std::vector<float> as_float(const std::vector<X>& v) {
  std::vector<float> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = fsdp::convert<float>(v[i]);
  return out;
}

// max |got - want| / max |want|.
double rel_error(const std::vector<float>& got, const std::vector<float>& want) {
  REQUIRE(got.size() == want.size());
  double diff = 0, scale = 1e-30;
  for (std::size_t i = 0; i < want.size(); ++i) {
    diff = std::max(diff, static_cast<double>(std::abs(got[i] - want[i])));
    scale = std::max(scale, static_cast<double>(std::abs(want[i])));
  }
  return diff / scale;
}

// A device copy of a host array.
template <class X>
struct on_device {
  fsdp::cuda_buffer buf;
  std::size_t n;
  on_device(const fsdp::cuda_device& gpu, const std::vector<X>& host)
      : buf(gpu.allocate(std::max<std::size_t>(1, host.size()) * sizeof(X), fsdp::mem_kind::transient)), n(host.size()) {
    gpu.copy_from_host(buf.data(), host.data(), n * sizeof(X));
  }
  X* get() const { return buf.as<X>(); }
  std::vector<X> host(const fsdp::cuda_device& gpu) const {
    std::vector<X> v(n);
    gpu.copy_to_host(v.data(), buf.data(), n * sizeof(X));
    return v;
  }
};

// The reference's hooks: nothing to gather (as tests/gpt's plain reference).
struct plain_hooks {
  struct scope {
    ~scope() {}
  };
  scope forward(int) { return {}; }
  scope backward(int) { return {}; }
  scope recompute(int) { return {}; }
};

// A device, the tiny model's cuBLAS handle and activations: the environment the kernels need.
template <class P>
struct fixture {
  fsdp::cuda_device gpu{0};
  gpt::cuda::model<P> m{tiny, gpu};
  gpt::cuda::activations acts{gpu, tiny, batch, fsdp::dtype_of<P>};
  gpt::cuda::env env() const { return acts.kernel_env(m.blas()); }
};

}  // namespace

TEST_CASE("gpt::cuda: without a usable GPU, the model and activations fail with errc::no_device" * doctest::skip(has_gpu)) {
  const fsdp::error m = fsdp_test::catch_error([] { gpt::cuda::model<float> model(tiny, fsdp::cuda_device{0}); });
  CHECK(m.code() == fsdp::errc::no_device);
  CHECK(contains(m.what(), "no CUDA device"));
  const fsdp::error a = fsdp_test::catch_error([] { gpt::cuda::activations acts(fsdp::cuda_device{}, tiny, batch); });
  CHECK(a.code() == fsdp::errc::no_device);
  CHECK(contains(a.what(), "no CUDA device"));
}

// cuBLASLt's epilogues write bf16 outputs for bf16 products: checked at the door (activations::
// check, which the constructor calls before any allocation; here without a GPU too).
TEST_CASE("gpt::cuda: activations refuse cuBLASLt's epilogues without bf16, the fused passes and a width of 8s") {
  using gpt::cuda::attention_kind;
  const gpt::cuda::activation_options lt{.fused_elementwise = true, .cublaslt_epilogues = true};
  gpt::config odd = tiny;
  odd.dim = 36;  // 4 heads of 9: GELU's input's leading dimension must be a multiple of 8
  const struct {
    const gpt::config& cfg;
    fsdp::dtype params;
    gpt::cuda::activation_options opts;
    const char* what;
  } bad[] = {
      {tiny, fsdp::dtype::f32, lt, "got f32"},
      {tiny, fsdp::dtype::bf16, {.cublaslt_epilogues = true}, "fused off"},
      {odd, fsdp::dtype::bf16, lt, "width 36"},
  };
  CHECK_NOTHROW(gpt::cuda::activations::check(tiny, batch, fsdp::dtype::bf16, lt));
  CHECK_NOTHROW(gpt::cuda::activations::check(tiny_cudnn, batch, fsdp::dtype::bf16,
                                              {.attention = attention_kind::cudnn, .fused_elementwise = true, .cublaslt_epilogues = true}));
  for (const auto& c : bad) {
    CAPTURE(c.what);
    const fsdp::error e = fsdp_test::catch_error([&] { gpt::cuda::activations::check(c.cfg, batch, c.params, c.opts); });
    CHECK(e.code() == fsdp::errc::invalid_argument);
    CHECK(contains(e.what(), "cuBLASLt's epilogues need bf16 parameters"));
    CHECK(contains(e.what(), c.what));
  }
}

TEST_CASE("gpt::cuda kernels: layernorm forward and backward match the CPU" * doctest::skip(!has_gpu)) {
  fixture<float> f;
  const int N = batch * tiny.seq, C = tiny.dim;
  const std::size_t NC = static_cast<std::size_t>(N * C);
  const auto in = randn(NC, 1.0f, 1), dout = randn(NC, 1.0f, 2), din0 = randn(NC, 1.0f, 3);
  auto w = randn(static_cast<std::size_t>(C), 0.1f, 4);
  for (float& x : w) x += 1.0f;
  const auto b = randn(static_cast<std::size_t>(C), 0.1f, 5), dw0 = randn(static_cast<std::size_t>(C), 1.0f, 6),
             db0 = randn(static_cast<std::size_t>(C), 1.0f, 7);
  std::vector<float> out(NC), mean(static_cast<std::size_t>(N)), rstd(mean.size()), din = din0, dw = dw0, db = db0;
  gpt::kernels::layernorm_forward(out.data(), mean.data(), rstd.data(), in.data(), w.data(), b.data(), N, C);
  gpt::kernels::layernorm_backward(din.data(), dw.data(), db.data(), dout.data(), in.data(), w.data(), mean.data(), rstd.data(), N, C);

  on_device<float> d_in(f.gpu, in), d_w(f.gpu, w), d_b(f.gpu, b), d_dout(f.gpu, dout), d_out(f.gpu, std::vector<float>(NC)),
      d_mean(f.gpu, mean), d_rstd(f.gpu, rstd), d_din(f.gpu, din0), d_dw(f.gpu, dw0), d_db(f.gpu, db0);
  gk::layernorm_forward(f.env(), d_out.get(), d_mean.get(), d_rstd.get(), d_in.get(), d_w.get(), d_b.get(), N, C);
  gk::layernorm_backward(f.env(), d_din.get(), d_dw.get(), d_db.get(), d_dout.get(), d_in.get(), d_w.get(), d_mean.get(), d_rstd.get(), N, C);
  CHECK(rel_error(d_out.host(f.gpu), out) <= 1e-5);
  CHECK(rel_error(d_mean.host(f.gpu), mean) <= 1e-5);
  CHECK(rel_error(d_rstd.host(f.gpu), rstd) <= 1e-5);
  CHECK(rel_error(d_din.host(f.gpu), din) <= 1e-4);
  CHECK(rel_error(d_dw.host(f.gpu), dw) <= 1e-4);
  CHECK(rel_error(d_db.host(f.gpu), db) <= 1e-4);
}

TEST_CASE_TEMPLATE("gpt::cuda kernels: matmul forward and backward (cuBLAS) match the CPU" * doctest::skip(!has_gpu), P, float, fsdp::bf16) {
  fixture<P> f;
  const double tol_fwd = std::is_same_v<P, float> ? 1e-5 : 1e-2, tol_bwd = std::is_same_v<P, float> ? 1e-4 : 1e-2;
  const int N = batch * tiny.seq, C = tiny.dim, OC = 3 * tiny.dim;
  const std::size_t n_in = static_cast<std::size_t>(N * C), n_out = static_cast<std::size_t>(N * OC), n_w = static_cast<std::size_t>(OC * C);
  const auto in = randn(n_in, 1.0f, 11), dout = randn(n_out, 1.0f, 12), din0 = randn(n_in, 1.0f, 13);
  const auto w = to<P>(randn(n_w, 0.2f, 14)), b = to<P>(randn(static_cast<std::size_t>(OC), 0.2f, 15));
  const auto dw0 = to<P>(randn(n_w, 1.0f, 16)), db0 = to<P>(randn(static_cast<std::size_t>(OC), 1.0f, 17));
  std::vector<float> out(n_out), din(n_in);  // the GPU's din is written (din0 on the device must go), dw and db added to
  std::vector<P> dw = dw0, db = db0;
  gpt::kernels::matmul_forward(out.data(), in.data(), w.data(), b.data(), N, C, OC);
  gpt::kernels::matmul_backward(din.data(), dw.data(), db.data(), dout.data(), in.data(), w.data(), N, C, OC);

  on_device<float> d_in(f.gpu, in), d_dout(f.gpu, dout), d_out(f.gpu, std::vector<float>(n_out)), d_din(f.gpu, din0);
  on_device<P> d_w(f.gpu, w), d_b(f.gpu, b), d_dw(f.gpu, dw0), d_db(f.gpu, db0);
  gk::matmul_forward(f.env(), d_out.get(), d_in.get(), d_w.get(), d_b.get(), N, C, OC);
  gk::matmul_backward(f.env(), d_din.get(), d_dw.get(), d_db.get(), d_dout.get(), d_in.get(), d_w.get(), N, C, OC);
  CHECK(rel_error(d_out.host(f.gpu), out) <= tol_fwd);
  CHECK(rel_error(d_din.host(f.gpu), din) <= tol_bwd);
  CHECK(rel_error(as_float(d_dw.host(f.gpu)), as_float(dw)) <= tol_bwd);
  CHECK(rel_error(as_float(d_db.host(f.gpu)), as_float(db)) <= tol_bwd);
}

TEST_CASE("gpt::cuda kernels: causal attention forward and backward match the CPU" * doctest::skip(!has_gpu)) {
  fixture<float> f;
  const int B = batch, T = tiny.seq, C = tiny.dim, H = tiny.heads;
  const std::size_t NC = static_cast<std::size_t>(B * T * C), natt = static_cast<std::size_t>(B * H * T * T);
  const auto qkv = randn(3 * NC, 1.0f, 21), dout = randn(NC, 1.0f, 22), dqkv0 = randn(3 * NC, 1.0f, 23);
  std::vector<float> out(NC), att(natt), dqkv = dqkv0;
  gpt::kernels::attention_forward(out.data(), att.data(), qkv.data(), B, T, C, H);
  gpt::kernels::attention_backward(dqkv.data(), dout.data(), qkv.data(), att.data(), B, T, C, H);

  on_device<float> d_qkv(f.gpu, qkv), d_dout(f.gpu, dout), d_out(f.gpu, std::vector<float>(NC)), d_att(f.gpu, std::vector<float>(natt)),
      d_dqkv(f.gpu, dqkv0);
  gk::attention_forward(f.env(), d_out.get(), d_att.get(), d_qkv.get(), B, T, C, H);
  gk::attention_backward(f.env(), d_dqkv.get(), d_dout.get(), d_qkv.get(), d_att.get(), B, T, C, H);
  CHECK(rel_error(d_out.host(f.gpu), out) <= 1e-5);
  CHECK(rel_error(d_att.host(f.gpu), att) <= 1e-5);  // zeros above the diagonal included
  CHECK(rel_error(d_dqkv.host(f.gpu), dqkv) <= 1e-4);

  // With bf16 parameters the attention's products run on TF32 tensor cores (env::attention_compute):
  // operands rounded to 10-bit mantissas (2^-11 ~ 5e-4 relative each), so 1e-2, as bf16's kernels.
  gpt::cuda::env tf32 = f.env();
  tf32.attention_compute = CUBLAS_COMPUTE_32F_FAST_TF32;
  on_device<float> t_out(f.gpu, std::vector<float>(NC)), t_att(f.gpu, std::vector<float>(natt)), t_dqkv(f.gpu, dqkv0);
  gk::attention_forward(tf32, t_out.get(), t_att.get(), d_qkv.get(), B, T, C, H);
  gk::attention_backward(tf32, t_dqkv.get(), d_dout.get(), d_qkv.get(), t_att.get(), B, T, C, H);
  CHECK(rel_error(t_out.host(f.gpu), out) <= 1e-2);
  CHECK(rel_error(t_att.host(f.gpu), att) <= 1e-2);
  CHECK(rel_error(t_dqkv.host(f.gpu), dqkv) <= 1e-2);
}

TEST_CASE("gpt::cuda: cuDNN's fused attention refuses a head size or a length it cannot take, and fails without a GPU") {
  // Checked before cuDNN is loaded: head size 6 is not a multiple of 8.
  const fsdp::error shape = fsdp_test::catch_error([] { gpt::cuda::cudnn_attention att(nullptr, 16, 12, 2); });
  CHECK(shape.code() == fsdp::errc::invalid_argument);
  CHECK(contains(shape.what(), "head size 6"));
  // One token: cuDNN's backward takes none (frontend 1.32).
  const fsdp::error one = fsdp_test::catch_error([] { gpt::cuda::cudnn_attention att(nullptr, 1, 32, 4); });
  CHECK(one.code() == fsdp::errc::invalid_argument);
  CHECK(contains(one.what(), "and 1 tokens"));
  if (has_gpu) return;
  const fsdp::error e = fsdp_test::catch_error([] { gpt::cuda::cudnn_attention att(nullptr, 16, 32, 4); });
  if (gpt::cuda::cudnn_built()) {
    CHECK(e.code() == fsdp::errc::no_device);  // no libcudnn.so.9, or no GPU for its handle
    CHECK(contains(e.what(), "cuDNN: "));
  } else {
    CHECK(e.code() == fsdp::errc::invalid_argument);
    CHECK(contains(e.what(), "built without cuDNN"));
  }
  const fsdp::error a = fsdp_test::catch_error(
      [] { gpt::cuda::activations acts(fsdp::cuda_device{}, tiny, batch, fsdp::dtype::bf16, {.attention = gpt::cuda::attention_kind::cudnn}); });
  CHECK(a.code() == fsdp::errc::no_device);
}

TEST_CASE("gpt::cuda: cuDNN's fused attention matches the CPU's attention, forward and backward (either backward algorithm)" * doctest::skip(!has_gpu)) {
  // GPT-2's head size (64), 2 heads, 2 sequences of 64 tokens.
  const int B = 2, T = 64, C = 128, H = 2;
  const std::size_t NC = static_cast<std::size_t>(B * T * C);
  // d qkv from zeros: the tolerance is then against the gradient's own scale.
  const auto qkv = randn(3 * NC, 1.0f, 31), dout = randn(NC, 1.0f, 32);
  const std::vector<float> dqkv0(3 * NC, 0.0f);
  std::vector<float> out(NC), att(static_cast<std::size_t>(B * H * T * T)), dqkv = dqkv0;
  gpt::kernels::attention_forward(out.data(), att.data(), qkv.data(), B, T, C, H);
  gpt::kernels::attention_backward(dqkv.data(), dout.data(), qkv.data(), att.data(), B, T, C, H);

  fsdp::cuda_device gpu{0};
  gpt::cuda::model<fsdp::bf16> m(gpt::config{.vocab = 256, .seq = T, .layers = 1, .dim = C, .heads = H}, gpu);
  // Both backward algorithms: the deterministic one (the default) and cuDNN's atomics.
  for (const bool deterministic : {true, false}) {
    CAPTURE(deterministic);
    gpt::cuda::activations acts(gpu, m.cfg(), B, fsdp::dtype::bf16,
                                {.attention = gpt::cuda::attention_kind::cudnn, .deterministic_attention = deterministic});
    REQUIRE(acts.fused() != nullptr);
    MESSAGE(acts.fused()->version());
    const gpt::cuda::env e = acts.kernel_env(m.blas());
    auto& s = acts.blocks[0];
    on_device<float> d_qkv(gpu, qkv), d_dout(gpu, dout), d_out(gpu, std::vector<float>(NC)), d_dqkv(gpu, dqkv0);
    gk::to_bf16(e, s.qkv16, d_qkv.get(), 3 * NC);
    acts.fused()->forward(s.atty16, s.att_stats, s.qkv16, B, acts.workspace(), acts.workspace_size());
    gk::from_bf16(e, d_out.get(), s.atty16, NC, false);
    gk::to_bf16(e, acts.dout16(), d_dout.get(), NC);
    acts.fused()->backward(acts.dqkv16(), acts.dout16(), s.atty16, s.att_stats, s.qkv16, B, acts.workspace(), acts.workspace_size());
    gk::from_bf16(e, d_dqkv.get(), acts.dqkv16(), 3 * NC, true);  // adds, as the plain attention_backward
    CHECK(rel_error(d_out.host(gpu), out) <= 1e-2);
    CHECK(rel_error(d_dqkv.host(gpu), dqkv) <= 2e-2);
    // No T x T matrix: the layer's att is not allocated.
    CHECK(s.att == nullptr);
    // The deterministic backward gives the same bits again (atomics may not; not checked).
    if (deterministic) {
      std::vector<fsdp::bf16> first(3 * NC), again(3 * NC);
      gpu.copy_to_host(first.data(), acts.dqkv16(), first.size() * sizeof(fsdp::bf16));
      acts.fused()->backward(acts.dqkv16(), acts.dout16(), s.atty16, s.att_stats, s.qkv16, B, acts.workspace(), acts.workspace_size());
      gpu.copy_to_host(again.data(), acts.dqkv16(), again.size() * sizeof(fsdp::bf16));
      CHECK(std::memcmp(first.data(), again.data(), first.size() * sizeof(fsdp::bf16)) == 0);
    }
  }
}

// cuBLASLt's products with their epilogues (activation_options::cublaslt_epilogues) against the CPU
// kernels on the same bf16 values: a bf16 output is rounded once (2^-9 relative), so 1e-2 as the
// other bf16 kernels; a float output (the residual stream) only differs by the order of f32 sums.
TEST_CASE("gpt::cuda kernels: cuBLASLt's products with bias, residual, GELU and GELU's backward match the CPU" * doctest::skip(!has_gpu)) {
  fsdp::cuda_device gpu{0};
  const gpt::config& cfg = tiny_cudnn;
  gpt::cuda::model<fsdp::bf16> m(cfg, gpu);
  gpt::cuda::activations acts(gpu, cfg, batch, fsdp::dtype::bf16, {.fused_elementwise = true, .cublaslt_epilogues = true});
  const gpt::cuda::env e = acts.kernel_env(m.blas(), m.lt());
  REQUIRE(e.lt != nullptr);
  const int N = batch * cfg.seq, C = cfg.dim;
  const auto z = [](int x) { return static_cast<std::size_t>(x); };
  using bf = fsdp::bf16;
  // Values that are bf16's, so that the CPU computes with exactly what the GPU reads.
  auto values = [&](std::size_t n, float scale, unsigned seed) { return as_float(to<bf>(randn(n, scale, seed))); };
  for (const int OC : {3 * C, C}) {  // qkv's bf16 output; the projections' float output with the residual
    CAPTURE(OC);
    const auto in = values(z(N) * z(C), 1.0f, 71), w = values(z(OC) * z(C), 0.2f, 72), b = values(z(OC), 0.2f, 73);
    const auto residual = randn(z(N) * z(OC), 1.0f, 74);
    std::vector<float> want(z(N) * z(OC));
    gpt::kernels::matmul_forward(want.data(), in.data(), w.data(), b.data(), N, C, OC);
    on_device<bf> d_in(gpu, to<bf>(in)), d_w(gpu, to<bf>(w)), d_b(gpu, to<bf>(b));
    if (OC == 3 * C) {
      on_device<bf> d_out(gpu, std::vector<bf>(want.size()));
      gk::matmul_bias_lt(e, d_out.get(), nullptr, nullptr, d_in.get(), d_w.get(), d_b.get(), N, C, OC);
      CHECK(rel_error(as_float(d_out.host(gpu)), want) <= 1e-2);
    } else {
      for (std::size_t i = 0; i < want.size(); ++i) want[i] += residual[i];
      on_device<float> d_res(gpu, residual), d_out(gpu, std::vector<float>(want.size()));
      gk::matmul_bias_lt(e, nullptr, d_out.get(), d_res.get(), d_in.get(), d_w.get(), d_b.get(), N, C, OC);
      CHECK(rel_error(d_out.host(gpu), want) <= 1e-4);
    }
  }
  {  // fc and GELU: GELU's input and output, both bf16; w and b 64-byte aligned, as a gathered
     // unit's parameters are (core/layout.hpp), not the 256 bytes cuBLASLt assumes by default
    const int OC = 4 * C;
    const auto in = values(z(N) * z(C), 1.0f, 75), w = values(z(OC) * z(C), 0.2f, 76), b = values(z(OC), 0.2f, 77);
    std::vector<float> pre(z(N) * z(OC)), out(pre.size());
    gpt::kernels::matmul_forward(pre.data(), in.data(), w.data(), b.data(), N, C, OC);
    gpt::kernels::gelu_forward(out.data(), pre.data(), pre.size());
    std::vector<bf> wb(32, fsdp::convert<bf>(0.0f));  // 32 bf16 (64 bytes) before w, then b at w's end + 32
    for (const float x : w) wb.push_back(fsdp::convert<bf>(x));
    wb.resize(wb.size() + 32, fsdp::convert<bf>(0.0f));
    for (const float x : b) wb.push_back(fsdp::convert<bf>(x));
    const std::size_t b_at = 32 + w.size() + 32;
    on_device<bf> d_in(gpu, to<bf>(in)), d_wb(gpu, wb), d_pre(gpu, std::vector<bf>(pre.size())), d_out(gpu, std::vector<bf>(pre.size()));
    REQUIRE(reinterpret_cast<std::uintptr_t>(d_wb.get() + 32) % 128 == 64);
    gk::matmul_gelu_lt(e, d_out.get(), d_pre.get(), d_in.get(), d_wb.get() + 32, d_wb.get() + b_at, N, C, OC);
    CHECK(rel_error(as_float(d_pre.host(gpu)), pre) <= 1e-2);
    CHECK(rel_error(as_float(d_out.host(gpu)), out) <= 1e-2);
  }
  {  // the MLP's output product's input gradient through GELU's backward: w is [C][4C]
    const int IN = 4 * C, OC = C;
    const auto dout = values(z(N) * z(OC), 1.0f, 78), w = values(z(OC) * z(IN), 0.2f, 79), pre = values(z(N) * z(IN), 2.0f, 80);
    std::vector<float> din(z(N) * z(IN), 0.0f);  // the CPU's backward adds into it
    gpt::kernels::matmul_backward(din.data(), static_cast<float*>(nullptr), static_cast<float*>(nullptr), dout.data(), pre.data(),
                                  w.data(), N, IN, OC);
    gpt::kernels::gelu_backward(din.data(), pre.data(), din.size());  // in place: din * GELU'(pre)
    on_device<bf> d_dout(gpu, to<bf>(dout)), d_w(gpu, to<bf>(w)), d_pre(gpu, to<bf>(pre)), d_din(gpu, std::vector<bf>(din.size()));
    gk::matmul_dgelu_lt(e, d_din.get(), d_dout.get(), d_w.get(), d_pre.get(), N, IN, OC);
    CHECK(rel_error(as_float(d_din.host(gpu)), din) <= 1e-2);
  }
}

TEST_CASE("gpt::cuda kernels: gelu forward and backward match the CPU" * doctest::skip(!has_gpu)) {
  fixture<float> f;
  const std::size_t n = 1000;
  const auto in = randn(n, 2.0f, 31), dout = randn(n, 1.0f, 32), din0 = randn(n, 1.0f, 33);
  std::vector<float> out(n), din = dout;
  gpt::kernels::gelu_forward(out.data(), in.data(), n);
  gpt::kernels::gelu_backward(din.data(), in.data(), n);  // the CPU's, in place: dout * GELU'(in)
  for (std::size_t i = 0; i < n; ++i) din[i] += din0[i];   // the CUDA kernel's adds into din
  on_device<float> d_in(f.gpu, in), d_dout(f.gpu, dout), d_out(f.gpu, std::vector<float>(n)), d_din(f.gpu, din0);
  gk::gelu_forward(f.env(), d_out.get(), d_in.get(), n);
  gk::gelu_backward(f.env(), d_din.get(), d_in.get(), d_dout.get(), n);
  CHECK(rel_error(d_out.host(f.gpu), out) <= 1e-5);
  CHECK(rel_error(d_din.host(f.gpu), din) <= 1e-5);
}

TEST_CASE("gpt::cuda kernels: softmax cross-entropy, its mean loss and its backward match the CPU" * doctest::skip(!has_gpu)) {
  fixture<float> f;
  const int N = batch * tiny.seq, V = tiny.vocab, micro = 2;
  const std::size_t NV = static_cast<std::size_t>(N * V);
  const auto logits = randn(NV, 2.0f, 41);
  const auto targets = random_bytes(static_cast<std::size_t>(N), 42);
  // model.hpp's head_forward / head_backward loops.
  std::vector<float> probs = logits, dlogits(NV);
  double loss = 0;
  for (int n = 0; n < N; ++n) {
    float* p = probs.data() + static_cast<std::size_t>(n * V);
    const float mx = *std::max_element(p, p + V);
    float sum = 0;
    for (int v = 0; v < V; ++v) sum += (p[v] = std::exp(p[v] - mx));
    for (int v = 0; v < V; ++v) p[v] /= sum;
    loss -= std::log(std::max(p[targets[static_cast<std::size_t>(n)]], 1e-30f));
  }
  loss /= N;
  for (std::size_t i = 0; i < NV; ++i) dlogits[i] = probs[i] - (static_cast<int>(i % static_cast<std::size_t>(V)) == targets[i / static_cast<std::size_t>(V)] ? 1.0f : 0.0f);
  for (auto& d : dlogits) d /= static_cast<float>(N * micro);

  on_device<float> d_probs(f.gpu, logits), d_losses(f.gpu, std::vector<float>(static_cast<std::size_t>(N))), d_dlogits(f.gpu, std::vector<float>(NV));
  on_device<double> d_loss(f.gpu, std::vector<double>(1));
  on_device<std::uint8_t> d_targets(f.gpu, targets);
  gk::crossentropy_forward(f.env(), d_probs.get(), d_losses.get(), d_loss.get(), d_targets.get(), N, V);
  gk::crossentropy_backward(f.env(), d_dlogits.get(), d_probs.get(), d_targets.get(), N, V, micro);
  CHECK(rel_error(d_probs.host(f.gpu), probs) <= 1e-5);
  CHECK(std::abs(d_loss.host(f.gpu)[0] - loss) <= 1e-5 * loss);
  CHECK(rel_error(d_dlogits.host(f.gpu), dlogits) <= 1e-5);
}

namespace {
template <class P>
void forward_backward_matches_cpu(gpt::cuda::activation_options opts) {
  const gpt::config& cfg = config_for(opts);
  constexpr bool f32 = std::is_same_v<P, float>;
  const bool exact = f32 && opts.attention == gpt::cuda::attention_kind::plain;  // else bf16 somewhere
  const double loss_tol = exact ? 1e-5 : 1e-3, grad_tol = exact ? 1e-4 : 3e-2;
  const int micro = 2;  // the head's scaling by N * micro
  const std::vector<std::string> frozen = {"wpe", "block0.qkv_w"};  // null gradients: skipped on both sides
  fsdp::cuda_device gpu{0};
  gpt::model<P> cpu(cfg);
  gpt::cuda::model<P> dev(cfg, gpu);
  auto params_of = [](gpt::model<P>& m) {
    std::vector<fsdp::buffer<P>*> all = m.emb().params();
    for (int l = 0; l < m.layers(); ++l)
      for (auto* p : m.layer(l).params()) all.push_back(p);
    return all;
  };
  const auto cpu_params = params_of(cpu), dev_params = params_of(dev.parameters());
  REQUIRE(cpu_params.size() == dev_params.size());
  // The initial values perturbed (so that biases and gains are not 0 and 1), the same on both sides.
  std::vector<std::vector<P>> host_w, host_g;
  std::vector<fsdp::cuda_buffer> dev_w, dev_g;
  std::vector<bool> is_frozen;
  for (std::size_t k = 0; k < cpu_params.size(); ++k) {
    fsdp::buffer<P>& p = *cpu_params[k];
    REQUIRE(p.name() == dev_params[k]->name());
    std::vector<float> v = randn(p.size(), 0.05f, static_cast<unsigned>(100 + k));
    for (std::size_t i = 0; i < v.size(); ++i) v[i] += gpt::initial_value(p.name(), i, cfg, 5);
    host_w.push_back(to<P>(v));
    host_g.emplace_back(p.size(), fsdp::convert<P>(0.0f));
    dev_w.push_back(gpu.allocate(p.size() * sizeof(P), fsdp::mem_kind::persistent));
    dev_g.push_back(gpu.allocate(p.size() * sizeof(P), fsdp::mem_kind::persistent));  // zero-filled
    gpu.copy_from_host(dev_w.back().data(), host_w.back().data(), p.size() * sizeof(P));
    is_frozen.push_back(std::find(frozen.begin(), frozen.end(), p.name()) != frozen.end());
    fsdp::param_traits<fsdp::buffer<P>>::bind(p, host_w.back().data(), is_frozen[k] ? nullptr : host_g.back().data());
    fsdp::param_traits<fsdp::buffer<P>>::bind(*dev_params[k], dev_w.back().data(), is_frozen[k] ? nullptr : dev_g.back().data());
  }
  const std::size_t n = static_cast<std::size_t>(batch * cfg.seq);
  const auto tokens = random_bytes(n, 51), targets = random_bytes(n, 52);
  plain_hooks hooks;
  gpt::activations cpu_acts;
  gpt::cuda::activations dev_acts(gpu, cfg, batch, fsdp::dtype_of<P>, opts);
  CHECK(gpu.memory().live >= dev_acts.bytes());  // the activations count in the device's stats

  const double want = gpt::forward_backward(hooks, cpu, cpu_acts, tokens, targets, batch, micro);
  const double got = gpt::cuda::forward_backward(hooks, dev, dev_acts, tokens, targets, batch, micro);
  CHECK(std::abs(got - want) <= loss_tol * std::abs(want));
  std::vector<std::vector<float>> first(dev_params.size());
  for (std::size_t k = 0; k < dev_params.size(); ++k) {
    CAPTURE(dev_params[k]->name());
    if (is_frozen[k]) continue;
    std::vector<P> g(dev_params[k]->size());
    gpu.copy_to_host(g.data(), dev_g[k].data(), g.size() * sizeof(P));
    first[k] = as_float(g);
    CHECK(rel_error(first[k], as_float(host_g[k])) <= grad_tol);
  }
  // Evaluation gives the same bits (deterministic kernels, one stream), and a second step adds
  // the same gradients again (backward accumulates, as model.hpp's).
  CHECK(gpt::cuda::forward_only(hooks, dev, dev_acts, tokens, targets, batch) == got);
  CHECK(gpt::cuda::forward_backward(hooks, dev, dev_acts, tokens, targets, batch, micro) == got);
  if (exact) {
    for (std::size_t k = 0; k < dev_params.size(); ++k) {
      CAPTURE(dev_params[k]->name());
      if (is_frozen[k]) continue;
      std::vector<float> g(dev_params[k]->size()), twice = first[k];
      gpu.copy_to_host(g.data(), dev_g[k].data(), g.size() * sizeof(float));
      for (float& x : twice) x *= 2;
      CHECK(rel_error(g, twice) <= 1e-5);
    }
  }
  for (std::size_t k = 0; k < cpu_params.size(); ++k) {
    fsdp::param_traits<fsdp::buffer<P>>::bind(*cpu_params[k], nullptr, nullptr);
    fsdp::param_traits<fsdp::buffer<P>>::bind(*dev_params[k], nullptr, nullptr);
  }
}
}  // namespace

TEST_CASE_TEMPLATE("gpt::cuda: one forward_backward matches gpt::forward_backward, loss and every gradient" * doctest::skip(!has_gpu), P,
                   float, fsdp::bf16) {
  forward_backward_matches_cpu<P>({});
}

// One forward_backward of the tiny model on fixed parameter values (the initial values perturbed),
// with `opts`: the loss, every gradient and the activations' bytes.
namespace {
struct step_result {
  double loss = 0;
  std::vector<std::vector<float>> grads;
  std::size_t bytes = 0;
};
template <class P>
step_result one_step(const gpt::cuda::activation_options& opts) {
  const gpt::config& cfg = config_for(opts);
  fsdp::cuda_device gpu{0};
  gpt::cuda::model<P> dev(cfg, gpu);
  plain_hooks hooks;
  std::vector<fsdp::buffer<P>*> params = dev.parameters().emb().params();
  for (int l = 0; l < dev.layers(); ++l)
    for (auto* p : dev.layer(l).params()) params.push_back(p);
  std::vector<fsdp::cuda_buffer> w, g;
  for (std::size_t k = 0; k < params.size(); ++k) {
    std::vector<float> v = randn(params[k]->size(), 0.05f, static_cast<unsigned>(200 + k));
    for (std::size_t i = 0; i < v.size(); ++i) v[i] += gpt::initial_value(params[k]->name(), i, cfg, 5);
    const std::vector<P> values = to<P>(v);
    w.push_back(gpu.allocate(v.size() * sizeof(P), fsdp::mem_kind::persistent));
    g.push_back(gpu.allocate(v.size() * sizeof(P), fsdp::mem_kind::persistent));  // zero-filled
    gpu.copy_from_host(w.back().data(), values.data(), values.size() * sizeof(P));
    fsdp::param_traits<fsdp::buffer<P>>::bind(*params[k], w.back().as<P>(), g.back().as<P>());
  }
  const std::size_t n = static_cast<std::size_t>(batch * cfg.seq);
  gpt::cuda::activations acts(gpu, cfg, batch, fsdp::dtype_of<P>, opts);
  step_result r;
  r.loss = gpt::cuda::forward_backward(hooks, dev, acts, random_bytes(n, 61), random_bytes(n, 62), batch);
  for (std::size_t k = 0; k < params.size(); ++k) {
    std::vector<P> grad(params[k]->size());
    gpu.copy_to_host(grad.data(), g[k].data(), grad.size() * sizeof(P));
    r.grads.push_back(as_float(grad));
  }
  r.bytes = acts.bytes();
  for (auto* p : params) fsdp::param_traits<fsdp::buffer<P>>::bind(*p, nullptr, nullptr);
  return r;
}
}  // namespace

// Activation recomputation changes where the blocks' activations live, not what is computed: the
// same kernels in the same order on the same inputs, so the same bits (cuDNN's backward is asked
// for its deterministic algorithm).
TEST_CASE("gpt::cuda: with recompute, forward_backward gives the same loss and gradients bit for bit" * doctest::skip(!has_gpu)) {
  const auto kept = one_step<float>({}), recomputed = one_step<float>({.recompute = true});
  CHECK(recomputed.loss == kept.loss);
  CHECK(recomputed.grads == kept.grads);
  CHECK(recomputed.bytes < kept.bytes);  // one set of block buffers instead of one per block
  const auto kept16 = one_step<fsdp::bf16>({.attention = gpt::cuda::attention_kind::cudnn, .fused_elementwise = true});
  const auto recomputed16 =
      one_step<fsdp::bf16>({.attention = gpt::cuda::attention_kind::cudnn, .recompute = true, .fused_elementwise = true});
  CHECK(recomputed16.loss == kept16.loss);
  CHECK(recomputed16.grads == kept16.grads);
  const gpt::cuda::activation_options lt{.attention = gpt::cuda::attention_kind::cudnn, .fused_elementwise = true, .cublaslt_epilogues = true};
  gpt::cuda::activation_options lt_recomputed = lt;
  lt_recomputed.recompute = true;
  const auto kept_lt = one_step<fsdp::bf16>(lt), recomputed_lt = one_step<fsdp::bf16>(lt_recomputed);
  CHECK(recomputed_lt.loss == kept_lt.loss);
  CHECK(recomputed_lt.grads == kept_lt.grads);
}

// Fused elementwise passes do the same arithmetic in the same order: a bias added in the pass
// after its product (with the residual, GELU or the cast), a bf16 operand written by its producer
// (the same rounding of the same float as a cast before the product). The same bits, with either
// attention and either parameter type.
TEST_CASE("gpt::cuda: fused elementwise passes give the bits of separate ones" * doctest::skip(!has_gpu)) {
  for (const auto attention : {gpt::cuda::attention_kind::plain, gpt::cuda::attention_kind::cudnn}) {
    CAPTURE(static_cast<int>(attention));
    const auto fused = one_step<fsdp::bf16>({.attention = attention, .fused_elementwise = true});
    const auto separate = one_step<fsdp::bf16>({.attention = attention});
    CHECK(fused.loss == separate.loss);
    CHECK(fused.grads == separate.grads);
    // Fewer bytes in all, at this tiny shape by the float d_fc at least: the bf16 copies of the
    // head's operands (dlogits16 is N V, V = 8 C here) take back what the blocks' dropped float
    // operands save (the case below counts a block's bytes).
    CHECK(fused.bytes < separate.bytes);
  }
  const auto fused = one_step<float>({.fused_elementwise = true}), separate = one_step<float>({});
  CHECK(fused.loss == separate.loss);
  CHECK(fused.grads == separate.grads);
  CHECK(fused.bytes == separate.bytes);  // f32 operands: nothing to copy, nothing dropped
}

// What one more block costs, against what model.cuh's activations say it keeps: a block's bytes
// are those of two layers less those of one (the shared buffers cancel).
TEST_CASE("gpt::cuda: a block keeps the activation bytes model.cuh gives" * doctest::skip(!has_gpu)) {
  using gpt::cuda::attention_kind;
  struct expected {
    gpt::cuda::activation_options opts;
    fsdp::dtype params;
    std::size_t floats_nc, halves_nc;  // per block, in units of N C
  };
  const expected cases[] = {
      {{}, fsdp::dtype::f32, 16, 0},                                                       // x ln1 qkv(3) atty x_mid ln2 fc(4) fc_gelu(4)
      {{.fused_elementwise = true}, fsdp::dtype::bf16, 10, 6},                             // ln1, ln2, fc_gelu as bf16 only
      {{.attention = attention_kind::cudnn}, fsdp::dtype::bf16, 16, 4},                    // + cuDNN's qkv16 and atty16
      {{.attention = attention_kind::cudnn, .fused_elementwise = true}, fsdp::dtype::bf16, 6, 10},  // x x_mid fc; qkv shared
      {{.fused_elementwise = true, .cublaslt_epilogues = true}, fsdp::dtype::bf16, 6, 10},  // GELU's input in bf16 (fc16), not fc
      // x x_mid; fc16, and no float qkv at all
      {{.attention = attention_kind::cudnn, .fused_elementwise = true, .cublaslt_epilogues = true}, fsdp::dtype::bf16, 2, 14},
  };
  fsdp::cuda_device gpu{0};
  for (const expected& c : cases) {
    CAPTURE(static_cast<int>(c.opts.attention));
    CAPTURE(c.opts.fused_elementwise);
    CAPTURE(c.opts.cublaslt_epilogues);
    gpt::config one = config_for(c.opts), two = one;
    one.layers = 1, two.layers = 2;
    const std::size_t B = batch, T = static_cast<std::size_t>(one.seq), H = static_cast<std::size_t>(one.heads), N = B * T,
                      NC = N * static_cast<std::size_t>(one.dim);
    const bool cudnn = c.opts.attention == attention_kind::cudnn;
    // Besides: two layer norms' mean and rstd (4 N floats), and the attention's T x T
    // probabilities (plain) or cuDNN's softmax statistics (B H T floats).
    const std::size_t other_floats = 4 * N + (cudnn ? B * H * T : B * H * T * T);
    const std::size_t want = (c.floats_nc * NC + other_floats) * sizeof(float) + c.halves_nc * NC * sizeof(fsdp::bf16);
    const gpt::cuda::activations a1(gpu, one, batch, c.params, c.opts), a2(gpu, two, batch, c.params, c.opts);
    CHECK(a2.bytes() - a1.bytes() == want);
  }
}

TEST_CASE_TEMPLATE("gpt::cuda: with cuDNN's fused attention, forward_backward matches gpt::forward_backward at bf16's tolerances" *
                       doctest::skip(!has_gpu),
                   P, float, fsdp::bf16) {
  forward_backward_matches_cpu<P>({.attention = gpt::cuda::attention_kind::cudnn, .fused_elementwise = true});
}

// cuBLASLt's epilogues (bf16 only): the whole model against the CPU at bf16's tolerances, as the
// fused passes they replace; forward_backward_matches_cpu also checks that evaluation and a second
// step give the same bits (each product's algorithm is picked once).
TEST_CASE("gpt::cuda: with cuBLASLt's epilogues, forward_backward matches gpt::forward_backward at bf16's tolerances" *
          doctest::skip(!has_gpu)) {
  for (const auto attention : {gpt::cuda::attention_kind::plain, gpt::cuda::attention_kind::cudnn}) {
    CAPTURE(static_cast<int>(attention));
    forward_backward_matches_cpu<fsdp::bf16>({.attention = attention, .fused_elementwise = true, .cublaslt_epilogues = true});
  }
}

TEST_CASE("gpt::cuda: a step with bad input fails at the door with errc::invalid_argument" * doctest::skip(!has_gpu)) {
  fixture<float> f;
  plain_hooks hooks;
  const std::size_t n = static_cast<std::size_t>(batch * tiny.seq);
  const std::vector<std::uint8_t> bytes(n, 1);
  auto code = [&](auto&& step) { return fsdp_test::catch_error(step).code(); };
  CHECK(code([&] { gpt::cuda::forward_backward(hooks, f.m, f.acts, bytes, bytes, batch + 1); }) == fsdp::errc::invalid_argument);
  CHECK(code([&] { gpt::cuda::forward_only(hooks, f.m, f.acts, std::vector<std::uint8_t>(n - 1), bytes, batch); }) ==
        fsdp::errc::invalid_argument);
  gpt::cuda::activations for_bf16(f.gpu, tiny, batch, fsdp::dtype::bf16);
  const fsdp::error e = fsdp_test::catch_error([&] { gpt::cuda::forward_only(hooks, f.m, for_bf16, bytes, bytes, batch); });
  CHECK(e.code() == fsdp::errc::invalid_argument);
  CHECK(contains(e.what(), "bf16 parameters"));
}
