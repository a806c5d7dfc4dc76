#!/usr/bin/python3
"""The baseline for bench/sim_vs_pytorch: the same federated scenario as a
plain PyTorch loop, the way a Python framework runs a simulation.

Clients train one after another with torch's own intra-op threads; each
client loads the global state, runs SGD for E epochs over its shard in
batches of B, and the server takes the example-weighted mean of the models.
Prints one JSON line: seconds, final accuracy, rounds.
"""
import argparse
import json
import os
import struct
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

# The same model definitions the numerics oracle checks Estuary against.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "models"))
from torch_models import CNN, MLP  # noqa: E402


def read_idx(path):
    with open(path, "rb") as f:
        magic = struct.unpack(">I", f.read(4))[0]
        dims = [struct.unpack(">I", f.read(4))[0] for _ in range(magic & 0xFF)]
        return np.frombuffer(f.read(), dtype=np.uint8).reshape(dims)


def load(data, split):
    prefix = "train" if split == "train" else "t10k"
    x = read_idx(f"{data}/{prefix}-images-idx3-ubyte").astype(np.float32) / 255.0
    y = read_idx(f"{data}/{prefix}-labels-idx1-ubyte").astype(np.int64)
    return torch.from_numpy(x.reshape(len(x), 784)), torch.from_numpy(y)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--per-round", type=int, default=10)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--model", default="mlp")
    p.add_argument("--seed", type=int, default=2017)
    a = p.parse_args()
    torch.manual_seed(a.seed)
    rng = np.random.default_rng(a.seed)
    x, y = load(a.data, "train")
    tx, ty = load(a.data, "test")
    shards = np.array_split(rng.permutation(len(x)), a.clients)
    model = MLP() if a.model == "mlp" else CNN()
    start = time.perf_counter()
    accuracy = 0.0
    for _ in range(a.rounds):
        global_state = {k: v.clone() for k, v in model.state_dict().items()}
        total = {k: torch.zeros_like(v) for k, v in global_state.items()}
        weight = 0
        for c in rng.choice(a.clients, a.per_round, replace=False):
            model.load_state_dict(global_state)
            opt = torch.optim.SGD(model.parameters(), lr=a.lr)
            idx = torch.from_numpy(shards[c])
            for _ in range(a.epochs):
                order = idx[torch.randperm(len(idx))]
                for b in range(0, len(order), a.batch):
                    batch = order[b:b + a.batch]
                    opt.zero_grad()
                    F.cross_entropy(model(x[batch]), y[batch]).backward()
                    opt.step()
            for k, v in model.state_dict().items():
                total[k] += v * len(idx)
            weight += len(idx)
        model.load_state_dict({k: v / weight for k, v in total.items()})
        with torch.no_grad():
            accuracy = (model(tx).argmax(1) == ty).float().mean().item()
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "final_accuracy": accuracy, "rounds": a.rounds,
                      "torch": torch.__version__, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
