#!/usr/bin/env python3
"""External oracle for FedBuff (aggregation/fedbuff.h).

Transcribed from Nguyen et al. 2022 ("Federated Learning with Buffered
Asynchronous Aggregation"), Algorithm 1, independently of estuary. Six sites
each minimise a least-squares objective F_i(y) = |A_i y - b_i|^2 / (2 m) with
Q full-batch SGD steps from the model version they pulled, and return the
paper's Delta_i = y_0 - y_Q. C of them train at once; which arrives next is
decided by a simulated clock (each site's speed is fixed), and a site that
arrives pulls the newest model and starts again. The server:

  Delta_bar += s(t - t_i) Delta_i      (t: its version; t_i: the site's)
  k += 1
  if k == K: w <- w - eta_g Delta_bar / K; t += 1; Delta_bar = 0; k = 0

refusing an update with t - t_i > max_staleness. s is constant, poly:A
((1 + tau)^-A) or hinge:A,B (1 if tau <= B, else 1 / (A (tau - B) + 1)).

Written per scenario: the start model, every arrival (the version it trained
from, its staleness or -1 when refused, its weight, and its delta in estuary's
convention local - global = -Delta_i, as float32) and every new version.

Usage: numpy_fedbuff.py --out PATH
"""
import argparse
import heapq
import sys

try:
    import numpy as np
except ImportError as error:  # fail loudly: a silent skip would hide a lost oracle
    sys.exit(f"numpy_fedbuff.py: NumPy is not importable by {sys.executable}: {error}")

D = 19          # parameters
SITES = 6
CONCURRENCY = 4
Q = 3           # local steps
LOCAL_LR = 0.05
ARRIVALS = 40
# (staleness weight, A, B, K, eta_g, max_staleness)
SCENARIOS = [("constant", 0, 0, 3, 1.0, 1000), ("poly", 0.5, 0, 2, 0.8, 1000), ("hinge", 10, 1, 3, 1.5, 1000),
             ("poly", 1.0, 0, 1, 1.0, 2)]


def s(form, a, b, tau):
    if form == "poly":
        return (1.0 + tau) ** (-a)
    if form == "hinge":
        return 1.0 if tau <= b else 1.0 / (a * (tau - b) + 1.0)
    return 1.0


def name(form, a, b):
    return {"constant": "constant", "poly": f"poly:{a:g}", "hinge": f"hinge:{a:g},{b:g}"}[form]


def fmt(values):
    return " ".join(repr(float(v)) for v in values)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rng = np.random.default_rng(2022)
    problems = [(rng.normal(size=(8, D)), rng.normal(size=8)) for _ in range(SITES)]
    speeds = [1.0, 0.2, 0.7, 1.3, 0.45, 0.9]  # local work per unit time
    lines = ["estuary-fedbuff-oracle 1"]
    for form, a, b, k_buffer, eta, max_staleness in SCENARIOS:
        w = rng.normal(size=D).astype(np.float32)
        lines.append(f"scenario {name(form, a, b)} {k_buffer} {eta!r} {max_staleness}")
        lines.append("start " + fmt(w))
        t, k, delta_bar = 0, 0, np.zeros(D)
        clock, queue = 0.0, []
        # sites 0..C-1 start on version 0; the next idle site takes an arrival's place
        idle = list(range(CONCURRENCY, SITES))

        def start(site, now):
            y0 = w.astype(np.float64)
            y = y0.copy()
            A, bb = problems[site]
            for _ in range(Q):
                y -= LOCAL_LR * A.T @ (A @ y - bb) / len(bb)
            heapq.heappush(queue, (now + 1.0 / speeds[site], site, t, (y0 - y).astype(np.float32)))

        for site in range(CONCURRENCY):
            start(site, clock)
        for _ in range(ARRIVALS):
            clock, site, t_i, delta = heapq.heappop(queue)
            tau = t - t_i
            if tau > max_staleness:
                lines.append(f"arrival {t_i} -1 0 " + fmt(-delta))
            else:
                weight = s(form, a, b, tau)
                lines.append(f"arrival {t_i} {tau} {weight!r} " + fmt(-delta))
                delta_bar += weight * delta.astype(np.float64)
                k += 1
                if k == k_buffer:
                    w = (w.astype(np.float64) - eta * delta_bar / k_buffer).astype(np.float32)
                    t += 1
                    k, delta_bar = 0, np.zeros(D)
                    lines.append(f"version {t} " + fmt(w))
            idle.append(site)
            start(idle.pop(0), clock)
    with open(args.out, "w") as out:
        out.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
