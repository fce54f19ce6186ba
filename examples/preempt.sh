#!/usr/bin/env bash
# Preemption, end to end: train_gpt gets SIGTERM (what Slurm and cloud schedulers send before they
# kill) in the middle of a run with --save. Every rank must stop after the same step, save that
# step's checkpoint, print "stopped by SIGTERM after step N", and exit 143 (128 + SIGTERM); a
# run resumed from the checkpoint must then print an uninterrupted run's losses, to the last bit.
#
#   preempt.sh TRAIN_GPT [MPIEXEC]     (with MPIEXEC: 2 MPI processes, and only rank 1 gets the
#                                       signal: the ranks agree on the stop at the step's end)
set -u
prog=$1 mpiexec=${2:-}
dir=$(mktemp -d)
trap 'kill -9 $job 2>/dev/null; rm -rf "$dir"' EXIT
job=
# 120 steps: the signal comes after step 2 and lands within about 40 steps (MPI, optimized build);
# the rest is the middle the run resumes from. The sanitizer passes run this
# script four times over, so its length is CI time.
steps=120
args=(--layers 2 --dim 32 --seq 32 --batch 8 --steps $steps --eval-every 20)
fail() { echo "preempt: FAILED: $*"; [ -f "$dir/out" ] && cat "$dir/out"; exit 1; }
if [ -n "$mpiexec" ]; then
  launch=("$mpiexec" -n 2 "$prog" --backend mpi)
else
  launch=("$prog" --ranks 2)
fi

"${launch[@]}" "${args[@]}" --loss-csv "$dir/straight.csv" > "$dir/straight.out" 2>&1 || fail "the straight run: $(cat "$dir/straight.out")"

"${launch[@]}" "${args[@]}" --save "$dir/ckpt" --save-every 1000 > "$dir/out" 2>&1 &
job=$!
for _ in $(seq 600); do grep -Eq '^step +2 ' "$dir/out" && break; sleep 0.1; done
grep -Eq '^step +2 ' "$dir/out" || fail "no step 2 in 60 s"
if [ -n "$mpiexec" ]; then
  # rank 1's process: mpiexec's (this job's) train_gpt child started last. Only its children: a
  # match over the whole machine once signalled another test's rank, run beside this one by
  # ctest -j (this run then finished all its steps, unsignalled).
  pids=$(pgrep -P "$job" -f -- "$prog --backend mpi" | sort -n)
  target=$(echo "$pids" | tail -1)
else
  target=$job
fi
kill -TERM "$target"
wait "$job"
rc=$?
job=
line=$(grep -o 'stopped by SIGTERM after step [0-9]*' "$dir/out" | head -1)
[ -n "$line" ] || fail "no 'stopped by SIGTERM after step N' line"
n=${line##* }
if [ -z "$mpiexec" ]; then
  [ "$rc" = 143 ] || fail "exit status $rc, not 143"
else
  [ "$rc" != 0 ] || fail "mpiexec exited 0"
fi
[ "$n" -lt $((steps - 1)) ] || fail "stopped only after step $n (the run's last is $((steps - 1)))"
ckpt=$(printf '%s/ckpt/step_%08d' "$dir" $((n + 1)))
[ -f "$ckpt/index.json" ] || fail "no checkpoint $ckpt"

"${launch[@]}" "${args[@]}" --resume "$dir/ckpt" --loss-csv "$dir/resumed.csv" > "$dir/resumed.out" 2>&1 ||
  fail "the resumed run: $(cat "$dir/resumed.out")"
want=$(awk -F, -v from=$((n + 1)) 'NR > 1 && $1 >= from' "$dir/straight.csv")
got=$(awk -F, 'NR > 1' "$dir/resumed.csv")
[ -n "$want" ] && [ "$want" = "$got" ] || fail "the resumed losses differ from the straight run's:
$(diff <(echo "$want") <(echo "$got") | head)"
# Resuming into a longer run changes the learning-rate schedule: said, not silent.
"${launch[@]}" "${args[@]/$steps/$((steps + 2))}" --resume "$dir/ckpt" > "$dir/longer.out" 2>&1 || fail "the longer resumed run: $(cat "$dir/longer.out")"
grep -q "warning: the checkpoint's run has --steps $steps, this one --steps $((steps + 2))" "$dir/longer.out" || fail "no schedule warning: $(cat "$dir/longer.out")"
echo "preempt: $line, exit $rc, $ckpt saved; steps $((n + 1))..$((steps - 1)) resumed bit for bit"
