#!/usr/bin/env bash
# Fault injection: runs fault_run (tests/faults/fault_run.cpp) on 3 ranks, hurts rank 1 and checks
# every survivor's report: what it printed, how long after the fault, and the exit status.
#
#   inject.sh SCENARIO FAULT_RUN MPIEXEC
#
# Scenarios (the wait timeout, FSDP_TIMEOUT_MS, is short where a timeout is what must fire, and
# long where the survivors must hear of the fault without waiting it out):
# A rank that throws its own exception prints it; its peers hear "rank 1 failed: an exception left
# its shard_group" (the group's destructor tells them while the exception unwinds, before any
# handler can see it).
#   threads_throw   a thread rank throws            peers: peer_failure at once; world::run rethrows it
#   threads_leave   a thread rank returns early     peers: peer_failure at once
#   mpi_throw       a process throws                peers: peer_failure naming it within 2 s (timeout 30 s)
#   mpi_leave       a process returns early         peers: timeout within the 3 s timeout + 3 s;
#                   the ranks' flight records (scripts/fsdp-flight) name rank 1 as never arriving
#   threads_mismatch  a thread rank issues an all_reduce where its peers issue an all_gather:
#                   peers: mismatch at once; the flight records name the collective and the ranks
#   mpi_kill9       kill -9 of a process under mpiexec --enable-recovery, on the default timeout
#                   (300 s): peers: "rank 1 stopped answering" within 15 s (its heartbeats stop:
#                   comm/mpi/heartbeats.hpp). Open MPI 4.1 exits 0 under --enable-recovery
#                   whatever the ranks did; launched through scripts/fsdp-mpiexec, the job exits 1.
#                   The survivors' flight records name rank 1 as the one that left none.
#   mpi_kill9_plain the same without --enable-recovery: mpiexec ends the job at once, naming the
#                   killed rank, and exits non-zero
#   mpi_stop_8s     SIGSTOP for 8 s on the default timeout: a live but stopped rank is not taken
#                   for dead; the run finishes, exit 0
#   mpi_stop_short  SIGSTOP for 1.5 s, under a 6 s timeout: the run finishes, exit 0; the
#                   survivors' longest step spent under 0.1 s of CPU per second waiting (polling
#                   20 us apart all along, they spent 0.28: core/backoff.hpp)
#   mpi_stop_long   SIGSTOP past the 3 s timeout: peers: timeout within 3 s + 3 s; exit non-zero
# Prints "faults: SCENARIO: ok" and each survivor's delay, or "FAILED" and the whole output.
# (Open MPI's own mismatch is not a scenario: an all_reduce against an all_gather corrupted the
# odd rank's heap, which crashed before it could write its flight record.)
set -u
scenario=$1 prog=$2 mpiexec=$3
# mpi_stop_short's bound on a survivor's CPU per second of waiting: 0.1 for optimized builds
# (they use 0.04-0.06 here); scripts/test.sh gives ThreadSanitizer's build 0.2, as its
# instrumented polling costs more (0.07-0.11 measured here, 2026-11-27).
cpu_bound=${FSDP_FAULTS_CPU_BOUND:-0.1}
dir=$(mktemp -d)
out=$dir/out.txt
: > "$out"
job=
cleanup() {
  [ -n "$job" ] && kill -9 "$job" 2>/dev/null
  [ -f "$dir/rank1.pid" ] && kill -CONT "$(cat "$dir/rank1.pid")" 2>/dev/null
  rm -rf "$dir"
}
trap cleanup EXIT

fail() {
  echo "faults: $scenario: FAILED: $*"
  echo "--- output ---"
  cat "$out"
  exit 1
}
now() { date +%s.%N; }

# Starts the job in the background: $job, output in $out.
start() {
  timeout -k 5 60 "$@" > "$out" 2>&1 &
  job=$!
}
# Waits for the job; sets $rc.
finish() {
  wait "$job"
  rc=$?
  job=
}
# Waits (at most $1 s) for rank 1's pid file; prints the pid.
wait_pid() {
  local until=$((SECONDS + $1))
  while [ ! -f "$dir/rank1.pid" ]; do
    [ $SECONDS -ge $until ] && fail "rank 1 never reached its fault step"
    sleep 0.05
  done
  cat "$dir/rank1.pid"
}
# Waits (at most $1 s) until ranks 0 and 2 have each printed a "rank R at T:" line.
wait_reports() {
  local until=$((SECONDS + $1))
  while ! { grep -q "^rank 0 at " "$out" && grep -q "^rank 2 at " "$out"; }; do
    [ $SECONDS -ge $until ] && return
    sleep 0.05
  done
}
# The time rank 1 printed "injects ... at T".
injected_at() {
  sed -n 's/^rank 1 injects [a-z]* at \([0-9.]*\)$/\1/p' "$out" | head -n 1
}
# check_survivors T0 MAX_S REGEX: ranks 0 and 2 each printed "rank R at T: ..." matching REGEX,
# at most MAX_S seconds after T0.
check_survivors() {
  local t0=$1 max=$2 regex=$3 r line t delay
  [ -n "$t0" ] || fail "no injection time"
  for r in 0 2; do
    line=$(grep -m 1 "^rank $r at " "$out") || fail "rank $r reported nothing"
    echo "$line" | grep -Eq "$regex" || fail "rank $r's report does not match '$regex'"
    t=$(echo "$line" | sed 's/^rank [0-9]* at \([0-9.]*\):.*/\1/')
    delay=$(awk -v a="$t" -v b="$t0" 'BEGIN { printf "%.3f", a - b }')
    awk -v d="$delay" -v m="$max" 'BEGIN { exit !(d <= m) }' || fail "rank $r reported after $delay s (at most $max s)"
    echo "faults: $scenario: rank $r reported after $delay s: ${line#rank $r at $t: }"
  done
}

mpi=("$mpiexec" -n 3)
# stop_rank_1_then_finish SECONDS: stops rank 1 at its fault step for SECONDS, lets it go on, and
# checks that the 40-step run then finished on every rank with exit 0.
stop_rank_1_then_finish() {
  local pid r
  pid=$(wait_pid 30)
  kill -STOP "$pid"
  sleep "$1"
  kill -CONT "$pid"
  finish
  [ "$rc" -eq 0 ] || fail "exit status $rc, expected 0"
  for r in 0 1 2; do grep -q "^rank $r: finished 40 steps" "$out" || fail "rank $r did not finish"; done
}
# check_culprit REGEX: the merged flight records (--flight-dir "$dir") name the culprit so.
check_culprit() {
  local report
  report=$(python3 "$(dirname "$0")/../../scripts/fsdp-flight" "$dir") || fail "fsdp-flight failed: $report"
  echo "$report" | grep -Eq "^culprit: $1" || fail "the flight records' culprit is not '$1':
$report"
  echo "faults: $scenario: $(echo "$report" | grep '^culprit: ')"
}
case $scenario in
  threads_mismatch)
    start env FSDP_TIMEOUT_MS=30000 "$prog" --backend threads --ranks 3 --fault mismatch --flight-dir "$dir"
    finish
    [ "$rc" -eq 1 ] || fail "exit status $rc, expected 1"
    check_survivors "$(injected_at)" 1 "mismatch across ranks.*rank 1 issued all_reduce of 64 f32"
    check_culprit "0,1,2/[0-9]+ #[0-9]+: the ranks disagree: ranks 0, 2 issued all_gather of [0-9]+ f32; rank 1 issued all_reduce of 64 f32 [(]sum[)]"
    ;;
  threads_throw | threads_leave)
    fault=${scenario#threads_}
    start env FSDP_TIMEOUT_MS=30000 "$prog" --backend threads --ranks 3 --fault "$fault"
    finish
    [ "$rc" -eq 1 ] || fail "exit status $rc, expected 1"
    if [ "$fault" = throw ]; then
      check_survivors "$(injected_at)" 1 "peer failure.*rank 1 failed: an exception left its shard_group [(]as rank 1 of 3[)]"
      grep -q "^rank 1 at [0-9.]*: injected failure on rank 1$" "$out" || fail "rank 1 did not print its own error"
      grep -q "^world::run rethrew: injected failure on rank 1$" "$out" || fail "world::run did not rethrow the root cause"
    else
      check_survivors "$(injected_at)" 1 "peer failure.*rank[(]s[)] 1 returned without joining"
      grep -q "^world::run rethrew: .*rank[(]s[)] 1 returned without joining" "$out" || fail "world::run did not rethrow the early return"
    fi
    ;;
  mpi_throw)
    start env FSDP_TIMEOUT_MS=30000 "${mpi[@]}" "$prog" --fault throw
    finish
    [ "$rc" -ne 0 ] || fail "mpiexec exited 0"
    check_survivors "$(injected_at)" 2 "peer failure.*rank 1 failed: an exception left its shard_group [(]as rank 1 of 3[)]"
    grep -q "^rank 1 at [0-9.]*: injected failure on rank 1$" "$out" || fail "rank 1 did not print its own error"
    ;;
  mpi_leave)
    start env FSDP_TIMEOUT_MS=3000 "${mpi[@]}" "$prog" --fault leave --flight-dir "$dir"
    finish
    [ "$rc" -ne 0 ] || fail "mpiexec exited 0"
    check_survivors "$(injected_at)" 6 "(timeout|peer failure).*(all_gather|reduce_scatter|rank 1)"
    check_culprit "rank 1 never issued 0,1,2/1 #[0-9]+ [(](all_gather|reduce_scatter) of [0-9]+ f32[^)]*[)], which ranks 0, 2 issued"
    ;;
  mpi_kill9)
    start env -u FSDP_TIMEOUT_MS "$(dirname "$0")/../../scripts/fsdp-mpiexec" --mpiexec "$mpiexec" -n 3 --enable-recovery \
      "$prog" --steps 100000 --pid-dir "$dir" --flight-dir "$dir"
    pid=$(wait_pid 30)
    kill -9 "$pid"
    t0=$(now)
    finish
    [ "$rc" -eq 1 ] || fail "exit status $rc: scripts/fsdp-mpiexec must exit 1 where mpiexec --enable-recovery exits 0"
    check_culprit "rank 1 left no record [(]killed, or it died before writing one[)]: rank 0 failed in 0,1,2/1"
    check_survivors "$t0" 15 "peer failure.*(all_gather|reduce_scatter).*rank 1 stopped answering [(]killed, stopped, or its host unreachable[)] [0-9.]+ s ago"
    ;;
  mpi_kill9_plain)
    start env -u FSDP_TIMEOUT_MS "${mpi[@]}" "$prog" --steps 100000 --pid-dir "$dir"
    pid=$(wait_pid 30)
    kill -9 "$pid"
    t0=$(now)
    finish
    delay=$(awk -v a="$(now)" -v b="$t0" 'BEGIN { printf "%.3f", a - b }')
    [ "$rc" -ne 0 ] || fail "mpiexec exited 0"
    awk -v d="$delay" 'BEGIN { exit !(d <= 15) }' || fail "the job ended $delay s after the kill (at most 15 s)"
    grep -Eq "process rank 1 with PID [0-9]+ on node .* exited on signal 9" "$out" || fail "mpiexec did not name the killed rank"
    echo "faults: $scenario: the job ended $delay s after the kill, exit $rc: $(grep -Eo "process rank 1 with PID [0-9]+ on node .* exited on signal 9" "$out")"
    ;;
  mpi_stop_8s)
    start env -u FSDP_TIMEOUT_MS "${mpi[@]}" "$prog" --steps 40 --pid-dir "$dir"
    stop_rank_1_then_finish 8
    echo "faults: $scenario: every rank finished after rank 1 was stopped for 8 s"
    ;;
  mpi_stop_short)
    start env FSDP_TIMEOUT_MS=6000 "${mpi[@]}" "$prog" --steps 40 --pid-dir "$dir"
    stop_rank_1_then_finish 1.5
    for r in 0 2; do
      line=$(grep -m 1 "^rank $r: finished" "$out")
      wall=$(echo "$line" | sed 's/.*longest step \([0-9.]*\) s wall.*/\1/')
      cpu=$(echo "$line" | sed 's/.*s wall, \([0-9.]*\) s CPU.*/\1/')
      awk -v w="$wall" 'BEGIN { exit !(w >= 1.2) }' || fail "rank $r's longest step was $wall s: it did not wait for the stopped rank"
      awk -v w="$wall" -v c="$cpu" -v b="$cpu_bound" 'BEGIN { exit !(c / w < b) }' || fail "rank $r burnt $cpu s of CPU in a $wall s wait (bound $cpu_bound s per s)"
      echo "faults: $scenario: rank $r waited $wall s for the stopped rank, using $cpu s of CPU"
    done
    ;;
  mpi_stop_long)
    start env FSDP_TIMEOUT_MS=3000 "${mpi[@]}" "$prog" --steps 1000 --pid-dir "$dir"
    pid=$(wait_pid 30)
    kill -STOP "$pid"
    t0=$(now)
    wait_reports 20
    kill -CONT "$pid" 2>/dev/null
    finish
    [ "$rc" -ne 0 ] || fail "mpiexec exited 0"
    check_survivors "$t0" 6 "(timeout|peer failure).*(all_gather|reduce_scatter|rank 1)"
    ;;
  *)
    fail "unknown scenario"
    ;;
esac
grep -Eq "ERROR: AddressSanitizer|WARNING: ThreadSanitizer|runtime error:" "$out" && fail "a sanitizer reported an error"
echo "faults: $scenario: ok"
