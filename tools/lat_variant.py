"""`tokenmill bench latency` with tools/graph_ab.py variants applied in the same process (GPU machine): checks that
a variant that won inside the batch-1 graph also wins end to end before it goes into the measured table.
Usage: python3 tools/lat_variant.py MODEL VARIANT[+VARIANT...] [latency flags ...]
MODEL is a shipped shape (dummy weights); VARIANT is a graph_ab name for MODEL ("base": none)."""
from __future__ import annotations

import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import graph_ab  # noqa: E402

from tokenmill.benchmarks import latency  # noqa: E402


def main() -> None:
    model, names, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    variants = graph_ab.VARIANTS[model]
    with contextlib.ExitStack() as stack:
        for name in names.split("+"):
            if name != "base":
                stack.enter_context(graph_ab.applied(*variants[name]))
        print(f"--- {model} with {names}", flush=True)
        latency.main(["--model", model, *rest])   # a shipped shape name loads with dummy weights


if __name__ == "__main__":
    main()
