#!/usr/bin/env python3
"""External oracle for DP-FedAvg's adaptive clipping (Andrew et al. 2021).

Writes per-round update norms (with dropouts: fewer reports than sampled) and,
written out independently of estuary from the paper's update rule, the clip
norm after every round and the mean the round releases; dp_adaptive_clip_test.cc
replays the norms through estuary's DpFedAvg with negligible noise and
compares. Also writes the sum's noise multiplier z_delta for a few (z, sigma_b).

Paper, Algorithm 1 with the geometric update; TensorFlow Privacy's quantile
estimator centres each bit and clamps the estimate to [0, 1]:
    b_tilde = clamp((sum(b_i - 1/2) + N(0, sigma_b^2)) / k + 1/2, 0, 1)
    C <- C * exp(-eta * (b_tilde - gamma))
    z_delta = (z^-2 - (2 sigma_b)^-2)^-1/2
Estuary stores C as float32 between rounds, so this does too.

Usage: numpy_adaptive_clip.py --out PATH
"""
import argparse
import sys

try:
    import numpy as np
except ImportError as error:  # fail loudly: a silent skip would hide a lost oracle
    sys.exit(f"numpy_adaptive_clip.py: NumPy is not importable by {sys.executable}: {error}")

ROUNDS = 40
SAMPLED = 20
CLIP0, GAMMA, ETA = 0.1, 0.7, 0.2


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out_path = parser.parse_args().out
    rng = np.random.default_rng(2021)
    lines = ["estuary-dp-adaptive-clip-oracle 1", f"options {SAMPLED} {CLIP0!r} {GAMMA!r} {ETA!r}"]
    clip = np.float32(CLIP0)
    for _ in range(ROUNDS):
        reported = SAMPLED - int(rng.integers(0, 4))  # up to 3 sites drop out
        norms = rng.lognormal(mean=0.0, sigma=0.5, size=reported)  # median 1: C must climb from 0.1
        # The release: every update is (norm, 0, ...), clipped, summed, over SAMPLED.
        mean = float(np.sum(np.minimum(norms, float(clip)))) / SAMPLED
        below = norms <= float(clip)
        estimate = min(max(float(np.sum(below.astype(np.float64) - 0.5)) / SAMPLED + 0.5, 0.0), 1.0)
        clip = np.float32(float(clip) * np.exp(-ETA * (estimate - GAMMA)))
        lines.append(f"round {reported} " + " ".join(repr(float(n)) for n in norms))
        lines.append(f"after {mean!r} {float(clip)!r}")
    for z, sigma_b in [(1.0, 1.0), (0.5, 0.3), (2.0, 5.0)]:
        z_delta = (z ** -2 - (2 * sigma_b) ** -2) ** -0.5
        lines.append(f"z_delta {z!r} {sigma_b!r} {z_delta!r}")
    with open(out_path, "w") as out:
        out.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
