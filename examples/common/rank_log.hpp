#pragma once
// examples/common/rank_log.hpp: per-rank log files, as torchrun's --log-dir writes them. Each
// rank's lines go to DIR/rank_<r>.log as well as to the terminal, written through at every
// newline, so that a rank's last words survive whatever happens to its output stream on the
// way to the terminal (mpiexec forwards a remote rank's output over the network: a cut link
// loses it).
//
//   example::tee_to_rank_log(dir, rank);   // MPI: from here on, stdout and stderr go to both
//   example::append_rank_log(dir, r, line) // threads: one rank's line (ranks share a process)

#include <fcntl.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>

namespace example {

//! DIR/rank_<r>.log.
inline std::string rank_log_path(const std::string& dir, int rank) {
  return (std::filesystem::path(dir) / ("rank_" + std::to_string(rank) + ".log")).string();
}

namespace detail {

inline int open_log(const std::string& path, bool truncate) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | (truncate ? O_TRUNC : 0), 0644);
  if (fd < 0) throw std::runtime_error("--log-dir: cannot open " + path + " for writing: " + std::strerror(errno));
  return fd;
}

inline void write_all(int fd, const char* p, std::size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;  // a log or a terminal that fails must not stop the rank
    p += w, n -= static_cast<std::size_t>(w);
  }
}

//! Where one tee'd stream writes: the stream's original file descriptor and the log.
struct tee_fds {
  int terminal;
  int log;
};

inline ssize_t tee_write(void* cookie, const char* buf, std::size_t n) {
  const auto* t = static_cast<const tee_fds*>(cookie);
  write_all(t->terminal, buf, n);
  write_all(t->log, buf, n);
  return static_cast<ssize_t>(n);
}

//! A line-buffered stream writing to `fd` and to `log`, for `stdout` or `stderr` to become.
inline std::FILE* tee_stream(int fd, int log) {
  cookie_io_functions_t io{};
  io.write = tee_write;
  auto* t = new tee_fds{::dup(fd), log};  // lives as long as the process: the stream may be used to the end
  std::FILE* f = ::fopencookie(t, "w", io);
  if (!f) throw std::runtime_error(std::string("--log-dir: fopencookie failed: ") + std::strerror(errno));
  std::setvbuf(f, nullptr, _IOLBF, 0);
  return f;
}

}  // namespace detail

//! From here on, this process's stdout and stderr (the C streams: printf, fprintf) are written
//! to their terminal and to DIR/rank_<rank>.log (created or emptied), a line at a time.
//! For one rank per process (MPI).
inline void tee_to_rank_log(const std::string& dir, int rank) {
  const int log = detail::open_log(rank_log_path(dir, rank), true);
  std::fflush(stdout);
  std::fflush(stderr);
  stdout = detail::tee_stream(STDOUT_FILENO, log);
  stderr = detail::tee_stream(STDERR_FILENO, log);
}

//! Creates DIR/rank_<rank>.log, or empties it.
inline void create_rank_log(const std::string& dir, int rank) { ::close(detail::open_log(rank_log_path(dir, rank), true)); }

//! Appends one line to DIR/rank_<rank>.log (for thread ranks, which share a process).
inline void append_rank_log(const std::string& dir, int rank, const std::string& line) {
  const int fd = detail::open_log(rank_log_path(dir, rank), false);
  const std::string l = line + "\n";
  detail::write_all(fd, l.data(), l.size());
  ::close(fd);
}

}  // namespace example
