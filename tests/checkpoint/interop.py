"""Reads fsdp's sample with the safetensors package and checks every value, then writes a file
of its own for fsdp to check. The values are a formula both sides compute (safetensors_sample.cpp)."""
import sys

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file


def expected():
    return {
        "layer.0.w": (np.arange(6, dtype=np.float32) * 0.5 - 1.0).reshape(2, 3),
        "layer.0.b": np.arange(5, dtype=np.float64) / 3.0,
        "step": np.array([42], dtype=np.int64),
    }


def main(ours, theirs):
    want = expected()
    with safe_open(ours, framework="numpy") as f:
        assert sorted(f.keys()) == sorted(want), f"names {sorted(f.keys())}"
        assert f.metadata() == {"format": "fsdp-sample", "ranks": "1"}, f"metadata {f.metadata()}"
        for name, value in want.items():
            got = f.get_tensor(name)
            assert got.dtype == value.dtype and got.shape == value.shape, f"{name}: {got.dtype}{got.shape}"
            assert np.array_equal(got, value), f"{name}: {got} != {value}"
    print(f"interop: python read fsdp's {ours}: {len(want)} tensors equal")
    save_file({"x": np.arange(12, dtype=np.float32).reshape(3, 4) * 0.25, "n": np.array([7, -7], dtype=np.int32)},
              theirs, metadata={"by": "python"})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
