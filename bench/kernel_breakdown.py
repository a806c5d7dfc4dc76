#!/usr/bin/env python3
"""Groups an Nsight Compute CSV of gpu__time_duration.sum (one row per kernel
launch) by kernel, and prints each kernel's total time, launch count and
share, largest first: where a training step's GPU time goes.
  ncu --csv --clock-control none --metrics gpu__time_duration.sum APP > k.csv
  bench/kernel_breakdown.py k.csv [--top 30]"""
import csv
import re
import sys
from collections import defaultdict

path = sys.argv[1]
top = int(sys.argv[sys.argv.index("--top") + 1]) if "--top" in sys.argv else 30
with open(path, newline="") as f:
    lines = [line for line in f if line.startswith('"')]  # ncu prefixes its own log lines with ==PROF==
rows = csv.DictReader(lines)
total_ns = defaultdict(float)
count = defaultdict(int)
for row in rows:
    if row.get("Metric Name") != "gpu__time_duration.sum":
        continue
    value = float(row["Metric Value"].replace(",", ""))
    unit = row.get("Metric Unit", "ns")
    ns = value * {"ns": 1, "nsecond": 1, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6}.get(unit, 1)
    name = re.sub(r"\(.*", "", row["Kernel Name"])[:90]
    total_ns[name] += ns
    count[name] += 1
grand = sum(total_ns.values())
print(f"{'kernel':92s} {'launches':>8s} {'ms':>9s} {'share':>6s}")
for name, ns in sorted(total_ns.items(), key=lambda kv: -kv[1])[:top]:
    print(f"{name:92s} {count[name]:8d} {ns / 1e6:9.3f} {100 * ns / grand:5.1f}%")
print(f"{'all kernels':92s} {sum(count.values()):8d} {grand / 1e6:9.3f}")
