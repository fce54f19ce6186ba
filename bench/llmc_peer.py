#!/usr/bin/env python3
"""llm.c's GPT-2 on the same GPU, reported in train_gpt's terms: issue 36's moonshot figure.

llm.c (github.com/karpathy/llm.c) is not part of fsdp and nothing of it is in this repository: its
train_gpt2cu, built with cuDNN by whoever runs this, is given by --exe (gpu-check.sh's llmc stage
looks for it at build/llmc/train_gpt2cu; docs/gpu.md). This script writes the GPT's corpus in
llm.c's token-file format (a header of 256 int32: 20240520, version 1, the token count; then the
tokens as uint16: here the corpus's bytes, as train_gpt reads it), trains llm.c's GPT-2-small from
scratch (-e d12: 12 layers, 768 wide, 1024 tokens, GPT-2's vocabulary of 50,257, padded to
50,304) for --steps steps of --batch sequences (llm.c's defaults otherwise, GELU recomputed in
backward among them: -r 1), and prints the mean speed after the first step and the MFU both ways
against 989 TFLOP/s, counting llm.c's own parameters (its gpt2_estimate_mfu's N), in the lines
train_gpt and bench/gpt_torch.py print. llm.c times each step by CUDA events
around its training section (the data's next batch, forward, backward, update), where train_gpt
times the host's whole step: llm.c's figure leaves out what happens between its steps (printing).

  python3 bench/llmc_peer.py --exe build/llmc/train_gpt2cu --batch 4 --steps 20
"""
import argparse
import array
import os
import re
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from fsdp2_gpt import load_corpus  # noqa: E402  (gpt/data.hpp's corpus in Python)
from gpt_torch import print_speed  # noqa: E402  (train_gpt's summary lines; imports no torch)


def write_tokens(path, data):
    text, _ = load_corpus(data)
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, len(text), *([0] * 253)))
        tokens = array.array("H", list(text))  # each byte a uint16 (from bytes, array would copy the raw bytes)
        if sys.byteorder != "little":
            tokens.byteswap()
        f.write(tokens.tobytes())
    return len(text)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--exe", required=True, help="llm.c's train_gpt2cu")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--data", default="/usr/share/games/fortunes")
    p.add_argument("--llmc-args", default="", help="more of llm.c's own options, e.g. '-r 0 -z 1'")
    a = p.parse_args()
    if not os.access(a.exe, os.X_OK):
        raise SystemExit(f"llmc_peer: {a.exe} is not an executable (llm.c's train_gpt2cu)")
    with tempfile.TemporaryDirectory() as d:
        tokens = os.path.join(d, "tokens.bin")
        count = write_tokens(tokens, a.data)
        if count < a.batch * a.seq + 1:
            raise SystemExit(f"llmc_peer: {a.data} has {count} bytes, fewer than one batch of {a.batch} x {a.seq} + 1")
        # The same file for validation, one batch of it at the first step and after the last (llm.c
        # takes step % val_loss_every unguarded: -v 0 would divide by zero), outside its timed
        # section. No sampling (-s 0: it needs GPT-2's tokenizer file), checkpoints or log directory.
        cmd = [a.exe, "-i", tokens, "-j", tokens, "-e", "d12", "-b", str(a.batch), "-t", str(a.seq),
               "-d", str(a.batch * a.seq), "-x", str(a.steps), "-v", "1000000", "-m", "1", "-s", "0", "-n", "0",
               *a.llmc_args.split()]
        print("llmc_peer: " + " ".join(cmd), flush=True)
        run = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sys.stdout.write(run.stdout)
    if run.returncode != 0:
        raise SystemExit(f"llmc_peer: llm.c exited {run.returncode}")
    n = re.search(r"^num_parameters: (\d+)", run.stdout, re.M)
    L, C = re.search(r"num_layers L +\| (\d+)", run.stdout), re.search(r"channels C +\| (\d+)", run.stdout)
    steps = [(float(loss), float(ms)) for loss, ms in
             re.findall(r"^step +\d+/\d+ \| loss ([0-9.]+) .*\| ([0-9.]+) ms \|", run.stdout, re.M)]
    if not n or not L or not C or len(steps) < 2:
        raise SystemExit(f"llmc_peer: found {len(steps)} step lines and {'a' if n else 'no'} parameter count in "
                         "llm.c's output (its format changed?)")
    n, L, C = int(n.group(1)), int(L.group(1)), int(C.group(1))
    rate = a.batch * a.seq * (len(steps) - 1) / (sum(ms for _, ms in steps[1:]) / 1e3)
    print(f"loss {steps[0][0]:.4f} -> {steps[-1][0]:.4f} over {len(steps)} steps of {a.batch} x {a.seq} tokens")
    print_speed(rate, n, L, C, a.seq)


if __name__ == "__main__":
    main()
