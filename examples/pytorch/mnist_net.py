"""The model and data of the PyTorch example: a small conv net with BatchNorm on MNIST.

Estuary has no such model built in; the server knows it only as the tensors
of its state dict (``estuary-server serve --initial-model``).
"""

import os
from pathlib import Path

import numpy as np
import torch
from torch import nn


class Net(nn.Module):
    """conv(8) - BN - ReLU - pool - conv(16) - BN - ReLU - pool - linear(10): 9 tensors, 2 int64 buffers."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16 * 7 * 7, 10)

    def forward(self, x):
        x = nn.functional.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 2)
        x = nn.functional.max_pool2d(torch.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(x.flatten(1))


def default_mnist_dir():
    """ESTUARY_MNIST, or the source tree's data/mnist (scripts/fetch-mnist data/mnist)."""
    if os.environ.get("ESTUARY_MNIST"):
        return Path(os.environ["ESTUARY_MNIST"])
    return Path(__file__).resolve().parents[2] / "data" / "mnist"


def _idx(path):
    data = Path(path).read_bytes()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def load_mnist(directory, split):
    """(images as float32 [N, 1, 28, 28], normalised; labels as int64) of the train or t10k split."""
    images = _idx(Path(directory) / f"{split}-images-idx3-ubyte").astype(np.float32) / 255
    labels = _idx(Path(directory) / f"{split}-labels-idx1-ubyte").astype(np.int64)
    x = torch.from_numpy((images - 0.1307) / 0.3081).unsqueeze(1)
    return x, torch.from_numpy(labels)


def accuracy(model, x, y):
    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())
