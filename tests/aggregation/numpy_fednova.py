#!/usr/bin/env python3
"""External oracle for FedNova (aggregation/fednova.h, client/local_work.h).

Transcribed from Wang et al. 2020 ("Tackling the Objective Inconsistency
Problem in Heterogeneous Federated Optimization"), independently of estuary.
Each site i minimises a least-squares objective F_i(x) = |A_i x - b_i|^2 / (2 m)
from the global x0 with its own local solver for tau_i full-batch steps:
  plain SGD, SGD with momentum rho (torch's: buf = rho buf + g; x -= lr buf),
  or SGD on F_i + mu/2 |x - x0|^2 (FedProx).
The site's update Delta_i = x_i - x0 (float32) is what estuary folds. The
oracle's next model follows the paper's eq. (6)-(8) from the recorded
gradients G_i = [g_0 .. g_{tau-1}] of F_i alone, not from Delta_i:
  d_i = G_i a_i / |a_i|_1
  x1  = x0 - tau_eff * lr * sum_i p_i d_i,  tau_eff = sum_i p_i |a_i|_1
with the paper's a_i: ones (SGD); (1 - rho^(tau-k)) / (1 - rho) (momentum,
its Appendix); (1 - lr mu)^(tau-1-k) (proximal). p_i = n_i / sum n.
Also written: FedAvg's x0 + sum p_i Delta_i for the same updates.

Usage: numpy_fednova.py --out PATH
"""
import argparse
import sys

try:
    import numpy as np
except ImportError as error:  # fail loudly: a silent skip would hide a lost oracle
    sys.exit(f"numpy_fednova.py: NumPy is not importable by {sys.executable}: {error}")

D = 23  # parameters
LR = 0.05
# (solver, tau, rho or mu, examples n_i)
SITES = [("sgd", 3, 0.0, 40), ("momentum", 7, 0.9, 25), ("prox", 5, 0.1, 60), ("sgd", 12, 0.0, 10),
         ("momentum", 2, 0.5, 33), ("prox", 9, 0.5, 17)]


def a_vector(solver, tau, param):
    k = np.arange(tau, dtype=np.float64)
    if solver == "sgd":
        return np.ones(tau)
    if solver == "momentum":
        return (1.0 - param ** (tau - k)) / (1.0 - param)
    return (1.0 - LR * param) ** (tau - 1 - k)


def local_run(rng, x0, solver, tau, param):
    m = 8
    A = rng.normal(0, 1, size=(m, D))
    b = rng.normal(0, 1, size=m)
    grad = lambda x: A.T @ (A @ x - b) / m
    x = x0.copy()
    buf = np.zeros(D)
    grads = []
    for _ in range(tau):
        g = grad(x)
        grads.append(g)
        if solver == "momentum":
            buf = param * buf + g
            x = x - LR * buf
        elif solver == "prox":
            x = x - LR * (g + param * (x - x0))
        else:
            x = x - LR * g
    return x - x0, np.stack(grads, axis=1)  # G: D x tau


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out_path = parser.parse_args().out
    rng = np.random.default_rng(2020)
    fmt = lambda values: " ".join(repr(float(v)) for v in values)
    x0 = rng.normal(0, 0.5, size=D).astype(np.float32).astype(np.float64)
    lines = ["estuary-fednova-oracle 1", f"lr {LR!r}", "global " + fmt(x0)]
    n_total = sum(s[3] for s in SITES)
    step = np.zeros(D)
    tau_eff = 0.0
    fedavg = np.zeros(D)
    for solver, tau, param, n in SITES:
        delta, G = local_run(rng, x0, solver, tau, param)
        delta32 = delta.astype(np.float32)
        a = a_vector(solver, tau, param)
        norm = float(np.sum(a))
        p = n / n_total
        step += p * (G @ a) / norm
        tau_eff += p * norm
        fedavg += p * delta32.astype(np.float64)
        rho = param if solver == "momentum" else 0.0
        mu = param if solver == "prox" else 0.0
        lines.append(f"site {n} {tau} {rho!r} {mu!r} {norm!r} " + fmt(delta32))
    lines.append("fednova " + fmt(x0 - tau_eff * LR * step))
    lines.append("fedavg " + fmt(x0 + fedavg))
    lines.append(f"tau_eff {tau_eff!r}")
    with open(out_path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
