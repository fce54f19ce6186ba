// bench/plans.cpp's command runs on a small configuration and rejects bad options. (Its
// numbers are paper estimates; what they are is checked by the simulator's and planners' tests.)

#include <doctest/doctest.h>

#include <string>
#include <vector>

int run_plans_command(int argc, char** argv);  // bench/plans.cpp

namespace {

int run(std::vector<std::string> args) {
  args.insert(args.begin(), "plans");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return run_plans_command(static_cast<int>(argv.size()), argv.data());
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
