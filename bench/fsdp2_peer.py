#!/usr/bin/env python3
"""PyTorch FSDP2's cost per unit on this machine, for the side-by-side in docs/benchmarks.md.

The peer of fsdp_bench's `overhead` benchmark (bench/overhead.cpp): `units` modules, each holding
one 64-element parameter and each wrapped by FSDP2's `fully_shard` (one FSDP unit each, then the
root), on CPU with the gloo backend, `ranks` processes. A step is what the overhead benchmark's
engine does: zero the gradients, forward through every unit, backward (FSDP2 all-gathers each
unit in forward and backward and reduce-scatters its gradient), with nothing else to compute.
Prints the median wall time per unit per step (rank 0, after warm-up steps) and the CPU time of
rank 0's process per unit per step.

Usage (torch from PyPI, 5.3 GB with the CUDA libraries it loads even on CPU; not part of the
build or the tests):
  python3 -m pip install --target /tmp/torchfull torch
  PYTHONPATH=/tmp/torchfull python3 bench/fsdp2_peer.py --ranks 2 --units 16 --steps 30
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


class Unit(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.full((64,), 0.01))

    def forward(self, x):
        return x * self.w


def run(rank, args, out):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    torch.set_num_threads(1)  # one core per rank, as fsdp's thread ranks
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (args.ranks,))
    model = nn.Sequential(*[Unit() for _ in range(args.units)])
    for unit in model:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.ones(64)
    wall, cpu = [], []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        model.zero_grad(set_to_none=False)
        model(x).sum().backward()
        t1, c1 = time.perf_counter(), time.process_time()
        if step >= args.warmup:
            wall.append(t1 - t0)
            cpu.append(c1 - c0)
    if rank == 0:
        out.put((statistics.median(wall), statistics.median(cpu)))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--units", type=int, default=16)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--port", type=int, default=29517)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.spawn(run, args=(args, out), nprocs=args.ranks, join=True)
    wall, cpu = out.get()
    print(f"fsdp2 torch={torch.__version__} ranks={args.ranks} units={args.units} "
          f"wall_us_per_unit={wall / args.units * 1e6:.1f} cpu_us_per_unit={cpu / args.units * 1e6:.1f}")


if __name__ == "__main__":
    main()
