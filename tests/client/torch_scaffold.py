#!/usr/bin/env python3
"""External oracle for one SCAFFOLD round (client/scaffold.h, aggregation/scaffold.h).

Transcribed from Karimireddy et al. 2020, Algorithm 1 with option II,
independently of estuary, on McMahan's 2NN (784-200-200-10, ReLU) in torch:
  each site i, from x with the server's c and its own c_i, K local steps
    y <- y - lr * (grad f_i(y) + c - c_i)       (f_i: mean cross-entropy)
  c_i+ = c_i - c + (x - y) / (K lr),   dy_i = y - x,   dc_i = c_i+ - c_i
  server: x+ = x + sum w_i dy_i / sum w_i      (w_i: the site's examples)
          c+ = c + (1/N) sum dc_i
Every step is full-batch (each site's batch is all its examples), so the
order in which estuary visits them changes nothing but rounding.

Reads DIR/inputs (little-endian float32): the flat model x, c, then per site
its c_i, its rows [n, 784] and its labels (as floats); DIR/shape holds
"P N K lr n_1 n_2 ...". Writes DIR/x_next, DIR/c_next and DIR/site_<i>
(c_i+), float32.

Usage: torch_scaffold.py DIR
"""
import os
import sys

try:
    import numpy as np
    import torch
except ImportError as error:  # fail loudly: a silent skip would hide a lost oracle
    sys.exit(f"torch_scaffold.py: torch/NumPy not importable by {sys.executable}: {error}")

SHAPES = [("fc1.weight", (200, 784)), ("fc1.bias", (200,)), ("fc2.weight", (200, 200)), ("fc2.bias", (200,)),
          ("fc3.weight", (10, 200)), ("fc3.bias", (10,))]


def unflatten(flat):
    out, at = [], 0
    for _, shape in SHAPES:
        size = int(np.prod(shape))
        out.append(flat[at:at + size].reshape(shape))
        at += size
    return out


def loss_of(params, x, y):
    w1, b1, w2, b2, w3, b3 = params
    h = torch.relu(x @ w1.T + b1)
    h = torch.relu(h @ w2.T + b2)
    return torch.nn.functional.cross_entropy(h @ w3.T + b3, y)


def main():
    out = sys.argv[1]
    header = open(os.path.join(out, "shape")).read().split()
    p, n_sites, k, lr = int(header[0]), int(header[1]), int(header[2]), float(header[3])
    counts = [int(v) for v in header[4:]]
    data = np.fromfile(os.path.join(out, "inputs"), dtype="<f4")
    at = 0

    def take(n):
        nonlocal at
        values = torch.from_numpy(data[at:at + n].copy())
        at += n
        return values

    x = take(p)
    c = take(p)
    sites = []
    for n in counts:
        sites.append((take(p), take(n * 784).reshape(n, 784), take(n).long(), n))
    assert at == len(data), "inputs longer than the shape says"

    dy_sum = torch.zeros(p, dtype=torch.float64)
    dc_sum = torch.zeros(p, dtype=torch.float64)
    weight = 0.0
    for i, (c_i, rows, labels, n) in enumerate(sites):
        y = x.clone()
        correction = c - c_i
        for _ in range(k):
            params = [t.clone().requires_grad_(True) for t in unflatten(y)]
            loss = loss_of(params, rows, labels)
            grads = torch.autograd.grad(loss, params)
            g = torch.cat([t.reshape(-1) for t in grads])
            y = y - lr * (g + correction)
        dy = (y - x).double()
        c_next = c_i.double() - c.double() + (x.double() - y.double()) / (k * lr)
        (c_next.float()).numpy().astype("<f4").tofile(os.path.join(out, f"site_{i}"))
        dy_sum += n * dy
        dc_sum += c_next - c_i.double()
        weight += n
    x_next = x.double() + dy_sum / weight
    c_next = c.double() + dc_sum / n_sites
    x_next.float().numpy().astype("<f4").tofile(os.path.join(out, "x_next"))
    c_next.float().numpy().astype("<f4").tofile(os.path.join(out, "c_next"))


if __name__ == "__main__":
    main()
