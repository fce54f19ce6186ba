#pragma once
// The GPT tests' plain reference and shared setup: a small English corpus, a small run's
// options, and the model trained on plain vectors (no hooks, no sharding, AdamW written out).

#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gpt/train.hpp"

namespace gpt_test {

// A small English text (written for this test), repeated: enough for training and validation
// sequences of 16 bytes.
inline const gpt::corpus& test_corpus() {
  static const gpt::corpus c = [] {
    const std::string paragraph =
        "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a "
        "single step. Every rank holds one shard of every unit, and the units are gathered just in "
        "time, used, and freed again. Gradients are reduced and scattered so that each rank owns the "
        "average of its slice. Sharding saves memory; overlap hides the time it costs to talk.\n";
    // Per process: ctest runs this file's cases as parallel processes, which must not write one file.
    const auto path = std::filesystem::temp_directory_path() / ("fsdp_test_gpt_corpus_" + std::to_string(::getpid()) + ".txt");
    {
      std::ofstream out(path);
      for (int i = 0; i < 12; ++i) out << paragraph;
    }
    auto loaded = gpt::load_corpus(path.string(), 16);
    std::filesystem::remove(path);
    return loaded;
  }();
  return c;
}

inline gpt::run_options small_run(int steps) {
  gpt::run_options o;
  // wte is 256 x 24 = 6144 elements; with 3 ranks the embedding unit (6656 elements after
  // alignment, padded to 6912) splits into shards of 2304, and the last rank's shard holds the
  // end of wte plus the other parameters: the uneven case where FSDP2 once left the last rank's
  // slice of a tied weight un-updated.
  o.model = {.vocab = 256, .seq = 16, .layers = 2, .dim = 24, .heads = 2};
  o.steps = steps;
  o.batch = 12;  // divisible by 1, 2, 3, 4
  o.lr = 1e-2f;
  o.warmup = 2;
  o.clip = 1.0f;  // clips in the first steps here: the reference must clip the same way
  o.seed = 7;
  o.eval_every = 0;
  return o;
}

// The plain reference: the model's own forward/backward on plain vectors (no hooks, no
// sharding), AdamW written out here; the parameters o.freeze names get no gradient and no update.
struct plain_hooks {
  struct scope {
    ~scope() {}  // user-provided: an RAII object, as fsdp's scopes are
  };
  scope forward(int) { return {}; }
  scope backward(int) { return {}; }
};

struct reference_result {
  std::vector<double> losses;
  int clipped = 0;  // steps whose gradient norm was clipped
  std::vector<float> wte;
};

inline reference_result train_reference(const gpt::run_options& o, const gpt::corpus& text) {
  gpt::model<float> m(o.model);
  std::vector<fsdp::buffer<float>*> params = m.emb().params();
  for (int l = 0; l < m.layers(); ++l) {
    for (auto* p : m.layer(l).params()) params.push_back(p);
    if (m.has_experts())  // all of them: one process is one ep rank
      for (auto* p : m.experts(l).params()) params.push_back(p);
  }
  struct state {
    std::vector<float> w, g, m, v;
  };
  std::vector<state> st(params.size());
  for (std::size_t k = 0; k < params.size(); ++k) {
    auto& s = st[k];
    const std::size_t n = params[k]->size();
    s.w.resize(n), s.g.assign(n, 0.0f), s.m.assign(n, 0.0f), s.v.assign(n, 0.0f);
    for (std::size_t i = 0; i < n; ++i) s.w[i] = gpt::initial_value(params[k]->name(), i, o.model, o.seed);
    const bool frozen = std::find(o.freeze.begin(), o.freeze.end(), params[k]->name()) != o.freeze.end();
    if (frozen) s.g.clear();  // no gradient: the model skips it, the norm and AdamW see nothing
    fsdp::param_traits<fsdp::buffer<float>>::bind(*params[k], s.w.data(), frozen ? nullptr : s.g.data());
  }
  plain_hooks hooks;
  gpt::activations acts;
  reference_result r;
  const float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f;
  for (int step = 0; step < o.steps; ++step) {
    for (auto& s : st) std::fill(s.g.begin(), s.g.end(), 0.0f);
    const gpt::batch b = gpt::make_batch(text, false, o.seed, static_cast<std::uint64_t>(step), 0, o.batch, o.model.seq);
    r.losses.push_back(gpt::forward_backward(hooks, m, acts, b.tokens, b.targets, o.batch));
    double norm = 0;
    for (auto& s : st)
      for (float g : s.g) norm += static_cast<double>(g) * g;
    norm = std::sqrt(norm);
    r.clipped += norm > o.clip;
    if (norm > o.clip)
      for (auto& s : st)
        for (float& g : s.g) g = static_cast<float>(g * (o.clip / (norm + 1e-6)));
    const double lr = gpt::learning_rate(o, step);
    const double t = step + 1;
    for (auto& s : st)
      for (std::size_t i = 0; i < s.g.size(); ++i) {
        s.m[i] = b1 * s.m[i] + (1 - b1) * s.g[i];
        s.v[i] = b2 * s.v[i] + (1 - b2) * s.g[i] * s.g[i];
        const double mhat = s.m[i] / (1 - std::pow(b1, t)), vhat = s.v[i] / (1 - std::pow(b2, t));
        s.w[i] -= static_cast<float>(lr * mhat / (std::sqrt(vhat) + eps));
      }
  }
  r.wte = st[0].w;
  for (auto* p : params) fsdp::param_traits<fsdp::buffer<float>>::bind(*p, nullptr, nullptr);
  return r;
}

// Sharding is a value: one group type per precision and bucket policy.
using full_f32 = fsdp::shard_group<fsdp::buffer<float>, fsdp::full_precision<float>>;
using full_f32_bytes = fsdp::shard_group<fsdp::buffer<float>, fsdp::full_precision<float>, fsdp::fixed_bytes>;
using full_bf16 = fsdp::shard_group<fsdp::buffer<fsdp::bf16>, fsdp::mixed_precision<fsdp::bf16, float, float>>;

inline double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double d = 0;
  for (std::size_t i = 0; i < a.size(); ++i) d = std::max(d, std::abs(a[i] - b[i]));
  return d;
}

}  // namespace gpt_test
