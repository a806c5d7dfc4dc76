"""The PyTorch example end to end: a conv net with BatchNorm, federated by three site processes on MNIST.

    PYTHONPATH=build/python python3 examples/pytorch/federate.py [--rounds 3] [--min-accuracy 0.9]

It writes the initial model, creates a CA and certificates (estuary-server
certs), starts estuary-server serve --initial-model on 127.0.0.1, starts
three site.py processes (mutual TLS), waits for the last round, exports the
global model, loads it into the net and scores it on MNIST's test split.
With --min-accuracy it exits 1 below that accuracy (the ctest test).
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import estuary
from mnist_net import Net, accuracy, default_mnist_dir, load_mnist

HERE = Path(__file__).resolve().parent


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sites", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--mnist", default=str(default_mnist_dir()))
    parser.add_argument("--min-accuracy", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=500, help="seconds the federation may take")
    args = parser.parse_args()
    if not (Path(args.mnist) / "t10k-images-idx3-ubyte").exists():
        print(f"no MNIST at {args.mnist} (scripts/fetch-mnist data/mnist; or set ESTUARY_MNIST)", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    torch.set_num_threads(1)
    net = Net()
    test_x, test_y = load_mnist(args.mnist, "t10k")
    before = accuracy(net, test_x, test_y)

    with tempfile.TemporaryDirectory(prefix="estuary-pytorch-") as work:
        work = Path(work)
        names = [f"site-{k}" for k in range(args.sites)]
        flags = ["--epochs", str(args.epochs), "--batch", str(args.batch), "--lr", str(args.lr), "--momentum",
                 str(args.momentum), "--seed", "1", "--round-deadline", "300"]
        server = estuary.LocalServer(work, net, names, args.rounds, flags=flags)
        sites = []
        started = time.monotonic()
        with server.start():
            for k, name in enumerate(names):
                files = server.site_files(name)
                argv = [sys.executable, str(HERE / "site.py"), "--server", server.address, "--cert", str(files["cert"]),
                        "--key", str(files["key"]), "--ca", str(files["ca"]), "--shard", str(k), "--shards",
                        str(args.sites), "--mnist", args.mnist]
                with open(work / f"{name}.log", "w") as log:
                    sites.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy()))
            try:
                server.wait(args.timeout)
                codes = [site.wait(timeout=60) for site in sites]
            finally:
                for site in sites:
                    if site.poll() is None:
                        site.kill()
                        site.wait()
        seconds = time.monotonic() - started
        for k, code in enumerate(codes):
            if code != 0:
                print(f"site-{k} exited with {code}:\n{(work / f'site-{k}.log').read_text()}", file=sys.stderr)
                return 1
        print(f"{'round':>5}  {'updates':>7}  {'train loss':>10}")
        for r in server.rounds():
            print(f"{r['round']:>5}  {r['updates_received']:>7}  {r['train_loss']:>10.4f}")
        net.load_state_dict(server.export(as_torch=True))  # num_batches_tracked: the initial file's
        after = accuracy(net, test_x, test_y)
    print(f"test accuracy {after:.4f} after {args.rounds} rounds of {args.sites} sites in {seconds:.1f} s "
          f"(initial model: {before:.4f})")
    if after < args.min_accuracy:
        print(f"below --min-accuracy {args.min_accuracy}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
