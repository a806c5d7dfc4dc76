"""One site of the PyTorch example: its shard of MNIST, trained on whatever round the server sends.

    python3 site.py --server HOST:PORT --cert site.pem --key site.key --ca ca.pem --shard K --shards N [--mnist DIR]

Each round: the global weights into the site's own module (its BatchNorm
num_batches_tracked stays its own), the task's epochs of SGD at the task's
learning rate, momentum and batch size, shuffled by the federation's seed,
the round and the shard; then the module's state dict back to the server.
"""

import argparse
import sys

import torch

import estuary
from mnist_net import Net, default_mnist_dir, load_mnist


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag in ("--server", "--cert", "--key", "--ca"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--shard", type=int, required=True)
    parser.add_argument("--shards", type=int, required=True)
    parser.add_argument("--mnist", default=str(default_mnist_dir()))
    args = parser.parse_args()
    torch.set_num_threads(1)

    x, y = load_mnist(args.mnist, "train")
    x, y = x[args.shard::args.shards], y[args.shard::args.shards]
    model = Net()

    def fit(weights, config):
        estuary.load_weights(model, weights)
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=config["learning_rate"], momentum=config["momentum"],
                                    weight_decay=config["weight_decay"])
        shuffle = torch.Generator().manual_seed(config["seed"] * 1_000_003 + config["round"] * 1009 + args.shard)
        total, batches = 0.0, 0
        for _ in range(config["epochs"]):
            for batch in torch.randperm(len(y), generator=shuffle).split(config["batch_size"]):
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
                loss.backward()
                optimizer.step()
                total, batches = total + float(loss), batches + 1
        return model.state_dict(), len(y), {"loss": total / max(batches, 1)}

    client = estuary.Client(args.server, cert=args.cert, key=args.key, ca=args.ca, expected_model=model,
                            num_examples=len(y), max_backoff_s=2)
    try:
        result = client.run(fit)
    except estuary.SiteError as error:
        print(f"site {args.shard}: {error}", file=sys.stderr)
        return 1
    print(f"site {args.shard}: trained {result.rounds_trained} rounds, {len(result.failures)} failed")
    return 0 if not result.failures else 1


if __name__ == "__main__":
    sys.exit(main())
