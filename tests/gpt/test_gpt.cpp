// The GPT training program's parity: N ranks against one rank and against a plain unsharded
// reference (the same model code on plain vectors, a plain AdamW loop, no fsdp), including the
// tied embedding / LM-head weight on unevenly sharded ranks.

#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "common/catch_error.hpp"
#include "gpt/cuda/token_rows.hpp"
#include "gpt/kernel_table.hpp"
#include "gpt/memory.hpp"
#include "gpt/train.hpp"
#include "reference.hpp"

namespace {

using namespace gpt_test;
struct sharded_result {
  std::vector<double> losses;
  std::vector<float> wte;  // the full wte after training, gathered from the shards
};

template <class Group>
sharded_result train_sharded(int ranks, const gpt::run_options& o, typename Group::options opts) {
  sharded_result out;
  fsdp::threads::world{ranks}.run([&](fsdp::threads::communicator& comm) {
    std::vector<float> wte;
    const gpt::run_result r =
        gpt::train_rank<Group>(comm, o, opts, test_corpus(), {.at_end = [&](Group& g) { wte = g.full_parameter(0, 0); }});
    if (comm.rank() == 0) {
      for (const auto& s : r.steps) out.losses.push_back(s.loss());
      out.wte = wte;
    }
  });
  return out;
}

}  // namespace

TEST_CASE("gpt: 4 ranks and 1 rank with the same global batch give the same loss at every step (fp32)") {
  const auto o = small_run(6);
  const auto one = train_sharded<full_f32>(1, o, {});
  const auto four = train_sharded<full_f32>(4, o, {});
  CHECK(max_abs_diff(one.losses, four.losses) <= 1e-4);
  // The loss really moves: the comparison is not between two constants.
  CHECK(one.losses.back() < one.losses.front() - 0.3);
}

TEST_CASE("gpt: clipping in AdamW's pass (the default) gives clip_grad_norm's own pass's losses and parameters, bit for bit") {
  auto o = small_run(5);
  REQUIRE(o.clip > 0);
  REQUIRE(o.clip_in_optimizer);
  const auto fused = train_sharded<full_f32>(3, o, {});
  o.clip_in_optimizer = false;
  const auto separate = train_sharded<full_f32>(3, o, {});
  REQUIRE(fused.losses.size() == 5);
  CHECK(fused.losses == separate.losses);
  CHECK(fused.wte == separate.wte);
  o.clip = 0;  // the clipping changed the run: the comparison is not between unclipped runs
  CHECK(train_sharded<full_f32>(3, o, {}).wte != fused.wte);
}

TEST_CASE("gpt: sharded training matches the plain unsharded reference, tied weight included") {
  const auto o = small_run(5);
  const auto ref = train_reference(o, test_corpus());
  REQUIRE(ref.losses.back() < ref.losses.front() - 0.3);
  REQUIRE(ref.clipped > 0);  // the clipping path is exercised
  std::map<std::string, sharded_result> runs;
  runs["full_shard on 3 ranks (uneven)"] = train_sharded<full_f32>(3, o, {});
  runs["full_shard on 4 ranks"] = train_sharded<full_f32>(4, o, {});
  runs["grad_op on 3 ranks"] = train_sharded<full_f32>(3, o, {.sharding = fsdp::shard_grad_op()});
  runs["hybrid 2x2"] = train_sharded<full_f32>(4, o, {.sharding = fsdp::hybrid_shard(2)});
  runs["no_shard (DDP) on 2 ranks"] = train_sharded<full_f32>(2, o, {.sharding = fsdp::no_shard()});
  // 60000 bytes: the embedding (26624 B) and block 0 (28896 B) share a bucket, block 1 is alone.
  runs["full_shard on 4 ranks, embedding and block 0 in one bucket"] =
      train_sharded<full_f32_bytes>(4, o, {.bucket = {.bytes = 60000}});
  // auto_bucket: 3 profiled steps, calibrate, plan (the searched one), then training replays
  // the plan; the nested embedding unit included.
  auto searched = o;
  searched.auto_plan = fsdp::auto_bucket{.search = true};
  runs["full_shard on 4 ranks, auto_bucket searched plan"] = train_sharded<full_f32>(4, searched, {});
  for (const auto& [name, r] : runs) {
    CAPTURE(name);
    CHECK(max_abs_diff(ref.losses, r.losses) <= 1e-4);
    // wte, element by element, on every rank's slice (the last rank's too): within 1e-4 of the
    // reference, and moved from its initial value wherever the reference moved it.
    REQUIRE(r.wte.size() == ref.wte.size());
    double worst = 0;
    std::size_t stale = 0;
    for (std::size_t i = 0; i < ref.wte.size(); ++i) {
      worst = std::max(worst, static_cast<double>(std::abs(r.wte[i] - ref.wte[i])));
      const float init = gpt::initial_value("wte", i, o.model, o.seed);
      if (ref.wte[i] != init && r.wte[i] == init) ++stale;
    }
    CHECK(worst <= 1e-4);
    CHECK(stale == 0);
  }
}

TEST_CASE("gpt: a fine-tune with frozen embeddings matches the plain reference, and wte and wpe stay bit-identical") {
  auto o = small_run(5);
  o.freeze = {"wte", "wpe", "block1.qkv_w"};
  const auto ref = train_reference(o, test_corpus());
  REQUIRE(ref.losses.back() < ref.losses.front() - 0.1);  // the rest still trains
  std::map<std::string, sharded_result> runs;
  runs["full_shard on 3 ranks"] = train_sharded<full_f32>(3, o, {});
  runs["hybrid 2x2"] = train_sharded<full_f32>(4, o, {.sharding = fsdp::hybrid_shard(2)});
  runs["no_shard on 2 ranks"] = train_sharded<full_f32>(2, o, {.sharding = fsdp::no_shard()});
  // The embedding (wte, wpe frozen; lnf trainable) and block 0 share a bucket.
  runs["full_shard on 4 ranks, embedding and block 0 in one bucket"] = train_sharded<full_f32_bytes>(4, o, {.bucket = {.bytes = 60000}});
  for (const auto& [name, r] : runs) {
    CAPTURE(name);
    CHECK(max_abs_diff(ref.losses, r.losses) <= 1e-4);
    REQUIRE(r.wte.size() == ref.wte.size());
    std::size_t moved = 0;
    for (std::size_t i = 0; i < r.wte.size(); ++i) moved += r.wte[i] != gpt::initial_value("wte", i, o.model, o.seed);
    CHECK(moved == 0);
  }
}

TEST_CASE("gpt: micro-batches train as one pass per step: accumulated unsharded, or reduced each with the all-reduce on the last") {
  const auto base = small_run(5);
  const auto ref = train_reference(base, test_corpus());
  struct run {
    const char* name;
    int ranks, micro;
    bool each;
    fsdp::sharding sharding;
  };
  for (const run& r : {run{"full_shard on 4 ranks, 3 micro-batches, no sync until the last", 4, 3, false, fsdp::full_shard()},
                       run{"full_shard on 2 ranks, 2 micro-batches, reduced each", 2, 2, true, fsdp::full_shard()},
                       run{"hybrid 2x2, 3 micro-batches, reduced each, all-reduce on the last", 4, 3, true, fsdp::hybrid_shard(2)}}) {
    CAPTURE(r.name);
    auto o = base;
    o.micro_batches = r.micro;
    o.reduce_each_micro_batch = r.each;
    const auto got = train_sharded<full_f32>(r.ranks, o, {.sharding = r.sharding});
    CHECK(max_abs_diff(ref.losses, got.losses) <= 1e-4);
    double worst = 0;
    for (std::size_t i = 0; i < ref.wte.size(); ++i) worst = std::max(worst, static_cast<double>(std::abs(got.wte[i] - ref.wte[i])));
    CHECK(worst <= 1e-4);
  }
  auto bad = base;
  bad.micro_batches = 2;  // 3 sequences per rank on 4 ranks
  const fsdp::error e = fsdp_test::catch_error([&] { train_sharded<full_f32>(4, bad, {}); });
  CHECK(std::string(e.what()).find("the micro-batches (2) must divide each rank's batch (3 sequences)") != std::string::npos);
}

TEST_CASE("gpt: bf16 parameters train close to fp32") {
  const auto o = small_run(5);
  const auto f32 = train_sharded<full_f32>(2, o, {});
  const auto b16 = train_sharded<full_bf16>(2, o, {});
  for (std::size_t s = 0; s < f32.losses.size(); ++s) CHECK(std::abs(b16.losses[s] - f32.losses[s]) <= 0.02 * f32.losses[s]);
}

TEST_CASE("gpt: bf16 with the low-precision shard kept (written in AdamW's pass) trains bit for bit as casting at each gather") {
  const auto o = small_run(5);
  const auto cast = train_sharded<full_bf16>(2, o, {});
  const auto kept = train_sharded<full_bf16>(2, o, {.keep_low_precision_shard = true});
  REQUIRE(cast.losses.size() == 5);
  CHECK(kept.losses == cast.losses);
  CHECK(kept.wte == cast.wte);
}

TEST_CASE("gpt: bad input names the problem") {
  fsdp::threads::world{3}.run([](fsdp::threads::communicator& comm) {
    auto o = small_run(1);
    o.batch = 4;  // not a multiple of 3
    const auto e = fsdp_test::catch_error([&] { gpt::train_rank<full_f32>(comm, o, {}, test_corpus()); });
    CHECK(e.code() == fsdp::errc::invalid_argument);
    CHECK(std::string(e.what()).find("multiple of the number of ranks") != std::string::npos);
  });
  const auto missing = fsdp_test::catch_error([] { gpt::load_corpus("/nonexistent/corpus.txt", 16); });
  CHECK(std::string(missing.what()).find("/nonexistent/corpus.txt") != std::string::npos);
  const auto path = std::filesystem::temp_directory_path() / ("fsdp_test_gpt_tiny_" + std::to_string(::getpid()) + ".txt");
  std::ofstream(path) << "too short";
  const auto tiny = fsdp_test::catch_error([&] { gpt::load_corpus(path.string(), 16); });
  std::filesystem::remove(path);
  CHECK(std::string(tiny.what()).find("too little text") != std::string::npos);
}

TEST_CASE("gpt: a loss that is not finite stops every rank, naming the step and the first non-finite gradient") {
  for (const float clip : {1.0f, 0.0f}) {  // with a gradient norm, and without (every step's shards are looked at)
    CAPTURE(clip);
    auto o = small_run(4);
    o.lr = 1e30f;  // step 0's update makes the parameters ~1e29: step 1's forward overflows
    o.clip = clip;
    std::string what;
    int reported = 0;
    try {
      fsdp::threads::world{3}.run([&](fsdp::threads::communicator& comm) {
        gpt::train_rank<full_f32>(comm, o, {}, test_corpus(), {.on_step = [&](const gpt::step_report&) { ++reported; }});
      });
    } catch (const gpt::not_finite& e) {
      what = e.what();
    }
    CAPTURE(what);
    CHECK(what.rfind("step 1: loss is nan (not finite); first non-finite gradient: ", 0) == 0);
    CHECK(what.find("; the parameters are finite, the largest ") != std::string::npos);
    CHECK(what.find("peak learning rate 1e+30") != std::string::npos);
    CHECK(reported == 2);  // step 1 is reported, then the run stops
  }
}

TEST_CASE("gpt: first_nonfinite names the parameter and element, in any rank's shard of a merged bucket") {
  struct target {
    const char* name;
    std::size_t element;
    int unit, param;
  };
  const auto o = small_run(1);
  // Frozen: wte and block0's qkv_w sit in the frozen regions after the trainable ones, so a shard
  // position maps to the flat buffer through two regions.
  for (const bool frozen : {false, true})
  for (const target t : {target{"wte", 5000, 0, 0}, target{"block0.fc_w", 1000, 1, 8}, target{"block1.out_b", 3, 2, 11}}) {
    CAPTURE(t.name);
    CAPTURE(frozen);
    std::vector<gpt::nonfinite_at> found(3);
    fsdp::threads::world{3}.run([&](fsdp::threads::communicator& comm) {
      gpt::model<float> m(o.model);
      // 60000 bytes: the embedding and block 0 share bucket 0 (see above), block 1 is alone.
      full_f32_bytes g{comm, {}, {.bucket = {.bytes = 60000}}};
      gpt::add_units(g, m, frozen ? std::vector<std::string>{"wte", "block0.qkv_w"} : std::vector<std::string>{});
      g.finalize(fsdp::init::per_shard([&](const fsdp::param_slice& s, std::span<float> out) {
        for (std::size_t i = 0; i < out.size(); ++i)
          out[i] = s.name == t.name && s.offset + i == t.element ? std::numeric_limits<float>::quiet_NaN() : 0.5f;
      }));
      std::vector<int> per_unit;
      for (const auto& u : gpt::parameter_names(m)) per_unit.push_back(static_cast<int>(u.size()));
      double max_abs = 0;
      found[static_cast<std::size_t>(comm.rank())] = gpt::first_nonfinite(g, false, per_unit, &max_abs);
      CHECK(max_abs == 0.5);
      CHECK_FALSE(gpt::first_nonfinite(g, true, per_unit).found());  // the gradients are zero
    });
    int holders = 0;
    for (const auto& f : found)
      if (f.found()) {
        ++holders;
        CHECK(f.unit == t.unit);
        CHECK(f.param == t.param);
        CHECK(f.element == t.element);
        CHECK(std::isnan(f.value));
      }
    CHECK(holders == 1);
  }
}

TEST_CASE("gpt: keep_steps = false keeps no history, and on_step still sees every step") {
  const auto o = small_run(3);
  fsdp::threads::world{2}.run([&](fsdp::threads::communicator& comm) {
    std::vector<int> seen;
    const auto r = gpt::train_rank<full_f32>(comm, o, {}, test_corpus(),
                                             {.on_step = [&](const gpt::step_report& s) { seen.push_back(s.step); }, .keep_steps = false});
    CHECK(r.steps.empty());
    if (comm.rank() == 0) CHECK(seen == std::vector<int>{0, 1, 2});
  });
}

TEST_CASE("gpt: the memory estimate counts the parameters as the model does, and shards the state") {
  for (const gpt::config c : {gpt::config{}, gpt::config{.seq = 16, .layers = 2, .dim = 24, .heads = 2},
                              gpt::config{.seq = 128, .layers = 3, .dim = 96, .heads = 8}})
    CHECK(gpt::parameter_count(c) == static_cast<double>(gpt::model<float>(c).numel()));
  gpt::run_options o;
  o.model = {.layers = 256, .dim = 8192};
  CHECK(gpt::parameter_count(o.model) == 206'188'331'008.0);  // what train_gpt refuses up front
  const auto one = gpt::estimate_memory(o, {.ranks = 4, .ranks_here = 4, .shard_size = 1});
  const auto four = gpt::estimate_memory(o, {.ranks = 4, .ranks_here = 4, .shard_size = 4});
  CHECK(four.state == doctest::Approx(one.state / 4));
  CHECK(four.total == doctest::Approx(4 * four.per_rank));
  CHECK(four.model_copy == doctest::Approx(4 * four.params));  // fp32: every rank builds the whole model first
  CHECK(gpt::available_memory().bytes > 0);
}

TEST_CASE("gpt: on_step failing on rank 0 stops every rank at the next exchange, with rank 0's exception") {
  for (const int fail_at : {1, 3}) {  // 3: the last step, stopped by the exchange after the loop
    CAPTURE(fail_at);
    const auto o = small_run(4);
    std::string what;
    int reported = 0;
    try {
      fsdp::threads::world{3}.run([&](fsdp::threads::communicator& comm) {
        gpt::train_rank<full_f32>(comm, o, {}, test_corpus(), {.on_step = [&](const gpt::step_report& s) {
                                    ++reported;
                                    if (s.step == fail_at) throw std::runtime_error("cannot write loss.csv");
                                  }});
      });
    } catch (const std::runtime_error& e) {
      what = e.what();
    }
    CHECK(what == "cannot write loss.csv");  // the root cause, not a peer's echo
    CHECK(reported == fail_at + 1);          // no step reported after the failure
  }
}

TEST_CASE("gpt: the GELU's tanh is within 1e-7 of std::tanh, and keeps a nan input's nan") {
  double worst = 0;
  for (float u = -30.0f; u <= 30.0f; u += 1.0e-3f)
    worst = std::max(worst, std::abs(static_cast<double>(gpt::kernels::tanh_approx(u)) - std::tanh(static_cast<double>(u))));
  CHECK(worst < 1e-7);
  CHECK(gpt::kernels::tanh_approx(INFINITY) == 1.0f);
  CHECK(gpt::kernels::tanh_approx(-INFINITY) == -1.0f);
  const float in[2] = {NAN, 1.0f};
  float out[2] = {}, din[2] = {1.0f, 1.0f};
  gpt::kernels::gelu_forward(out, in, 2);
  gpt::kernels::gelu_backward(din, in, 2);
  CHECK(std::isnan(out[0]));
  CHECK(std::isnan(din[0]));
  CHECK(out[1] == doctest::Approx(0.841192).epsilon(1e-5));  // GELU(1), tanh form
}

TEST_CASE("gpt: the GELU's backward is its forward's derivative (central differences), in place") {
  std::vector<float> x, grad;
  for (float v = -5.0f; v <= 5.0f; v += 0.125f) x.push_back(v), grad.push_back(2.0f);
  gpt::kernels::gelu_backward(grad.data(), x.data(), x.size());  // 2 * GELU'(x), written over the 2s
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double h = 1e-3;
    float up = 0, down = 0;
    const float xu = static_cast<float>(x[i] + h), xd = static_cast<float>(x[i] - h);
    gpt::kernels::gelu_forward(&up, &xu, 1);
    gpt::kernels::gelu_forward(&down, &xd, 1);
    const double slope = (static_cast<double>(up) - down) / (static_cast<double>(xu) - xd);
    CHECK(grad[i] == doctest::Approx(2.0 * slope).epsilon(1e-3).scale(1.0));
  }
}

#if GPT_OPENBLAS
// Equal within float rounding: OpenBLAS sums in another order than the loops.
static bool equal_within_rounding(const std::vector<float>& a, const std::vector<float>& b) {
  for (std::size_t i = 0; i < a.size(); ++i)
    if (std::abs(a[i] - b[i]) > 1e-5f * std::max(1.0f, std::abs(a[i]))) return false;
  return true;
}

// The GPU's embedding backward adds each wte row's gradient over the rows grouped here, in their
// order: the grouping must hold every row of the token, ascending, against a plain scan.
TEST_CASE("gpt: the rows grouped by token (the GPU's embedding backward) are each token's rows in row order") {
  for (const int vocab : {1, 7, 256}) {
    CAPTURE(vocab);
    std::vector<std::uint8_t> tokens(1000);
    std::uint32_t x = 12345;
    for (auto& t : tokens) {
      x = x * 1664525u + 1013904223u;
      t = static_cast<std::uint8_t>((x >> 16) % static_cast<std::uint32_t>(vocab == 256 ? 40 : vocab));  // some tokens unused at 256
    }
    std::vector<std::int32_t> starts(static_cast<std::size_t>(vocab) + 1, -1), rows(tokens.size(), -1);
    gpt::cuda::group_rows_by_token(tokens, vocab, starts, rows);
    std::vector<std::int32_t> want_rows, want_starts{0};
    for (int v = 0; v < vocab; ++v) {
      for (std::size_t n = 0; n < tokens.size(); ++n)
        if (tokens[n] == v) want_rows.push_back(static_cast<std::int32_t>(n));
      want_starts.push_back(static_cast<std::int32_t>(want_rows.size()));
    }
    CHECK(starts == want_starts);
    CHECK(rows == want_rows);
  }
}

// --kernel-times's table (the GPU side records through CUPTI and runs only on a GPU): who owns a
// kernel, by names as CUDA reports them, and the per-step figures.
TEST_CASE("gpt: the kernel table names each kernel's owner and sums the time a step, largest first") {
  using gpt::kernel_owner;
  CHECK(gpt::owner_of("void thrust::THRUST_300001_SM_900_NS::cuda_cub::core::_kernel_agent<__for_each::for_each_f<"
                      "fsdp::detail::adamw_op<float, __nv_bfloat16>, long>>(long)") == kernel_owner::fsdp);
  CHECK(gpt::owner_of("void fsdp::threads::detail::rank_order_sum_kernel<float>(...)") == kernel_owner::fsdp);
  CHECK(gpt::owner_of("void gpt::cuda::detail::layernorm_row_kernel<float>(float*, ...)") == kernel_owner::model);
  CHECK(gpt::owner_of("void gpt::cuda::detail::bias_epilogue_kernel<fsdp::bf16>(float*, const fsdp::bf16*, int)") == kernel_owner::model);
  CHECK(gpt::owner_of("void cub::CUB_300001_SM_900_NS::DeviceReduceKernel<Policy, const float*, fsdp::detail::square_op>(...)") ==
        kernel_owner::fsdp);
  CHECK(gpt::owner_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel") ==
        kernel_owner::cublas);
  CHECK(gpt::owner_of("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>(Params)") ==
        kernel_owner::cublas);
  CHECK(gpt::owner_of("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT") == kernel_owner::cublas);
  CHECK(gpt::owner_of("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0") ==
        kernel_owner::cudnn);
  CHECK(gpt::owner_of("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == kernel_owner::nccl);
  CHECK(gpt::owner_of("[memset]") == kernel_owner::other);

  gpt::kernel_table t;
  CHECK(t.empty());
  t.add("sm90_xmma_gemm_a", 6'000'000);  // over 2 steps: 3 ms a step
  t.add("sm90_xmma_gemm_a", 2'000'000);
  t.add("void gpt::cuda::detail::gelu_kernel<float>()", 1'000'000);
  t.add("void fsdp::detail::cast<float>()", 500'000);
  t.add("[memset]", 500'000);
  CHECK(t.total_ns() == 10'000'000);
  CHECK(t.owner_ns(kernel_owner::cublas) == 8'000'000);
  CHECK(t.owner_ns(kernel_owner::fsdp) == 500'000);
  const std::string table = t.format(2, 2);
  CHECK(table.find("GPU time: 5.000 ms a step") != std::string::npos);
  CHECK(table.find("cuBLAS   80.00%      4.000 ms a step") != std::string::npos);
  CHECK(table.find("fsdp      5.00%      0.250 ms a step") != std::string::npos);
  // The two largest kernels, largest first, with their calls a step; the rest cut.
  const std::size_t gemm = table.find("80.00%     4.000 ms     1.0 calls  cuBLAS sm90_xmma_gemm_a");
  const std::size_t gelu = table.find("10.00%     0.500 ms     0.5 calls  model  void gpt::cuda::detail::gelu_kernel");
  CHECK(gemm != std::string::npos);
  CHECK(gelu != std::string::npos);
  CHECK(gemm < gelu);
  CHECK(table.find("fsdp::detail::cast") == std::string::npos);
}

TEST_CASE("gpt: OpenBLAS's matrix products equal the plain loops (within float rounding), forward and backward") {
  const int N = 7, C = 13, OC = 11;  // odd sizes: no kernel's blocking fits them exactly
  std::vector<float> in(N * C), w(OC * C), b(OC), dout(N * OC);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = std::sin(0.37f * static_cast<float>(i));
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = std::cos(0.11f * static_cast<float>(i));
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = 0.01f * static_cast<float>(i);
  for (std::size_t i = 0; i < dout.size(); ++i) dout[i] = std::sin(1.3f * static_cast<float>(i));
  struct result {
    std::vector<float> out, din, dw, db;
  };
  auto run = [&](bool blas) {
    gpt::use_blas = blas;
    result r{std::vector<float>(N * OC), std::vector<float>(N * C, 0.5f), std::vector<float>(OC * C, 0.25f), std::vector<float>(OC, 1.0f)};
    gpt::kernels::matmul_forward(r.out.data(), in.data(), w.data(), b.data(), N, C, OC);
    gpt::kernels::matmul_backward(r.din.data(), r.dw.data(), r.db.data(), dout.data(), in.data(), w.data(), N, C, OC);  // adds (+=)
    gpt::use_blas = false;
    return r;
  };
  const result loops = run(false), blas = run(true);
  CHECK(equal_within_rounding(loops.out, blas.out));
  CHECK(equal_within_rounding(loops.din, blas.din));
  CHECK(equal_within_rounding(loops.dw, blas.dw));
  CHECK(equal_within_rounding(loops.db, blas.db));
}

TEST_CASE("gpt: attention through OpenBLAS equals the plain loops (within float rounding), forward and backward") {
  const int B = 2, T = 7, C = 12, H = 3;  // odd T: no kernel's blocking fits it exactly
  std::vector<float> qkv(B * T * 3 * C), dout(B * T * C);
  for (std::size_t i = 0; i < qkv.size(); ++i) qkv[i] = std::sin(0.37f * static_cast<float>(i));
  for (std::size_t i = 0; i < dout.size(); ++i) dout[i] = std::cos(1.3f * static_cast<float>(i));
  struct result {
    std::vector<float> out, att, dqkv;
  };
  auto run = [&](bool blas) {
    gpt::use_blas = blas;
    result r{std::vector<float>(B * T * C), std::vector<float>(B * H * T * T, 9.0f), std::vector<float>(qkv.size(), 0.5f)};
    gpt::kernels::attention_forward(r.out.data(), r.att.data(), qkv.data(), B, T, C, H);
    gpt::kernels::attention_backward(r.dqkv.data(), dout.data(), qkv.data(), r.att.data(), B, T, C, H);  // adds (+=)
    gpt::use_blas = false;
    return r;
  };
  const result loops = run(false), blas = run(true);
  CHECK(equal_within_rounding(loops.out, blas.out));
  CHECK(equal_within_rounding(loops.att, blas.att));  // the masked future is zero in both
  CHECK(equal_within_rounding(loops.dqkv, blas.dqkv));
}

TEST_CASE("gpt: training with OpenBLAS follows the plain loops' loss curve (4 ranks, 6 steps)") {
  const auto o = small_run(6);
  const auto loops = train_sharded<full_f32>(4, o, {});
  gpt::enable_blas();
  const auto blas = train_sharded<full_f32>(4, o, {});
  gpt::use_blas = false;
  CHECK(max_abs_diff(loops.losses, blas.losses) <= 1e-4);
  CHECK(blas.losses.back() < blas.losses.front() - 0.3);
}
#endif
