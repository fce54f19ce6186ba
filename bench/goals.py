#!/usr/bin/env python3
"""Prints issue 15's table of collective and hook costs from what scripts/bench.sh wrote.

Usage: bench/goals.py [DIR]   (DIR: scripts/bench.sh's results, build/bench by default)

Reads DIR/fsdp_bench.json (Google Benchmark's JSON: the medians of the collectives and overhead
benchmarks) and DIR/mpi_collectives_<n>.txt (bench/mpi_collectives' table), and prints one row
per figure: what is measured, the value(s) now, the goal, and whether every value meets it. Every
figure is a ratio measured in one run, or a time per unit (docs/benchmarks.md says how each is
measured). Values whose benchmark did not run are left out; a row with none says "not run". Python's own json module
reads the files: the script is a reader of the benchmark's output, not part of the toolkit.
"""
import json
import os
import re
import sys

out = sys.argv[1] if len(sys.argv) > 1 else "build/bench"


def medians():
    """{benchmark name without the aggregate suffix: counters} for every *_median entry."""
    path = os.path.join(out, "fsdp_bench.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        runs = json.load(f)["benchmarks"]
    found = {}
    for b in runs:
        if b.get("aggregate_name") == "median":
            found[b["run_name"]] = b
    return found


def mpi_ratios(n):
    """{(collective, bytes): ratio} from mpi_collectives_<n>.txt ("all_gather.w": on an on_wait queue)."""
    path = os.path.join(out, f"mpi_collectives_{n}.txt")
    rows = {}
    if not os.path.exists(path):
        return rows
    for line in open(path):
        m = re.match(r"((?:all_gather|reduce_scatter)(?:\.w)?|MPI_Iallgather)\s+(\d+)\s+\S+\s+\S+\s+\S+\s+\S+\s+(\S+)", line)
        if m:
            rows[(m.group(1), int(m.group(2)))] = float(m.group(3))
    return rows


bench = medians()


def counter(name, key):
    b = bench.get(name)
    return None if b is None else b.get(key)


def collective(kind, ranks, size, family="collectives", key="ratio"):
    return counter(f"{family}/threads/{kind}/ranks:{ranks}/bytes:{size}/manual_time", key)


KiB, MiB = 1024, 1024 * 1024
rows = []  # (what, values, goal, whether larger is better)


def row(what, values, goal, at_least=True):
    rows.append((what, values, goal, at_least))


def size_label(size):
    return f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"


def per_unit_us(key):
    """The 1-rank f32 overhead counter `key` for each unit count, in us (None where not run)."""
    values = [counter(f"overhead/ranks:1/params:f32/units:{u}/manual_time", key) for u in units]
    return [None if v is None else v / 1e3 for v in values]


units = (1, 4, 16, 64, 256, 1024)
for kind, what, goals in (("reduce_scatter", "threads reduce-scatter / summing loop", ((64 * KiB, 0.5), (MiB, 0.8), (16 * MiB, 0.8))),
                          ("all_gather", "threads all-gather / memcpy", ((64 * KiB, 0.5), (MiB, 0.9)))):
    for size, goal in goals:
        row(f"{what}, {size_label(size)}, 2 and 4 ranks", [collective(kind, r, size) for r in (2, 4)], goal)
        # The same, on a queue_wake::on_wait queue: the waiting thread runs the collective.
        row(f"  issued and waited at once (on_wait queue)", [collective(kind, r, size, "collectives_waited") for r in (2, 4)], goal)
        # The floor: the raw moves between two barriers of the rank threads, the least any
        # collective that synchronizes adds (bench/collectives.cpp's `bound`); "met" here says
        # the goal is within reach on this machine.
        row(f"  floor: raw / (raw between two barriers)", [collective(kind, r, size, key="bound") for r in (2, 4)], goal)
mpi = {n: mpi_ratios(n) for n in (2, 4)}
# Not a goal of its own: how much faster a collective issued and waited for at once completes on an
# on_wait queue than on the default one (fsdp_us of the two benchmarks, same run, not interleaved).
for kind in ("all_gather", "reduce_scatter"):
    ratios = []
    for r in (2, 4):
        queued, waited = collective(kind, r, 64 * KiB, key="fsdp_us"), collective(kind, r, 64 * KiB, "collectives_waited", "fsdp_us")
        ratios.append(queued / waited if queued and waited else None)
    row(f"threads {kind.replace('_', '-')}, 64 KiB, time on_enqueue / on_wait queue, 2 and 4 ranks", ratios, 1)
row("MPI reduce-scatter / MPI_Reduce_scatter_block, >= 1 MiB, 2 and 4 processes",
    [v for n in (2, 4) for (k, b), v in sorted(mpi[n].items()) if k == "reduce_scatter" and b >= MiB], 2)
row("MPI all-gather / MPI_Allgather, 64 KiB, 2 and 4 processes", [mpi[n].get(("all_gather", 64 * KiB)) for n in (2, 4)], 0.8)
row("  issued and waited at once (on_wait queue)", [mpi[n].get(("all_gather.w", 64 * KiB)) for n in (2, 4)], 0.8)
# The floor: MPI's own nonblocking all-gather against its blocking one (bench/mpi_collectives.cpp).
row("  floor: MPI_Allgather / (MPI_Iallgather + MPI_Wait)", [mpi[n].get(("MPI_Iallgather", 64 * KiB)) for n in (2, 4)], 0.8)
row("one f32 rank, full step, wall us per unit", per_unit_us("ns_per_unit"), 2, at_least=False)
row("one f32 rank, full step, engine-thread CPU us per unit", per_unit_us("cpu_ns_per_unit"), 1, at_least=False)
row("two ranks, bare collectives / fsdp", [counter(f"overhead/ranks:2/params:f32/units:{u}/manual_time", "ratio") for u in units], 0.97)
# The control: a bare step against a second bare step, interleaved alike (equal work): how far
# this machine's scheduling alone moves the row above.
row("  control: bare / bare", [counter(f"overhead/ranks:2/bare_vs_bare/units:{u}/manual_time", "ratio") for u in units], 0.97)


def alone_ratio(u):
    """overhead_alone's bare step over its fsdp step at u units (each alone in its world)."""
    bare = counter(f"overhead_alone/ranks:2/bare/units:{u}/manual_time", "ns_per_unit")
    fsdp = counter(f"overhead_alone/ranks:2/params:f32/units:{u}/manual_time", "ns_per_unit")
    return None if not bare or not fsdp else bare / fsdp


row("  each alone in its world, 16 and 64 units", [alone_ratio(u) for u in (16, 64)], 0.97)

print("issue 15's figures (ratios: same run; times: medians)")
print(f"{'what':<78} {'now':<40} {'goal':<8} met")
for what, values, goal, at_least in rows:
    values = [v for v in values if v is not None]  # a filtered run leaves some out
    goal_text = f"{'>=' if at_least else '<='} {goal:g}"
    if not values:
        print(f"{what:<78} {'not run':<40} {goal_text:<8} -")
        continue
    now = " / ".join(f"{v:.3g}" for v in values)
    met = all(v >= goal if at_least else v <= goal for v in values)
    print(f"{what:<78} {now:<40} {goal_text:<8} {'yes' if met else 'no'}")
