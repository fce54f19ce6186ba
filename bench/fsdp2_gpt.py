#!/usr/bin/env python3
"""fsdp's LibTorch adapter against PyTorch FSDP2 on the very same torch kernels (issue 34).

Both sides train the same GPT: examples/libtorch/train_torch_gpt (torch::nn modules sharded by
fsdp's adapter, thread ranks), built against the LibTorch inside PyPI's torch wheel
(bench/build_torch_gpt.sh), and this file's copy of it in Python (the same modules, names and
forward; FSDP2's fully_shard per block and at the root, or DDP for replicate; gloo, one process
per rank). Same data (gpt/data.hpp's batches, recomputed here), same initial values (the C++
program writes them with --save-init and this one loads them), same optimizer (AdamW, lr 3e-3,
betas 0.9/0.999, eps 1e-8, no weight decay), no clipping, one intra-op thread per rank on both
sides. Attention: LibTorch's C++ MultiheadAttention computes its weights with bmm and softmax;
Python's would switch to fused SDPA when the weights are not asked for, so this side asks for
them (need_weights=True, not averaged) to run the same kernels.

  python3 -m pip install --target /tmp/torchfull torch        # 5 GB with the CUDA libraries
  bench/build_torch_gpt.sh /tmp/torchfull                      # -> build/torch-wheel/train_torch_gpt
  PYTHONPATH=/tmp/torchfull python3 bench/fsdp2_gpt.py --check  # losses of both over 20 steps
  PYTHONPATH=/tmp/torchfull python3 bench/fsdp2_gpt.py          # the table (docs/benchmarks.md)

The table: tokens/s after the first step (the median step), interleaved rounds, the median of
the rounds' figures; each fsdp sharding against FSDP2's (full / grad_op) and DDP (replicate).
"""
import argparse
import os
import re
import statistics
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MASK = (1 << 64) - 1


# --- gpt/data.hpp, in Python ----------------------------------------------------------------------
def load_corpus(path, val_fraction=0.1):
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path)
                       if os.path.isfile(os.path.join(path, f)) and not os.path.islink(os.path.join(path, f))
                       and os.path.splitext(f)[1] not in (".dat", ".u8"))
    else:
        files = [path]
    text = b"".join(open(f, "rb").read() for f in files)
    return text, int(len(text) * (1.0 - val_fraction))


def mix(z):
    z = (z + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def make_batch(text, train_end, seed, index, first, count, seq):
    starts = train_end - seq - 1
    tokens, targets = [], []
    for s in range(first, first + count):
        key = mix(mix(seed * 2) ^ ((mix(index) * 31) & MASK) ^ s)
        at = key % starts
        tokens.append(list(text[at:at + seq]))
        targets.append(list(text[at + 1:at + seq + 1]))
    return tokens, targets


# --- the FSDP2 side ---------------------------------------------------------------------------------
def fsdp2_worker(rank, a, out_path):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(a.port)
    dist.init_process_group("gloo", rank=rank, world_size=a.ranks)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(a.dim)
            self.attn = nn.MultiheadAttention(a.dim, a.heads)
            self.ln2 = nn.LayerNorm(a.dim)
            self.fc1 = nn.Linear(a.dim, 4 * a.dim)
            self.fc2 = nn.Linear(4 * a.dim, a.dim)

        def forward(self, x, mask):
            h = self.ln1(x)
            # need_weights keeps MultiheadAttention on bmm and softmax, as LibTorch's C++ module;
            # without it (--main-job) torch runs its fused scaled-dot-product attention.
            x = x + self.attn(h, h, h, need_weights=not a.sdpa, attn_mask=mask, average_attn_weights=False)[0]
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(256, a.dim)
            self.wpe = nn.Embedding(a.seq, a.dim)
            self.lnf = nn.LayerNorm(a.dim)

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = Embed()
            self.blocks = nn.ModuleList(Block() for _ in range(a.layers))

        def forward(self, tokens):
            t = tokens.size(1)
            mask = torch.full((t, t), float("-inf")).triu(1)
            x = (self.emb.wte(tokens) + self.emb.wpe(torch.arange(t))).transpose(0, 1)
            for b in self.blocks:
                x = b(x, mask)
            return self.emb.lnf(x.transpose(0, 1)) @ self.emb.wte.weight.t()

    model = GPT()
    # The C++ program's initial values (train_torch_gpt --save-init), by name.
    params = dict(model.named_parameters())
    with open(a.init or os.devnull, "rb") as f:  # no --init: torch's own initial values
        loaded = 0
        while header := f.read(4):
            name = f.read(struct.unpack("<I", header)[0]).decode()
            dims = struct.unpack("<I", f.read(4))[0]
            shape = struct.unpack(f"<{dims}q", f.read(8 * dims))
            n = 1
            for d in shape:
                n *= d
            values = torch.frombuffer(bytearray(f.read(4 * n)), dtype=torch.float32).reshape(shape)
            if name not in params or tuple(params[name].shape) != tuple(shape):
                raise SystemExit(f"fsdp2_gpt: --init has {name} {shape}, the model has "
                                 f"{tuple(params[name].shape) if name in params else 'no such parameter'}")
            with torch.no_grad():
                params[name].copy_(values)
            loaded += 1
        if a.init and loaded != len(params):
            raise SystemExit(f"fsdp2_gpt: --init held {loaded} parameters, the model has {len(params)}")

    if a.mode == "replicate":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard
        for b in model.blocks:
            fully_shard(b, reshard_after_forward=a.mode == "full")
        fully_shard(model, reshard_after_forward=a.mode == "full")
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)

    text, train_end = load_corpus(a.data)
    local = a.batch // a.ranks
    rates, losses = [], []
    for step in range(a.steps):
        t0 = time.perf_counter()
        tok, tgt = make_batch(text, train_end, 1, step, rank * local, local, a.seq)
        logits = model(torch.tensor(tok))
        loss = F.cross_entropy(logits.reshape(-1, 256), torch.tensor(tgt).reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        s = time.perf_counter() - t0
        losses.append(mean.item() / a.ranks)
        if step > 0:
            rates.append(a.batch * a.seq / s)
    if rank == 0:
        with open(out_path, "w") as f:
            f.write(f"median {statistics.median(rates) if rates else 0.0}\n")
            f.write("losses " + " ".join(repr(x) for x in losses) + "\n")
    dist.destroy_process_group()


RUNS = [0]


def run_fsdp2(a, mode, dim, ranks, steps, init):
    # A fresh port for every run: a run right after another on the same port was seen to abort in
    # gloo's set-up ("terminate called without an active exception"); a failed run is retried once.
    for attempt in range(2):
        RUNS[0] += 1
        with tempfile.NamedTemporaryFile("r", suffix=".txt") as out:
            cmd = [sys.executable, __file__, "--worker", "--mode", mode, "--dim", str(dim), "--ranks", str(ranks),
                   "--steps", str(steps), "--init", init, "--out", out.name, "--port", str(a.port + RUNS[0] % 1000),
                   "--data", a.data, "--layers", str(a.layers), "--heads", str(a.heads), "--seq", str(a.seq),
                   "--batch", str(a.batch)] + (["--sdpa"] if a.main_job else [])
            if subprocess.run(cmd).returncode != 0:
                print(f"fsdp2_gpt: FSDP2 {mode} at dim {dim} on {ranks} ranks failed (attempt {attempt + 1})", file=sys.stderr)
                continue
            lines = dict(l.split(" ", 1) for l in out.read().splitlines())
        return float(lines["median"]), [float(x) for x in lines["losses"].split()]
    raise SystemExit(f"fsdp2_gpt: FSDP2 {mode} at dim {dim} on {ranks} ranks failed twice")


def run_main_job(a, sharding, dim, ranks, steps):
    # The main job's own C++ model and kernels (OpenBLAS); the same statistic as the FSDP2 side:
    # the median of the per-step rates after the first step.
    cmd = [a.fsdp_exe, "--ranks", str(ranks), "--sharding", sharding, "--dim", str(dim), "--steps", str(steps),
           "--layers", str(a.layers), "--heads", str(a.heads), "--seq", str(a.seq), "--batch", str(a.batch),
           "--data", a.data, "--eval-every", "0"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rates = [float(r) for r in re.findall(r"^step +[0-9]+ \| loss [0-9.]+ \| +([0-9.]+) tok/s", out, re.M)]
    return statistics.median(rates[1:]), []


def run_fsdp(a, sharding, dim, ranks, steps, init):
    if a.main_job:
        return run_main_job(a, sharding, dim, ranks, steps)
    cmd = [a.fsdp_exe, "--ranks", str(ranks), "--sharding", sharding, "--dim", str(dim), "--steps", str(steps),
           "--layers", str(a.layers), "--heads", str(a.heads), "--seq", str(a.seq), "--batch", str(a.batch),
           "--data", a.data, "--torch-threads", "1", "--print-every", "1", "--save-init", init]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    median = float(re.search(r"median after the first step: ([0-9.]+) tok/s", out).group(1))
    losses = [float(x) for x in re.findall(r"\| loss ([0-9.]+) \|", out)]
    return median, losses


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fsdp-exe", default="")
    p.add_argument("--main-job", action="store_true",
                   help="fsdp's side is the main job, examples/train_gpt (its own C++ model on OpenBLAS), and "
                        "FSDP2's attention is torch's fused SDPA; 4 layers unless --layers says otherwise")
    p.add_argument("--dims", default="64,128,256,512")
    p.add_argument("--rank-counts", default="2,4")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--check", action="store_true", help="compare both sides' losses over 20 steps at dim 64, 2 ranks")
    p.add_argument("--layers", type=int, default=0, help="blocks (default 2; with --main-job 4)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--data", default="/usr/share/games/fortunes")
    p.add_argument("--port", type=int, default=29512)
    # the worker's own arguments (this file runs itself for each FSDP2 run)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--sdpa", action="store_true")
    p.add_argument("--mode", default="full")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--init", default="")
    p.add_argument("--out", default="")
    a = p.parse_args()
    a.layers = a.layers or (4 if a.main_job else 2)
    a.fsdp_exe = a.fsdp_exe or os.path.join(ROOT, "build/release/examples/train_gpt" if a.main_job
                                            else "build/torch-wheel/train_torch_gpt")
    if a.worker:
        import torch.multiprocessing as mp
        mp.spawn(fsdp2_worker, args=(a, a.out), nprocs=a.ranks, join=True)
        return
    init = "" if a.main_job else os.path.join(tempfile.mkdtemp(), "init.bin")
    if a.check and a.main_job:
        raise SystemExit("fsdp2_gpt: --check compares the adapter's model with FSDP2's; the main job's model is its own")
    if a.check:
        f_rate, f_loss = run_fsdp(a, "full", 64, 2, 20, init)
        t_rate, t_loss = run_fsdp2(a, "full", 64, 2, 20, init)
        worst = max(abs(x - y) for x, y in zip(f_loss, t_loss))
        print("step  fsdp full  FSDP2 full")
        for i, (x, y) in enumerate(zip(f_loss, t_loss)):
            print(f"{i:4d}  {x:.6f}  {y:.6f}")
        print(f"largest difference over {len(f_loss)} steps: {worst:.2e}")
        return
    pairs = [("full", "full"), ("grad_op", "grad_op"), ("none", "replicate")]
    results = {}
    for rnd in range(a.rounds):
        for ranks in [int(x) for x in a.rank_counts.split(",")]:
            for dim in [int(x) for x in a.dims.split(",")]:
                for ours, theirs in pairs:
                    results.setdefault(("fsdp", ours, dim, ranks), []).append(run_fsdp(a, ours, dim, ranks, a.steps, init)[0])
                    results.setdefault(("fsdp2", theirs, dim, ranks), []).append(run_fsdp2(a, theirs, dim, ranks, a.steps, init)[0])
                print(f"round {rnd + 1}: {ranks} ranks, dim {dim} done", file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    print("| ranks | dim | fsdp full / grad_op / none | FSDP2 full / grad_op / DDP | fsdp full ÷ FSDP2 full | fsdp full ÷ DDP | fsdp grad_op ÷ FSDP2 grad_op | fsdp none ÷ DDP |")
    print("|---|---|---|---|---|---|---|---|")
    for ranks in [int(x) for x in a.rank_counts.split(",")]:
        for dim in [int(x) for x in a.dims.split(",")]:
            f = [med[("fsdp", m, dim, ranks)] for m in ("full", "grad_op", "none")]
            t = [med[("fsdp2", m, dim, ranks)] for m in ("full", "grad_op", "replicate")]
            print(f"| {ranks} | {dim} | {f[0]:,.0f} / {f[1]:,.0f} / {f[2]:,.0f} | {t[0]:,.0f} / {t[1]:,.0f} / {t[2]:,.0f} | "
                  f"{f[0] / t[0]:.2f} | {f[0] / t[2]:.2f} | {f[1] / t[1]:.2f} | {f[2] / t[2]:.2f} |")


if __name__ == "__main__":
    main()
