"""The Python SDK's cost per round against the C++ client API doing the same work, in one run.

    PYTHONPATH=build/python python3 bench/python_sdk.py [--rounds 40] [--repeats 3]

A federation of one site over the flagship MLP's tensors (784-200-200-10:
fc1.weight [200, 784] ... fc3.bias [10], 199,210 floats) on a real
estuary-server (mutual TLS on 127.0.0.1), once with the C++ site
(bench/sdk_cpp_site.cc: an estuary::Trainer) and once with a Python site
(estuary.Client) whose fit does the same work, w * 0.999 on every tensor, in
NumPy; the two alternate, --repeats times each. Two figures, medians over
every round:
  - the Train call, as the agent sees it: for Python, taking the GIL, the
    zero-copy views, the task dict, fit and copying its result back
    (RunResult.train_seconds); for C++ the same work in a loop. Their
    difference is what the SDK adds to a round.
  - the round as the site lives it, start of one Train to the next: the
    download, the work, the upload and the server's fold. The SDK's cost is
    reported as a share of the C++ site's round. (Whole rounds of the two
    sites are compared too, but on a shared machine their spread is wider
    than the difference.)
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import estuary

SHAPES = {"fc1.weight": (200, 784), "fc1.bias": (200,), "fc2.weight": (200, 200), "fc2.bias": (200,),
          "fc3.weight": (10, 200), "fc3.bias": (10,)}
DECAY = np.float32(0.999)


def federation(work, rounds):
    rng = np.random.default_rng(0)
    model = {k: (rng.standard_normal(s) * 0.05).astype(np.float32) for k, s in SHAPES.items()}
    return estuary.LocalServer(work, model, ["site-0"], rounds, flags=["--round-deadline", "60", "--lr", "0.1"])


def cpp_rounds(binary, rounds):
    """(round intervals, Train seconds) of the C++ site."""
    with tempfile.TemporaryDirectory() as work:
        with federation(work, rounds).start() as server:
            files = server.site_files("site-0")
            out = subprocess.run([binary, "--server", server.address, "--cert", str(files["cert"]), "--key",
                                  str(files["key"]), "--ca", str(files["ca"])], capture_output=True, text=True,
                                 timeout=600)
            if out.returncode != 0:
                sys.exit(f"sdk_cpp_site: {out.stderr.strip()}")
            server.wait(60)
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    return [float(v) for v in lines["round_seconds"].split()], [float(v) for v in lines["train_seconds"].split()]


def python_rounds(rounds):
    """(round intervals, Train seconds, the SDK's own seconds a round) of the Python site."""
    starts = []

    def fit(weights, config):
        starts.append(time.perf_counter())
        return {k: v * DECAY for k, v in weights.items()}, 100, {"loss": 1.0}

    with tempfile.TemporaryDirectory() as work:
        with federation(work, rounds).start() as server:
            result = estuary.Client(server.address, **server.site_files("site-0"), max_backoff_s=1).run(fit)
            server.wait(60)
    return list(np.diff(starts)), result.train_seconds, result.overhead_seconds / result.rounds_trained


def ms(values):
    return (f"{statistics.median(values) * 1e3:8.3f} ms  (p10-p90 {np.percentile(values, 10) * 1e3:.3f}-"
            f"{np.percentile(values, 90) * 1e3:.3f})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpp-site", default=str(Path(estuary.find_server()).parents[1] / "bench" / "sdk_cpp_site"))
    args = parser.parse_args()
    cpp_round, cpp_train, py_round, py_train, around = [], [], [], [], []
    for _ in range(args.repeats):
        rounds, train = cpp_rounds(args.cpp_site, args.rounds)
        cpp_round, cpp_train = cpp_round + rounds, cpp_train + train
        rounds, train, overhead = python_rounds(args.rounds)
        py_round, py_train, around = py_round + rounds, py_train + train, around + [overhead]
    added = statistics.median(py_train) - statistics.median(cpp_train)
    print(f"flagship MLP tensors ({sum(int(np.prod(s)) for s in SHAPES.values()):,} floats), one site, "
          f"{args.rounds} rounds x {args.repeats} runs each, alternating")
    print(f"Train call, C++ site (estuary::Trainer):   {ms(cpp_train)}")
    print(f"Train call, Python site (estuary.Client):  {ms(py_train)}")
    print(f"the SDK's own work around fit (views, task, copying the result): {statistics.mean(around) * 1e3:.3f} ms a round")
    print(f"round, C++ site:                           {ms(cpp_round)}")
    print(f"round, Python site:                        {ms(py_round)}")
    print(f"the SDK adds {added * 1e3:.3f} ms a round: {added / statistics.median(cpp_round) * 100:.2f} % of the "
          f"C++ site's round")
    print(f"ratio (Python site's round / C++ site's, medians): {statistics.median(py_round) / statistics.median(cpp_round):.3f}")
    print(f"ratio (C++ round + what the SDK adds / C++ round): {1 + added / statistics.median(cpp_round):.4f}")


if __name__ == "__main__":
    main()
