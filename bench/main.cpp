// fsdp_bench: the benchmark executable.
//
//   fsdp_bench [--benchmark_filter=REGEX] [--benchmark_min_time=SECONDS] [--benchmark_out=FILE] ...
//   fsdp_bench plans [ARGS...]        plans for Llama-3-like models on paper (bench/plans.cpp)
//   fsdp_bench overlap [ARGS...]      plans run on the GPT program with a modelled link, against
//                                     the simulator's predictions (bench/overlap.cpp)
//   fsdp_bench accounting             per-rank traffic and memory of every sharding and mode, side
//                                     by side: exact counts (bench/accounting.cpp)
//
// Without a subcommand it is a plain Google Benchmark program: every benchmark registered by the
// sources linked in (overhead.cpp, collectives.cpp, gpt_step.cpp) and every
// --benchmark_* flag. A subcommand is dispatched before benchmark::Initialize, so its own
// options never meet Google Benchmark's parser. docs/benchmarks.md says what each one measures.

#include <cstdio>
#include <cstring>

#include <benchmark/benchmark.h>

// bench/plans.cpp. argv[0] is "plans", the subcommand's options follow (as for git's).
int run_plans_command(int argc, char** argv);
// bench/overlap.cpp, the same way.
int run_overlap_command(int argc, char** argv);
// bench/accounting.cpp, the same way.
int run_accounting_command(int argc, char** argv);

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "plans") == 0) {
    return run_plans_command(argc - 1, argv + 1);
  }
  if (argc > 1 && std::strcmp(argv[1], "overlap") == 0) return run_overlap_command(argc - 1, argv + 1);
  if (argc > 1 && std::strcmp(argv[1], "accounting") == 0) return run_accounting_command(argc - 1, argv + 1);
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], "--help") == 0) {
      std::printf("fsdp_bench: fsdp's benchmarks (docs/benchmarks.md)\n");
      std::printf("  fsdp_bench plans [ARGS...]     plans for Llama-3-like models on paper (fsdp_bench plans --help)\n");
      std::printf("  fsdp_bench overlap [ARGS...]   plans run on the GPT program with a modelled link (--help)\n");
      std::printf("  fsdp_bench accounting          traffic and memory per rank of every sharding and mode (exact counts)\n");
      std::printf("  fsdp_bench [--benchmark_* flags]   Google Benchmark's options:\n\n");
      break;
    }

  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
