#!/usr/bin/env python3
"""External oracles for the server optimisers of aggregation/fedopt.h and
aggregation/fedavgm.h, each fed the pseudo-gradient g = -Δ (Δ the
example-weighted mean client delta) in float64:

  fedadam     torch.optim.Adam(lr=η, betas=(β1, β2), eps=τ): Reddi et al.'s
              FedAdam with bias correction, exactly.
  fedadagrad  torch.optim.Adagrad(lr=η, eps=τ): Reddi et al.'s FedAdagrad with
              β1 = 0 (torch's Adagrad keeps no first moment).
  fedavgm     torch.optim.SGD(lr=η, momentum=β): Hsu et al.'s server momentum.
  fedyogi     torch has no Yogi: Reddi et al.'s Algorithm 2 written out here
              in float64 tensors, a second implementation of the rule.

It makes fixed float32 data (initial model, per-round client deltas and
weights) and writes, per strategy, the inputs and the parameters after every
round to OUT_DIR/<strategy>.txt, which fedopt_oracle_test.cc replays through
estuary's strategies.

Usage: torch_fedopt.py --out OUT_DIR
"""
import argparse
import os
import sys

try:
    import torch
except ImportError as error:  # fail loudly: a silent skip would hide a lost oracle
    sys.exit(f"torch_fedopt.py: PyTorch is not importable by {sys.executable}: {error}")

PARAMETERS = 600
ROUNDS = 5
CLIENTS = 3


class Yogi:
    """Reddi et al. 2021, Algorithm 2 (FedYogi), v and m starting at zero."""

    def __init__(self, param, lr, beta1, beta2, tau):
        self.param, self.lr, self.beta1, self.beta2, self.tau = param, lr, beta1, beta2, tau
        self.m = torch.zeros_like(param)
        self.v = torch.zeros_like(param)

    def step(self, delta):
        self.m = self.beta1 * self.m + (1 - self.beta1) * delta
        square = delta * delta
        self.v = self.v - (1 - self.beta2) * square * torch.sign(self.v - square)
        self.param += self.lr * self.m / (torch.sqrt(self.v) + self.tau)


# name: (options line "lr beta1 beta2 tau momentum bias_correction", how to make the optimiser)
STRATEGIES = {
    "fedadam": ((0.05, 0.9, 0.99, 1e-3, 0.0, 1),
                lambda p, o: torch.optim.Adam([p], lr=o[0], betas=(o[1], o[2]), eps=o[3])),
    "fedadagrad": ((0.05, 0.0, 0.0, 1e-3, 0.0, 0),
                   lambda p, o: torch.optim.Adagrad([p], lr=o[0], eps=o[3])),
    "fedavgm": ((0.7, 0.0, 0.0, 1e-3, 0.9, 0),
                lambda p, o: torch.optim.SGD([p], lr=o[0], momentum=o[4])),
    # β2 = 0.5 so that v overtakes Δ² for some parameters within five rounds: both of sign(v - Δ²)'s cases.
    "fedyogi": ((0.1, 0.9, 0.5, 1e-3, 0.0, 0), None),
}


def floats(tensor):
    # repr of a Python float round-trips exactly, so float32 inputs arrive bit-exact.
    return " ".join(repr(float(v)) for v in tensor.tolist())


def write(out_dir, name, options, make):
    generator = torch.Generator().manual_seed(20210503)
    # Parameters away from zero so a relative comparison is meaningful.
    magnitude = 0.5 + torch.rand(PARAMETERS, generator=generator)
    sign = torch.where(torch.rand(PARAMETERS, generator=generator) < 0.5, -1.0, 1.0)
    x0 = (magnitude * sign).to(torch.float32)
    # Per-parameter scales from 1e-5 to 1: small ones put √v near τ, where the
    # choice of formula matters most.
    scale = 10.0 ** (-5.0 * torch.rand(PARAMETERS, generator=generator))

    param = torch.nn.Parameter(x0.to(torch.float64).clone())
    optimizer = make(param, options) if make else None
    yogi = None if make else Yogi(param.data, *options[:4])

    lines = [
        "estuary-fedopt-oracle 1",
        f"strategy {name}",
        f"shape {PARAMETERS} {ROUNDS} {CLIENTS}",
        "options " + " ".join(repr(float(v)) for v in options),
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
        if optimizer:
            optimizer.zero_grad()
            param.grad = -mean_delta  # the server "gradient" points against the clients' progress
            optimizer.step()
        else:
            with torch.no_grad():
                yogi.step(mean_delta)
        lines.append(f"after {floats(param.detach())}")

    path = os.path.join(out_dir, name + ".txt")
    with open(path + ".tmp", "w") as out:
        out.write("\n".join(lines) + "\n")
    os.replace(path + ".tmp", path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="a directory; one file per strategy")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for name, (options, make) in STRATEGIES.items():
        write(args.out, name, options, make)
    print(f"torch {torch.__version__}: wrote {ROUNDS} rounds of {PARAMETERS} parameters for "
          f"{', '.join(STRATEGIES)} to {args.out}")


if __name__ == "__main__":
    main()
