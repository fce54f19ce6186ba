#pragma once
// A small multi-unit model with uneven parameter sizes (primes, a 1-element gain, one unit
// larger than the others), its hand-written backward, a plain single-process reference
// trainer (plain vectors, plain SGD / AdamW loops: no fsdp), and a driver that trains the same
// model through fsdp::shard_group on a threads world. Parity tests compare the two.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <numeric>
#include <tuple>
#include <utility>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "fsdp/fsdp.hpp"

namespace fsdp_test {

// One unit = one layer: u = W x + b; z = g * u (if gain); y = tanh(z) (if act) else y = z.
struct layer_shape {
  int in, out;
  bool gain, act;
};

// 5 -> 7 -> 11 -> 31 -> 3: W sizes 35, 77, 341 (the large one), 93; biases 7, 11, 31, 3; a
// 1-element gain in unit 1.
inline const std::vector<layer_shape>& shapes() {
  static const std::vector<layer_shape> s = {{5, 7, false, true}, {7, 11, true, true}, {11, 31, false, true}, {31, 3, false, false}};
  return s;
}
inline constexpr int batch_global = 24;  // divisible by 1, 2, 3, 4, 8

inline std::vector<std::size_t> param_sizes(const layer_shape& l) {
  std::vector<std::size_t> v{static_cast<std::size_t>(l.out * l.in), static_cast<std::size_t>(l.out)};
  if (l.gain) v.push_back(1);
  return v;
}

// Padded elements of each unit's flat buffer (one bucket per unit), computed here from the
// rule in docs/design.md, independently of fsdp::flat_layout: each parameter starts on a
// multiple of 64 elements; the buffer is padded to a multiple of lcm(world, 128).
inline std::vector<std::size_t> padded_units(int world) {
  const std::size_t pad = std::lcm(static_cast<std::size_t>(world), std::size_t{128});
  std::vector<std::size_t> out;
  for (const auto& l : shapes()) {
    std::size_t end = 0;
    for (std::size_t n : param_sizes(l)) end = (end + 63) / 64 * 64 + n;
    out.push_back((end + pad - 1) / pad * pad);
  }
  return out;
}

inline std::uint64_t mix(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
// Uniform in [-1, 1), a pure function of its arguments.
inline float uniform(std::uint64_t a, std::uint64_t b, std::uint64_t c) {
  const std::uint64_t h = mix(a * 1000003ull ^ mix(b * 7919ull ^ mix(c)));
  return static_cast<float>((h >> 40) * (1.0 / (1ull << 24)) * 2.0 - 1.0);
}

// The initial value of element i of parameter `index` of unit `unit`.
inline float init_value(int unit, int index, std::size_t i) {
  const layer_shape& l = shapes()[static_cast<std::size_t>(unit)];
  const float r = uniform(static_cast<std::uint64_t>(unit), static_cast<std::uint64_t>(index), i);
  if (index == 0) return r / std::sqrt(static_cast<float>(l.in));
  if (index == 1) return 0.1f * r;
  return 1.0f + 0.1f * r;  // gain
}

// Sample s of step `step`: inputs in [-1, 1), targets a fixed smooth function of them.
inline void sample(int step, int s, float* x, float* t) {
  const int in = shapes().front().in, out = shapes().back().out;
  for (int i = 0; i < in; ++i) x[i] = uniform(1000u + static_cast<std::uint64_t>(step), static_cast<std::uint64_t>(s), static_cast<std::uint64_t>(i));
  for (int o = 0; o < out; ++o) {
    float acc = 0.0f;
    for (int i = 0; i < in; ++i) acc += std::sin(static_cast<float>(o + 1) * x[i] + static_cast<float>(i));
    t[o] = 0.5f * acc / static_cast<float>(in);
  }
}

template <class T>
float get(const T* p, std::size_t i) {
  return fsdp::convert<float>(p[i]);
}
template <class T>
void add_to(T* p, std::size_t i, float v) {
  p[i] = fsdp::convert<T>(fsdp::convert<float>(p[i]) + v);
}

// Activations of one layer for a batch.
struct layer_cache {
  std::vector<float> x, u, y;
};

// Forward of one layer over `batch` samples (row-major [batch][in] -> [batch][out]).
template <class T>
void layer_forward(const layer_shape& l, const T* W, const T* b, const T* g, const std::vector<float>& x, int batch,
                   layer_cache& c) {
  c.x = x;
  c.u.assign(static_cast<std::size_t>(batch * l.out), 0.0f);
  c.y.assign(c.u.size(), 0.0f);
  const float gain = l.gain ? get(g, 0) : 1.0f;
  for (int s = 0; s < batch; ++s)
    for (int o = 0; o < l.out; ++o) {
      float acc = get(b, static_cast<std::size_t>(o));
      for (int i = 0; i < l.in; ++i)
        acc += get(W, static_cast<std::size_t>(o * l.in + i)) * x[static_cast<std::size_t>(s * l.in + i)];
      const auto k = static_cast<std::size_t>(s * l.out + o);
      c.u[k] = acc;
      const float z = gain * acc;
      c.y[k] = l.act ? std::tanh(z) : z;
    }
}

// Backward: adds (+=) into dW, db, dg (each skipped when null: a frozen parameter); returns dx.
template <class T>
std::vector<float> layer_backward(const layer_shape& l, const T* W, const T* g, T* dW, T* db, T* dg, const layer_cache& c,
                                  const std::vector<float>& dy, int batch) {
  std::vector<float> dx(static_cast<std::size_t>(batch * l.in), 0.0f);
  const float gain = l.gain ? get(g, 0) : 1.0f;
  float dgain = 0.0f;
  std::vector<float> dWacc(static_cast<std::size_t>(l.out * l.in), 0.0f), dbacc(static_cast<std::size_t>(l.out), 0.0f);
  for (int s = 0; s < batch; ++s)
    for (int o = 0; o < l.out; ++o) {
      const auto k = static_cast<std::size_t>(s * l.out + o);
      const float dz = l.act ? dy[k] * (1.0f - c.y[k] * c.y[k]) : dy[k];
      dgain += dz * c.u[k];
      const float du = dz * gain;
      dbacc[static_cast<std::size_t>(o)] += du;
      for (int i = 0; i < l.in; ++i) {
        dWacc[static_cast<std::size_t>(o * l.in + i)] += du * c.x[static_cast<std::size_t>(s * l.in + i)];
        dx[static_cast<std::size_t>(s * l.in + i)] += du * get(W, static_cast<std::size_t>(o * l.in + i));
      }
    }
  if (dW)
    for (std::size_t i = 0; i < dWacc.size(); ++i) add_to(dW, i, dWacc[i]);
  if (db)
    for (std::size_t i = 0; i < dbacc.size(); ++i) add_to(db, i, dbacc[i]);
  if (l.gain && dg) add_to(dg, 0, dgain);
  return dx;
}

// Loss 0.5 * mean over samples of |y - t|^2 and its gradient dL/dy.
inline float loss_and_grad(const std::vector<float>& y, const std::vector<float>& t, int batch, std::vector<float>& dy) {
  dy.assign(y.size(), 0.0f);
  double loss = 0.0;
  for (std::size_t k = 0; k < y.size(); ++k) {
    const float d = y[k] - t[k];
    loss += 0.5 * d * d;
    dy[k] = d / static_cast<float>(batch);
  }
  return static_cast<float>(loss / batch);
}

inline void batch_slice(int step, int first, int count, std::vector<float>& x, std::vector<float>& t) {
  const int in = shapes().front().in, out = shapes().back().out;
  x.assign(static_cast<std::size_t>(count * in), 0.0f);
  t.assign(static_cast<std::size_t>(count * out), 0.0f);
  for (int s = 0; s < count; ++s)
    sample(step, first + s, &x[static_cast<std::size_t>(s * in)], &t[static_cast<std::size_t>(s * out)]);
}

enum class optimizer { sgd, adamw };

// Activation recomputation in sharded_step: off; each layer's forward re-run inside its backward
// through group.recompute(u); or through group.forward(u) there (what an autograd engine's
// forward hooks call when a checkpointed module re-runs).
enum class recompute { off, scope, forward_hooks };

struct train_config {
  optimizer opt = optimizer::sgd;
  int steps = 20;
  int micro_batches = 1;  // gradient accumulation: global batch split into this many passes
  bool sync_each_micro_batch = false;  // reduce every micro-batch instead of only the last
  bool all_reduce_last_only = false;   // HSDP: the replicas' all-reduce on the last micro-batch only
  double clip = 0.0;      // > 0: clip the global grad norm
  recompute recompute_mode = recompute::off;  // sharded_step only (the reference keeps its activations)
  fsdp::sgd_options sgd{.lr = 0.05f, .momentum = 0.9f, .weight_decay = 0.01f};
  fsdp::adamw_options adamw{.lr = 0.01f, .weight_decay = 0.1f};
  std::vector<std::pair<int, int>> frozen{};  // (unit, index): parameters that get no gradient and no update
  bool is_frozen(std::size_t u, std::size_t p) const {
    return std::find(frozen.begin(), frozen.end(), std::pair{static_cast<int>(u), static_cast<int>(p)}) != frozen.end();
  }
};

struct train_result {
  std::vector<std::vector<std::vector<float>>> params;  // [unit][index][element]
  std::vector<double> losses;                           // per step, mean over the global batch
};

// ---- the plain reference: one process, whole global batch, plain vectors and loops -------------

inline train_result train_reference(const train_config& cfg) {
  const auto& L = shapes();
  train_result r;
  r.params.resize(L.size());
  for (std::size_t u = 0; u < L.size(); ++u) {
    const auto sizes = param_sizes(L[u]);
    for (std::size_t p = 0; p < sizes.size(); ++p) {
      std::vector<float> v(sizes[p]);
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = init_value(static_cast<int>(u), static_cast<int>(p), i);
      r.params[u].push_back(std::move(v));
    }
  }
  auto zeros_like = [&] {
    auto z = r.params;
    for (auto& u : z)
      for (auto& p : u) std::fill(p.begin(), p.end(), 0.0f);
    return z;
  };
  auto m = zeros_like(), v = zeros_like();
  const int mb = batch_global / cfg.micro_batches;
  for (int step = 0; step < cfg.steps; ++step) {
    auto grads = zeros_like();
    double loss_sum = 0.0;
    for (int k = 0; k < cfg.micro_batches; ++k) {
      std::vector<float> x, t, dy;
      batch_slice(step, k * mb, mb, x, t);
      std::vector<layer_cache> caches(L.size());
      for (std::size_t u = 0; u < L.size(); ++u) {
        auto& P = r.params[u];
        layer_forward(L[u], P[0].data(), P[1].data(), L[u].gain ? P[2].data() : nullptr, u ? caches[u - 1].y : x, mb, caches[u]);
      }
      loss_sum += loss_and_grad(caches.back().y, t, mb, dy);
      for (std::size_t u = L.size(); u-- > 0;) {
        auto& P = r.params[u];
        auto& G = grads[u];
        dy = layer_backward(L[u], P[0].data(), L[u].gain ? P[2].data() : nullptr, G[0].data(), G[1].data(),
                            L[u].gain ? G[2].data() : nullptr, caches[u], dy, mb);
      }
    }
    // Micro-batch gradients add up (as in PyTorch); each one averages its own samples.
    r.losses.push_back(loss_sum / cfg.micro_batches);
    if (cfg.clip > 0) {
      double sq = 0;
      for (std::size_t u = 0; u < grads.size(); ++u)
        for (std::size_t p = 0; p < grads[u].size(); ++p)
          if (!cfg.is_frozen(u, p))
            for (float gi : grads[u][p]) sq += static_cast<double>(gi) * gi;
      const double norm = std::sqrt(sq), coef = cfg.clip / (norm + 1e-6);
      if (coef < 1.0)
        for (auto& u : grads)
          for (auto& p : u)
            for (float& gi : p) gi = gi * static_cast<float>(coef);
    }
    for (std::size_t u = 0; u < L.size(); ++u)
      for (std::size_t p = 0; p < r.params[u].size(); ++p) {
        if (cfg.is_frozen(u, p)) continue;
        auto& w = r.params[u][p];
        auto& g = grads[u][p];
        if (cfg.opt == optimizer::sgd) {
          const auto& o = cfg.sgd;
          for (std::size_t i = 0; i < w.size(); ++i) {
            const float d = g[i] + o.weight_decay * w[i];
            const float b = step == 0 ? d : o.momentum * m[u][p][i] + d;
            m[u][p][i] = b;
            w[i] = w[i] - o.lr * b;
          }
        } else {
          const auto& o = cfg.adamw;
          const float bc1 = 1.0f - std::pow(o.beta1, static_cast<float>(step + 1));
          const float bc2 = 1.0f - std::pow(o.beta2, static_cast<float>(step + 1));
          for (std::size_t i = 0; i < w.size(); ++i) {
            float x = w[i] * (1.0f - o.lr * o.weight_decay);
            m[u][p][i] = o.beta1 * m[u][p][i] + (1.0f - o.beta1) * g[i];
            v[u][p][i] = o.beta2 * v[u][p][i] + (1.0f - o.beta2) * g[i] * g[i];
            x -= (o.lr / bc1) * m[u][p][i] / (std::sqrt(v[u][p][i]) / std::sqrt(bc2) + o.eps);
            w[i] = x;
          }
        }
      }
  }
  return r;
}

// ---- the same training through fsdp ---------------------------------------------------------

// The model's parameter handles on one rank.
template <class T>
struct model {
  std::vector<std::vector<std::unique_ptr<fsdp::buffer<T>>>> params;  // [unit][index]
  model() {
    const auto& L = shapes();
    params.resize(L.size());
    for (std::size_t u = 0; u < L.size(); ++u) {
      const auto sizes = param_sizes(L[u]);
      for (std::size_t p = 0; p < sizes.size(); ++p) {
        // Appended, not "u" + std::to_string(u) + ...: GCC 12 at -O3 reports a false -Wrestrict
        // in operator+(const char*, std::string&&) (GCC bugs 105329 and 105651).
        std::string name = "u";
        name.append(std::to_string(u)).append(".p").append(std::to_string(p));
        params[u].push_back(std::make_unique<fsdp::buffer<T>>(sizes[p], name));
      }
    }
  }
  // Fills the handles with the initial values (what broadcast_from reads on the root).
  void fill_initial(bool garbage = false) {
    for (std::size_t u = 0; u < params.size(); ++u)
      for (std::size_t p = 0; p < params[u].size(); ++p) {
        auto v = params[u][p]->values();
        for (std::size_t i = 0; i < v.size(); ++i)
          v[i] = fsdp::convert<T>(garbage ? 42.0f : init_value(static_cast<int>(u), static_cast<int>(p), i));
      }
  }
  template <class Group>
  void register_with(Group& g, const std::vector<std::pair<int, int>>& frozen = {}) {
    for (std::size_t u = 0; u < params.size(); ++u) {
      std::vector<fsdp::buffer<T>*> ptrs, frozen_ptrs;
      for (auto& p : params[u]) ptrs.push_back(p.get());
      for (auto [fu, fp] : frozen)
        if (static_cast<std::size_t>(fu) == u) frozen_ptrs.push_back(params[u].at(static_cast<std::size_t>(fp)).get());
      g.add_unit(ptrs, {}, frozen_ptrs);
    }
  }
  T* ptr(std::size_t u, std::size_t p) { return p < params[u].size() ? params[u][p]->data() : nullptr; }
  T* grad(std::size_t u, std::size_t p) { return p < params[u].size() ? params[u][p]->grad() : nullptr; }
};

inline auto per_shard_init() {
  return fsdp::init::per_shard([](const fsdp::param_slice& s, std::span<float> out) {
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = init_value(s.unit, s.index, s.offset + i);
  });
}

// Activation checkpointing: keep each layer's input, poison what its backward reads (NaN), so
// a backward that was not preceded by its recompute cannot match.
inline void forget_activations(std::vector<layer_cache>& caches) {
  for (auto& c : caches) {
    std::fill(c.u.begin(), c.u.end(), std::nanf(""));
    std::fill(c.y.begin(), c.y.end(), std::nanf(""));
  }
}

// Layer u's forward re-run inside its backward scope, from its kept input.
template <class T, class Group>
void recompute_layer(Group& g, model<T>& m, recompute how, std::size_t u, int batch, layer_cache& c) {
  auto scope = how == recompute::scope ? g.recompute(static_cast<int>(u)) : g.forward(static_cast<int>(u));
  const std::vector<float> x = c.x;
  layer_forward(shapes()[u], m.ptr(u, 0), m.ptr(u, 1), m.ptr(u, 2), x, batch, c);
}

// One training step (forward + backward over this rank's part of each micro-batch) through
// the group's RAII hooks (with activation recomputation when cfg asks for it). Returns the rank's mean loss over its samples.
template <class T, class Group>
double sharded_step(Group& g, model<T>& m, const train_config& cfg, int step) {
  const auto& L = shapes();
  const int n = g.world_size(), r = g.rank();
  const int mb = batch_global / cfg.micro_batches, local = mb / n;
  double loss_sum = 0.0;
  for (int k = 0; k < cfg.micro_batches; ++k) {
    const bool last = k + 1 == cfg.micro_batches;
    g.set_requires_gradient_sync(last || cfg.sync_each_micro_batch);
    if (cfg.all_reduce_last_only) g.set_requires_all_reduce(last);
    std::vector<float> x, t, dy;
    batch_slice(step, k * mb + r * local, local, x, t);
    std::vector<layer_cache> caches(L.size());
    for (std::size_t u = 0; u < L.size(); ++u) {
      auto scope = g.forward(static_cast<int>(u));
      layer_forward(L[u], m.ptr(u, 0), m.ptr(u, 1), m.ptr(u, 2), u ? caches[u - 1].y : x, local, caches[u]);
    }
    loss_sum += loss_and_grad(caches.back().y, t, local, dy);
    if (cfg.recompute_mode != recompute::off) forget_activations(caches);
    for (std::size_t u = L.size(); u-- > 0;) {
      auto scope = g.backward(static_cast<int>(u));
      if (cfg.recompute_mode != recompute::off) recompute_layer(g, m, cfg.recompute_mode, u, local, caches[u]);
      dy = layer_backward(L[u], m.ptr(u, 0), m.ptr(u, 2), m.grad(u, 0), m.grad(u, 1), m.grad(u, 2), caches[u], dy, local);
    }
  }
  g.set_requires_gradient_sync(true);
  if (cfg.all_reduce_last_only) g.set_requires_all_reduce(true);
  return loss_sum / cfg.micro_batches;
}

// Two steps (sharded_step, then opt.step()); the group's traffic over the second, a steady
// step (the first also checks the unit order across ranks).
template <class Group, class T, class Opt>
fsdp::traffic_counters second_step_traffic(Group& g, model<T>& m, Opt& opt, const train_config& cfg = {}) {
  sharded_step(g, m, cfg, 0);
  opt.step();
  const fsdp::traffic_counters start = g.traffic();
  sharded_step(g, m, cfg, 1);
  opt.step();
  return g.traffic() - start;
}

// One rank's part of training through a shard_group of type Group on any communicator:
// returns the final full parameters (on every rank) and this rank's mean loss per step.
template <class Group, class T = typename Group::param_type>
train_result train_rank(typename Group::comm_type& comm, const train_config& cfg, typename Group::options opts = {},
                        bool broadcast_init = false) {
  train_result res;
  model<T> m;
  if (broadcast_init) m.fill_initial(comm.rank() != 0);
  Group g{comm, {}, opts};
  m.register_with(g, cfg.frozen);
  if (broadcast_init)
    g.finalize(fsdp::init::broadcast_from{0});
  else
    g.finalize(per_shard_init());
  auto run = [&](auto& opt) {
    for (int step = 0; step < cfg.steps; ++step) {
      res.losses.push_back(sharded_step(g, m, cfg, step));
      if (cfg.clip > 0) fsdp::clip_grad_norm(g, cfg.clip);
      opt.step();
      opt.zero_grad();
    }
  };
  if (cfg.opt == optimizer::sgd) {
    fsdp::sgd opt{g, cfg.sgd};
    run(opt);
  } else {
    fsdp::adamw opt{g, cfg.adamw};
    run(opt);
  }
  res.params.resize(shapes().size());
  for (int u = 0; u < g.num_units(); ++u)
    for (std::size_t p = 0; p < m.params[static_cast<std::size_t>(u)].size(); ++p) {
      auto v = g.full_parameter(u, static_cast<int>(p));
      res.params[static_cast<std::size_t>(u)].push_back(std::vector<float>(v.begin(), v.end()));
    }
  return res;
}

// Trains on `ranks` thread ranks; returns rank 0's final full parameters and the mean loss
// over ranks per step.
template <class Group>
train_result train_sharded(int ranks, const train_config& cfg, typename Group::options opts = {}, bool broadcast_init = false) {
  std::vector<train_result> per(static_cast<std::size_t>(ranks));
  fsdp::threads::world{ranks}.run([&](fsdp::threads::communicator& comm) {
    per[static_cast<std::size_t>(comm.rank())] = train_rank<Group>(comm, cfg, opts, broadcast_init);
  });
  train_result res;
  res.params = per[0].params;
  for (int s = 0; s < cfg.steps; ++s) {
    double acc = 0;
    for (const auto& r : per) acc += r.losses[static_cast<std::size_t>(s)];
    res.losses.push_back(acc / ranks);
  }
  return res;
}

// Largest relative difference |a - b| / |b| over all parameter elements (|b| floored at 0.01,
// so elements near zero are held to 1e-7 absolute at a 1e-5 bar).
inline double max_rel_diff(const train_result& a, const train_result& b) {
  double worst = 0.0;
  for (std::size_t u = 0; u < b.params.size(); ++u)
    for (std::size_t p = 0; p < b.params[u].size(); ++p)
      for (std::size_t i = 0; i < b.params[u][p].size(); ++i) {
        const double x = a.params.at(u).at(p).at(i), y = b.params[u][p][i];
        worst = std::max(worst, std::abs(x - y) / std::max(std::abs(y), 1e-2));
      }
  return worst;
}

}  // namespace fsdp_test
