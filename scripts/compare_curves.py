#!/usr/bin/env python3
"""Test accuracy per round of several estuary-sim reports, side by side.

Writes one SVG with a curve per report and prints a Markdown table of the
accuracy at chosen rounds and the first round that reaches each target.
Standard library only.

Usage: compare_curves.py --svg OUT.svg --at 10,25,50,100,200 --targets 0.8,0.85 \\
           LABEL=REPORT.json [LABEL=REPORT.json ...]
"""
import argparse
import json

COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--svg", required=True)
    parser.add_argument("--at", default="10,25,50,100")
    parser.add_argument("--targets", default="0.8")
    parser.add_argument("--title", default="")
    parser.add_argument("runs", nargs="+", help="LABEL=REPORT.json")
    args = parser.parse_args()
    runs = []
    for spec in args.runs:
        label, path = spec.rsplit("=", 1)
        rounds = json.load(open(path))["rounds"]
        runs.append((label, [r["round"] for r in rounds], [r["test_accuracy"] for r in rounds]))

    at = [int(v) for v in args.at.split(",")]
    targets = [float(v) for v in args.targets.split(",")]
    print("| run | " + " | ".join(f"round {r}" for r in at) + " | "
          + " | ".join(f"first round ≥ {t:.0%}" for t in targets) + " |")
    print("|---" * (1 + len(at) + len(targets)) + "|")
    for label, rounds, accuracy in runs:
        cells = [f"{accuracy[r - 1]:.4f}" if r <= len(accuracy) else "—" for r in at]
        for t in targets:
            first = next((rounds[i] for i, a in enumerate(accuracy) if a >= t), None)
            cells.append(str(first) if first else "—")
        print(f"| {label} | " + " | ".join(cells) + " |")

    width, height, left, bottom, top, right = 720, 420, 60, 40, 30, 150
    last = max(max(r) for _, r, _ in runs)
    x = lambda r: left + (width - left - right) * (r - 1) / max(last - 1, 1)
    y = lambda a: top + (height - top - bottom) * (1 - a)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             'font-size="12">', f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{left}" y="18">{args.title}</text>']
    for tick in range(0, 11, 2):
        a = tick / 10
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(a)}" y2="{y(a)}" stroke="#ddd"/>')
        parts.append(f'<text x="{left - 8}" y="{y(a) + 4}" text-anchor="end">{a:.1f}</text>')
    for r in sorted({1, last} | {t for t in at if t <= last}):
        parts.append(f'<text x="{x(r)}" y="{height - bottom + 16}" text-anchor="middle">{r}</text>')
    parts.append(f'<text x="{(width - right + left) / 2}" y="{height - 6}" text-anchor="middle">round</text>')
    for i, (label, rounds, accuracy) in enumerate(runs):
        colour = COLOURS[i % len(COLOURS)]
        points = " ".join(f"{x(r):.1f},{y(a):.1f}" for r, a in zip(rounds, accuracy))
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{points}"/>')
        parts.append(f'<text x="{width - right + 10}" y="{top + 18 * i + 10}" fill="{colour}">{label}</text>')
    parts.append("</svg>")
    with open(args.svg, "w") as out:
        out.write("\n".join(parts) + "\n")


if __name__ == "__main__":
    main()
