#!/usr/bin/env python3
"""External oracle for exact LoRA merging: torch.linalg.svd of the average update.

Makes fixed float32 LoRA adapters for one module from clients of different
ranks and alphas, forms the example-weighted average update
ΔW_avg = Σ w_i (alpha_i / r_i) B_i A_i / Σ w_i in float64, and writes the
adapters, the weights and every singular value of ΔW_avg (torch.linalg.svd, a
dense SVD of the out x in matrix: a different route from lora_merge.cc's
QR-of-the-stacks) to a text file that lora_merge_oracle_test.cc replays.

Usage: torch_lora_svd.py --out PATH
"""
import argparse
import os
import sys

try:
    import torch
except ImportError as error:  # fail loudly: a silent skip would hide a lost oracle
    sys.exit(f"torch_lora_svd.py: PyTorch is not importable by {sys.executable}: {error}")

OUT, IN = 80, 96
RANKS = (4, 8, 16)
ALPHAS = (8.0, 16.0, 32.0)
TARGET_RANK, TARGET_ALPHA = 8, 16.0


def floats(tensor):
    # repr of a Python float round-trips exactly, so float32 inputs arrive bit-exact.
    return " ".join(repr(float(v)) for v in tensor.reshape(-1).tolist())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    generator = torch.Generator().manual_seed(20241105)
    lines = [
        "estuary-lora-svd-oracle 1",
        f"shape {OUT} {IN} {len(RANKS)} {TARGET_RANK} {TARGET_ALPHA!r}",
    ]
    average = torch.zeros(OUT, IN, dtype=torch.float64)
    total_weight = 0.0
    for rank, alpha in zip(RANKS, ALPHAS):
        weight = float(torch.randint(1, 500, (1,), generator=generator).item())
        a = (torch.randn(rank, IN, generator=generator) / IN ** 0.5).to(torch.float32)
        b = (torch.randn(OUT, rank, generator=generator) * 0.1).to(torch.float32)
        lines += [f"client {weight!r} {rank} {alpha!r}", f"a {floats(a)}", f"b {floats(b)}"]
        average += weight * (alpha / rank) * (b.to(torch.float64) @ a.to(torch.float64))
        total_weight += weight
    average /= total_weight
    sigma = torch.linalg.svd(average, full_matrices=False).S
    kept = min(sum(RANKS), OUT, IN)
    lines.append(f"sigma {floats(sigma[:kept])}")

    temporary = args.out + ".tmp"
    with open(temporary, "w") as out:
        out.write("\n".join(lines) + "\n")
    os.replace(temporary, args.out)
    print(f"torch {torch.__version__}: wrote {len(RANKS)} adapters and {kept} singular values to {args.out}")


if __name__ == "__main__":
    main()
