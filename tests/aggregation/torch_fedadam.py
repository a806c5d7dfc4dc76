#!/usr/bin/env python3
"""External oracle for FedAdam: torch.optim.Adam on the pseudo-gradient -Δ.

Reddi et al.'s FedAdam with bias correction is exactly Adam with lr=η,
betas=(β1, β2), eps=τ applied to g = -Δ, where Δ is the example-weighted mean
client delta. This script makes fixed float32 data (initial model, per-round
client deltas and weights), runs torch's Adam in float64 over it, and writes
inputs and the parameters after every round to a text file that
fedadam_oracle_test.cc replays through estuary's FedAdam.

Usage: torch_fedadam.py --out PATH
"""
import argparse
import os
import sys

try:
    import torch
except ImportError as error:  # fail loudly: a silent skip would hide a lost oracle
    sys.exit(f"torch_fedadam.py: PyTorch is not importable by {sys.executable}: {error}")

PARAMETERS = 600
ROUNDS = 5
CLIENTS = 3
LR, BETA1, BETA2, TAU = 0.05, 0.9, 0.99, 1e-3


def floats(tensor):
    # repr of a Python float round-trips exactly, so float32 inputs arrive bit-exact.
    return " ".join(repr(float(v)) for v in tensor.tolist())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    generator = torch.Generator().manual_seed(20210503)
    # Parameters away from zero so a relative comparison is meaningful.
    magnitude = 0.5 + torch.rand(PARAMETERS, generator=generator)
    sign = torch.where(torch.rand(PARAMETERS, generator=generator) < 0.5, -1.0, 1.0)
    x0 = (magnitude * sign).to(torch.float32)
    # Per-parameter scales from 1e-5 to 1: small ones put √v near τ, where the
    # choice of formula matters most.
    scale = 10.0 ** (-5.0 * torch.rand(PARAMETERS, generator=generator))

    param = torch.nn.Parameter(x0.to(torch.float64).clone())
    adam = torch.optim.Adam([param], lr=LR, betas=(BETA1, BETA2), eps=TAU)

    lines = [
        "estuary-fedadam-oracle 1",
        f"shape {PARAMETERS} {ROUNDS} {CLIENTS}",
        f"options {LR!r} {BETA1!r} {BETA2!r} {TAU!r}",
        f"x0 {floats(x0)}",
    ]
    for _ in range(ROUNDS):
        weighted = torch.zeros(PARAMETERS, dtype=torch.float64)
        total_weight = 0.0
        for _ in range(CLIENTS):
            weight = float(torch.randint(1, 500, (1,), generator=generator).item())
            delta = (torch.randn(PARAMETERS, generator=generator) * scale + 0.3 * scale).to(torch.float32)
            lines.append(f"client {weight!r} {floats(delta)}")
            weighted += weight * delta.to(torch.float64)
            total_weight += weight
        mean_delta = weighted / total_weight
        adam.zero_grad()
        param.grad = -mean_delta  # the server "gradient" points against the clients' progress
        adam.step()
        lines.append(f"after {floats(param.detach())}")

    temporary = args.out + ".tmp"
    with open(temporary, "w") as out:
        out.write("\n".join(lines) + "\n")
    os.replace(temporary, args.out)
    print(f"torch {torch.__version__}: wrote {ROUNDS} rounds of {PARAMETERS} parameters to {args.out}")


if __name__ == "__main__":
    main()
