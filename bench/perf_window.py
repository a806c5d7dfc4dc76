#!/usr/bin/env python3
"""Where a window of a `perf record -g` went, by thread group and by cost.

A benchmark's process does more than the part being measured (bench/upload
builds a 500 MB model, downloads it and times its baselines before each
upload), so a whole-run profile hides the window. This reads `perf script`
output, takes as the window the first to the last sample whose top frame
matches --marker on the threads of the first group (for bench/upload: the
server digesting what it stages, i.e. the upload), and prints for each
group of threads its share of the window's samples by top symbol, each
kernel symbol with the system call or fault it served.

    perf record -g -F 1999 -o up.data build/bench/upload --rounds 1 --staging-memory-mib 1024
    perf script -i up.data -F comm,tid,time,ip,sym,dso > up.txt
    bench/perf_window.py up.txt --group estuary-io,server-run --group upload --marker XXH3

Samples are at -F per second per thread, so a group's count over F is its CPU
seconds in the window.
"""
import argparse
import collections
import re

FRAME = re.compile(r"\s*([0-9a-f]+)\s+(.*?)\s+\((.*)\)\s*$")
# Kernel entry points that say what a kernel symbol was doing.
CONTEXTS = ("sys_pwrite", "sys_recvfrom", "sys_sendto", "sys_read", "sys_write", "exc_page_fault")


def samples(path):
    current = None
    for line in open(path, errors="replace"):
        if not line.strip():
            if current:
                yield current
            current = None
        elif not line[0].isspace():
            comm, tid, time = line.split()[:3]
            current = {"comm": comm, "tid": int(tid), "time": float(time.rstrip(":")), "frames": []}
        elif current is not None:
            match = FRAME.match(line)
            if match:
                current["frames"].append((match.group(2), match.group(3).rsplit("/", 1)[-1]))
    if current:
        yield current


def cost(frames):
    symbol, dso = frames[0]
    if dso.startswith("libcrypto"):
        return "libcrypto (AES-GCM and the rest)"
    if dso == "[kernel.kallsyms]":
        for name, _ in frames[1:]:
            context = next((c for c in CONTEXTS if c in name), None)
            if context:
                return f"{symbol} [{context}]"
    return symbol


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("script", help="perf script -F comm,tid,time,ip,sym,dso output of a perf record -g")
    parser.add_argument("--group", action="append", required=True,
                        help="thread names (comma-separated) counted together; the first group holds the marker")
    parser.add_argument("--marker", required=True, help="a top-frame symbol substring that marks the window")
    parser.add_argument("--top", type=int, default=12, help="costs listed per group")
    args = parser.parse_args()
    groups = [tuple(g.split(",")) for g in args.group]
    all_samples = [s for s in samples(args.script) if s["frames"]]
    marks = [s["time"] for s in all_samples if s["comm"] in groups[0] and args.marker in s["frames"][0][0]]
    if not marks:
        raise SystemExit(f"perf_window: no sample of {groups[0]} has {args.marker!r} on top")
    begin, end = min(marks), max(marks)
    window = [s for s in all_samples if begin <= s["time"] <= end]
    print(f"window: {end - begin:.3f} s, {len(window)} samples")
    for group in groups:
        counts = collections.Counter(cost(s["frames"]) for s in window if s["comm"] in group)
        total = sum(counts.values())
        print(f"== {','.join(group)}: {total} samples")
        for what, n in counts.most_common(args.top):
            print(f"{100 * n / max(total, 1):5.1f} %  {what}")


if __name__ == "__main__":
    main()
