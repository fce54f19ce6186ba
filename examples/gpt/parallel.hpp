#pragma once
// gpt/parallel.hpp: the GPT on a device mesh (fsdp::mesh): Megatron-style tensor parallelism
// inside each block, its layers split into pipeline stages that pass activations and their
// gradients by send/recv over micro-batches (GPipe or 1F1B), and fsdp sharding each stage's TP
// slice over the data-parallel ranks. This is the engine's side of composing fsdp with TP and
// PP, in one readable driver: docs/guide.md "Composing with tensor, pipeline and expert
// parallelism" walks through it.
//
// With experts (config::experts > 0, mesh_shape::ep), each block's MLP is a mixture of experts
// (gpt/moe.hpp): its router is dense, its experts are spread over the ep group (tokens travel by
// all-to-all) and registered with a second shard_group over mesh.expert_dp(), FSDP2's
// per-parameter mesh.
//
// What each rank holds: the blocks of its stage, each its TP slice (model.hpp, tensor_parallel),
// registered with one shard_group over mesh.dp(); the first and the last stage also hold the
// embedding unit (wte, wpe, lnf), since wte is both the input embedding and the tied head. The
// two copies get one gradient: after backward the first and last stage sum their embedding
// unit's gradient shards (an all-reduce of two, as Megatron does for tied embeddings); the
// shards line up because the unit and the data-parallel group are the same on both.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <fsdp/comm/mesh.hpp>
#include <fsdp/fsdp.hpp>

#include "gpt/data.hpp"
#include "gpt/model.hpp"
#include "gpt/train.hpp"

namespace gpt {

enum class pipeline_schedule { gpipe, one_f_one_b };

struct parallel_options {
  fsdp::mesh_shape mesh{};  //!< pp x dp_replicate x dp_shard x tp (dp_shard 0: the rest of the world)
  pipeline_schedule schedule = pipeline_schedule::one_f_one_b;
  //! Each block's activations are dropped after its forward and recomputed inside its
  //! backward (full activation checkpointing): the block is gathered once for both.
  bool recompute = false;
};

//! One action of a pipeline stage: the forward or the backward of micro-batch `micro`.
struct pipeline_action {
  bool forward = true;
  int micro = 0;
  friend bool operator==(const pipeline_action&, const pipeline_action&) = default;
};

//! The order in which stage `stage` of `stages` runs the forwards and backwards of `micro`
//! micro-batches. GPipe: every forward, then every backward. 1F1B (PipeDream-Flush, Megatron's
//! default): stage s runs stages - s - 1 forwards to fill the pipeline, then alternates one
//! forward and one backward, then drains the backwards; it holds at most stages - s micro-batches'
//! activations where GPipe holds all of them. Both end with the last micro-batch's backward.
inline std::vector<pipeline_action> pipeline_order(pipeline_schedule s, int stage, int stages, int micro) {
  std::vector<pipeline_action> out;
  if (s == pipeline_schedule::gpipe) {
    for (int k = 0; k < micro; ++k) out.push_back({true, k});
    for (int k = 0; k < micro; ++k) out.push_back({false, k});
    return out;
  }
  const int warm = std::min(stages - stage - 1, micro);
  for (int k = 0; k < warm; ++k) out.push_back({true, k});
  for (int k = warm; k < micro; ++k) {
    out.push_back({true, k});
    out.push_back({false, k - warm});
  }
  for (int k = micro - warm; k < micro; ++k) out.push_back({false, k});
  return out;
}

//! One step's figures, the same on every rank.
struct parallel_step {
  int step = 0;
  double loss = 0;       //!< mean over the global batch
  double grad_norm = 0;  //!< of the whole model's gradient, before clipping (0 when not clipping)
};

//! What a rank's run returns: every step's figures, and this rank's traffic per mesh
//! dimension and peak of fsdp-managed bytes.
struct parallel_result {
  std::vector<parallel_step> steps;
  fsdp::traffic_counters dp, tp, pp, ep, expert_dp;  // expert_dp: the experts' shard_group
  std::size_t peak_bytes = 0;
  //! Per shard_group (the dense one, then the experts'), of the step that came closest to its
  //! bound: the most transient bytes held, and stage_memory_bound() as it stood before the step
  //! (the first step's, before the order is known, is the conservative one).
  std::vector<std::size_t> transient_peak, transient_bound;
};

//! Which parameters of a block are TP slices (model.hpp's block order: ln1_w, ln1_b, qkv_w,
//! qkv_b, proj_w, proj_b, ln2_w, ln2_b, fc_w, fc_b, out_w, out_b); the rest are replicated.
inline bool tp_sliced(int param) { return param == 2 || param == 3 || param == 4 || param == 8 || param == 9 || param == 10; }

//! This rank's index among the data-parallel ranks (the batch slice it reads).
inline int mesh_dp_rank(const auto& at, const fsdp::mesh_shape& s) { return at.dp_replicate * s.dp_shard + at.dp_shard; }

//! After a block's forward under recomputation: keep its input only.
inline void drop_block_activations(activations::per_block& s) {
  for (auto* v : {&s.ln1, &s.ln1_mean, &s.ln1_rstd, &s.qkv, &s.att, &s.atty, &s.x_mid, &s.ln2, &s.ln2_mean, &s.ln2_rstd, &s.fc, &s.fc_gelu})
    std::vector<float>().swap(*v);
}

//! The transient bytes a pipeline stage's group may hold: the group's bound for one pass
//! (transient_memory_bound(), docs/design.md), plus what a stage holds beyond one pass: with
//! several micro-batches, every bucket's unsharded gradient while sync is off, and the
//! embedding unit kept gathered around the stage's blocks (`held_unit`, or -1).
template <class Group>
std::size_t stage_memory_bound(const Group& g, int micro, int held_unit) {
  constexpr std::size_t param_bytes = sizeof(typename Group::param_type);
  const auto one_pass = g.transient_memory_bound();
  std::size_t extra = 0;
  if (micro > 1)
    for (std::size_t b = 0; b < g.num_buckets(); ++b) extra += g.layout(b).trainable_numel() * param_bytes;
  if (held_unit >= 0) extra += g.layout(static_cast<std::size_t>(g.bucket_of(held_unit))).padded_numel() * param_bytes;
  return std::max(one_pass.forward, one_pass.backward) + extra;
}

//! Σ g² over this rank's gradient shards (padding is zero), with the kernel clip_grad_norm uses.
template <class Group>
double sum_of_squares(Group& g) {
  double sum = 0;
  for (std::size_t b = 0; b < g.num_buckets(); ++b) {
    const auto s = g.shard(b);
    sum += fsdp::detail::sum_of_squares(g.device().execution_policy(), s.grads, s.numel);
  }
  return sum;
}

//! Every gradient shard times `coef` (the experts' average over the expert-parallel ranks, and
//! clipping in a pass of its own).
template <class Group>
void scale_gradients(Group& g, double coef) {
  for (std::size_t b = 0; b < g.num_buckets(); ++b) {
    const auto s = g.shard(b);
    fsdp::detail::scale(g.device().execution_policy(), s.grads, s.numel, static_cast<float>(coef));
  }
}

//! Σ weight(unit, param) · g² over this rank's gradient shards (host memory), the bucket
//! entries being the units' parameters in unit order.
template <class Group, class Weight>
double weighted_sum_of_squares(Group& g, const std::vector<int>& params_per_unit, Weight weight) {
  const int shard_rank = g.rank() % g.shard_size();  // shard groups are consecutive ranks
  double sum = 0;
  for (std::size_t b = 0; b < g.num_buckets(); ++b) {
    const auto s = g.shard(b);
    const fsdp::flat_layout& layout = g.layout(b);
    std::vector<std::pair<int, int>> owner;  // bucket entry -> (unit, parameter)
    for (int u = 0; u < g.num_units(); ++u)
      if (g.bucket_of(u) == static_cast<int>(b))
        for (int i = 0; i < params_per_unit[static_cast<std::size_t>(u)]; ++i) owner.emplace_back(u, i);
    std::size_t e = 0;
    for (std::size_t k = 0; k < s.numel; ++k) {
      const std::size_t at = layout.position(shard_rank, k);
      while (e < layout.size() && at >= layout[e].offset + layout[e].numel) ++e;
      if (e == layout.size() || at < layout[e].offset) continue;  // padding
      const double x = static_cast<double>(s.grads[k]);
      sum += weight(owner[e].first, owner[e].second) * x * x;
    }
  }
  return sum;
}

//! Trains the GPT on `world` laid out as p.mesh, with the shard_group type Group over each
//! rank's data-parallel group (its options in `opts`; a mesh with dp_replicate > 1 replaces
//! their sharding with hybrid_shard(dp_shard)). o.micro_batches are the pipeline's
//! micro-batches (and gradient accumulation without PP). `on_step`, when given, runs on every
//! rank after each step.
template <class Group>
parallel_result train_parallel(typename Group::comm_type& world, const run_options& o, const parallel_options& p,
                               typename Group::options opts, const corpus& text,
                               const std::function<void(const parallel_step&)>& on_step = {}) {
  using T = typename Group::param_type;
  fsdp::mesh<typename Group::comm_type> mesh{world, p.mesh};
  const fsdp::mesh_shape shape = mesh.shape();
  const auto at = mesh.coords();
  const int dp = shape.dp_replicate * shape.dp_shard, stages = shape.pp, stage = at.pp, L = o.model.layers;
  auto refuse = [&](const std::string& why) { throw fsdp::error(fsdp::errc::invalid_argument, why, {world.rank(), -1, {}}); };
  if (o.model.heads % shape.tp != 0)
    refuse("--tp " + std::to_string(shape.tp) + " must divide --heads " + std::to_string(o.model.heads) + " (heads split over TP ranks)");
  if (o.model.dim % o.model.heads != 0) refuse("--dim must be a multiple of --heads");
  if (L < stages) refuse("--pp " + std::to_string(stages) + " stages need at least as many --layers (" + std::to_string(L) + ")");
  if (o.batch % dp != 0 || (o.batch / dp) % o.micro_batches != 0)
    refuse("the global batch (" + std::to_string(o.batch) + ") must split over " + std::to_string(dp) +
           " data-parallel ranks and then into " + std::to_string(o.micro_batches) + " micro-batches");
  if (!o.freeze.empty()) refuse("--freeze is not supported with --tp or --pp");
  const bool moe = o.model.experts > 0;
  if (moe && (shape.tp > 1 || p.recompute))
    refuse("--experts: not with --tp (the experts are not TP-sliced) or --recompute (not built for experts yet)");
  if (!moe && shape.ep > 1) refuse("--ep " + std::to_string(shape.ep) + " needs --experts");
  if (shape.dp_replicate > 1) opts.sharding = mesh.sharding();

  // 1. This stage's blocks [begin, end) (balanced), each this rank's TP slice; unit 0 the
  //    embedding on the first and last stage, then one unit per block.
  const bool first = stage == 0, last = stage == stages - 1, has_embedding = first || last;
  const int begin = stage * L / stages, end = (stage + 1) * L / stages;
  const int local = o.batch / dp, micro = o.micro_batches, rows = local / micro, N = rows * o.model.seq;
  const auto n_act = static_cast<std::size_t>(N) * static_cast<std::size_t>(o.model.dim);
  const tensor_parallel tp{at.tp, shape.tp};
  model<T> m(o.model, tp, moe::ep_group{shape.ep, mesh.ep().rank(), {}});
  fsdp::host_queue tp_queue{"tp", fsdp::queue_wake::on_wait}, ep_queue{"ep", fsdp::queue_wake::on_wait};
  m.all_reduce_tp = [&](float* x, std::size_t n) {
    mesh.tp().all_reduce(x, x, n, fsdp::dtype::f32, fsdp::reduce_op::sum, tp_queue).wait(mesh.tp().timeout());
  };
  m.ep().all_to_all = [&](const float* send, float* recv, std::size_t n) {
    mesh.ep().all_to_all(send, recv, n, fsdp::dtype::f32, ep_queue).wait(mesh.ep().timeout());
  };
  Group group{mesh.dp(), {}, opts};
  std::vector<int> params_per_unit;  // for the norm's weights below
  std::vector<bool> unit_is_embedding;
  auto add = [&](std::vector<fsdp::buffer<T>*> ps, std::string name, bool embedding) {
    params_per_unit.push_back(static_cast<int>(ps.size()));
    unit_is_embedding.push_back(embedding);
    group.add_unit(std::move(ps), std::move(name));
  };
  if (has_embedding) add(m.emb().params(), "embedding", true);
  for (int l = begin; l < end; ++l) add(m.layer(l).params(), "block" + std::to_string(l), false);
  const int first_block_unit = has_embedding ? 1 : 0;
  const auto init = fsdp::init::per_shard([&](const fsdp::param_slice& s, std::span<float> out) {
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = initial_value(s.name, tp.full_index(s.name, s.offset + i, o.model), o.model, o.seed);
  });
  group.finalize(init);
  fsdp::adamw opt{group, {.lr = o.lr, .weight_decay = 0.0f}};
  // The experts: unit k the experts of block begin + k, sharded over the ranks that hold them.
  std::optional<Group> experts;
  std::optional<fsdp::adamw<Group>> expert_opt;
  if (moe) {
    typename Group::options expert_opts = opts;
    if (shape.dp_replicate > 1) expert_opts.sharding = mesh.expert_sharding();
    experts.emplace(mesh.expert_dp(), typename Group::device_type{}, expert_opts);
    for (int l = begin; l < end; ++l) experts->add_unit(m.experts(l).params(), "block" + std::to_string(l) + ".experts");
    experts->finalize(init);
    expert_opt.emplace(*experts, fsdp::adamw_options{.lr = o.lr, .weight_decay = 0.0f});
  }
  // A block's units in use: its dense unit, and its experts' unit around the whole block too.
  auto run_block = [&](int l, bool forward, auto&& body) {
    auto in_use = forward ? group.forward(first_block_unit + l - begin) : group.backward(first_block_unit + l - begin);
    if (!experts) return body();
    auto experts_in_use = forward ? experts->forward(l - begin) : experts->backward(l - begin);
    body();
  };
  auto each_group = [&](auto&& fn) {
    fn(group);
    if (experts) fn(*experts);
  };
  // The tied embedding's two copies (first and last stage): their own communicator.
  std::optional<typename Group::comm_type> tie;
  if (stages > 1) tie.emplace(mesh.pp().split(has_embedding ? 0 : 1, stage));
  if (tie && has_embedding && group.num_units() > 1 && group.bucket_of(1) == group.bucket_of(0))
    refuse("--pp: the embedding unit must be a bucket of its own (per-unit buckets), so that its shards line up on both stages");

  // 2. The pipeline's messages: one queue per direction and kind, so that a send waiting for its
  //    receiver never holds up a message in the other direction (the ranks wait only on recvs).
  //    The micro-batches' activations, which the sends read and the recvs write, are made first,
  //    so that they outlive the queues: leaving by an exception (a peer failed), a queue's
  //    destructor waits for the send its peer may still be reading.
  std::vector<activations> acts(static_cast<std::size_t>(micro));
  fsdp::host_queue send_up{"pp send activations"}, recv_up{"pp recv activations"}, send_down{"pp send gradients"},
      recv_down{"pp recv gradients"};
  auto& pp = mesh.pp();
  std::vector<fsdp::host_event> sends;
  fsdp::host_queue stats{"stats", fsdp::queue_wake::on_wait};
  auto sum_over = [&](auto& comm, double x) {
    comm.all_reduce(&x, &x, 1, fsdp::dtype::f64, fsdp::reduce_op::sum, stats).wait(comm.timeout());
    return x;
  };

  parallel_result result;
  const std::size_t groups = experts ? 2 : 1;
  result.transient_peak.assign(groups, 0);
  result.transient_bound.assign(groups, 0);
  std::vector<std::size_t> bound(groups);
  const auto order = pipeline_order(p.schedule, stage, stages, micro);
  for (int step = 0; step < o.steps; ++step) {
    each_group([](Group& g) { g.device().reset_peak_memory(); });
    bound[0] = stage_memory_bound(group, micro, has_embedding ? 0 : -1);
    if (experts) bound[1] = stage_memory_bound(*experts, micro, -1);
    std::vector<batch> batches;
    for (int k = 0; k < micro; ++k)
      batches.push_back(make_batch(text, false, o.seed, static_cast<std::uint64_t>(step), mesh_dp_rank(at, shape) * local + k * rows, rows,
                                   o.model.seq));
    double loss = 0;
    for (const pipeline_action& act : order) {
      activations& a = acts[static_cast<std::size_t>(act.micro)];
      const batch& b = batches[static_cast<std::size_t>(act.micro)];
      // The embedding unit stays gathered across the stage's part of a pass, as in forward_backward.
      auto with_embedding = [&](bool forward, auto&& body) {
        if (!has_embedding) return body();
        auto in_use = forward ? group.forward(0) : group.backward(0);
        body();
      };
      if (act.forward) {
        a.blocks.resize(static_cast<std::size_t>(L));
        if (!first) {
          a.blocks[static_cast<std::size_t>(begin)].x.resize(n_act);
          pp.recv(a.blocks[static_cast<std::size_t>(begin)].x.data(), n_act, fsdp::dtype::f32, stage - 1, recv_up).wait(pp.timeout());
        }
        with_embedding(true, [&] {
          if (first) m.embed_forward(a, b.tokens, rows);
          for (int l = begin; l < end; ++l)
            run_block(l, true, [&] {
              m.block_forward(a, l, rows);
              if (p.recompute) drop_block_activations(a.blocks[static_cast<std::size_t>(l)]);
            });
          if (last) loss += m.head_forward(a, b.targets, rows) / micro;
        });
        if (!last) sends.push_back(pp.send(a.blocks[static_cast<std::size_t>(end)].x.data(), n_act, fsdp::dtype::f32, stage + 1, send_up));
      } else {
        // Gradients reduce once, after the last micro-batch's backward (no_sync before it).
        each_group([&](Group& g) {
          g.set_requires_gradient_sync(act.micro + 1 == micro);
          g.set_requires_all_reduce(act.micro + 1 == micro);
        });
        if (!last) {
          a.dx.resize(n_act);
          pp.recv(a.dx.data(), n_act, fsdp::dtype::f32, stage + 1, recv_down).wait(pp.timeout());
        }
        with_embedding(false, [&] {
          if (last) m.head_backward(a, b.targets, rows, micro);
          for (int l = end - 1; l >= begin; --l)
            run_block(l, false, [&] {
              if (p.recompute) {
                auto again = group.recompute(first_block_unit + l - begin);
                m.block_forward(a, l, rows);
              }
              m.block_backward(a, l, rows);
            });
          if (first) m.embed_backward(a, b.tokens, rows);
        });
        if (!first) sends.push_back(pp.send(a.dx.data(), n_act, fsdp::dtype::f32, stage - 1, send_down));
      }
    }
    for (auto& s : sends) s.wait(pp.timeout());
    sends.clear();
    each_group([](Group& g) { g.finish_backward(); });
    // An expert's rows came from all ep ranks' tokens, each rank's loss a mean over its own: the
    // experts' shard group averages over dp / ep ranks where the dense one averages over dp.
    if (experts && shape.ep > 1) scale_gradients(*experts, 1.0 / shape.ep);

    // 3. The tied embedding's gradient: the first stage's (embedding) plus the last's (head).
    if (tie && has_embedding) {
      const auto s = group.shard(static_cast<std::size_t>(group.bucket_of(0)));
      tie->all_reduce(s.grads, s.grads, s.numel, fsdp::dtype_of<std::remove_pointer_t<decltype(s.grads)>>, fsdp::reduce_op::sum, stats)
          .wait(tie->timeout());
    }
    // 4. The global gradient norm: this rank's shards, each value once over the world (a TP-
    //    replicated value counts 1/tp on each TP rank; the embedding on the first stage only),
    //    summed over the shard group, the TP group and the stages.
    parallel_step figures{step, 0, 0};
    float clip_scale = 1.0f;  // clip_grad_norm's factor, applied in the optimizers' own pass
    if (o.clip > 0) {
      auto weight = [&](int unit, int param) {
        if (unit_is_embedding[static_cast<std::size_t>(unit)]) return first ? 1.0 / shape.tp : 0.0;
        return tp_sliced(param) ? 1.0 : 1.0 / shape.tp;
      };
      double sq = group.shard_group_sum(weighted_sum_of_squares(group, params_per_unit, weight));
      if (experts) sq += sum_over(mesh.ep(), experts->shard_group_sum(sum_of_squares(*experts)));  // each ep rank its own experts
      figures.grad_norm = std::sqrt(sum_over(pp, sum_over(mesh.tp(), sq)));
      clip_scale = fsdp::clip_coefficient(figures.grad_norm, o.clip);
      if (!o.clip_in_optimizer && clip_scale < 1.0f) {  // clip_grad_norm's own pass (--clip-pass separate)
        each_group([&](Group& g) { scale_gradients(g, clip_scale); });
        clip_scale = 1.0f;
      }
    }
    opt.options().lr = learning_rate(o, step);
    opt.step(clip_scale);
    opt.zero_grad();
    if (expert_opt) {
      expert_opt->options().lr = learning_rate(o, step);
      expert_opt->step(clip_scale);
      expert_opt->zero_grad();
    }
    // 5. The loss: the last stage's, averaged over the data-parallel ranks (TP ranks agree).
    figures.loss = sum_over(world, last && at.tp == 0 ? loss / dp : 0.0);
    result.peak_bytes = std::max(result.peak_bytes, group.memory().peak + (experts ? experts->memory().peak : 0));
    for (std::size_t g = 0; g < groups; ++g) {
      const std::size_t peak = (g == 0 ? group : *experts).memory().transient_peak;
      const auto excess = [](std::size_t a, std::size_t b) { return static_cast<double>(a) - static_cast<double>(b); };
      if (step == 0 || excess(peak, bound[g]) > excess(result.transient_peak[g], result.transient_bound[g]))
        result.transient_peak[g] = peak, result.transient_bound[g] = bound[g];
    }
    result.steps.push_back(figures);
    if (on_step) on_step(figures);
  }
  result.dp = group.traffic();
  result.tp = mesh.tp().traffic();
  result.pp = pp.traffic();
  result.ep = mesh.ep().traffic();
  if (experts) result.expert_dp = experts->traffic();
  return result;
}

}  // namespace gpt
