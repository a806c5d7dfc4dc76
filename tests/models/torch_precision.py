#!/usr/bin/python3
"""Writes PyTorch's bf16/fp16 conversions as bit patterns for precision_test.
Usage: torch_precision.py OUT_DIR. Writes OUT_DIR/precision.json:
  f32:  fp32 inputs (uint32 bits): specials, every fp16 value, the exact ties
        between neighbouring fp16 values and one fp32 ulp either side, bf16
        ties, and seeded random bit patterns (every exponent, NaNs included);
  bf16, f16: torch's .to(torch.bfloat16 / torch.float16) of them (uint16 bits);
  bf16_to_f32, f16_to_f32: torch's .float() of all 65536 patterns (uint32 bits)."""
import json
import os
import sys

try:
    import numpy as np
    import torch
except ImportError as e:  # fail loudly: these tests are the numerics oracle
    sys.exit(f"torch_precision.py: PyTorch and numpy are required (python3-torch, python3-numpy): {e}")

out_dir = sys.argv[1]
os.makedirs(out_dir, exist_ok=True)
rng = np.random.default_rng(20240517)

specials = [0x00000000, 0x80000000, 0x7f800000, 0xff800000,  # ±0, ±inf
            0x7fc00000, 0xffc00000, 0x7f800001, 0xff800001, 0x7fffffff, 0x7fa00000, 0x7f80ffff,  # NaNs
            0x7f7fffff, 0xff7fffff, 0x7f7f8000, 0x7f7f7fff,  # fp32 max, around the bf16 overflow tie
            0x00800000, 0x00000001, 0x007fffff, 0x80000001,  # fp32 min normal and subnormals
            0x477fe000, 0x477fefff, 0x477ff000, 0x477ff001, 0x47800000,  # 65504 .. 65536
            0x38800000, 0x387fffff, 0x387fe000, 0x387ff000,  # around 2^-14, the smallest normal fp16
            0x33800000, 0x33000000, 0x33000001, 0x32ffffff, 0x33c00000, 0x33a00000]  # 2^-24, 2^-25 ...

# Every finite fp16 value, the tie halfway to its successor, and one fp32 ulp either side of the tie.
h = np.arange(0, 0x7c00, dtype=np.uint16)
lo = h.view(np.float16).astype(np.float64)
hi = (h + 1).view(np.float16).astype(np.float64)
ties = ((lo + hi) / 2).astype(np.float32).view(np.uint32)  # exact: fp16 midpoints fit in fp32
f16_cases = np.concatenate([lo.astype(np.float32).view(np.uint32), ties, ties - 1, ties + 1])
f16_cases = np.concatenate([f16_cases, f16_cases | np.uint32(0x80000000)])

# bf16 ties and near-ties at random magnitudes.
upper = rng.integers(0, 1 << 16, size=20000, dtype=np.uint32) << np.uint32(16)
bf16_cases = np.concatenate([upper | np.uint32(0x8000), upper | np.uint32(0x7fff), upper | np.uint32(0x8001)])

random_bits = rng.integers(0, 1 << 32, size=100000, dtype=np.uint64).astype(np.uint32)

f32 = np.concatenate([np.array(specials, dtype=np.uint32), f16_cases, bf16_cases, random_bits])
x = torch.from_numpy(f32.view(np.float32).copy())
bf16 = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
f16 = x.to(torch.float16).view(torch.int16).numpy().view(np.uint16)

every = torch.from_numpy(np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.int16).copy())
bf16_to_f32 = every.view(torch.bfloat16).float().view(torch.int32).numpy().view(np.uint32)
f16_to_f32 = every.view(torch.float16).float().view(torch.int32).numpy().view(np.uint32)

with open(os.path.join(out_dir, "precision.json"), "w") as f:
    json.dump({"f32": f32.tolist(), "bf16": bf16.tolist(), "f16": f16.tolist(),
               "bf16_to_f32": bf16_to_f32.tolist(), "f16_to_f32": f16_to_f32.tolist()}, f)
