#!/usr/bin/env python3
"""External oracle for the Byzantine-robust rules (aggregation/robust.h).

Writes fixed inputs (float32 updates, some of them Byzantine outliers) and,
transcribed independently of estuary from the papers, each rule's result:
  median        coordinate-wise median (Yin et al. 2018); NumPy's, in float64
  trimmed       coordinate-wise trimmed mean, beta (Yin et al. 2018): drop the
                floor(beta n) largest and smallest per coordinate, mean of the
                rest summed in ascending order (np.cumsum: sequential)
  krum_scores   sum of squared distances to the n - f - 2 nearest others
                (Blanchard et al. 2017), distances in float64
  krum_select   the updates by ascending score (stable: ties to the lower index)
  multikrum     the mean of the n - f lowest-scored updates
  bulyan_select theta = n - 2f picked by repeated Krum over the rest
  bulyan        per coordinate the beta = theta - 2f selected values closest
                to their median, averaged (El Mhamdi et al. 2018)
robust_oracle_test.cc replays the inputs through estuary and compares.

Usage: numpy_robust.py --out PATH
"""
import argparse
import sys

try:
    import numpy as np
except ImportError as error:  # fail loudly: a silent skip would hide a lost oracle
    sys.exit(f"numpy_robust.py: NumPy is not importable by {sys.executable}: {error}")

# (n updates, d values, f Byzantine, trim beta)
CASES = [(7, 50, 1, 0.15), (10, 37, 1, 0.2), (11, 64, 2, 0.1), (16, 129, 3, 0.25)]


def krum_scores(dist, among, f):
    n = len(among)
    k = max(n - f - 2, 0)
    scores = []
    for a in among:
        others = np.sort([dist[a, b] for b in among if b != a])
        scores.append(float(np.sum(others[:k])) if k else 0.0)
    return np.array(scores)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out_path = parser.parse_args().out
    rng = np.random.default_rng(2018)
    lines = ["estuary-robust-oracle 1"]
    fmt = lambda values: " ".join(repr(float(v)) for v in values)
    for n, d, f, beta in CASES:
        honest = rng.normal(0.5, 1.0, size=(n, d)).astype(np.float32)
        # f Byzantine updates: far away, in a random direction, at random positions.
        x = honest.copy()
        for i in rng.choice(n, size=f, replace=False):
            x[i] = (-20.0 * honest[i] + rng.normal(0, 5, size=d)).astype(np.float32)
        x64 = x.astype(np.float64)
        lines.append(f"case {n} {d} {f} {beta!r}")
        for row in x:
            lines.append("update " + fmt(row))
        lines.append("median " + fmt(np.median(x64, axis=0).astype(np.float32)))
        k = int(np.floor(beta * n))
        kept = np.sort(x64, axis=0)[k:n - k]
        lines.append("trimmed " + fmt((np.cumsum(kept, axis=0)[-1] / (n - 2 * k)).astype(np.float32)))
        dist = ((x64[:, None, :] - x64[None, :, :]) ** 2).sum(axis=-1)
        scores = krum_scores(dist, list(range(n)), f)
        order = np.argsort(scores, kind="stable")
        lines.append("krum_scores " + fmt(scores))
        lines.append("krum_select " + " ".join(str(i) for i in order))
        lines.append("multikrum " + fmt(x64[order[:n - f]].mean(axis=0).astype(np.float32)))
        theta = n - 2 * f
        remaining, selected = list(range(n)), []
        while len(selected) < theta:
            best = int(np.argsort(krum_scores(dist, remaining, f), kind="stable")[0])
            selected.append(remaining.pop(best))
        chosen = x64[selected]
        med = np.median(chosen, axis=0)
        closest = np.argsort(np.abs(chosen - med), axis=0, kind="stable")[:theta - 2 * f]
        bulyan = np.take_along_axis(chosen, closest, axis=0).mean(axis=0)
        lines.append("bulyan_select " + " ".join(str(i) for i in selected))
        lines.append("bulyan " + fmt(bulyan.astype(np.float32)))
    with open(out_path, "w") as out:
        out.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
