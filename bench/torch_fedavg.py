#!/usr/bin/python3
"""The baseline for bench/sim_vs_pytorch: the same federated scenario as a
plain PyTorch loop, the way a Python framework runs a simulation.

Each sampled client loads the global state, runs SGD for E epochs over its
shard in batches of B, and the server takes the example-weighted mean of the
models. Two ways to use N cores:
  --threads T   clients one after another in this process, torch's intra-op
                pool at T threads (torch.set_num_threads);
  --workers N   N single-threaded worker processes that each train a share of
                a round's clients, as a Python framework's simulation runs one
                client per CPU (Flower's, on Ray); the state travels pickled.
Prints one JSON line: seconds, final accuracy, rounds, threads, workers.
"""
import argparse
import json
import multiprocessing
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


# A worker process's copy of the training set, set by its initializer.
_train = None


def _init_worker(data):
    global _train
    torch.set_num_threads(1)
    _train = load(data, "train")


def train_client(model, global_state, x, y, idx, a, generator):
    """One client's local training from the global state; its state and weight."""
    model.load_state_dict(global_state)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr)
    for _ in range(a.epochs):
        order = idx[torch.randperm(len(idx), generator=generator)]
        for b in range(0, len(order), a.batch):
            batch = order[b:b + a.batch]
            opt.zero_grad()
            F.cross_entropy(model(x[batch]), y[batch]).backward()
            opt.step()
    return model.state_dict(), len(idx)


def _worker_round(job):
    """In a worker: its share of one round's clients, summed by weight."""
    a, global_state, shares = job
    x, y = _train
    model = MLP() if a.model == "mlp" else CNN()
    total, weight = None, 0
    for client, idx, seed in shares:
        state, n = train_client(model, global_state, x, y, torch.from_numpy(idx), a,
                                torch.Generator().manual_seed(int(seed)))
        if total is None:
            total = {k: v * n for k, v in state.items()}
        else:
            for k, v in state.items():
                total[k] += v * n
        weight += n
    return total, weight


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
    p.add_argument("--threads", type=int, default=0, help="torch's intra-op threads (0: torch's default)")
    p.add_argument("--workers", type=int, default=0, help="single-threaded worker processes (0: none)")
    a = p.parse_args()
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    rng = np.random.default_rng(a.seed)
    x, y = load(a.data, "train")
    tx, ty = load(a.data, "test")
    shards = np.array_split(rng.permutation(len(x)), a.clients)
    model = MLP() if a.model == "mlp" else CNN()
    pool = None
    if a.workers > 0:
        # Started (and the data loaded in each) before the clock, as a framework's actors are.
        pool = multiprocessing.get_context("fork").Pool(a.workers, initializer=_init_worker, initargs=(a.data,))
        pool.map(abs, range(a.workers))
    start = time.perf_counter()
    accuracy = 0.0
    for _ in range(a.rounds):
        global_state = {k: v.clone() for k, v in model.state_dict().items()}
        total = {k: torch.zeros_like(v) for k, v in global_state.items()}
        weight = 0
        selected = rng.choice(a.clients, a.per_round, replace=False)
        if pool is not None:
            seeds = rng.integers(0, 2**62, len(selected))
            jobs = [(a, global_state, [(c, shards[c], s) for c, s in zip(selected[w::a.workers], seeds[w::a.workers])])
                    for w in range(min(a.workers, len(selected)))]
            for part, n in pool.map(_worker_round, jobs):
                for k, v in part.items():
                    total[k] += v
                weight += n
        else:
            for c in selected:
                state, n = train_client(model, global_state, x, y, torch.from_numpy(shards[c]), a, None)
                for k, v in state.items():
                    total[k] += v * n
                weight += n
        model.load_state_dict({k: v / weight for k, v in total.items()})
        with torch.no_grad():
            accuracy = (model(tx).argmax(1) == ty).float().mean().item()
    seconds = time.perf_counter() - start
    if pool is not None:
        pool.close()
        pool.join()
    print(json.dumps({"seconds": seconds, "final_accuracy": accuracy, "rounds": a.rounds,
                      "torch": torch.__version__, "threads": torch.get_num_threads(), "workers": a.workers}))


if __name__ == "__main__":
    main()
