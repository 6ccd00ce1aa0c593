"""Start-up timeline of a process, measured from the moment the OS started it: for the one-line breakdown that
`tokenmill serve` logs when it is ready (interpreter and imports, engine config, engine core phases, API start).

Time zero is the process's own start (Linux: /proc/self/stat against /proc/uptime, 10 ms resolution), so the
interpreter's start-up and the imports before any tokenmill code runs are counted too; elsewhere it is the first
import of this module.
"""
from __future__ import annotations

import os
import time

_FALLBACK_T0 = time.time()


def process_age() -> float:
    """Seconds since this process started."""
    try:
        with open("/proc/self/stat") as f:
            # Field 22 (starttime, clock ticks after boot) follows the command name, which may hold spaces.
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time() - _FALLBACK_T0


def format_phases(phases: list[tuple[str, float]]) -> str:
    return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases)


class StartupTimeline:
    """Phases of this process's start-up in order: `mark(name)` closes the phase that began at the previous mark
    (or at the process's start) and names it. `total()` is the process's age."""

    def __init__(self) -> None:
        self._last = time.monotonic() - process_age()
        self.phases: list[tuple[str, float]] = []

    def mark(self, name: str) -> float:
        now = time.monotonic()
        self.phases.append((name, now - self._last))
        self._last = now
        return self.phases[-1][1]

    def total(self) -> float:
        return process_age()


# The API server process's timeline (the CLI marks its imports, the server the rest).
SERVER = StartupTimeline()
