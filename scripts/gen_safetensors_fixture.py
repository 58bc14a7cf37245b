#!/usr/bin/env python3
"""Writes test/fixtures/safetensors_py.safetensors with the reference `safetensors` package.

test/data/test_safetensors.cpp reads it back and checks every value listed here, so keel's
reader is tested against a writer nobody here wrote. The values are exactly representable in
their dtypes, so the test can compare bit patterns. The package orders metadata keys freely,
so a re-run may give other bytes with the same content. Re-run only if the test's table changes:

    python3 scripts/gen_safetensors_fixture.py [output path]
"""
import pathlib
import sys

import torch
from safetensors.torch import save_file

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "test" / "fixtures" / "safetensors_py.safetensors"


def tensors():
    return {
        "f32": torch.tensor([[1.5, -2.0, 3.25], [0.0, -0.5, 1024.0]], dtype=torch.float32),
        "bf16": torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.bfloat16),
        "f16": torch.tensor([1.0, -2.0, 65504.0], dtype=torch.float16),
        "f64": torch.tensor([3.141592653589793, -1e300], dtype=torch.float64),
        "i32": torch.tensor([-1, 2147483647, 0], dtype=torch.int32),
        "i64": torch.tensor([[-5], [2**40]], dtype=torch.int64),
        "u16": torch.tensor([0, 65535, 1234], dtype=torch.uint16),
        "scalar": torch.tensor(7.0, dtype=torch.float32),
        "empty": torch.zeros((0, 3), dtype=torch.float32),
    }


def main():
    out = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT
    save_file(tensors(), str(out), metadata={"format": "pt", "source": "keel fixture"})
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
