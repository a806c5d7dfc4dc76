#!/usr/bin/env python3
"""Simulated time for estuary-sim reports to reach a test accuracy.

For each report: the first round (an --async run: model version) whose test
accuracy reaches each target, the simulated clock then (sim_time: local steps
of a full-speed site), the updates the server had received by then, and the
best accuracy of the run. Prints a Markdown table. Standard library only.

Usage: time_to_target.py --targets 0.85,0.88 LABEL=REPORT.json [LABEL=REPORT.json ...]
"""
import argparse
import json


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--targets", default="0.88")
    parser.add_argument("runs", nargs="+", help="LABEL=REPORT.json")
    args = parser.parse_args()
    targets = [float(v) for v in args.targets.split(",")]
    print("| run | " + " | ".join(f"≥ {t:.0%}: round, sim time, updates" for t in targets) + " | best accuracy |")
    print("|---" * (2 + len(targets)) + "|")
    for spec in args.runs:
        label, path = spec.rsplit("=", 1)
        rounds = json.load(open(path))["rounds"]
        cells = []
        for t in targets:
            received = 0
            for r in rounds:
                received += r["updates_received"]
                if r["test_accuracy"] >= t:
                    cells.append(f"{r['round']}, {r['sim_time']:.0f}, {received}")
                    break
            else:
                cells.append("—")
        best = max(r["test_accuracy"] for r in rounds)
        print(f"| {label} | " + " | ".join(cells) + f" | {best:.4f} |")


if __name__ == "__main__":
    main()
