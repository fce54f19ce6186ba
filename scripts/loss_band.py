#!/usr/bin/env python3
"""Whether loss curves stay within a band of a reference curve (train_gpt --loss-csv files).

  scripts/loss_band.py REFERENCE.csv OTHER.csv [MORE.csv ...] [--window 20] [--band 0.05]

Two runs that differ only in rounding (bf16 against f32, cuDNN's attention against the plain
kernels, PyTorch against train_gpt) do not give the same losses step by step: a rounding
difference grows until single steps differ, and a loss spike (a few steps several nats high) lands
in one run and not the other. What they share is the curve: the median loss of each window of
WINDOW steps, which a spike of a few steps does not move (a window's mean does: two steps 3.6 and
2.5 nats high moved a 20-step mean by 0.31 where the medians differed by 0.022). Each OTHER passes when
every window's median is within BAND nats of the reference's over the same steps (a last, shorter
window counts too). Exit 0 when all pass, 1 when one does not, 2 on bad input (a missing file, a
curve of another length, a non-finite loss).

The default band, 0.05 nats over 20-step windows, is from the host train_gpt at 2 layers, dim 64,
16 sequences of 64 bytes, learning rate 1e-3, 200 steps, seeds 1 to 6 (2026-11-29): bf16 against
f32 differs by at most 0.022 (1 rank) and 0.016 (4 ranks), and bench/gpt_torch.py's bf16
autocast on the CPU by 0.011 (seeds 1 to 3), while f32 with the learning rate 7e-4 instead of
1e-3 differs by 0.27 to 0.31 (and by 0.09 or more in every window after the 60th step).
examples/loss_band.cmake checks both sides of that line.
"""
import argparse
import math
import statistics
import sys


def read_curve(path):
    try:
        lines = open(path).read().splitlines()
    except OSError as e:
        raise SystemExit(f"loss_band: cannot read {path}: {e.strerror}")
    if not lines or not lines[0].startswith("step,train_loss"):
        raise SystemExit(f"loss_band: {path} is not a loss CSV (its first line should be 'step,train_loss,...')")
    losses = []
    for n, line in enumerate(lines[1:], start=2):
        fields = line.split(",")
        try:
            step, loss = int(fields[0]), float(fields[1])
        except (IndexError, ValueError):
            raise SystemExit(f"loss_band: {path}:{n}: '{line}' is not 'step,train_loss,...'")
        if step != len(losses) or not math.isfinite(loss):
            raise SystemExit(f"loss_band: {path}:{n}: step {step} with loss {loss} (expected step {len(losses)}, a finite loss)")
        losses.append(loss)
    if not losses:
        raise SystemExit(f"loss_band: {path} has no steps")
    return losses


def window_medians(losses, window):
    return [statistics.median(losses[i:i + window]) for i in range(0, len(losses), window)]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("reference")
    p.add_argument("others", nargs="+")
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--band", type=float, default=0.05)
    a = p.parse_args()
    if a.window < 1 or not a.band > 0:
        raise SystemExit("loss_band: --window must be at least 1 and --band above 0")
    try:
        ref = read_curve(a.reference)
        ref_medians = window_medians(ref, a.window)
        failed = 0
        for path in a.others:
            other = read_curve(path)
            if len(other) != len(ref):
                raise SystemExit(f"loss_band: {path} has {len(other)} steps, {a.reference} has {len(ref)}")
            diffs = [y - x for x, y in zip(ref_medians, window_medians(other, a.window))]
            worst = max(range(len(diffs)), key=lambda i: abs(diffs[i]))
            ok = abs(diffs[worst]) <= a.band
            failed += not ok
            print(f"{'within' if ok else 'OUTSIDE'} {a.band:g} nats: {path} against {a.reference}, {len(ref)} steps; "
                  f"the medians of {a.window}-step windows differ by at most {abs(diffs[worst]):.3f} (steps {worst * a.window}.."
                  f"{min(len(ref), (worst + 1) * a.window) - 1}); last window {ref_medians[-1]:.4f} and "
                  f"{ref_medians[-1] + diffs[-1]:.4f}")
            print("  window differences: " + " ".join(f"{d:+.3f}" for d in diffs))
    except SystemExit as e:
        print(e, file=sys.stderr)
        sys.exit(2)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
