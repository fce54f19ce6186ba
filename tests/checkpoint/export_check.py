"""Reads the full-parameter files fsdp's export_full wrote (safetensors_sample export DIR) with the
safetensors package and compares them with the parameters the model gathered one by one
(reference.f32, raw little-endian float32; names, sizes and shapes in reference.txt).
The f32 file must equal the reference bit for bit; the bf16 file must hold each value rounded to
nearest even (numpy has no bfloat16: its 16-bit patterns are compared with the rounding done
here on the float32 bits)."""
import json
import struct
import sys

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file


def reference(d):
    raw = np.fromfile(f"{d}/reference.f32", dtype="<f4")
    out, at = {}, 0
    for line in open(f"{d}/reference.txt"):
        name, n, *shape = line.split()
        out[name] = raw[at:at + int(n)].reshape([int(x) for x in shape] or [int(n)])
        at += int(n)
    assert at == raw.size, f"reference.f32 holds {raw.size} values, reference.txt lists {at}"
    return out


def bf16_bits(x):
    """float32 -> bfloat16 bit patterns, round to nearest even (finite values)."""
    u = x.astype("<f4").view("<u4").astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def main(d):
    want = reference(d)
    got = load_file(f"{d}/model_f32.safetensors")
    assert sorted(got) == sorted(want), f"names {sorted(got)} != {sorted(want)}"
    for name, value in want.items():
        assert got[name].dtype == np.float32 and got[name].shape == value.shape, f"{name}: {got[name].dtype}{got[name].shape}"
        assert np.array_equal(got[name].view("<u4"), value.view("<u4")), f"{name}: f32 values differ"
    with safe_open(f"{d}/model_bf16.safetensors", framework="numpy") as f:
        assert sorted(f.keys()) == sorted(want)
        for name in want:
            assert f.get_slice(name).get_dtype() == "BF16", f"{name}: {f.get_slice(name).get_dtype()}"
    # The bf16 bytes, by the offsets of the file's own header.
    blob = open(f"{d}/model_bf16.safetensors", "rb").read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    for name, value in want.items():
        b, e = header[name]["data_offsets"]
        bits = np.frombuffer(blob[8 + n + b:8 + n + e], dtype="<u2")
        assert np.array_equal(bits, bf16_bits(value).ravel()), f"{name}: bf16 values are not the reference rounded to nearest even"
    print(f"export: python read fsdp's full export, {len(want)} parameters equal to the gathered model (f32 exact, bf16 rounded)")


if __name__ == "__main__":
    main(sys.argv[1])
