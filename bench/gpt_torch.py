#!/usr/bin/env python3
"""The GPT of train_gpt in PyTorch: the peer a GPU run is measured against (issue 36).

The same model as examples/gpt/model.hpp -- byte vocabulary, pre-norm blocks with one qkv product,
GELU (tanh), the head tied to wte -- with the same parameter names and initial values (model.hpp's
initial_value, computed here with the same hash), the same batches (gpt/data.hpp, through
fsdp2_gpt.py's port of it), the same AdamW (betas 0.9/0.999, eps 1e-8, no weight decay), the same
learning-rate schedule (train.hpp's learning_rate) and clipping (global norm 1.0). What PyTorch
brings is its own kernels: scaled_dot_product_attention (flash attention on a GPU), bf16 autocast
(the products in bf16 with f32 accumulation, layer norms and the loss in f32), the fused AdamW,
and torch.compile with --compile; --vocab 50304 gives wte llm.c's padded GPT-2 vocabulary (the
tokens stay bytes), for the side by side with llm.c (bench/llmc_peer.py). It prints train_gpt's
lines: the loss a step, tokens/s after the first step, and the MFU both ways (6 N, and llm.c's
6 N + 6 L C T) against 989 TFLOP/s.

  PYTHONPATH=/tmp/torchfull python3 bench/gpt_torch.py --device cuda --precision bf16 \\
      --layers 12 --dim 768 --heads 12 --seq 1024 --batch 4 --steps 20

--ranks R --sharding full|grad_op|none runs it on R processes as FSDP2 (fully_shard per block
and at the root) or DDP: on a GPU NCCL ranks on the one GPU, each with its own NCCL_HOSTID, as
train_gpt --backend nccl runs; on the CPU gloo (issue 35's peers).

--check trains a small model on the CPU in f32 here and with the host train_gpt (f32, the same
ranks and sharding) and compares their loss curves step by step: the same model, data and
optimizer computed by two independent programs (docs/gpu.md gives the figures). torch from PyPI (5 GB with its CUDA
libraries, which it loads on the CPU too); not part of the build or the tests:
  python3 -m pip install --target /tmp/torchfull torch
  PYTHONPATH=/tmp/torchfull python3 bench/gpt_torch.py --check
"""
import argparse
import math
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from fsdp2_gpt import load_corpus, make_batch  # noqa: E402  (gpt/data.hpp in Python)

PEAK_FLOPS = 989e12  # the H100's (and H200's) dense bf16 peak, as train_gpt's MFU line
M64 = (1 << 64) - 1


# --- model.hpp's initial_value, in torch int64 (wrapping products; shifts made logical) -----------
def _s64(x):
    x &= M64
    return x - (1 << 64) if x >> 63 else x


def _shr(z, k):  # a logical right shift of int64 bit patterns
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix(z):
    z = (z ^ _shr(z, 30)) * _s64(0xBF58476D1CE4E5B9)
    z = (z ^ _shr(z, 27)) * _s64(0x94D049BB133111EB)
    return z ^ _shr(z, 31)


def initial_values(torch, name, numel, layers, seed):
    """model.hpp's initial_value(name, i) for i in [0, numel): N(0, 0.02) weights (the residual
    projections 0.02 / sqrt(2 L)), zero biases, unit layer-norm gains."""
    if name.endswith("_b"):
        return torch.zeros(numel)
    if name.endswith(("ln1_w", "ln2_w", "lnf_w")):
        return torch.ones(numel)
    h = (seed * 0x9E3779B97F4A7C15) & M64
    for ch in name.encode():
        h = ((h ^ ch) * 0x100000001B3) & M64
    at = _s64(h) + 2 * torch.arange(numel, dtype=torch.int64)
    u1 = (_shr(_mix(at), 11).double() + 1.0) / 9007199254740992.0
    u2 = _shr(_mix(at + 1), 11).double() / 9007199254740992.0
    normal = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(6.283185307179586 * u2)
    stddev = 0.02 / math.sqrt(2.0 * layers) if name.endswith(("proj_w", "out_w")) else 0.02
    return (stddev * normal).float()


def print_speed(rate, n, layers, dim, seq):
    """train_gpt's two summary lines: tokens/s after the first step, and the MFU both ways
    (6 N, and llm.c's 6 N + 6 L C T a token) against 989 TFLOP/s."""
    attention = 6.0 * layers * dim * seq
    print(f"after the first step: {rate:.0f} tokens/s")
    print(f"model FLOPs utilisation: {100 * 6.0 * n * rate / PEAK_FLOPS:.1f}% of 989 TFLOP/s (6 x {n} parameters x "
          f"{rate:.0f} tokens/s); llm.c's count (6 N + 6 L C T a token): {100 * (6.0 * n + attention) * rate / PEAK_FLOPS:.1f}%")


def learning_rate(a, step):  # train.hpp's learning_rate: linear warm-up, cosine decay to lr / 10
    warm = min(1.0, (step + 1.0) / a.warmup) if a.warmup > 0 else 1.0
    progress = step / (a.steps - 1) if a.steps > 1 else 0.0
    return a.lr * warm * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def build(torch, a):
    import torch.nn.functional as F
    from torch import nn

    C, H, L, T, V = a.dim, a.heads, a.layers, a.seq, a.vocab

    def param(*shape):
        return nn.Parameter(torch.empty(*shape))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1_w, self.ln1_b = param(C), param(C)
            self.qkv_w, self.qkv_b = param(3 * C, C), param(3 * C)
            self.proj_w, self.proj_b = param(C, C), param(C)
            self.ln2_w, self.ln2_b = param(C), param(C)
            self.fc_w, self.fc_b = param(4 * C, C), param(4 * C)
            self.out_w, self.out_b = param(C, 4 * C), param(C)

        def forward(self, x):
            B = x.size(0)
            q, k, v = F.linear(F.layer_norm(x, (C,), self.ln1_w, self.ln1_b, 1e-5), self.qkv_w, self.qkv_b).split(C, -1)
            q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
            x = x + F.linear(y, self.proj_w, self.proj_b)
            h = F.layer_norm(x, (C,), self.ln2_w, self.ln2_b, 1e-5)
            return x + F.linear(F.gelu(F.linear(h, self.fc_w, self.fc_b), approximate="tanh"), self.out_w, self.out_b)

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = param(V, C), param(T, C)
            self.lnf_w, self.lnf_b = param(C), param(C)
            self.blocks = nn.ModuleList(Block() for _ in range(L))

        def forward(self, tokens, targets):
            x = self.wte[tokens] + self.wpe
            for b in self.blocks:
                x = b(x)
            logits = F.linear(F.layer_norm(x, (C,), self.lnf_w, self.lnf_b, 1e-5), self.wte)
            return F.cross_entropy(logits.float().view(-1, V), targets.view(-1))

    model = GPT()
    with torch.no_grad():
        for name, p in model.named_parameters():
            ours = name.replace("blocks.", "block", 1) if name.startswith("blocks.") else name  # block3.qkv_w
            p.copy_(initial_values(torch, ours, p.numel(), L, a.seed).view(p.shape))
    return model


def train(a, rank=0):
    """One rank of a run (a.ranks of them: FSDP2 or DDP over NCCL on a GPU, gloo on the CPU)."""
    import torch

    torch.set_num_threads(a.threads or (torch.get_num_threads() if a.ranks == 1 else 1))
    dev = torch.device(a.device)
    if dev.type == "cuda" and dev.index is None:  # set_device needs an index: the one GPU
        dev = torch.device("cuda", 0)
    dist = None
    if a.ranks > 1:
        import torch.distributed as dist
        if dev.type == "cuda":
            # Every rank on the one GPU: with NCCL 2.28 two ranks of a communicator may share a GPU
            # only as different hosts, so each gets its own NCCL_HOSTID and NCCL joins them through
            # its socket transport, as train_gpt --backend nccl does (docs/gpu.md).
            os.environ["NCCL_HOSTID"] = f"gpt-torch-{os.getppid()}-{rank}"
            torch.cuda.set_device(dev)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=rank, world_size=a.ranks)
    model = build(torch, a).to(dev)
    n = sum(p.numel() for p in model.parameters())
    # bf16: the products in bf16, the master weights and reductions in f32. FSDP2 as it is run
    # (torchtitan's recipe): bf16 parameters gathered and f32 reductions (its MixedPrecisionPolicy),
    # so its residual stream and layer norms' outputs are bf16 too; one rank and DDP keep f32
    # parameters under bf16 autocast, activations f32 between the products as train_gpt's.
    fsdp2 = a.ranks > 1 and a.sharding != "none"
    if fsdp2:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if a.precision == "bf16" else MixedPrecisionPolicy()
        for b in model.blocks:
            fully_shard(b, reshard_after_forward=a.sharding == "full", mp_policy=mp)
        # The root (wte, wpe, lnf) stays gathered from forward into backward, as FSDP2 advises
        # and as train_gpt keeps its embedding unit: backward begins with it.
        fully_shard(model, reshard_after_forward=False, mp_policy=mp)
    elif a.ranks > 1:
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, device_ids=[dev.index or 0] if dev.type == "cuda" else None)
    step_fn = torch.compile(model) if a.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                            fused=dev.type == "cuda")
    text, train_end = load_corpus(a.data)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.precision == "bf16" and not fsdp2)
    say = print if rank == 0 else (lambda *args, **kw: None)
    how = (f"{a.ranks} ranks, {'FSDP2 ' + a.sharding if fsdp2 else 'DDP'}" if a.ranks > 1 else "1 rank")
    say(f"model: {a.layers} layers, dim {a.dim}, {a.heads} heads, context {a.seq} bytes; batch {a.batch} sequences; "
        f"{a.steps} steps, AdamW lr {a.lr:g}; PyTorch {torch.__version__} on {dev}"
        f"{' (' + torch.cuda.get_device_name(dev) + ')' if dev.type == 'cuda' else ''}, {how}, {a.precision}"
        f"{', torch.compile' if a.compile else ''}; {n:,} parameters")
    csv = open(a.loss_csv, "w") if a.loss_csv and rank == 0 else None
    if csv:
        csv.write("step,train_loss,val_loss\n")
    # train_gpt's split of a global batch: rank r trains sequences [r B/R, (r+1) B/R) (gpt/data.hpp).
    local = a.batch // a.ranks
    tokens_per_step, total, first = a.batch * a.seq, 0.0, 0.0
    for step in range(a.steps):
        t0 = time.perf_counter()
        tok, tgt = make_batch(text, train_end, a.seed, step, rank * local, local, a.seq)
        tok = torch.tensor(tok, dtype=torch.int64).to(dev, non_blocking=True)
        tgt = torch.tensor(tgt, dtype=torch.int64).to(dev, non_blocking=True)
        for g in opt.param_groups:
            g["lr"] = learning_rate(a, step)
        with autocast:
            loss = step_fn(tok, tgt)
        loss.backward()  # the gradients averaged over the ranks: the global batch's mean, as train_gpt's
        if a.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().float()
        if dist:
            dist.all_reduce(mean)
            mean /= a.ranks
        value = mean.item()  # the step's one wait for the device, as train_gpt reads its loss
        s = time.perf_counter() - t0
        total += s
        if step == 0:
            first = s
        say(f"step {step:4d} | loss {value:.4f} | {tokens_per_step / s:10.0f} tok/s", flush=True)
        if csv:
            csv.write(f"{step},{value!r},\n")
    if csv:
        csv.close()
    rate = tokens_per_step * (a.steps - 1) / (total - first) if a.steps > 1 else tokens_per_step / total
    if rank == 0:
        print_speed(rate, n, a.layers, a.dim, a.seq)
    if dist:
        dist.destroy_process_group()


def run(a):
    """a.ranks processes of train() (one: this process)."""
    if a.ranks == 1:
        return train(a)
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:  # a free port for the ranks' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    mp.spawn(_rank, args=(a,), nprocs=a.ranks, join=True)


def _rank(rank, a):  # what mp.spawn calls: its index first
    train(a, rank)


def read_csv(path):
    rows = [l.split(",") for l in open(path).read().splitlines()[1:]]
    return [float(r[1]) for r in rows]


def check(a):
    """Both programs, f32 on the CPU, the same small model: the largest loss difference a step."""
    exe = a.train_gpt or os.path.join(os.path.dirname(HERE), "build/release/examples/train_gpt")
    if not os.path.exists(exe):
        raise SystemExit(f"gpt_torch: no {exe} (build train_gpt, or give --train-gpt)")
    d = tempfile.mkdtemp()
    shape = ["--layers", str(a.layers), "--dim", str(a.dim), "--heads", str(a.heads), "--seq", str(a.seq),
             "--batch", str(a.batch), "--steps", str(a.steps), "--data", a.data]
    subprocess.run([exe, "--ranks", str(a.ranks), "--sharding", a.sharding, "--precision", "fp32", "--eval-every", "0",
                    *shape, "--loss-csv", f"{d}/fsdp.csv"], check=True, stdout=subprocess.DEVNULL)
    a.loss_csv, a.device, a.precision = f"{d}/torch.csv", "cpu", "fp32"
    run(a)
    ours, theirs = read_csv(f"{d}/fsdp.csv"), read_csv(f"{d}/torch.csv")
    print(f"{a.ranks} rank(s), sharding {a.sharding}")
    print("step  train_gpt (host, f32)  PyTorch (CPU, f32)  difference")
    for i, (x, y) in enumerate(zip(ours, theirs)):
        print(f"{i:4d}  {x:.7f}  {y:.7f}  {y - x:+.2e}")
    worst = max(abs(x - y) for x, y in zip(ours, theirs))
    print(f"largest difference over {len(ours)} steps: {worst:.2e} (step 0: {abs(ours[0] - theirs[0]):.2e})")
    if len(ours) != a.steps or len(theirs) != a.steps or worst > a.check_tolerance:
        raise SystemExit(f"gpt_torch: the curves differ by more than {a.check_tolerance:g}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--layers", type=int, default=0, help="default 12 (--check: 2)")
    p.add_argument("--dim", type=int, default=0, help="default 768 (--check: 64)")
    p.add_argument("--heads", type=int, default=0, help="default 12 (--check: 4)")
    p.add_argument("--seq", type=int, default=0, help="default 1024 (--check: 64)")
    p.add_argument("--vocab", type=int, default=256,
                   help="rows of wte (the tokens stay bytes): 256 is train_gpt's model; 50304 is llm.c's GPT-2 (its "
                        "vocabulary padded), for the side by side with bench/llmc_peer.py")
    p.add_argument("--batch", type=int, default=4, help="the global batch, in sequences (split over the ranks)")
    p.add_argument("--ranks", type=int, default=1, help="processes, all on the one device: NCCL on a GPU, gloo on the CPU")
    p.add_argument("--sharding", choices=["full", "grad_op", "none"], default="full",
                   help="with ranks: FSDP2's fully_shard per block and at the root, resharding after forward (full) "
                        "or not (grad_op); none: DDP")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--data", default="/usr/share/games/fortunes")
    p.add_argument("--loss-csv", default="")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (default: PyTorch's)")
    p.add_argument("--check", action="store_true", help="compare with the host train_gpt, f32 on the CPU")
    p.add_argument("--train-gpt", default="", help="--check: the host train_gpt (default build/release/examples/train_gpt)")
    p.add_argument("--check-tolerance", type=float, default=1e-4)
    a = p.parse_args()
    if a.check and a.vocab != 256:
        raise SystemExit("gpt_torch: --check compares with train_gpt, whose vocabulary is the 256 bytes")
    small = a.check
    a.layers = a.layers or (2 if small else 12)
    a.dim = a.dim or (64 if small else 768)
    a.heads = a.heads or (4 if small else 12)
    a.seq = a.seq or (64 if small else 1024)
    if a.ranks < 1 or a.batch % a.ranks:
        raise SystemExit(f"gpt_torch: --batch {a.batch} must split evenly over --ranks {a.ranks}")
    check(a) if a.check else run(a)


if __name__ == "__main__":
    main()
