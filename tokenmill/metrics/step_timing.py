"""Optional per-phase wall-clock accounting of engine steps (TOKENMILL_STEP_TIMING=1), for benchmarks.

Off by default: then `phase()` returns a shared no-op context.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict

from tokenmill import envs
from tokenmill.logger import init_logger

logger = init_logger(__name__)


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


class SlowStepLog:
    """Logs engine steps slower than TOKENMILL_SLOW_STEP_MS with the time each phase took in them and the batch
    they ran (a diagnostic for latency stalls; off by default, then `run` is just the call)."""

    def __init__(self, timer: StepTimer = TIMER) -> None:
        self.threshold_s = envs.TOKENMILL_SLOW_STEP_MS / 1000.0
        self.timer = timer
        if self.threshold_s > 0:
            timer.enabled = True

    def run(self, step, describe=None):
        """Return step(); if it took longer than the threshold, log it with describe() (the batch it ran)."""
        if self.threshold_s <= 0:
            return step()
        seconds, counts = dict(self.timer.seconds), dict(self.timer.counts)
        t = time.perf_counter()
        result = step()
        dt = time.perf_counter() - t
        if dt > self.threshold_s:
            phases = ", ".join(f"{k} {(v - seconds.get(k, 0.0)) * 1000:.1f} ms"
                               for k, v in self.timer.seconds.items() if v - seconds.get(k, 0.0) > 5e-4)
            events = ", ".join(f"{k} x{n - counts.get(k, 0)}" for k, n in self.timer.counts.items()
                               if k not in self.timer.seconds and n != counts.get(k, 0))
            what = describe() if describe is not None else ""
            logger.warning("Slow step: %.1f ms (%s%s)%s", dt * 1000, phases, f"; {events}" if events else "",
                           f" {what}" if what else "")
        return result


async def watch_event_loop(threshold_ms: int, period_s: float = 0.005) -> None:
    """Log whenever this event loop wakes up more than threshold_ms late (something blocked it): run as a task."""
    loop = asyncio.get_running_loop()
    late_s = threshold_ms / 1000.0
    while True:
        t = loop.time()
        await asyncio.sleep(period_s)
        lag = loop.time() - t - period_s
        if lag > late_s:
            logger.warning("Event loop blocked for %.1f ms", lag * 1000)
