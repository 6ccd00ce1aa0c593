"""Optional per-phase wall-clock accounting of engine steps (TOKENMILL_STEP_TIMING=1), for benchmarks.

Off by default: then `phase()` is a no-op context and costs one attribute check.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict

from tokenmill import envs


class StepTimer:
    def __init__(self) -> None:
        self.enabled = envs.TOKENMILL_STEP_TIMING
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    @contextlib.contextmanager
    def phase(self, name: str):
        if not self.enabled:
            yield
            return
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t
            self.counts[name] += 1

    def count(self, name: str) -> None:
        if self.enabled:
            self.counts[name] += 1

    def report(self) -> str:
        rows = [f"  {k:<22} {v * 1000:10.1f} ms  ({self.counts[k]} calls)" for k, v in sorted(self.seconds.items())]
        rows += [f"  {k:<22} {n} times" for k, n in sorted(self.counts.items()) if k not in self.seconds]
        return "Step timing:\n" + "\n".join(rows)


TIMER = StepTimer()
