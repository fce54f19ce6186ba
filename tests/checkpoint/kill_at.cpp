// The kill tests' shim (LD_PRELOAD): FSDP_KILL_AT="fsync:K" kills the process with SIGKILL
// when it calls fsync() for the K-th time, before that call runs; "rename:K" does the same at
// the K-th rename(). A checkpoint save calls fsync for each file it writes and for its
// directories, and rename to commit, so K walks a save from its first file to its commit.
// Test-only code: the library itself is header-only.
#include <dlfcn.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

std::atomic<int> fsyncs{0}, renames{0};

void maybe_kill(const char* what, std::atomic<int>& calls) {
  const char* at = std::getenv("FSDP_KILL_AT");
  const std::size_t n = std::strlen(what);
  if (!at || std::strncmp(at, what, n) != 0 || at[n] != ':') return;
  if (calls.fetch_add(1) + 1 == std::atoi(at + n + 1)) {
    std::fprintf(stderr, "kill_at: SIGKILL at %s\n", at);
    ::kill(::getpid(), SIGKILL);
  }
}

template <class F>
F real(const char* name) {
  return reinterpret_cast<F>(::dlsym(RTLD_NEXT, name));
}

}  // namespace

extern "C" int fsync(int fd) {
  maybe_kill("fsync", fsyncs);
  return real<int (*)(int)>("fsync")(fd);
}

extern "C" int rename(const char* from, const char* to) {
  maybe_kill("rename", renames);
  return real<int (*)(const char*, const char*)>("rename")(from, to);
}
