#!/usr/bin/env bash
# The GPU checks, in one or two calls on a lent GPU machine (docs/gpu.md, "Running the GPU checks").
# A session is lent 15 device-minutes, so build here and carry the build:
#   here:   scripts/gpu-deps.sh     (stages .gpu-deps/: doctest, nlohmann-json, xxhash.h, corpus)
#           STAGES="configure build prune" OUT=out/gpu-build bash scripts/gpu-check.sh   (build/gpu, ~3 min)
#   there:  the device tool's run, carry [".gpu-deps", "build/gpu"], command
#           STAGES="prebuilt env ctest direct sanitize gpt nccl ab profile" bash scripts/gpu-check.sh
# (or carry only .gpu-deps and let the default STAGES configure and build there, on all cores).
# From the repository root, each stage named in STAGES, in that order:
#   prebuilt  takes build/gpu as built here: links this checkout's absolute path and the
#             configuring cmake where the build's files name them; finds cuBLAS and NCCL
#   env       records the machine (nvidia-smi, nvcc, cmake, NCCL's location)       -> env.txt
#   configure configures build/gpu (Release with -lineinfo, FSDP_CUDA, sm_90, warnings as
#             errors, prefix .gpu-deps)                                           -> build.log
#   build     builds only the CUDA tests and examples listed below               -> build.log
#   prune     deletes the build's object files, so that it fits a device call's carry
#   ctest     runs `ctest -L cuda`                                               -> tests.log
#   direct    runs each CUDA test executable itself (every case that applies on this machine;
#             ctest knows only the cases listed where the executable was built) -> tests.log
#   sanitize  runs each CUDA test executable under compute-sanitizer memcheck and racecheck
#                                                                                 -> sanitizer.log
#   gpt       trains the GPT (GPT-2 small: 12 layers, 768 wide, 1024 tokens) on 1, 2, 4, 8 ranks
#             of the GPU, fully sharded and unsharded, bf16                      -> gpt.log,
#             with a timeline of the 4-rank full run                             -> trace_gpu_4ranks.json
#   nccl      the same GPT on NCCL ranks, each a process on the GPU, or a thread of one
#             process with NCCL 2.30 (NCCL_RUNS; NCCL_BUILT: an NCCL built here)  -> gpt.log
#   ab        train_gpt's GPU switches A/B in one binary (AB_VARIANTS), AB_ROUNDS rounds -> gpt.log
#   profile   times every kernel of two one-rank GPT steps: CUPTI's records (train_gpt
#             --kernel-times, by owner), and Nsight Compute where it is there
#             (PROFILE_NCU=0: not)                                               -> profile.txt
#   peer      the same GPT in PyTorch (bench/gpt_torch.py: SDPA, bf16 autocast), one rank's
#             batch, eager and compiled, and at llm.c's vocabulary (PEER_VARIANTS) -> gpt.log
#   fsdp2     the PyTorch peer as FSDP2 (or DDP) on NCCL ranks, each a process on the GPU, as
#             the nccl stage runs train_gpt (FSDP2_RUNS, default NCCL_RUNS)      -> gpt.log
#   llmc      llm.c's GPT-2 (its train_gpt2cu, where one is at LLMC_BIN) at LLMC_BATCHES
#             sequences, reported as train_gpt reports (bench/llmc_peer.py)      -> gpt.log
#   curve     CURVE_STEPS steps of the plain path, the fast path and the PyTorch peer, their
#             loss curves held to the plain one (scripts/loss_band.py)           -> gpt.log
# and writes a table of every stage's exit code                                   -> summary.txt
# into $OUT (the device tool sets it; ./out otherwise): at most 8 files come back from there, so
# the per-run logs are concatenated. A stage that fails does not stop the later ones; every command
# is bounded by `timeout`, and the whole run by BUDGET_S (default 540 s, inside the tool's 600 s):
# a stage that would start with too little time left is recorded as skipped. The script's exit
# code is 0 when every stage that ran passed, 1 otherwise.
#
# Everything below can be overridden from the environment, e.g. a second call on the still-warm
# machine (30 s) that reruns only some GPT runs:
#   STAGES="prebuilt gpt" GPT_RUNS="4:full 8:none" S=50 bash scripts/gpu-check.sh
set -uo pipefail   # not -e: each stage's exit code is recorded and the next stage runs
cd "$(dirname "$0")/.." || exit 1
root=$PWD

# --- what to build and run ---------------------------------------------------------------------
# The test executables of label cuda (names CMake does not know yet are skipped with a note).
TEST_TARGETS=${TEST_TARGETS:-"test_file_store test_cuda test_threads_cuda test_nccl_ranks test_gpt_cuda"}
# Those that run CUDA code: what compute-sanitizer runs (test_file_store is host-only).
SANITIZE_TARGETS=${SANITIZE_TARGETS:-"test_cuda test_threads_cuda test_gpt_cuda"}
SANITIZE_TOOLS=${SANITIZE_TOOLS:-"memcheck racecheck"}
MEMCHECK_ARGS=${MEMCHECK_ARGS:-"--leak-check full"}
SANITIZE_TEST_ARGS=${SANITIZE_TEST_ARGS:-}   # passed to each test executable (doctest filters)
EXAMPLE_TARGETS=${EXAMPLE_TARGETS:-"train_gpt train_gpt_cuda train_mlp_cuda"}
# The GPT runs: global batch B_PER_RANK * R sequences, S steps.
GPT_RANKS=${GPT_RANKS:-"1 2 4 8"}
GPT_SHARDINGS=${GPT_SHARDINGS:-"full none"}
# Or the runs named one by one as RANKS:SHARDING (e.g. "1:full 8:full 8:none"): then GPT_RANKS
# and GPT_SHARDINGS are not used.
GPT_RUNS=${GPT_RUNS:-}
B_PER_RANK=${B_PER_RANK:-4}
S=${S:-20}
GPT_MODEL=${GPT_MODEL:-"--layers 12 --dim 768 --heads 12 --seq 1024"}
GPT_EXTRA_ARGS=${GPT_EXTRA_ARGS:-}
GPT_TRACE_RANKS=${GPT_TRACE_RANKS:-4}   # the full-sharding run with this many ranks writes the trace

# --- where and how long ------------------------------------------------------------------------
# The stages, run in this order (e.g. "env configure build ctest gpt sanitize" trains before the
# sanitizers, whose time is harder to foresee).
STAGES=${STAGES:-"env configure build ctest direct sanitize gpt"}
BUILD_DIR=${BUILD_DIR:-build/gpu}
OUT=${OUT:-$root/out}
JOBS=${JOBS:-$(nproc)}
CTEST_JOBS=${CTEST_JOBS:-1}           # one GPU: the tests run one at a time
BUDGET_S=${BUDGET_S:-540}             # the whole script
CONFIGURE_TIMEOUT=${CONFIGURE_TIMEOUT:-120}
BUILD_TIMEOUT=${BUILD_TIMEOUT:-330}
CTEST_TIMEOUT=${CTEST_TIMEOUT:-150}
DIRECT_TIMEOUT=${DIRECT_TIMEOUT:-180}         # each test executable run directly (test_nccl_ranks: 24 s on the H200 before its graph and thread cases)
SANITIZE_TIMEOUT=${SANITIZE_TIMEOUT:-60}     # each compute-sanitizer run
SANITIZE_BUDGET=${SANITIZE_BUDGET:-150}      # all of them together
GPT_TIMEOUT=${GPT_TIMEOUT:-60}               # each GPT run
RESERVE_S=${RESERVE_S:-10}                   # kept back for the summary

mkdir -p "$OUT" "$BUILD_DIR"
OUT=$(cd "$OUT" && pwd)
BUILD_DIR=$(cd "$BUILD_DIR" && pwd)
work=$BUILD_DIR/gpu-check   # per-run logs and the programs' working directory (not carried back)
mkdir -p "$work"
start=$(date +%s)
: >"$OUT/summary.txt"

# --- bookkeeping -------------------------------------------------------------------------------
stage_names=() stage_codes=() stage_secs=() stage_notes=()
record() {  # record NAME CODE SECONDS NOTE
  stage_names+=("$1") stage_codes+=("$2") stage_secs+=("$3") stage_notes+=("$4")
  printf '== %-28s exit %-5s %4ss  %s\n' "$1" "$2" "$3" "$4"
}
left() { echo $((start + BUDGET_S - RESERVE_S - $(date +%s))); }
# bounded WANTED: the timeout for a command, at most WANTED and what the budget leaves (0: none).
bounded() {
  local l; l=$(left)
  if [ "$l" -lt 5 ]; then echo 0; elif [ "$1" -lt "$l" ]; then echo "$1"; else echo "$l"; fi
}
# run_logged NAME TIMEOUT LOG CMD...: runs CMD under `timeout` in the folder $run_dir (default:
# the repository root), its output appended to LOG (and shown), and records its exit code
# (124/137: it ran out of time).
run_dir=""
run_logged() {
  local name=$1 want=$2 log=$3; shift 3
  local t; t=$(bounded "$want")
  if [ "$t" -eq 0 ]; then record "$name" skip 0 "no time left in BUDGET_S=$BUDGET_S"; return 0; fi
  local t0 rc note=""; t0=$(date +%s)
  echo "### $name: $* (timeout ${t}s, in ${run_dir:-$root})" >>"$log"
  (cd "${run_dir:-$root}" && exec timeout -k 10 "$t" "$@") 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  case $rc in 124|137) note="timed out after ${t}s" ;; esac
  echo "### $name: exit $rc" >>"$log"
  record "$name" "$rc" $(($(date +%s) - t0)) "$note"
}

# --- the toolchain -----------------------------------------------------------------------------
cuda_home=${CUDA_HOME:-}
if [ -z "$cuda_home" ]; then
  if command -v nvcc >/dev/null 2>&1; then
    cuda_home=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
  else
    for d in /usr/local/cuda /usr/local/cuda-*; do [ -x "$d/bin/nvcc" ] && { cuda_home=$d; break; }; done
  fi
fi
if [ -n "$cuda_home" ] && ! command -v nvcc >/dev/null 2>&1; then export PATH="$cuda_home/bin:$PATH"; fi
sanitizer=$(command -v compute-sanitizer 2>/dev/null || true)
for c in "$cuda_home/bin/compute-sanitizer" "$cuda_home/compute-sanitizer/compute-sanitizer"; do
  [ -z "$sanitizer" ] && [ -x "$c" ] && sanitizer=$c
done

# NCCL: NCCL_HOME's when set; else the toolkit's (lib64/libnccl.so, include/nccl.h: what
# CMakeLists.txt finds by itself); else the pip package nvidia-nccl-cu13 beside PyTorch, which has
# include/nccl.h and only lib/libnccl.so.2 (no unversioned libnccl.so for find_library). The one
# found is given to CMake by path (FSDP_NCCL_LIBRARY, FSDP_NCCL_INCLUDE_DIR: library and header
# from the same place) and its folder goes on LD_LIBRARY_PATH.
nccl_lib="" nccl_inc="" nccl_from=""
nccl_in() {  # nccl_in DIR: sets nccl_lib and nccl_inc when DIR holds include/nccl.h and lib*/libnccl.so*
  local d=$1 l
  [ -f "$d/include/nccl.h" ] || return 1
  for l in "$d"/lib64/libnccl.so "$d"/lib/libnccl.so "$d"/lib64/libnccl.so.2 "$d"/lib/libnccl.so.2 "$d"/lib/x86_64-linux-gnu/libnccl.so*; do
    if [ -e "$l" ]; then nccl_lib=$l; nccl_inc=$d/include; return 0; fi
  done
  return 1
}
pip_nccl_dirs() {  # the folders of Python packages that may hold NCCL (nvidia.nccl, nvidia/*)
  command -v python3 >/dev/null 2>&1 || return 0
  timeout 60 python3 - <<'EOF' 2>/dev/null
import importlib, os
try:
    m = importlib.import_module("nvidia.nccl")
    for p in list(getattr(m, "__path__", [])) + ([os.path.dirname(m.__file__)] if getattr(m, "__file__", None) else []):
        print(p)
except Exception:
    pass
try:
    import nvidia
    for base in nvidia.__path__:
        for sub in sorted(os.listdir(base)):
            print(os.path.join(base, sub))
except Exception:
    pass
EOF
}
if [ -n "${NCCL_HOME:-}" ] && nccl_in "$NCCL_HOME"; then
  nccl_from="NCCL_HOME"
elif [ -n "$cuda_home" ] && nccl_in "$cuda_home"; then
  nccl_from="the CUDA toolkit"
else
  while IFS= read -r d; do
    if [ -n "$d" ] && nccl_in "$d"; then nccl_from="the Python package in $d"; break; fi
  done < <(pip_nccl_dirs)
fi
nccl_args=()
if [ -n "$nccl_lib" ]; then
  nccl_args=("-DFSDP_NCCL_LIBRARY=$nccl_lib" "-DFSDP_NCCL_INCLUDE_DIR=$nccl_inc")
  LD_LIBRARY_PATH="$(dirname "$nccl_lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export LD_LIBRARY_PATH
fi
# An NCCL built here and carried (NCCL_BUILT, default build/nccl: NCCL 2.30 for sm_90, docs/gpu.md
# "NCCL ranks as threads") is loaded before the machine's, by the same soname: with it thread
# ranks share the GPU (train_gpt --nccl-ranks threads, test_nccl_ranks' thread launches). NCCL
# keeps its ABI across versions, so what was linked against 2.28's headers runs on it.
# NCCL_BUILT= keeps the machine's.
NCCL_BUILT=${NCCL_BUILT-$root/build/nccl}
nccl_loaded=$nccl_lib
ld_without_built() {  # LD_LIBRARY_PATH without NCCL_BUILT's lib
  local ld=":${LD_LIBRARY_PATH:-}:"
  [ -z "$NCCL_BUILT" ] || ld=${ld//":$NCCL_BUILT/lib:"/:}
  ld=${ld#:}
  echo "${ld%:}"
}
nccl_first() {  # puts NCCL_BUILT's lib first on LD_LIBRARY_PATH (again after prebuilt's additions)
  [ -n "$NCCL_BUILT" ] && [ -e "$NCCL_BUILT/lib/libnccl.so.2" ] || return 0
  local ld; ld=$(ld_without_built)
  LD_LIBRARY_PATH="$NCCL_BUILT/lib${ld:+:$ld}"
  export LD_LIBRARY_PATH
  nccl_loaded="$(readlink -f "$NCCL_BUILT/lib/libnccl.so.2") (NCCL_BUILT)"
}
if [ -n "$NCCL_BUILT" ] && [ -d "$NCCL_BUILT" ]; then NCCL_BUILT=$(cd "$NCCL_BUILT" && pwd); fi  # the runs' folders are elsewhere
nccl_first

# The GPT's text: the fortunes if installed, else the copy scripts/gpu-deps.sh staged. The tests
# of label cuda run train_gpt on its default corpus too (example.train_gpt.cuda), so on the GPU
# machine (bare, given back after the session, commands run as root) the staged copy is linked
# where the default corpus lives; where that cannot be done, the GPT runs get --data.
DEFAULT_CORPUS=${DEFAULT_CORPUS:-/usr/share/games/fortunes}
staged_corpus=$root/.gpu-deps/share/fortunes
corpus_note="the default corpus ($DEFAULT_CORPUS)"
gpt_data=()
if [ -n "${GPT_DATA:-}" ]; then
  gpt_data=(--data "$GPT_DATA"); corpus_note="--data $GPT_DATA"
elif [ ! -e "$DEFAULT_CORPUS" ] && [ -d "$staged_corpus" ]; then
  if mkdir -p "$(dirname "$DEFAULT_CORPUS")" 2>/dev/null && ln -s "$staged_corpus" "$DEFAULT_CORPUS" 2>/dev/null; then
    corpus_note="$DEFAULT_CORPUS, linked to the staged $staged_corpus"
  else
    gpt_data=(--data "$staged_corpus"); corpus_note="--data $staged_corpus (could not link it to $DEFAULT_CORPUS)"
  fi
fi

# --- 0. a build carried from here (stage prebuilt) ------------------------------------------------
# With 15 device-minutes a session, building on the GPU machine costs too much of them: build
# build/gpu here (docs/gpu.md, "Running the GPU checks") and carry it. Its CMake files name this
# checkout's absolute path, so where the GPU machine's copy sits elsewhere that path is linked to
# it (ctest reads its CTestTestfile.cmake with those paths), and the shared libraries the
# executables were linked against here (cuBLAS, NCCL) are looked for in the CUDA toolkit and the
# Python packages there and put on LD_LIBRARY_PATH.
stage_prebuilt() {
  t0=$(date +%s)
  local note="" src
  src=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$BUILD_DIR/CMakeCache.txt" 2>/dev/null)
  if [ -z "$src" ]; then record prebuilt 1 0 "no $BUILD_DIR/CMakeCache.txt: carry the build folder"; build_ok=0; return; fi
  if [ "$(readlink -f "$src")" != "$(readlink -f "$root")" ]; then
    if [ -e "$src" ]; then record prebuilt 1 0 "$src (the build's source) exists here and is not this checkout"; build_ok=0; return; fi
    mkdir -p "$(dirname "$src")" && ln -s "$root" "$src" && note="linked $src to $root"
  fi
  # ctest runs the example tests through the cmake that configured the build (CMAKE_COMMAND).
  local cm
  cm=$(sed -n 's/^CMAKE_COMMAND:INTERNAL=//p' "$BUILD_DIR/CMakeCache.txt")
  if [ -n "$cm" ] && [ ! -e "$cm" ] && command -v cmake >/dev/null 2>&1; then
    mkdir -p "$(dirname "$cm")" && ln -s "$(command -v cmake)" "$cm" && note="$note; linked $cm to $(command -v cmake)"
  fi
  local dirs=() missing
  while IFS= read -r d; do [ -n "$d" ] && dirs+=("$d"); done < <(
    ls -d "$cuda_home"/lib64 "$cuda_home"/targets/*/lib 2>/dev/null
    pip_nccl_dirs | sed 's|$|/lib|')
  local exes
  exes=$(find "$BUILD_DIR" -path "$work" -prune -o -type f -perm -u+x \( -name 'test_*' -o -name 'train_*' \) -print)
  for exe in $exes; do
    for lib in $(ldd "$exe" 2>/dev/null | awk '/not found/ {print $1}'); do
      for d in "${dirs[@]}"; do
        if [ -e "$d/$lib" ]; then
          case ":${LD_LIBRARY_PATH:-}:" in *":$d:"*) ;; *) LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; note="$note; $lib from $d" ;; esac
          break
        fi
      done
    done
  done
  # cuDNN is not linked but loaded when --attention cudnn asks for it (dlopen of libcudnn.so.9,
  # gpt/cuda/attention_cudnn.cpp): ldd cannot name it, so look for it by name.
  # (grep without -q reads ldconfig's whole list: -q would stop at the match, and under pipefail
  # ldconfig's SIGPIPE would make the pipeline fail at random.)
  if ! ldconfig -p 2>/dev/null | grep 'libcudnn[.]so[.]9 ' >/dev/null; then
    for d in "${dirs[@]}"; do
      if [ -e "$d/libcudnn.so.9" ]; then
        case ":${LD_LIBRARY_PATH:-}:" in *":$d:"*) ;; *) LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; note="$note; libcudnn.so.9 from $d" ;; esac
        break
      fi
    done
  fi
  export LD_LIBRARY_PATH
  nccl_first
  missing=$(for exe in $exes; do ldd "$exe" 2>/dev/null | awk '/not found/ {print $1}'; done | sort -u | paste -sd, -)
  record prebuilt "$([ -z "$missing" ] && echo 0 || echo 1)" $(($(date +%s) - t0)) "${note#; }${missing:+; still missing: $missing}"
}

# --- 1. the machine ----------------------------------------------------------------------------
stage_env() {
  t0=$(date +%s)
  {
    echo "# gpu-check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname 2>/dev/null || cat /proc/sys/kernel/hostname) ($(uname -srm)), $(nproc) cores"
    echo "# commit: $(git rev-parse HEAD 2>/dev/null || echo '?')"; git status --short 2>/dev/null | head -50
    echo; echo "# nvidia-smi"; timeout 30 nvidia-smi 2>&1
    timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit --format=csv 2>&1
    echo; echo "# nvcc ($(command -v nvcc || echo 'not found'); CUDA_HOME $cuda_home)"; nvcc --version 2>&1
    echo; echo "# cmake: $(command -v cmake || echo 'not found')"; cmake --version 2>&1 | head -1
    echo "# ninja: $(command -v ninja || echo 'not found') $(ninja --version 2>/dev/null)"
    echo "# c++: $(c++ --version 2>&1 | head -1)"
    echo "# compute-sanitizer: ${sanitizer:-not found} $([ -n "$sanitizer" ] && "$sanitizer" --version 2>&1 | tail -1)"
    echo "# NCCL: ${nccl_lib:-not found} (from ${nccl_from:-nowhere}); include ${nccl_inc:-?}"
    [ -n "$nccl_inc" ] && echo "# NCCL version (nccl.h): $(sed -nE 's/^#define NCCL_(MAJOR|MINOR|PATCH) +([0-9]+).*/\2/p' "$nccl_inc/nccl.h" | paste -sd. -)"
    echo "# NCCL loaded at run time: ${nccl_loaded:-none}; the tests' executable finds $(ldd "$(exe_of test_nccl_ranks)" 2>/dev/null | awk '/libnccl/ {print $3}')"
    echo "# LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
    # cuDNN's frontend loads a cudart of its own, 12 before 13 where both are found
    # (gpt/cuda/attention_cudnn.cpp points it at 13 where that loads): which ones the loader finds.
    local d cudarts="" ld=${LD_LIBRARY_PATH:-}
    for d in ${ld//:/ }; do cudarts="$cudarts $(ls "$d"/libcudart.so.1[23] 2>/dev/null | paste -sd' ')"; done
    echo "# libcudart.so.12/13 on LD_LIBRARY_PATH:${cudarts:- none}; in ldconfig: $(ldconfig -p 2>/dev/null | awk '/libcudart.so.1[23] / {print $NF}' | paste -sd' ')"
    # The Python packages the peers and cuDNN come from, by their metadata (no import: torch's
    # takes seconds); gcc, which torch.compile's Triton needs to build its launcher.
    echo "# python3: $(command -v python3 || echo 'not found') $(timeout 20 python3 -c '
from importlib.metadata import version
for p in ("torch", "triton", "nvidia-cudnn-cu13", "nvidia-nccl-cu13"):
    try: print(p, version(p), end="; ")
    except Exception: print(p, "absent", end="; ")' 2>/dev/null)gcc: $(command -v gcc || echo 'not found')"
    echo "# GPT data: $corpus_note"
    echo; echo "# .gpu-deps"
    if [ -f "$root/.gpu-deps/MANIFEST.txt" ]; then cat "$root/.gpu-deps/MANIFEST.txt"; else echo "missing: run scripts/gpu-deps.sh here and carry .gpu-deps"; fi
  } 2>&1 | tee "$OUT/env.txt"
  record env 0 $(($(date +%s) - t0)) "${nccl_lib:+NCCL from $nccl_from}${nccl_loaded:+; loaded: ${nccl_loaded##*/}}"
}

# --- 2. configure and build --------------------------------------------------------------------
build_ok=1
stage_configure() {
  gen=()
  if command -v ninja >/dev/null 2>&1 && { [ ! -f "$BUILD_DIR/CMakeCache.txt" ] || grep -q '^CMAKE_GENERATOR:INTERNAL=Ninja$' "$BUILD_DIR/CMakeCache.txt"; }; then
    gen=(-G Ninja)
  fi
  # Google Benchmark only where a CMake package of it is installed; MPI and LibTorch are not part
  # of these checks (none on the GPU machine; PyTorch's pip package has a Torch CMake config
  # that must not stand in for LibTorch).
  bench=OFF
  if ls -d /usr/lib/cmake/benchmark /usr/lib/*/cmake/benchmark /usr/local/lib*/cmake/benchmark >/dev/null 2>&1; then bench=ON; fi
  prefix=()
  if [ -d "$root/.gpu-deps" ]; then prefix=("-DCMAKE_PREFIX_PATH=$root/.gpu-deps"); else echo "gpu-check: no .gpu-deps (run scripts/gpu-deps.sh here, carry .gpu-deps)" | tee -a "$OUT/build.log"; fi
  cuda_compiler=()
  if command -v nvcc >/dev/null 2>&1; then cuda_compiler=("-DCMAKE_CUDA_COMPILER=$(command -v nvcc)"); fi
  run_logged configure "$CONFIGURE_TIMEOUT" "$OUT/build.log" \
    cmake -S "$root" -B "$BUILD_DIR" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_FLAGS=-lineinfo \
      -DFSDP_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 "${cuda_compiler[@]}" -DFSDP_WERROR=ON \
      -DFSDP_BUILD_TESTS=ON -DFSDP_BUILD_EXAMPLES=ON -DFSDP_BUILD_BENCH=$bench \
      -DFSDP_MPI=OFF -DFSDP_LIBTORCH=OFF "${prefix[@]}" "${nccl_args[@]}"
  [ "${stage_codes[-1]}" = 0 ] || build_ok=0
}

built_targets=()
stage_build() {
  if [ "$build_ok" = 1 ] && [ -f "$BUILD_DIR/CMakeCache.txt" ]; then
    known=$(cmake --build "$BUILD_DIR" --target help 2>/dev/null)
    missing=()
    for t in $TEST_TARGETS $EXAMPLE_TARGETS; do
      if grep -qE "^(\.\.\. )?$t(: |$)" <<<"$known"; then built_targets+=("$t"); else missing+=("$t"); fi
    done
    [ ${#missing[@]} -eq 0 ] || echo "gpu-check: not targets of this build (skipped): ${missing[*]}" | tee -a "$OUT/build.log"
    keep_going=()   # build every target that compiles, not only those before the first error
    if grep -q '^CMAKE_GENERATOR:INTERNAL=Ninja$' "$BUILD_DIR/CMakeCache.txt"; then keep_going=(-- -k 0); else keep_going=(-- -k); fi
    if [ ${#built_targets[@]} -gt 0 ]; then
      run_logged build "$BUILD_TIMEOUT" "$OUT/build.log" \
        cmake --build "$BUILD_DIR" -j "$JOBS" --target "${built_targets[@]}" "${keep_going[@]}"
      stage_notes[-1]="${stage_notes[-1]:+${stage_notes[-1]}; }${built_targets[*]}${missing[*]:+ (not targets: ${missing[*]})}"
    else
      record build skip 0 "none of the targets is known to CMake"
    fi
  else
    record build skip 0 "configure failed"
  fi
}
# What the GPU machine needs of a build made here is its executables and CMake's test files: its
# object files (23 of build/gpu's 48 MiB on 2026-11-29) are deleted, so that it fits the 64 MiB a
# device call carries beside the repository, .gpu-deps, build/llmc and build/nccl. (The next build
# here compiles everything again.)
stage_prune() {
  t0=$(date +%s)
  local before after i
  # After a failed build its object files are what the next try resumes from: kept.
  for i in "${!stage_names[@]}"; do
    if [ "${stage_names[$i]}" = build ] && [ "${stage_codes[$i]}" != 0 ]; then
      record prune skip 0 "the build failed: its object files kept for the next try"
      return
    fi
  done
  before=$(du -sm "$BUILD_DIR" 2>/dev/null | cut -f1)
  find "$BUILD_DIR" -name '*.o' -type f -delete 2>/dev/null
  after=$(du -sm "$BUILD_DIR" 2>/dev/null | cut -f1)
  record prune 0 $(($(date +%s) - t0)) "$BUILD_DIR: ${before:-?} MiB, ${after:-?} MiB without object files"
}
exe_of() {  # exe_of TARGET: the built executable's path (empty when not built)
  find "$BUILD_DIR" -path "$work" -prune -o -type f -name "$1" -perm -u+x -print 2>/dev/null | head -1
}

# --- 3. the tests of label cuda ----------------------------------------------------------------
stage_ctest() {
  t=$(bounded "$CTEST_TIMEOUT")
  stop=()
  # --stop-time lets ctest end the tests itself and still write the JUnit file.
  if [ "$t" -gt 20 ]; then stop=(--stop-time "$(date -d "@$(($(date +%s) + t - 10))" +%H:%M:%S)"); fi
  run_logged ctest "$CTEST_TIMEOUT" "$OUT/tests.log" \
    ctest --test-dir "$BUILD_DIR" -L cuda --output-on-failure -j "$CTEST_JOBS" --output-junit "$work/junit.xml" "${stop[@]}"
  # ctest's count and the names of the tests that failed, for the summary.
  line=$(grep -E 'tests passed, [0-9]+ tests failed out of' "$OUT/tests.log" | tail -1)
  failed_tests=$(sed -n '/^The following tests FAILED:/,/^Errors while running CTest/p' "$OUT/tests.log" |
                 grep -E '^[[:space:]]+[0-9]+ - ' | sed -E 's/^[[:space:]]+[0-9]+ - //' | paste -sd, - | cut -c1-200)
  stage_notes[-1]="${stage_notes[-1]:+${stage_notes[-1]}; }${line:-no ctest result line}${failed_tests:+; failed: $failed_tests}"
}

# --- 3b. each test executable run directly (stage direct) -----------------------------------------
# ctest knows the doctest cases that were listed when the executable was built: on a machine
# without a GPU (a build carried from here) that is only the no-device cases, since the GPU cases
# are marked skip there. Run directly on the GPU machine, an executable runs every case that
# applies there; --duration prints each case's time and name.
stage_direct() {
  : >>"$OUT/tests.log"
  for t in $TEST_TARGETS; do
    exe=$(exe_of "$t")
    if [ -z "$exe" ]; then record "run:$t" skip 0 "not built"; continue; fi
    run_dir=$(dirname "$exe")
    local before
    before=$(wc -l <"$OUT/tests.log")
    # Line-buffered, so that a test killed at the timeout leaves what it printed; thread ranks of
    # test_nccl_ranks need every kernel loaded at start (common/nccl_thread_ranks.hpp).
    local stdbuf=() loading=()
    command -v stdbuf >/dev/null 2>&1 && stdbuf=(stdbuf -oL -eL)
    [ "$t" = test_nccl_ranks ] && loading=(env CUDA_MODULE_LOADING=EAGER)
    run_logged "run:$t" "$DIRECT_TIMEOUT" "$OUT/tests.log" "${loading[@]}" "${stdbuf[@]}" "$exe" --duration=true
    run_dir=""
    line=$(tail -n +"$((before + 1))" "$OUT/tests.log" | grep -E '^\[doctest\] test cases:' | tail -1 | tr -s ' ')
    stage_notes[-1]="${stage_notes[-1]:+${stage_notes[-1]}; }${line:-no doctest summary}"
  done
}

# --- 4. compute-sanitizer ----------------------------------------------------------------------
stage_sanitize() {
  san_end=$(($(date +%s) + SANITIZE_BUDGET))
  : >>"$OUT/sanitizer.log"
  for t in $SANITIZE_TARGETS; do
    exe=$(exe_of "$t")
    if [ -z "$exe" ]; then
      echo "### $t: not built" >>"$OUT/sanitizer.log"
      continue
    fi
    for tool in $SANITIZE_TOOLS; do
      name="$tool:$t"
      if [ -z "$sanitizer" ]; then record "$name" 127 0 "compute-sanitizer not found"; continue; fi
      l=$((san_end - $(date +%s)))
      if [ "$l" -lt 5 ]; then record "$name" skip 0 "no time left in SANITIZE_BUDGET=$SANITIZE_BUDGET"; continue; fi
      [ "$l" -lt "$SANITIZE_TIMEOUT" ] || l=$SANITIZE_TIMEOUT
      extra=()
      [ "$tool" = memcheck ] && read -r -a extra <<<"$MEMCHECK_ARGS"
      read -r -a targs <<<"$SANITIZE_TEST_ARGS"
      # In the executable's folder, as ctest runs it; --error-exitcode 99 tells a sanitizer
      # report apart from a failing test (1). The full report goes to sanitizer.log only.
      run_dir=$(dirname "$exe")
      before=$(wc -l <"$OUT/sanitizer.log")
      run_logged "$name" "$l" "$OUT/sanitizer.log" \
        "$sanitizer" --tool "$tool" "${extra[@]}" --error-exitcode 99 --print-limit 50 "$exe" "${targs[@]}" >/dev/null
      run_dir=""
      summary_line=$(tail -n +"$((before + 1))" "$OUT/sanitizer.log" | grep -E '^=+ (ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY)' | tail -1)
      [ -z "$summary_line" ] || stage_notes[-1]="${stage_notes[-1]:+${stage_notes[-1]}; }${summary_line#*= }"
      if [ "$tool" = memcheck ] && [ "${stage_codes[-1]}" = 99 ]; then
        # NCCL's own start-up (seen with the pip package nvidia-nccl-cu13) probes each of its kernels
        # with cudaFuncGetAttributes and clears the "no kernel image" error of those not built for
        # this GPU; memcheck reports each such API error. When every report is one of those (and
        # all were printed), the run found nothing in fsdp: it counts as passed, with a note.
        local total probe
        total=$(grep -oE 'ERROR SUMMARY: [0-9]+' <<<"$summary_line" | grep -oE '[0-9]+$')
        probe=$(tail -n +"$((before + 1))" "$OUT/sanitizer.log" | awk '
          /^========= [A-Z]/ && !/COMPUTE-SANITIZER|SUMMARY/ { hdr = $0; first = 1; next }
          /Host Frame:/ && first { first = 0
            if (hdr ~ /cudaErrorNoKernelImageForDevice/ && $0 ~ /ncclInitKernelsForDevice/) n++ }
          END { print n + 0 }')
        if [ -n "$total" ] && [ "$total" -gt 0 ] && [ "$probe" = "$total" ]; then
          stage_codes[-1]=0
          stage_notes[-1]="${stage_notes[-1]}; all $total are NCCL's kernel probe (ncclInitKernelsForDevice), none in fsdp"
        fi
      fi
    done
  done
}

# --- 4b. where a GPT step's GPU time goes (stage profile) -----------------------------------------
# Two views of a one-rank GPT run, both into profile.txt: train_gpt's own --kernel-times (CUPTI's
# activity records, what PyTorch's profiler reads: each kernel timed where it ran, grouped by owner
# -- model, cuBLAS, cuDNN, fsdp, NCCL -- over steps 2..PROFILE_STEPS + 1; it works on the gVisor
# machines, where Nsight Compute reads no counters), then Nsight Compute where it is there: every
# kernel of PROFILE_STEPS steps replayed alone (one metric, gpu__time_duration, so one replay pass
# each; clocks left alone), the time summed per kernel name, largest first (the per-kernel CSV
# stays in the work folder: at most 8 files come back).
PROFILE_STEPS=${PROFILE_STEPS:-2}
PROFILE_KERNELS=${PROFILE_KERNELS:-3000}
PROFILE_TIMEOUT=${PROFILE_TIMEOUT:-150}
# train_gpt's switches for the profiled run, e.g. "--attention cudnn" (issue 36: where the time
# goes with cuDNN's attention and the fused elementwise passes: "--attention cudnn --elementwise fused").
PROFILE_ARGS=${PROFILE_ARGS:-}
PROFILE_NCU=${PROFILE_NCU:-1}   # 0: CUPTI's table only (Nsight Compute's replay takes up to PROFILE_TIMEOUT)
stage_profile() {
  local ncu gpt
  ncu=$(command -v ncu 2>/dev/null || ls "$cuda_home"/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  gpt=$(exe_of train_gpt_cuda)
  if [ -z "$gpt" ]; then record profile skip 0 "train_gpt_cuda: not built"; return; fi
  read -r -a model <<<"$GPT_MODEL"
  read -r -a profile_args <<<"$PROFILE_ARGS"
  run_dir=$work
  rm -f "$work/kernel_times.log"  # a warm machine's earlier call left one
  run_logged kernel_times "$GPT_TIMEOUT" "$work/kernel_times.log" "$gpt" --device cuda --ranks 1 "${model[@]}" --batch "$B_PER_RANK" \
    --steps $((PROFILE_STEPS + 1)) --precision bf16 --eval-every 0 "${gpt_data[@]}" "${profile_args[@]}" --kernel-times >/dev/null
  # The table (up to run_logged's "### ... exit" line), or the run's last lines where it failed.
  local cupti_note="no CUPTI table"
  {
    echo "# train_gpt_cuda --kernel-times (CUPTI), one rank, $PROFILE_ARGS"
    if grep -q '^GPU time: ' "$work/kernel_times.log" 2>/dev/null; then
      sed -n '/^GPU time: /,/^### /{/^### /!p}' "$work/kernel_times.log"
      cupti_note=$(grep -m1 '^GPU time: ' "$work/kernel_times.log")
    else
      echo "(no table: the run failed or was skipped; its last lines:)"
      tail -n 15 "$work/kernel_times.log" 2>/dev/null
    fi
    echo
  } >"$OUT/profile.txt"
  [ "${stage_names[-1]}" = kernel_times ] && stage_notes[-1]="${stage_notes[-1]:+${stage_notes[-1]}; }$cupti_note"
  if [ "$PROFILE_NCU" = 0 ]; then run_dir=""; return; fi
  if [ -z "$ncu" ]; then record profile skip 0 "ncu: not found"; run_dir=""; return; fi
  rm -f "$work/profile.csv"  # a warm machine's earlier call left one: never report it as this run's
  run_logged profile "$PROFILE_TIMEOUT" "$work/profile.log" "$ncu" --csv --metrics gpu__time_duration.sum \
    --clock-control none -c "$PROFILE_KERNELS" --log-file "$work/profile.csv" \
    "$gpt" --device cuda --ranks 1 "${model[@]}" --batch "$B_PER_RANK" --steps "$PROFILE_STEPS" --precision bf16 \
    --eval-every 0 "${gpt_data[@]}" "${profile_args[@]}" >/dev/null
  run_dir=""
  if [ ! -s "$work/profile.csv" ]; then echo "# Nsight Compute: no profile (skipped for time, or failed: $work/profile.log)" >>"$OUT/profile.txt"; return; fi
  echo "# Nsight Compute, each kernel replayed alone" >>"$OUT/profile.txt"
  python3 - "$work/profile.csv" >"$work/profile_ncu.txt" <<'EOF'
import csv, sys, collections
scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}
rows = [l for l in open(sys.argv[1], errors="replace") if l.startswith('"')]
total, count, n = collections.Counter(), collections.Counter(), 0
for r in csv.DictReader(rows):
    if r.get("Metric Name") != "gpu__time_duration.sum": continue
    name = r["Kernel Name"].split("(")[0][:90]
    total[name] += float(r["Metric Value"].replace(",", "")) * scale.get(r["Metric Unit"], 1.0)
    count[name] += 1; n += 1
all_us = sum(total.values())
print(f"{n} kernels, {all_us / 1e3:.2f} ms of GPU time in all")
print(f"{'ms':>9} {'share':>6} {'calls':>6}  kernel")
for k, v in total.most_common():
    print(f"{v / 1e3:9.3f} {100 * v / all_us:5.1f}% {count[k]:6d}  {k}")
EOF
  cat "$work/profile_ncu.txt" >>"$OUT/profile.txt"
  stage_notes[-1]="${stage_notes[-1]:+${stage_notes[-1]}; }$(head -1 "$work/profile_ncu.txt")"
}

# --- 5. the GPT on 1..8 ranks of the GPU (stages gpt, nccl, ab) ----------------------------------
# gpt_run NAME RANKS SHARDING STEPS [ARGS...]: one train_gpt run, its log appended to gpt.log and
# its last throughput line in the summary; the full-sharding run with GPT_TRACE_RANKS ranks of
# stage gpt writes the trace.
gpt_run() {
  local name=$1 r=$2 sh=$3 steps=$4; shift 4
  local gpt; gpt=$(exe_of train_gpt)
  if [ -z "$gpt" ]; then record "$name" skip 0 "train_gpt not built"; return; fi
  read -r -a model <<<"$GPT_MODEL"
  local log=$work/$name.log stdbuf=()
  : >"$log"
  command -v stdbuf >/dev/null 2>&1 && stdbuf=(stdbuf -oL -eL)
  run_dir=$work
  run_logged "$name" "$GPT_TIMEOUT" "$log" "${stdbuf[@]}" "$gpt" --device cuda --ranks "$r" \
    "${model[@]}" --batch $((B_PER_RANK * r)) --steps "$steps" --precision bf16 --sharding "$sh" \
    --eval-every 0 "${gpt_data[@]}" "$@"
  run_dir=""
  local last
  last=$(grep -E 'after the first step' "$log" | tail -1 | tr -s ' ' | cut -c1-110)
  [ -n "$last" ] || last=$(grep -E 'tok(ens)?/s' "$log" | tail -1 | tr -s ' ' | cut -c1-110)
  [ -z "$last" ] || stage_notes[-1]="${stage_notes[-1]:+${stage_notes[-1]}; }$last"
  { echo "### $name: $*"; cat "$log"; } >>"$OUT/gpt.log"
}
gpt_runs_of() {  # the RANKS:SHARDING list: GPT_RUNS, else every GPT_RANKS x GPT_SHARDINGS
  local runs=$GPT_RUNS
  if [ -z "$runs" ]; then for r in $GPT_RANKS; do for sh in $GPT_SHARDINGS; do runs="$runs $r:$sh"; done; done; fi
  echo $runs
}
stage_gpt() {
  read -r -a extra <<<"$GPT_EXTRA_ARGS"
  for run in $(gpt_runs_of); do
    local r=${run%%:*} sh=${run#*:} trace=()
    if [ "$r" = "$GPT_TRACE_RANKS" ] && [ "$sh" = full ]; then trace=(--trace "$OUT/trace_gpu_${r}ranks.json"); fi
    gpt_run "gpt_${r}_${sh}" "$r" "$sh" "$S" "${trace[@]}" "${extra[@]}"
  done
}
# The same GPT on NCCL ranks (--backend nccl; docs/gpu.md): NCCL_RUNS as RANKS:SHARDING, each rank
# a process on the GPU (NCCL over sockets, slow), or RANKS:SHARDING:threads, each rank a thread of
# one process (--nccl-ranks threads: NCCL 2.30's ranks sharing the GPU, with NCCL_BUILT's NCCL);
# a last :registered gives the groups' buffers from NCCL's registered memory (--nccl-buffers
# registered: zero-copy collectives), beside the same run without; NCCL_STEPS steps each.
NCCL_RUNS=${NCCL_RUNS:-"2:full 2:none 4:full 4:none"}
NCCL_STEPS=${NCCL_STEPS:-8}
NCCL_EXTRA_ARGS=${NCCL_EXTRA_ARGS:-}   # not GPT_EXTRA_ARGS: the NCCL runs measure the transport on the kernels run before
stage_nccl() {
  read -r -a extra <<<"$NCCL_EXTRA_ARGS"
  local run r sh how buffers
  for run in $NCCL_RUNS; do
    how=processes buffers=pool
    case $run in *:registered) buffers=registered; run=${run%:registered} ;; esac
    case $run in *:threads) how=threads; run=${run%:threads} ;; *:processes) run=${run%:processes} ;; esac
    r=${run%%:*} sh=${run#*:}   # the sharding may hold a colon itself (hybrid:2)
    [ "$buffers" = pool ] || nccl_reg_log begin
    gpt_run "gpt_nccl_${r}_${sh/:/}$([ "$how" = threads ] && echo _threads)$([ "$buffers" = registered ] && echo _registered)" \
      "$r" "$sh" "$NCCL_STEPS" --backend nccl --nccl-ranks "$how" --nccl-buffers "$buffers" "${extra[@]}"
    [ "$buffers" = pool ] || nccl_reg_log end
  done
}
# nccl_reg_log begin|end: around a registered run, NCCL's REG log into files of $work (one line a
# buffer per collective: too many for gpt.log), then what they say in the note and gpt.log: how
# many buffers NCCL mapped for a peer (zero-copy), found mapped already, or failed to map (NCCL
# then copies as without registration). The caller's NCCL_DEBUG settings are put back.
nccl_reg_saved=()
nccl_reg_log() {
  local v
  if [ "$1" = begin ]; then
    nccl_reg_saved=()
    for v in NCCL_DEBUG NCCL_DEBUG_SUBSYS NCCL_DEBUG_FILE; do nccl_reg_saved+=("$v=${!v-}"); done
    rm -f "$work"/nccl_reg.*
    export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=REG NCCL_DEBUG_FILE="$work/nccl_reg.%p"
    return
  fi
  for v in "${nccl_reg_saved[@]}"; do
    if [ -n "${v#*=}" ]; then export "$v"; else unset "${v%%=*}"; fi
  done
  local files=("$work"/nccl_reg.*) counts
  [ -e "${files[0]}" ] || files=(/dev/null)
  counts="NCCL registrations: $(cat "${files[@]}" | grep -c 'IPC register buffer') mapped for a peer, $(cat "${files[@]}" |
    grep -c 'IPC reuse buffer') reused, $(cat "${files[@]}" | grep -c 'failed to IPC register') failed"
  stage_notes[-1]="${stage_notes[-1]:+${stage_notes[-1]}; }$counts"
  { echo "$counts"; cat "${files[@]}" | grep ' NCCL WARN ' | head -20; } >>"$OUT/gpt.log"  # NCCL's warnings went to the files too
}
# A/B of train_gpt's GPU switches in one binary, on the same machine: AB_ROUNDS rounds, each
# running every variant of AB_VARIANTS (separated by ';', "" the defaults) in turn at AB_RANKS
# ranks, full sharding, S steps; compare the "after the first step" tokens/s of each row.
# The defaults' A/B (issue 36): cuDNN's attention; the fused elementwise passes; both; cuDNN with
# cuBLASLt's epilogues; both with recomputation at 4x the batch (16 sequences a rank at AB_RANKS=4:
# the last --batch wins).
AB_VARIANTS=${AB_VARIANTS:-"; --attention cudnn; --elementwise fused; --attention cudnn --elementwise fused; --attention cudnn --elementwise cublaslt; --attention cudnn --elementwise fused --attention-backward nondeterministic; --attention cudnn --elementwise fused --recompute --batch 64; --comm-priority normal; --device-timing off; --clip-pass separate; --low-precision-shard keep"}
AB_RANKS=${AB_RANKS:-4}
AB_ROUNDS=${AB_ROUNDS:-2}
stage_ab() {
  local variants=() v round i
  IFS=';' read -r -a variants <<<"$AB_VARIANTS"
  for round in $(seq 1 "$AB_ROUNDS"); do
    for i in "${!variants[@]}"; do
      read -r -a v <<<"${variants[$i]}"
      gpt_run "ab${round}_v${i}" "$AB_RANKS" full "$S" "${v[@]}"
      stage_notes[-1]="[${variants[$i]:-defaults}] ${stage_notes[-1]}"
    done
  done
}

# --- 5b. the peers and the 200-step loss curves (stages peer, llmc, curve) -----------------------
# bench/gpt_torch.py: the same GPT in PyTorch (SDPA's flash attention, bf16 autocast, the fused
# AdamW; the same initial values, batches and schedule), on the GPU image's own PyTorch, at the
# GPT shape and one rank's batch: the peer issue 36 measures train_gpt against, in the same call.
# PEER_VARIANTS: the runs, ';'-separated, each the options it adds (" " alone: eager only); the
# default runs train_gpt's model eager, llm.c's (GPT-2's padded vocabulary; stage llmc) compiled,
# then train_gpt's compiled (torch.compile: about a minute each).
PEER_VARIANTS=${PEER_VARIANTS:-"; --vocab 50304 --compile; --compile"}
PEER_TIMEOUT=${PEER_TIMEOUT:-150}
torch_ok=""
have_torch() {  # whether python3 imports a torch that sees the GPU (asked once: the import takes seconds)
  [ -n "$torch_ok" ] || { timeout 60 python3 -c 'import torch; assert torch.cuda.is_available()' >/dev/null 2>&1 && torch_ok=1 || torch_ok=0; }
  [ "$torch_ok" = 1 ]
}
py_run() {  # py_run NAME SCRIPT [ARGS...]: a peer's Python script, its log into gpt.log, its speed in the note
  local name=$1; shift
  local log=$work/$name.log
  : >"$log"
  # PyTorch keeps its own NCCL: NCCL_BUILT's has only fsdp's reductions (scripts/build-nccl.sh),
  # and a reduction it lacks would do nothing, so its folder is left off the peers' library path.
  run_logged "$name" "$PEER_TIMEOUT" "$log" env LD_LIBRARY_PATH="$(ld_without_built)" python3 -u "$@"
  local last
  last=$(sed -nE 's/^model FLOPs utilisation: ([0-9.]+)% .* x ([0-9]+) tokens\/s\); llm.c.s count .*: ([0-9.]+)%$/\2 tokens\/s after the first step; MFU \1% (6 N), \3% (llm.c)/p' "$log" | tail -1)
  [ -z "$last" ] || stage_notes[-1]="${stage_notes[-1]:+${stage_notes[-1]}; }$last"
  { echo "### $name: $*"; cat "$log"; } >>"$OUT/gpt.log"
}
peer_run() {  # peer_run NAME STEPS [ARGS...]: bench/gpt_torch.py at the GPT shape and one rank's batch
  local name=$1 steps=$2; shift 2
  read -r -a model <<<"$GPT_MODEL"
  py_run "$name" bench/gpt_torch.py --device cuda --precision bf16 "${model[@]}" --batch "$B_PER_RANK" --steps "$steps" \
    "${gpt_data[@]}" "$@"
}
stage_peer() {
  if ! have_torch; then record peer skip 0 "python3 cannot import torch with CUDA"; return; fi
  local variants=() v i
  IFS=';' read -r -a variants <<<"$PEER_VARIANTS"
  for i in "${!variants[@]}"; do
    read -r -a v <<<"${variants[$i]}"
    peer_run "peer_v${i}" "$S" "${v[@]}"
    stage_notes[-1]="[${v[*]:-eager}] ${stage_notes[-1]}"
  done
}
# FSDP2 and DDP on the same NCCL ranks (issue 35: "FSDP2 and Megatron-FSDP are the bar"):
# bench/gpt_torch.py --ranks R, each rank a process on the GPU with its own NCCL_HOSTID, as the
# nccl stage runs train_gpt --backend nccl: FSDP2_RUNS as RANKS:SHARDING (full and grad_op are
# FSDP2's fully_shard, none is DDP), NCCL_STEPS steps, one rank's batch B_PER_RANK sequences.
# (A run of NCCL_RUNS on thread ranks has no FSDP2 peer: PyTorch's ranks are processes; nor has a
# registered one: the peer's is the pool run's.)
FSDP2_RUNS=${FSDP2_RUNS:-$(for run in $NCCL_RUNS; do case $run in *:threads | *:registered) ;; *) echo "${run%:processes}" ;; esac; done | paste -sd' ' -)}
stage_fsdp2() {
  if ! have_torch; then record fsdp2 skip 0 "python3 cannot import torch with CUDA"; return; fi
  read -r -a model <<<"$GPT_MODEL"
  local run r sh
  for run in $FSDP2_RUNS; do
    r=${run%%:*} sh=${run#*:}
    py_run "fsdp2_${r}_${sh}" bench/gpt_torch.py --device cuda --precision bf16 "${model[@]}" --ranks "$r" --sharding "$sh" \
      --batch $((B_PER_RANK * r)) --steps "$NCCL_STEPS" "${gpt_data[@]}"
  done
}
# llm.c's own GPT-2 on the same GPU (issue 36's moonshot): bench/llmc_peer.py runs a train_gpt2cu
# built from llm.c by whoever prepares the call (nothing of llm.c is in this repository; docs/gpu.md)
# at each of LLMC_BATCHES sequences of 1024 tokens, S steps, and reports it as train_gpt reports.
LLMC_BIN=${LLMC_BIN:-$root/build/llmc/train_gpt2cu}
LLMC_BATCHES=${LLMC_BATCHES:-"4 64"}
LLMC_ARGS=${LLMC_ARGS:-}
stage_llmc() {
  if [ ! -x "$LLMC_BIN" ]; then record llmc skip 0 "no llm.c train_gpt2cu at $LLMC_BIN"; return; fi
  local missing b
  missing=$(ldd "$LLMC_BIN" 2>/dev/null | awk '/not found/ {print $1}' | paste -sd, -)
  [ -z "$missing" ] || echo "gpu-check: llm.c's libraries not found: $missing" | tee -a "$OUT/gpt.log"
  for b in $LLMC_BATCHES; do
    py_run "llmc_b$b" bench/llmc_peer.py --exe "$LLMC_BIN" --batch "$b" --steps "$S" "${gpt_data[@]}" --llmc-args="$LLMC_ARGS"
    [ -z "$missing" ] || stage_notes[-1]="${stage_notes[-1]:+${stage_notes[-1]}; }not found: $missing"
  done
}
# CURVE_STEPS steps at one rank: the plain kernels (the reference), train_gpt's fast paths
# (CURVE_FAST_ARGS, ';'-separated: curve_fast1, curve_fast2, ...), and the PyTorch peer, the same
# data and initial values; scripts/loss_band.py then holds the others to the plain curve (20-step windows' medians within 0.05 nats: its docstring says where that band
# comes from). At the learning rate 1e-3: at the default 3e-3 the GPT-2-small shape spikes in its
# first steps (docs/gpu.md).
CURVE_STEPS=${CURVE_STEPS:-200}
CURVE_ARGS=${CURVE_ARGS:-"--lr 0.001"}
CURVE_FAST_ARGS=${CURVE_FAST_ARGS:-"--attention cudnn --elementwise fused; --attention cudnn --elementwise cublaslt"}
stage_curve() {
  local args fast variants=() curves=() i
  read -r -a args <<<"$CURVE_ARGS"
  IFS=';' read -r -a variants <<<"$CURVE_FAST_ARGS"
  rm -f "$work"/curve_*.csv
  gpt_run curve_plain 1 full "$CURVE_STEPS" "${args[@]}" --loss-csv "$work/curve_plain.csv"
  for i in "${!variants[@]}"; do
    read -r -a fast <<<"${variants[$i]}"
    gpt_run "curve_fast$((i + 1))" 1 full "$CURVE_STEPS" "${args[@]}" "${fast[@]}" --loss-csv "$work/curve_fast$((i + 1)).csv"
    [ -s "$work/curve_fast$((i + 1)).csv" ] && curves+=("$work/curve_fast$((i + 1)).csv")
  done
  if have_torch; then
    peer_run curve_torch "$CURVE_STEPS" "${args[@]}" --loss-csv "$work/curve_torch.csv"
    [ -s "$work/curve_torch.csv" ] && curves+=("$work/curve_torch.csv")
  fi
  if [ ! -s "$work/curve_plain.csv" ] || [ ${#curves[@]} -eq 0 ]; then record loss_band skip 0 "no curves to compare"; return; fi
  run_logged loss_band 30 "$OUT/gpt.log" python3 scripts/loss_band.py "$work/curve_plain.csv" "${curves[@]}"
  stage_notes[-1]="$(grep -E '^(within|OUTSIDE)' "$OUT/gpt.log" | tail -n ${#curves[@]} | sed -E 's/ against .*at most/: at most/; s/ \(steps.*//; s|[^ ]*/curve_||' | paste -sd';' -)"
}

# --- the stages, in the order STAGES names them ---------------------------------------------------
for st in $STAGES; do
  if declare -F "stage_$st" >/dev/null; then "stage_$st"; else record "$st" 2 0 "no such stage (prebuilt env configure build prune ctest direct sanitize profile gpt nccl ab peer fsdp2 llmc curve)"; fi
done

# --- 6. summary --------------------------------------------------------------------------------
# Files over 15 MiB would not come back (16 MiB each): a trace is compressed, a log keeps its
# first and last 7 MiB.
for f in "$OUT"/*; do
  [ -f "$f" ] || continue
  size=$(stat -c %s "$f")
  [ "$size" -gt $((15 * 1024 * 1024)) ] || continue
  case $f in
    *.json) gzip -9f "$f" && echo "gpu-check: $f was $size bytes: compressed to $f.gz" ;;
    *) { head -c $((7 * 1024 * 1024)) "$f"; printf '\n[... %s bytes cut by gpu-check ...]\n' "$size"; tail -c $((7 * 1024 * 1024)) "$f"; } >"$f.cut" && mv "$f.cut" "$f"
       echo "gpu-check: $f was $size bytes: its middle was cut" ;;
  esac
done
failed=0
for c in "${stage_codes[@]}"; do case $c in 0|skip) ;; *) failed=$((failed + 1)) ;; esac; done
{
  echo "gpu-check summary ($(date -u +%Y-%m-%dT%H:%M:%SZ), $(($(date +%s) - start)) s; build dir $BUILD_DIR)"
  printf '%-28s %-5s %6s  %s\n' stage exit secs note
  for i in "${!stage_names[@]}"; do
    printf '%-28s %-5s %6s  %s\n' "${stage_names[$i]}" "${stage_codes[$i]}" "${stage_secs[$i]}" "${stage_notes[$i]}"
  done
  echo "$failed stage(s) failed"
} | tee "$OUT/summary.txt"
[ "$failed" -eq 0 ]
