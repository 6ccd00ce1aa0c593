"""Triton compile time in this process, for the start-up breakdown.

Triton (3.4 and later) calls `triton.knobs.compilation.listener` after every kernel compile, cache hits included,
with the time each stage took. `CompileStats.track()` chains a listener that sums them until `stop()`; without that knob (or
without triton) it tracks nothing and `available` stays False, so the log line leaves compile out rather than
report zero.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompileStats:
    """Kernels compiled (`compiled`, with `seconds` spent compiling them) and loaded from Triton's cache."""
    available: bool = False
    compiled: int = 0
    cache_hits: int = 0
    seconds: float = 0.0
    _restore: object = None

    def record(self, times, cache_hit: bool) -> None:
        if cache_hit:
            self.cache_hits += 1
            return
        self.compiled += 1
        us = times.ir_initialization + sum(d for _, d in times.lowering_stages) + times.store_results
        self.seconds += us / 1e6

    def describe(self) -> str:
        return f"{self.seconds:.1f} s for {self.compiled} Triton kernels ({self.cache_hits} from cache)"

    @classmethod
    def track(cls) -> "CompileStats":
        stats = cls()
        try:
            import triton.knobs as knobs
            comp = knobs.compilation
            previous = comp.listener
        except (ImportError, AttributeError):
            return stats

        def listener(*, src, metadata, metadata_group, times, cache_hit):
            stats.record(times, cache_hit)
            if previous is not None:
                previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)

        comp.listener = listener
        stats.available = True
        stats._restore = lambda: setattr(comp, "listener", previous)
        return stats

    def stop(self) -> None:
        if self._restore is not None:
            self._restore()
            self._restore = None
