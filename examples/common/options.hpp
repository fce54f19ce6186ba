#pragma once
// examples/common/options.hpp: the command-line parser the example programs share. Each flag
// takes one value ("--steps 20"); --help (or -h) prints the usage and exits 0; a bad value, a
// missing value or an unknown flag prints "<program>: <what is wrong>" and the usage on stderr
// and exits 2.
//
//   example::parser p{"train_mlp", usage};
//   p.flag("--steps", c.steps, example::at_least(1));      // "--steps needs an integer >= 1, got 'x'"
//   p.flag("--ranks", c.ranks, example::in(1, 1024));      // "--ranks needs an integer in [1, 1024], got 'x'"
//   p.flag("--lr", c.lr, example::positive());             // "--lr needs a positive number, got 'x'"
//   p.flag("--backend", c.backend);                        // any text
//   p.flag("--trace", [&](const char* v) { ... });         // anything else
//   p.parse(argc, argv);
//   if (c.batch % c.ranks != 0) p.fail("--batch must be a multiple of --ranks");

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <concepts>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <fsdp/policy/sharding.hpp>

namespace example {

//! The integers a flag accepts: [min, max]. at_least() names only its lower bound in the
//! message; max then only keeps absurd values out.
struct int_range {
  long min = 0;
  long max = 1'000'000;
  bool say_max = true;
};
inline int_range in(long min, long max) { return {min, max, true}; }
inline int_range at_least(long min, long max = 1'000'000) { return {min, max, false}; }

//! The real numbers a flag accepts: finite, and >= 0 or > 0.
enum class real_range { non_negative, positive };
inline real_range non_negative() { return real_range::non_negative; }  // "needs a number >= 0"
inline real_range positive() { return real_range::positive; }          // "needs a positive number"

class parser {
 public:
  parser(std::string program, std::string usage) : program_(std::move(program)), usage_(std::move(usage)) {}
  parser(const parser&) = delete;  // the flags' readers point at this parser
  parser& operator=(const parser&) = delete;

  //! Prints "<program>: msg" and the usage on stderr, and exits 2.
  [[noreturn]] void fail(const std::string& msg) const {
    std::fprintf(stderr, "%s: %s\n%s", program_.c_str(), msg.c_str(), usage_.c_str());
    std::exit(2);
  }

  //! `v` as an integer in `r`, else fail() naming `what` (a flag, or a part of one).
  long integer(const std::string& what, const char* v, int_range r) const {
    char* end = nullptr;
    errno = 0;
    const long x = std::strtol(v, &end, 10);
    if (end == v || *end != '\0' || errno != 0 || x < r.min || x > r.max)
      fail(what + " needs an integer " +
           (r.say_max ? "in [" + std::to_string(r.min) + ", " + std::to_string(r.max) + "]" : ">= " + std::to_string(r.min)) +
           ", got '" + v + "'");
    return x;
  }

  //! `v` as a real number in `r` (parsed as T: float or double), else fail().
  template <std::floating_point T>
  T real(const std::string& what, const char* v, real_range r) const {
    char* end = nullptr;
    const T x = std::is_same_v<T, float> ? std::strtof(v, &end) : static_cast<T>(std::strtod(v, &end));
    const bool in_range = r == real_range::positive ? x > 0 : x >= 0;
    if (end == v || *end != '\0' || !in_range || !std::isfinite(x))
      fail(what + (r == real_range::positive ? " needs a positive number" : " needs a number >= 0") + ", got '" + v + "'");
    return x;
  }

  //! A flag whose value is any text.
  parser& flag(std::string name, std::string& out) {
    return flag(std::move(name), [&out](const char* v) { out = v; });
  }
  //! A flag whose value is an integer in `r`.
  template <std::integral T>
  parser& flag(std::string name, T& out, int_range r) {
    return flag(name, [this, &out, name, r](const char* v) { out = static_cast<T>(integer(name, v, r)); });
  }
  //! A flag whose value is a real number in `r`.
  template <std::floating_point T>
  parser& flag(std::string name, T& out, real_range r) {
    return flag(name, [this, &out, name, r](const char* v) { out = real<T>(name, v, r); });
  }
  //! A flag read by `read(value)`, which may call fail().
  parser& flag(std::string name, std::function<void(const char*)> read) {
    flags_.push_back({std::move(name), std::move(read), true});
    return *this;
  }
  //! A flag without a value: present sets `out`.
  parser& toggle(std::string name, bool& out) {
    flags_.push_back({std::move(name), [&out](const char*) { out = true; }, false});
    return *this;
  }

  //! Reads argv[1..]: every argument is a flag followed by its value (a toggle has none).
  void parse(int argc, char** argv) const {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--help" || a == "-h") {
        std::fputs(usage_.c_str(), stdout);
        std::exit(0);
      }
      if (a.rfind("--", 0) != 0) fail("unexpected argument '" + a + "'");
      const auto f = std::find_if(flags_.begin(), flags_.end(), [&](const entry& x) { return x.name == a; });
      if (f == flags_.end()) fail("unknown option " + a);
      if (!f->takes_value) {
        f->read(nullptr);
        continue;
      }
      if (i + 1 >= argc) fail("missing value for " + a);
      f->read(argv[++i]);
    }
  }

 private:
  std::string program_, usage_;
  struct entry {
    std::string name;
    std::function<void(const char*)> read;
    bool takes_value;
  };
  std::vector<entry> flags_;
};

//! --sharding's value: full | grad_op | hybrid:SHARD_SIZE | none, as an fsdp::sharding; else
//! p.fail() saying what is accepted.
inline fsdp::sharding parse_sharding(const parser& p, const std::string& v) {
  if (v == "full") return fsdp::full_shard();
  if (v == "grad_op") return fsdp::shard_grad_op();
  if (v == "none") return fsdp::no_shard();
  if (v == "hybrid") return fsdp::hybrid_shard_per_host();
  if (v.rfind("hybrid:", 0) == 0) return fsdp::hybrid_shard(static_cast<int>(p.integer("--sharding hybrid:", v.c_str() + 7, in(1, 1024))));
  p.fail("--sharding must be full, grad_op, hybrid, hybrid:SHARD_SIZE or none, got '" + v + "'");
}

}  // namespace example
