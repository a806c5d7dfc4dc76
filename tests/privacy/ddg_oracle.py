#!/usr/bin/env python3
"""The distributed discrete Gaussian's epsilon, transcribed independently in
plain Python (math only) from Kairouz, Liu and Steinke 2021, Prop. 14, and Zhu
and Wang 2019's general Poisson-subsampling bound, with the tight RDP -> (eps,
delta) conversion; writes one line per case for distributed_dp_test.cc:

    case q l2 l1 variance sites dimension rounds delta epsilon

The last case is the MNIST flagship's distributed run (docs/PRIVACY.md): its
plan (scale, shares) is recomputed here from n = 100, d = 199210, C = 1, z = 1,
b = 32 as simulations/secagg_round.cc describes it.
"""
import argparse
import math


def default_orders():
    return [1 + i / 10 for i in range(1, 100)] + list(range(11, 64)) + [64, 128, 256, 512]


def log_binomial(n, k):
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def log_sum_exp(values):
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


def unsampled(alpha, l2, l1, variance, sites, dimension):
    tau = 10 * sum(math.exp(-2 * math.pi ** 2 * variance * k / (k + 1)) for k in range(1, sites))
    if l1 == 0:
        l1 = l2 * min(math.sqrt(dimension), l2)
    scale = math.sqrt(sites * variance)
    a2, a1 = l2 / scale, l1 / scale
    return min(alpha / 2 * a2 ** 2 + tau * dimension,
               alpha / 2 * (a2 ** 2 + 2 * a1 * tau + tau ** 2 * dimension),
               alpha / 2 * (a2 + tau * math.sqrt(dimension)) ** 2)


def sampled(q, alpha, eps):
    if q == 1:
        return eps(alpha)
    a = int(math.ceil(alpha))
    terms = [(a - 1) * math.log1p(-q) + math.log1p((a - 1) * q),
             log_binomial(a, 2) + 2 * math.log(q) + (a - 2) * math.log1p(-q) + eps(2)]
    for l in range(3, a + 1):
        terms.append(math.log(3) + log_binomial(a, l) + l * math.log(q) + (a - l) * math.log1p(-q) + (l - 1) * eps(l))
    return min(eps(alpha), log_sum_exp(terms) / (a - 1))


def epsilon(q, l2, l1, variance, sites, dimension, rounds, delta):
    best = math.inf
    for alpha in default_orders():
        rdp = rounds * sampled(q, alpha, lambda a: unsampled(a, l2, l1, variance, sites, dimension))
        best = min(best, rdp + math.log((alpha - 1) / alpha) - (math.log(delta) + math.log(alpha)) / (alpha - 1))
    return max(0.0, best)


def flagship():
    n, d, clip, z, bits = 100, 199210, 1.0, 1.0, 32
    slack = math.sqrt(d) + 1
    limit = 2 ** (bits - 1) - 1
    scale = math.floor(min((limit - n - 10 * math.sqrt(n) - 10 * z * slack) / (clip * (n + 10 * z)),
                           (math.sqrt(n) * 2 ** 26 / z - slack) / clip))
    delta2 = scale * clip + slack
    variance = math.ceil(z * z * delta2 * delta2 / n)
    return (0.1, delta2, 0, variance, n, d, 20, 1e-5)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    cases = [
        (0.1, 1e6, 0, 1e10, 100, 199210, 20, 1e-5),     # z = 1, tau = 0
        (0.01, 1e6, 0, 2.5e9, 100, 1000, 300, 1e-5),    # z = 0.5
        (0.5, 3, 0, 1, 10, 1000, 5, 1e-5),              # small shares: tau > 0
        (1.0, 40, 0, 30, 4, 64, 3, 1e-6),               # no sampling, tau > 0
        (0.2, 100, 500, 400, 20, 10000, 10, 1e-5),      # a given L1 sensitivity
        flagship(),
    ]
    with open(args.out, "w") as out:
        out.write("estuary-ddg-oracle 1\n")
        for case in cases:
            out.write("case " + " ".join(repr(float(v)) for v in case) + " " + repr(epsilon(*case)) + "\n")


if __name__ == "__main__":
    main()
