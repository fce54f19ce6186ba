#!/usr/bin/env bash
# Kill tests: train_gpt saving a checkpoint after every step is killed with SIGKILL at each
# fsync and rename of its first saves (kill_at.c, LD_PRELOAD), synchronous and asynchronous.
# After every kill a fresh process resumes from the save directory: it must start from the
# latest complete checkpoint and print the straight run's losses from there to the last bit; a
# kill before any save completed must be refused by name, with the unfinished save named.
#
#   kill_during_save.sh TRAIN_GPT KILL_AT_SO WORKDIR
set -u
prog=$1 shim=$2 work=$3
args=(--layers 2 --dim 32 --seq 32 --batch 8 --eval-every 0 --steps 6)
mkdir -p "$work" && cd "$work" || exit 1
fail() { echo "kill_during_save: $*"; exit 1; }

"$prog" "${args[@]}" --loss-csv straight.csv >/dev/null 2>&1 || fail "the straight run failed"
# One save of 4 ranks: 4 rank files + user.bin + index.json + 2 directories = 8 fsyncs, 1 rename.
points=()
for k in $(seq 1 18); do points+=("fsync:$k"); done
points+=(rename:1 rename:2 rename:3)
killed=0 resumed=0 refused=0
for mode in sync async; do
  for at in "${points[@]}"; do
    rm -rf ckpt resumed.csv
    FSDP_KILL_AT=$at LD_PRELOAD=$shim "$prog" "${args[@]}" --save ckpt --save-every 1 --save-mode $mode >run.log 2>&1
    rc=$?
    [ $rc -eq 137 ] || fail "$mode $at: the run was not killed (exit $rc): $(tail -3 run.log)"
    killed=$((killed + 1))
    if "$prog" "${args[@]}" --resume ckpt --loss-csv resumed.csv >resume.log 2>&1; then
      first=$(sed -n 2p resumed.csv | cut -d, -f1)
      [ -d "ckpt/step_$(printf %08d "$first")" ] || fail "$mode $at: resumed at step $first, which has no checkpoint"
      # Nothing later than the step resumed from may be complete.
      for d in ckpt/step_*; do
        case $d in *.partial) continue ;; esac
        n=$((10#${d##*step_}))
        [ $n -le "$first" ] || fail "$mode $at: resumed at step $first although $d is complete"
      done
      diff <(tail -n +2 resumed.csv) <(awk -F, -v s="$first" 'NR > 1 && $1 >= s' straight.csv) >/dev/null ||
        fail "$mode $at: the losses after resuming at step $first differ from the straight run's"
      resumed=$((resumed + 1))
    else
      grep -q "neither a checkpoint (no index.json) nor a directory holding a complete step_\* checkpoint" resume.log ||
        fail "$mode $at: the resume failed without naming why: $(tail -3 resume.log)"
      # A refusal is right only when no save completed.
      for d in ckpt/step_*; do
        case $d in *.partial) continue ;; esac
        [ -f "$d/index.json" ] && fail "$mode $at: refused although $d is complete"
      done
      refused=$((refused + 1))
    fi
  done
done
rm -rf ckpt
echo "kill_during_save: $killed runs killed by SIGKILL inside a save; $resumed resumed from the latest complete checkpoint with the straight run's losses, $refused (killed inside the first save) refused by name"
