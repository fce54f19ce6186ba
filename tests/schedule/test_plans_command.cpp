// bench/plans.cpp's command runs on a small configuration and rejects bad options. (Its
// numbers are paper estimates; what they are is checked by the simulator's and planners' tests.)
// `plans --3d` (bench/plans_3d.cpp) prints the 70B and 405B tables; their rows are read back
// and checked for sanity: 405B without TP or PP does not fit on 512 GPUs, every marked best
// fits 80 GB and is the fastest fitting row of its GPU count.

#include <doctest/doctest.h>

#include <unistd.h>

#include <cstdio>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

int run_plans_command(int argc, char** argv);  // bench/plans.cpp

namespace {

int run(std::vector<std::string> args) {
  args.insert(args.begin(), "plans");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return run_plans_command(static_cast<int>(argv.size()), argv.data());
}

// Runs the command with its stdout sent to a temporary file; returns what it printed.
std::pair<int, std::string> run_captured(std::vector<std::string> args) {
  std::fflush(stdout);
  std::FILE* tmp = std::tmpfile();
  REQUIRE(tmp != nullptr);
  const int saved = ::dup(::fileno(stdout));
  ::dup2(::fileno(tmp), ::fileno(stdout));
  const int rc = run(std::move(args));
  std::fflush(stdout);
  ::dup2(saved, ::fileno(stdout));
  ::close(saved);
  std::string out;
  std::rewind(tmp);
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, tmp)) > 0;) out.append(buf, n);
  std::fclose(tmp);
  return {rc, out};
}

struct row {
  bool best = false;
  int tp = 0, pp = 0, dp = 0;
  double mem_gb = 0, tokens = 0;
  bool fits = false;
};

// model name -> GPU count -> rows, read from the --3d tables.
std::map<std::string, std::map<int, std::vector<row>>> parse_tables(const std::string& out) {
  std::map<std::string, std::map<int, std::vector<row>>> t;
  std::istringstream in(out);
  std::string line, model;
  int gpus = 0;
  while (std::getline(in, line)) {
    if (line.rfind("llama3-", 0) == 0) {
      model = line.substr(0, line.find(':'));
      continue;
    }
    int n = 0;
    if (std::sscanf(line.c_str(), " %d H100s", &n) == 1 && line.find("H100s (") != std::string::npos) {
      gpus = n;
      continue;
    }
    if (line.size() < 4 || line.compare(0, 2, "  ") != 0) continue;
    row r;
    int m = 0, b = 0;
    char ac[8] = {}, fits[8] = {};
    double step = 0;
    if (std::sscanf(line.c_str() + 3, "%d %d %d %d x %d %7s %lf %7s %lf %lf", &r.tp, &r.pp, &r.dp, &m, &b, ac, &r.mem_gb,
                    fits, &step, &r.tokens) != 10)
      continue;
    r.best = line[2] == '*';
    r.fits = std::string(fits) == "yes";
    t[model][gpus].push_back(r);
  }
  return t;
}

}  // namespace

TEST_CASE("plans command: a small configuration runs, bad options are refused") {
  CHECK(run({"--model", "8b", "--ranks", "8,16", "--evals", "200"}) == 0);
  CHECK(run({"--model", "8b", "--ranks", "16", "--shard", "8", "--evals", "100", "--limit-gib", "40"}) == 0);
  CHECK(run({"--help"}) == 0);
  CHECK(run({"--model", "7b"}) == 2);
  CHECK(run({"--ranks", "8,x"}) == 2);
  CHECK(run({"--ranks", "12", "--shard", "8"}) == 2);
  CHECK(run({"--frobnicate", "1"}) == 2);
  CHECK(run({"--seq"}) == 2);
}

TEST_CASE("plans --3d: 70B and 405B tables at 64-512 H100s, the best of each fits and is the fastest that does") {
  const auto [rc, out] = run_captured({"--3d"});
  REQUIRE(rc == 0);
  const auto tables = parse_tables(out);
  REQUIRE(tables.count("llama3-70b") == 1);
  REQUIRE(tables.count("llama3-405b") == 1);
  for (const auto& [model, by_gpus] : tables) {
    CAPTURE(model);
    CHECK(by_gpus.size() == 4);
    for (const auto& [gpus, rows] : by_gpus) {
      CAPTURE(gpus);
      CHECK(gpus % 64 == 0);
      CHECK(rows.size() >= 10);
      int marked = 0;
      double fastest_fitting = 0;
      for (const row& r : rows) {
        CHECK(r.tp * r.pp * r.dp == gpus);
        CHECK(r.mem_gb > 0);
        if (r.fits) CHECK(r.mem_gb <= 80.05);  // printed to 0.1 GB
        else CHECK(r.mem_gb >= 79.95);
        if (r.fits && r.tokens > fastest_fitting) fastest_fitting = r.tokens;
      }
      for (const row& r : rows)
        if (r.best) {
          ++marked;
          CHECK(r.fits);
          CHECK(r.tokens == fastest_fitting);
        }
      CHECK(marked == (fastest_fitting > 0 ? 1 : 0));
    }
  }
  // 405B unsharded by TP or PP: 16 bytes of state per parameter over 512 ranks plus a whole
  // model's activations does not fit 80 GB; on 512 GPUs something does.
  bool found = false;
  for (const row& r : tables.at("llama3-405b").at(512))
    if (r.tp == 1 && r.pp == 1) {
      found = true;
      CHECK_FALSE(r.fits);
    }
  CHECK(found);
  int best_512 = 0;
  for (const row& r : tables.at("llama3-405b").at(512)) best_512 += r.best ? 1 : 0;
  CHECK(best_512 == 1);
  // 405B on 64 H100s: 405e9 x 16 bytes / 64 = 101 GB of sharded state alone, nothing fits.
  for (const row& r : tables.at("llama3-405b").at(64)) CHECK_FALSE(r.fits);
  // The published configurations are set beside the model's rows.
  CHECK(out.find("Llama 3 paper (Table 4): TP 8, PP 16") != std::string::npos);
  CHECK(out.find("torchtitan benchmark (Table 5)") != std::string::npos);
}

TEST_CASE("plans --3d: options") {
  CHECK(run({"--3d", "--help"}) == 0);
  CHECK(run({"--3d", "--model", "70b", "--ranks", "64", "--global-batch", "64"}) == 0);
  CHECK(run({"--3d", "--ranks", "60"}) == 2);  // not whole nodes
  CHECK(run({"--3d", "--model", "7b"}) == 2);
  CHECK(run({"--3d", "--seq"}) == 2);
}
