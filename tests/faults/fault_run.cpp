// fault_run: a small sharded training loop that tests/faults/inject.sh runs and hurts. Every rank
// prints what happened to it, with the wall-clock time (epoch seconds), so that the driver can
// tell how long each survivor took to report a fault injected at a known time:
//
//   rank R at T: <error>                         a rank that caught an error (then exits 1)
//   rank R injects <fault> at T                  the faulting rank, for faults it makes itself
//   rank R: finished N steps; longest step W s wall, C s CPU
//
//   fault_run [--backend threads|mpi] [--ranks N] [--steps N] [--step-ms MS]
//             [--fault none|throw|leave|mismatch] [--fault-rank R] [--fault-step S] [--pid-dir DIR]
//             [--flight-dir DIR]
//
// mismatch: the fault rank issues an all_reduce of 64 f32 where the others issue the step's
// all_gather. --flight-dir: every rank writes its flight record (comm/flight_recorder.hpp) to
// DIR/flight_rank_<r>.jsonl when it ends, failed or not (a killed rank writes none).
// --pid-dir: the fault rank writes DIR/rank<R>.pid when it reaches the fault step (the driver
// waits for it, then sends kill -9 or SIGSTOP). The wait timeout is FSDP_TIMEOUT_MS.
// CPU time is the process's (every thread: compute, queues, the MPI engine): in the longest
// step of a survivor, it is what waiting on a stopped peer costs.

#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/fsdp.hpp"
#include "fsdp/comm/mpi.hpp"

namespace {

struct options {
  std::string backend = "mpi", fault = "none", pid_dir, flight_dir;
  int ranks = 3, steps = 30, step_ms = 10, fault_rank = 1, fault_step = 5;
};

double now_s() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

double cpu_s() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + 1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

// One rank's loop: two units, a forward and a backward per step with a little "compute".
template <class Comm>
void train(Comm& comm, const options& o) {
  const int r = comm.rank();
  fsdp::buffer<float> a(4096, "a"), b(4096, "b");
  fsdp::shard_group<fsdp::buffer<float>, Comm> group{comm};
  group.add_unit({&a});
  group.add_unit({&b});
  group.finalize(fsdp::init::broadcast_from{0});
  fsdp::sgd opt{group, {.lr = 1e-3f}};
  double longest = 0, longest_cpu = 0;
  for (int step = 0; step < o.steps; ++step) {
    if (r == o.fault_rank && step == o.fault_step) {
      if (!o.pid_dir.empty()) {
        const std::string tmp = o.pid_dir + "/rank" + std::to_string(r) + ".tmp";
        std::ofstream(tmp) << getpid() << '\n';
        std::rename(tmp.c_str(), (o.pid_dir + "/rank" + std::to_string(r) + ".pid").c_str());
      }
      if (o.fault != "none") {
        std::printf("rank %d injects %s at %.3f\n", r, o.fault.c_str(), now_s());
        std::fflush(stdout);
      }
      if (o.fault == "throw") throw std::runtime_error("injected failure on rank " + std::to_string(r));
      if (o.fault == "leave") return;  // without its remaining collectives; the group ends normally
      if (o.fault == "mismatch") {
        std::vector<float> x(64, 1.0f);
        fsdp::host_queue q;
        comm.all_reduce(x.data(), x.data(), x.size(), fsdp::dtype::f32, fsdp::reduce_op::sum, q).wait(comm.timeout());
      }
    }
    const auto t0 = std::chrono::steady_clock::now();
    const double c0 = cpu_s();
    for (int u = 0; u < 2; ++u) {
      auto in_use = group.forward(u);
      std::this_thread::sleep_for(std::chrono::milliseconds(o.step_ms / 4));
    }
    for (int u = 1; u >= 0; --u) {
      auto in_use = group.backward(u);
      fsdp::buffer<float>& p = u ? b : a;
      for (std::size_t i = 0; i < 4096; ++i) p.grad()[i] += 1.0f;
      std::this_thread::sleep_for(std::chrono::milliseconds(o.step_ms / 4));
    }
    opt.step();
    opt.zero_grad();
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (wall > longest) longest = wall, longest_cpu = cpu_s() - c0;
  }
  std::printf("rank %d: finished %d steps; longest step %.3f s wall, %.3f s CPU\n", r, o.steps, longest, longest_cpu);
  std::fflush(stdout);
}

void write_flight_record(const options& o, int world_rank, int world_size) {
  if (!o.flight_dir.empty()) fsdp::flight_recorder::of(world_rank).write_to(o.flight_dir, world_size);
}

int report(int rank, const std::exception& e) {
  std::printf("rank %d at %.3f: %s\n", rank, now_s(), e.what());
  std::fflush(stdout);
  return 1;
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument("fault_run: " + k + " needs a value");
    const std::string v = argv[++i];
    if (k == "--backend") o.backend = v;
    else if (k == "--fault") o.fault = v;
    else if (k == "--pid-dir") o.pid_dir = v;
    else if (k == "--flight-dir") o.flight_dir = v;
    else if (k == "--ranks") o.ranks = std::stoi(v);
    else if (k == "--steps") o.steps = std::stoi(v);
    else if (k == "--step-ms") o.step_ms = std::stoi(v);
    else if (k == "--fault-rank") o.fault_rank = std::stoi(v);
    else if (k == "--fault-step") o.fault_step = std::stoi(v);
    else throw std::invalid_argument("fault_run: unknown option " + k);
  }
  if (o.fault != "none" && o.fault != "throw" && o.fault != "leave" && o.fault != "mismatch")
    throw std::invalid_argument("fault_run: --fault must be none, throw, leave or mismatch, got " + o.fault);
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  if (o.backend == "threads") {
    int rc = 0;
    try {
      fsdp::threads::world{o.ranks}.run([&](fsdp::threads::communicator& comm) {
        try {
          train(comm, o);
        } catch (const std::exception& e) {
          report(comm.rank(), e);
          write_flight_record(o, comm.rank(), comm.size());
          throw;
        }
        write_flight_record(o, comm.rank(), comm.size());
      });
    } catch (const std::exception& e) {
      std::printf("world::run rethrew: %s\n", e.what());
      rc = 1;
    }
    return rc;
  }
  fsdp::mpi::environment env(argc, argv);
  int world_size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  try {
    auto comm = env.world();
    train(comm, o);
  } catch (const std::exception& e) {
    const int rc = report(env.rank(), e);  // before ~environment's MPI_Abort
    write_flight_record(o, env.rank(), world_size);
    env.abort(e.what());
    return rc;
  }
  write_flight_record(o, env.rank(), world_size);
  return 0;
}
