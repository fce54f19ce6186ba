#pragma once
// examples/common/process_ranks.hpp: N ranks as N processes of this program on one machine, for
// the NCCL backend on one GPU (train_gpt --device cuda --backend nccl, tests/cuda/test_nccl_ranks).
//
// NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected") unless they
// look like different hosts: NCCL 2.30 added NCCL_MULTI_RANK_GPU_ENABLE for threads of one process,
// but the lent GPU machines have NCCL 2.28.9 (docs/gpu.md). Giving each process its own
// NCCL_HOSTID makes NCCL treat them as separate hosts and connect them through its socket
// transport: slow (loopback TCP instead of NVLink or shared memory), but every NCCL code path a
// multi-node job takes. Each rank finds the others through a file_store folder (rank 0 writes the
// ncclUniqueId there).
//
//   if (auto me = example::this_process_rank()) return run_one_rank(me->rank, me->size, me->store);
//   const auto exits = example::spawn_process_ranks({.ranks = 4, .args = {...}});   // the launcher
//
// The launcher waits for every rank up to a timeout; once one fails it gives the others a grace
// period (their NCCL waits time out or see the abort) and then kills them, so nothing hangs.

#include <signal.h>
#include <spawn.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fsdp/core/error.hpp>

extern char** environ;

namespace example {

//! The rank a process was started as (environment FSDP_PROCESS_RANK, FSDP_PROCESS_RANKS,
//! FSDP_PROCESS_STORE, set by spawn_process_ranks).
struct process_rank {
  int rank = 0;
  int size = 1;
  std::filesystem::path store;  //!< the file_store folder the ranks meet in
};

//! This process's rank when spawn_process_ranks started it; nullopt otherwise.
inline std::optional<process_rank> this_process_rank() {
  const char* r = std::getenv("FSDP_PROCESS_RANK");
  const char* n = std::getenv("FSDP_PROCESS_RANKS");
  const char* s = std::getenv("FSDP_PROCESS_STORE");
  if (r == nullptr || n == nullptr || s == nullptr) return std::nullopt;
  process_rank p{std::atoi(r), std::atoi(n), s};
  if (p.size < 1 || p.rank < 0 || p.rank >= p.size)
    throw fsdp::error(fsdp::errc::invalid_argument, std::string("FSDP_PROCESS_RANK=") + r + " of FSDP_PROCESS_RANKS=" + n + " is not a rank");
  return p;
}

struct spawn_options {
  int ranks = 2;
  std::vector<std::string> args{};        //!< argv[1..] of every rank (argv[0] is this program)
  std::vector<std::string> env{};         //!< more NAME=VALUE for every rank
  std::filesystem::path store{};          //!< empty: a fresh folder under the temp directory, removed after
  std::chrono::seconds timeout{300};      //!< every rank must have ended by then, else all are killed
  std::chrono::seconds grace{30};         //!< after a rank fails, the others' time to end on their own
  bool separate_hosts = true;             //!< a distinct NCCL_HOSTID per rank (above)
};

//! How one rank ended: its exit code, or the signal that ended it (killed: by the launcher).
struct rank_exit {
  int code = 0;        //!< exit code; -1 when a signal ended it
  int signal = 0;
  bool killed = false; //!< the launcher killed it (timeout or grace over)
  bool ok() const { return code == 0 && signal == 0; }
  std::string str() const {
    if (killed) return "killed by the launcher (" + std::string(strsignal(signal)) + ")";
    if (signal != 0) return std::string("ended by signal ") + strsignal(signal);
    return "exit " + std::to_string(code);
  }
};

//! Starts o.ranks processes of this program (/proc/self/exe) with o.args, rank r's environment
//! being this one's plus FSDP_PROCESS_RANK=r, FSDP_PROCESS_RANKS, FSDP_PROCESS_STORE and (with
//! separate_hosts) NCCL_HOSTID=fsdp-<pid>-r, and waits for them (see the file's comment). Their
//! standard output and error are this process's. Returns how each ended, by rank.
inline std::vector<rank_exit> spawn_process_ranks(const spawn_options& o) {
  using clock = std::chrono::steady_clock;
  if (o.ranks < 1) throw fsdp::error(fsdp::errc::invalid_argument, "spawn_process_ranks: ranks must be >= 1, got " + std::to_string(o.ranks));
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) throw fsdp::error(fsdp::errc::internal, "spawn_process_ranks: cannot read /proc/self/exe: " + ec.message());
  std::filesystem::path store = o.store;
  const bool own_store = store.empty();
  if (own_store) {
    store = std::filesystem::temp_directory_path() / ("fsdp-ranks-" + std::to_string(getpid()) + "-" +
                                                     std::to_string(clock::now().time_since_epoch().count()));
  }
  std::filesystem::create_directories(store);

  std::vector<pid_t> pids(static_cast<std::size_t>(o.ranks), -1);
  std::vector<rank_exit> out(static_cast<std::size_t>(o.ranks));
  auto kill_all = [&](std::vector<bool>& done) {
    for (std::size_t r = 0; r < pids.size(); ++r)
      if (pids[r] > 0 && !done[r]) kill(pids[r], SIGKILL);
  };
  std::vector<bool> done(pids.size(), false);
  for (int r = 0; r < o.ranks; ++r) {
    // The argument and environment arrays are built before spawning (nothing is allocated
    // between fork and exec); names this process already has are replaced.
    std::vector<std::string> env{"FSDP_PROCESS_RANK=" + std::to_string(r), "FSDP_PROCESS_RANKS=" + std::to_string(o.ranks),
                                 "FSDP_PROCESS_STORE=" + store.string()};
    if (o.separate_hosts) env.push_back("NCCL_HOSTID=fsdp-" + std::to_string(getpid()) + "-" + std::to_string(r));
    env.insert(env.end(), o.env.begin(), o.env.end());
    auto named = [&](const char* kv) {
      for (const std::string& e : env)
        if (std::strncmp(kv, e.c_str(), e.find('=') + 1) == 0) return true;
      return false;
    };
    for (char** e = environ; *e != nullptr; ++e)
      if (!named(*e)) env.emplace_back(*e);
    std::vector<std::string> args{self.string()};
    args.insert(args.end(), o.args.begin(), o.args.end());
    std::vector<char*> argv, envp;
    for (std::string& a : args) argv.push_back(a.data());
    for (std::string& e : env) envp.push_back(e.data());
    argv.push_back(nullptr);
    envp.push_back(nullptr);
    pid_t pid = -1;
    if (const int rc = posix_spawn(&pid, self.c_str(), nullptr, nullptr, argv.data(), envp.data()); rc != 0) {
      kill_all(done);
      throw fsdp::error(fsdp::errc::internal, "spawn_process_ranks: cannot start rank " + std::to_string(r) + ": " + std::strerror(rc));
    }
    pids[static_cast<std::size_t>(r)] = pid;
  }

  const auto deadline = clock::now() + o.timeout;
  std::optional<clock::time_point> grace_end;
  for (int left = o.ranks; left > 0;) {
    bool reaped = false;
    for (std::size_t r = 0; r < pids.size(); ++r) {
      if (done[r]) continue;
      int status = 0;
      if (waitpid(pids[r], &status, WNOHANG) != pids[r]) continue;
      done[r] = reaped = true;
      --left;
      if (WIFEXITED(status)) out[r].code = WEXITSTATUS(status);
      else out[r] = {.code = -1, .signal = WTERMSIG(status), .killed = out[r].killed};
      if (!out[r].ok() && !grace_end) grace_end = clock::now() + o.grace;
    }
    if (left == 0) break;
    const auto now = clock::now();
    if (now >= deadline || (grace_end && now >= *grace_end)) {
      for (std::size_t r = 0; r < pids.size(); ++r)
        if (!done[r]) out[r].killed = true;
      kill_all(done);
      for (std::size_t r = 0; r < pids.size(); ++r) {
        if (done[r]) continue;
        int status = 0;
        waitpid(pids[r], &status, 0);
        out[r] = {.code = -1, .signal = SIGKILL, .killed = true};
        done[r] = true;
      }
      break;
    }
    if (!reaped) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (own_store) std::filesystem::remove_all(store, ec);
  return out;
}

//! "rank 0: exit 0, rank 1: exit 1" for a message.
inline std::string describe(const std::vector<rank_exit>& exits) {
  std::string s;
  for (std::size_t r = 0; r < exits.size(); ++r) s += (r ? ", rank " : "rank ") + std::to_string(r) + ": " + exits[r].str();
  return s;
}

}  // namespace example
