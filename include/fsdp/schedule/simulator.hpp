#pragma once
//! \file simulate(trace, cost, plan): one training step of one rank, as a discrete-event run of
//! what shard_group does, priced by the cost model. Every rank runs the same step, so one rank
//! stands for all. Three lanes and one link:
//!
//!   compute  the caller's thread: replays the trace's hook events (trace.hpp; derived from
//!            the orders and unit times when a pass has none), computing compute_s before each,
//!            and blocks where the runtime blocks (a bucket's pre-hook waits for its
//!            all-gather; the end of a bucket's backward waits for the reductions the plan says
//!            must be done; finish_backward waits for all), then the optimizer step.
//!   ag       the all-gather queue: all-gathers in issue order.
//!   rs       the reduction queue: each bucket's reduction (reduce-scatter in the shard group,
//!            then all-reduce across replicas) in issue order.
//!   link     one per rank, shared by both queues: a collective starts at
//!            max(issued, its queue free, link free), first come first served by that ready
//!            time (ties: issue order), and holds the link for alpha + sent bytes / beta.
//!
//! Hooks, as shard_group's counters run them: a bucket's pre-hook is the first pre of any of
//! its units in the pass (issue its all-gather unless prefetched, in backward allocate its
//! gradient buffer, wait, then issue what the plan issues at its position); its post is the
//! post of its last unit in the pass, when as many of its units have posted as it holds (free
//! the parameters when resharding after forward; in backward free them, wait for the
//! reductions due at its position, issue its reduction). So a unit that stays in use around
//! others (GPT's unit 0) keeps its bucket gathered, and in backward its gradient buffer, from
//! its pre to its post, and its reduction is issued at that post. Pres of other units of a
//! started bucket change nothing. After the backward's last hook, backward_tail_s of compute,
//! then finish_backward.
//!
//! Casts, the gradient accumulation and allocations take no time (they are elementwise work
//! small next to the layers' compute). Memory is counted exactly as the runtime allocates it,
//! with each bucket's padded size from flat_layout:
//!
//!   persistent  per bucket (2 + optimizer_states) * shard * master_elem, plus shard * param_elem
//!               with low_precision_shard
//!   gathered    n * param_elem from the all-gather's issue to the reshard (not when aliased)
//!   gradient    n * param_elem from the bucket's backward pre-hook until its reduction has read
//!               it (with a reduce dtype of another size: when the queue casts it, as the
//!               reduction starts; otherwise at the end of the reduce-scatter, or of the
//!               all-reduce when S == 1)
//!   reduction   n * reduce_elem (cast copy, when the sizes differ) until the reduce-scatter
//!               ends; shard * reduce_elem (reduce-scatter output, S > 1) until the reduction
//!               ends. Both are allocated when the reduction is issued.
//!
//! At equal times, memory released by a queue counts before the compute thread's
//! allocations (a waiter sees what the collective it waited for released).
//!
//!   auto r = fsdp::schedule::simulate(trace, fsdp::schedule::h100_nvlink(8),
//!                                     fsdp::schedule::per_unit_prefetch(trace));
//!   r.step_s; r.exposed_comm_s; r.peak_bytes; r.collectives;   // a timeline to draw

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "fsdp/core/error.hpp"
#include "fsdp/core/layout.hpp"
#include "fsdp/schedule/cost_model.hpp"
#include "fsdp/schedule/plan.hpp"
#include "fsdp/schedule/trace.hpp"

namespace fsdp::schedule {

enum class collective_kind : std::uint8_t { all_gather, reduce_scatter, all_reduce };
enum class step_phase : std::uint8_t { forward, backward };

constexpr const char* to_string(collective_kind k) noexcept {
  return k == collective_kind::all_gather ? "all_gather" : k == collective_kind::reduce_scatter ? "reduce_scatter" : "all_reduce";
}
constexpr const char* to_string(step_phase p) noexcept { return p == step_phase::forward ? "forward" : "backward"; }

//! One collective of the simulated step.
struct collective_record {
  collective_kind kind = collective_kind::all_gather;
  int bucket = 0;
  step_phase phase = step_phase::forward;
  double issue_s = 0;       //!< when the compute thread issued its gather or reduction
  double start_s = 0;       //!< when it took the link
  double end_s = 0;         //!< when it completed
  std::uint64_t bytes = 0;  //!< bytes this rank sent
};

//! What simulate() reports, times in seconds from the start of the step, bytes per rank.
struct sim_result {
  double step_s = 0;          //!< forward + backward + optimizer
  double forward_s = 0;       //!< until the forward's last hook
  double backward_s = 0;      //!< from there (the loss included) until finish_backward returned
  double optimizer_s = 0;     //!< the optimizer step
  double compute_s = 0;       //!< all compute: the events' (or units'), backward_tail_s, the optimizer
  double exposed_comm_s = 0;  //!< step_s - compute_s: time the compute thread waited
  double comm_busy_s = 0;     //!< time the link was busy (sum of the collectives' durations)
  std::size_t persistent_bytes = 0;                //!< shards and optimizer state
  std::size_t peak_transient_bytes = 0;            //!< most transient bytes at once
  std::size_t forward_peak_transient_bytes = 0;    //!< most at once when the forward allocated
  std::size_t backward_peak_transient_bytes = 0;   //!< most at once when the backward allocated
  std::size_t peak_bytes = 0;                      //!< persistent + peak transient
  std::vector<collective_record> collectives;      //!< in the order they took the link
};

namespace detail {

// Expects a valid cost model and plan (simulate() checks them; the planners simulate only the
// plans they make).
class step_simulator {
 public:
  step_simulator(const checked_trace& t, const cost_model& c, const plan& p, bool record)
      : t_(*t), c_(c), p_(p), record_(record) {
    pos_ = positions_of(t, p.bucket_of_unit);
    k_ = p.num_buckets();
    const auto layouts = bucket_layouts(*t, p.bucket_of_unit);
    for (const auto& l : layouts) {
      padded_.push_back(l.padded_numel());
      shard_.push_back(l.shard_numel());
    }
    units_in_.assign(static_cast<std::size_t>(k_), 0);
    for (int b : p.bucket_of_unit) ++units_in_[static_cast<std::size_t>(b)];
    // Who is issued at each position's pre-hook, in position order.
    fwd_issue_at_.resize(static_cast<std::size_t>(k_));
    bwd_issue_at_.resize(static_cast<std::size_t>(k_));
    wait_at_.resize(static_cast<std::size_t>(k_) + 1);
    for (int at = 0; at < k_; ++at) {
      const int fb = pos_.forward[static_cast<std::size_t>(at)];
      fwd_issue_at_[static_cast<std::size_t>(p.forward_issue[static_cast<std::size_t>(fb)])].push_back(fb);
      const int bb = pos_.backward[static_cast<std::size_t>(at)];
      bwd_issue_at_[static_cast<std::size_t>(p.backward_issue[static_cast<std::size_t>(bb)])].push_back(bb);
      wait_at_[static_cast<std::size_t>(p.reduce_wait[static_cast<std::size_t>(bb)])].push_back(bb);
    }
  }

  sim_result run() {
    sim_result r;
    const std::size_t kk = static_cast<std::size_t>(k_);
    for (std::size_t b = 0; b < kk; ++b)
      r.persistent_bytes += shard_[b] * (t_.master_elem * static_cast<std::size_t>(2 + t_.optimizer_states) +
                                         (t_.low_precision_shard ? t_.param_elem : 0));
    gathered_.assign(kk, false);
    gather_job_.assign(kk, -1);
    reduce_job_.assign(kk, -1);
    std::vector<int> remaining(kk, 0);

    // Forward. A bucket's pre-hook is the first pre of any of its units; its post the post of
    // its last unit (shard_group's fwd_remaining / bwd_remaining counters). Compute runs
    // before each event.
    phase_ = step_phase::forward;
    std::vector<hook_event> derived_fwd, derived_bwd;
    const std::vector<hook_event>& fwd = events(true, derived_fwd);
    std::vector<bool> started(kk, false);
    for (const hook_event& e : fwd) {
      compute(r, e.compute_s);
      const int b = p_.bucket_of_unit[static_cast<std::size_t>(e.unit)];
      const auto bi = static_cast<std::size_t>(b);
      if (e.pre) {
        if (started[bi]) continue;
        started[bi] = true;
        remaining[bi] = units_in_[bi];
        if (!gathered_[bi]) issue_gather(b);
        wait_gather(b);
        for (int j : fwd_issue_at_[static_cast<std::size_t>(pos_.forward_pos[bi])])
          if (!gathered_[static_cast<std::size_t>(j)]) issue_gather(j);
      } else if (--remaining[bi] == 0 && t_.reshard_after_forward) {
        free_gathered(b);
      }
    }
    r.forward_s = now_;

    // Backward.
    phase_ = step_phase::backward;
    const std::vector<hook_event>& bwd = events(false, derived_bwd);
    started.assign(kk, false);
    for (const hook_event& e : bwd) {
      compute(r, e.compute_s);
      const int b = p_.bucket_of_unit[static_cast<std::size_t>(e.unit)];
      const auto bi = static_cast<std::size_t>(b);
      const int at = pos_.backward_pos[bi];
      if (e.pre) {  // the bucket's pre-hook: gather (again), gradient buffer, wait, prefetch
        if (started[bi]) continue;
        started[bi] = true;
        remaining[bi] = units_in_[bi];
        if (!gathered_[bi]) issue_gather(b);
        allocate(grad_bytes(b));
        wait_gather(b);
        for (int j : bwd_issue_at_[static_cast<std::size_t>(at)])
          if (!gathered_[static_cast<std::size_t>(j)]) issue_gather(j);
      } else if (--remaining[bi] == 0) {  // the bucket's backward is over: reshard, wait, reduce
        free_gathered(b);
        for (int w : wait_at_[static_cast<std::size_t>(at)]) wait_job(reduce_job_[static_cast<std::size_t>(w)]);
        issue_reduction(b);
      }
    }
    compute(r, t_.backward_tail_s);
    for (int w = 0; w < k_; ++w) wait_job(reduce_job_[static_cast<std::size_t>(w)]);  // finish_backward
    r.backward_s = now_ - r.forward_s;

    r.optimizer_s = t_.optimizer_s;
    now_ += t_.optimizer_s;
    r.compute_s += t_.optimizer_s;
    r.step_s = now_;
    r.exposed_comm_s = std::max(0.0, r.step_s - r.compute_s);
    r.comm_busy_s = busy_;
    tally_memory(r);
    r.collectives = std::move(records_);
    return r;
  }

 private:
  struct op {
    collective_kind kind;
    double duration;
    std::uint64_t bytes;
    std::size_t free_after;  // bytes the queue releases when this collective ends
  };
  struct job {
    int queue = 0;  // 0: all-gather queue, 1: reduction queue
    int bucket = 0;
    step_phase phase = step_phase::forward;
    double issue = 0;
    std::vector<op> ops;
    std::size_t next = 0;
    double prev_end = 0;
    std::size_t free_at_start = 0;  // the gradient, released by the cast as the queue reaches it
    long long cast_order = -1;      // ordering of that release when the queue was idle
    std::size_t free_at_end = 0;
    bool done = false;
    double end = 0;
  };
  struct mem_event {
    double t;
    long long order;  // -1: a queue's release; 2i: the compute thread's i-th event
    long long delta;
    step_phase phase;
  };

  // The pass's events: the trace's, or the plain sequence derived into `storage` when it has none.
  const std::vector<hook_event>& events(bool forward, std::vector<hook_event>& storage) const {
    const std::vector<hook_event>& given = forward ? t_.forward_events : t_.backward_events;
    if (!given.empty()) return given;
    storage = sequential_events(t_, forward);
    return storage;
  }
  void compute(sim_result& r, double seconds) {
    now_ += seconds;
    r.compute_s += seconds;
  }

  std::size_t grad_bytes(int b) const { return padded_[static_cast<std::size_t>(b)] * t_.param_elem; }

  void allocate(std::size_t bytes) {
    if (bytes) mem_.push_back({now_, 2 * seq_++, static_cast<long long>(bytes), phase_});
  }
  void release(std::size_t bytes) {
    if (bytes) mem_.push_back({now_, 2 * seq_++, -static_cast<long long>(bytes), phase_});
  }
  void queue_release(double t, std::size_t bytes, long long order = -1) {
    if (bytes) mem_.push_back({t, order, -static_cast<long long>(bytes), step_phase::backward});
  }

  job make_job(int queue, int bucket) const {
    job j;
    j.queue = queue;
    j.bucket = bucket;
    j.phase = phase_;
    j.issue = now_;
    return j;
  }
  int enqueue(job j) {
    const int id = static_cast<int>(jobs_.size());
    queues_[static_cast<std::size_t>(j.queue)].push_back(id);
    jobs_.push_back(std::move(j));
    return id;
  }

  void issue_gather(int b) {
    const auto bi = static_cast<std::size_t>(b);
    gathered_[bi] = true;
    if (t_.aliased()) return;  // the handles point at the master copy: nothing to gather
    allocate(padded_[bi] * t_.param_elem);
    job j = make_job(0, b);
    if (t_.shard_size > 1) {
      const std::uint64_t sent = all_gather_bytes(shard_[bi], t_.param_elem, t_.shard_size);
      j.ops.push_back({collective_kind::all_gather, c_.all_gather.seconds(sent), sent, 0});
    }
    gather_job_[bi] = enqueue(std::move(j));
  }
  void wait_gather(int b) { wait_job(gather_job_[static_cast<std::size_t>(b)]); }
  void free_gathered(int b) {
    const auto bi = static_cast<std::size_t>(b);
    if (!gathered_[bi]) return;
    gathered_[bi] = false;
    gather_job_[bi] = -1;
    if (!t_.aliased()) release(padded_[bi] * t_.param_elem);
  }

  void issue_reduction(int b) {
    const auto bi = static_cast<std::size_t>(b);
    const std::size_t n = padded_[bi], shard = shard_[bi];
    const bool cast = t_.reduce_elem != t_.param_elem;
    const std::size_t grad = grad_bytes(b);
    const std::size_t red = cast ? n * t_.reduce_elem : grad;  // what the reduce-scatter reads
    job j = make_job(1, b);
    if (cast) allocate(red);
    std::size_t out = red;  // S == 1: the whole buffer is the shard
    if (t_.shard_size > 1) {
      out = shard * t_.reduce_elem;
      allocate(out);
      const std::uint64_t sent = reduce_scatter_bytes(shard, t_.reduce_elem, t_.shard_size);
      j.ops.push_back({collective_kind::reduce_scatter, c_.reduce_scatter.seconds(sent), sent, red});
    }
    if (t_.replicas() > 1) {
      const std::uint64_t sent = all_reduce_bytes(shard, t_.reduce_elem, t_.replicas());
      j.ops.push_back({collective_kind::all_reduce, c_.all_reduce.seconds(sent), sent, 0});
    }
    if (cast) {
      j.free_at_start = grad;
      j.cast_order = 2 * seq_ - 1;  // right after this issue's allocations
    }
    j.free_at_end = out;
    reduce_job_[bi] = enqueue(std::move(j));
  }

  // Blocks the compute thread until job `id` is done (no-op for -1: nothing to wait for).
  void wait_job(int id) {
    if (id < 0) return;
    while (!jobs_[static_cast<std::size_t>(id)].done)
      if (!grant_next()) throw error(errc::internal, "simulate: the compute thread waits for a collective nobody issued");
    now_ = std::max(now_, jobs_[static_cast<std::size_t>(id)].end);
  }

  // When the head job of queue q can start its next collective.
  double ready_of(int q) const {
    const job& h = jobs_[static_cast<std::size_t>(queues_[static_cast<std::size_t>(q)].front())];
    return h.next == 0 ? std::max(h.issue, queue_free_[static_cast<std::size_t>(q)]) : h.prev_end;
  }

  // Advances the communication by one step: completes the queues' jobs that need no link,
  // then gives the link to the collective that has been ready longest. Correct to do lazily
  // (only when the compute thread waits): whatever it issues later is ready later. False when
  // nothing was left to do.
  bool grant_next() {
    bool progress = false;
    for (int q = 0; q < 2; ++q) {
      auto& queue = queues_[static_cast<std::size_t>(q)];
      while (!queue.empty() && jobs_[static_cast<std::size_t>(queue.front())].ops.empty()) {
        job& h = jobs_[static_cast<std::size_t>(queue.front())];
        const double at = std::max(h.issue, queue_free_[static_cast<std::size_t>(q)]);
        start_job(h, at);
        finish_job(h, at);
        queue_free_[static_cast<std::size_t>(q)] = at;
        queue.pop_front();
        progress = true;
      }
    }
    int best = -1;
    double best_ready = 0;
    for (int q = 0; q < 2; ++q) {
      if (queues_[static_cast<std::size_t>(q)].empty()) continue;
      const double r = ready_of(q);
      const int id = queues_[static_cast<std::size_t>(q)].front();
      if (best < 0 || r < best_ready ||
          (r == best_ready && id < queues_[static_cast<std::size_t>(best)].front())) {
        best = q;
        best_ready = r;
      }
    }
    if (best < 0) return progress;
    auto& queue = queues_[static_cast<std::size_t>(best)];
    job& h = jobs_[static_cast<std::size_t>(queue.front())];
    if (h.next == 0) start_job(h, best_ready);
    const op& o = h.ops[h.next];
    const double start = std::max(best_ready, link_free_);
    const double end = start + o.duration;
    link_free_ = end;
    busy_ += o.duration;
    if (record_) records_.push_back({o.kind, h.bucket, h.phase, h.issue, start, end, o.bytes});
    queue_release(end, o.free_after);
    h.prev_end = end;
    if (++h.next == h.ops.size()) {
      finish_job(h, end);
      queue_free_[static_cast<std::size_t>(best)] = end;
      queue.pop_front();
    }
    return true;
  }
  void start_job(job& h, double at) {
    // The cast runs as the queue reaches the job: right after the issue when the queue was
    // idle, else when the previous job ended.
    queue_release(at, h.free_at_start, at <= h.issue ? h.cast_order : -1);
  }
  void finish_job(job& h, double at) {
    h.done = true;
    h.end = at;
    queue_release(at, h.free_at_end);
  }

  void tally_memory(sim_result& r) {
    std::stable_sort(mem_.begin(), mem_.end(), [](const mem_event& a, const mem_event& b) {
      return a.t < b.t || (a.t == b.t && a.order < b.order);
    });
    long long live = 0, peak = 0, fpeak = 0, bpeak = 0;
    for (const auto& e : mem_) {
      live += e.delta;
      if (e.delta <= 0) continue;  // only allocations raise a peak
      peak = std::max(peak, live);
      long long& phase_peak = e.phase == step_phase::forward ? fpeak : bpeak;
      phase_peak = std::max(phase_peak, live);
    }
    if (live != 0) throw error(errc::internal, "simulate: transient memory does not return to zero at the end of the step");
    r.peak_transient_bytes = static_cast<std::size_t>(peak);
    r.forward_peak_transient_bytes = static_cast<std::size_t>(fpeak);
    r.backward_peak_transient_bytes = static_cast<std::size_t>(bpeak);
    r.peak_bytes = r.persistent_bytes + r.peak_transient_bytes;
  }

  const step_trace& t_;
  const cost_model& c_;
  const plan& p_;
  bool record_;
  bucket_positions pos_;
  int k_ = 0;
  std::vector<std::size_t> padded_, shard_;
  std::vector<int> units_in_;
  std::vector<std::vector<int>> fwd_issue_at_, bwd_issue_at_, wait_at_;

  step_phase phase_ = step_phase::forward;
  double now_ = 0;
  double link_free_ = 0;
  double busy_ = 0;
  long long seq_ = 0;
  std::vector<bool> gathered_;
  std::vector<int> gather_job_, reduce_job_;
  std::vector<job> jobs_;
  std::deque<int> queues_[2];
  double queue_free_[2] = {0, 0};
  std::vector<mem_event> mem_;
  std::vector<collective_record> records_;
};

}  // namespace detail

//! Runs one step of `trace` under plan `p`, priced by `cost` (see the file comment for the
//! model). Throws fsdp::error(errc::invalid_argument) on an invalid trace, cost model or plan.
inline sim_result simulate(const checked_trace& trace, const cost_model& cost, const plan& p) {
  validate(cost);
  validate(trace, p);
  return detail::step_simulator(trace, cost, p, true).run();
}

}  // namespace fsdp::schedule
