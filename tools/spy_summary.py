"""Summarise py-spy raw (collapsed) stacks: where the engine core spends its time inside one function.

Usage: python tools/spy_summary.py FILE [--under execute_model] [--top 25]
Prints, for the samples whose stack contains --under, the inclusive share of each frame below it and the self share
of each leaf, so a slow phase can be read off one run."""
from __future__ import annotations

import argparse
import collections
import re


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--under", default="execute_model")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    total = 0
    under = 0
    incl: collections.Counter = collections.Counter()
    leaf: collections.Counter = collections.Counter()
    for line in open(a.file, errors="replace"):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not n.isdigit():
            continue
        n = int(n)
        total += n
        frames = [re.sub(r" \((.*?)\)$", lambda m: " (" + m.group(1).split("/")[-1] + ")", f)
                  for f in stack.split(";")]
        idx = next((i for i, f in enumerate(frames) if f.split(" (")[0].split(".")[-1] == a.under), None)
        if idx is None:
            continue
        under += n
        for f in set(frames[idx + 1:]):
            incl[f] += n
        leaf[frames[-1]] += n
    print(f"{a.file}: {total} samples, {under} under {a.under}")
    print(f"-- inclusive below {a.under}")
    for f, n in incl.most_common(a.top):
        print(f"{100.0 * n / max(under, 1):6.1f}%  {f[:150]}")
    print("-- self (leaf frames)")
    for f, n in leaf.most_common(a.top):
        print(f"{100.0 * n / max(under, 1):6.1f}%  {f[:150]}")


if __name__ == "__main__":
    main()
