"""Optional per-phase wall-clock accounting of engine steps (TOKENMILL_STEP_TIMING=1), for benchmarks.

Off by default: then `phase()` returns a shared no-op context.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict

from tokenmill import envs


_NOOP = contextlib.nullcontext()


class StepTimer:
    def __init__(self) -> None:
        self.enabled = envs.TOKENMILL_STEP_TIMING
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    def phase(self, name: str):
        """A context timing one phase; a shared no-op when timing is off (this sits on the per-step path)."""
        return self._timed(name) if self.enabled else _NOOP

    @contextlib.contextmanager
    def _timed(self, name: str):
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
