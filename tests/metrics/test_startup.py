"""The start-up timeline: phases measured from the process's own start."""
from __future__ import annotations

import subprocess
import sys
import time

from tokenmill.metrics.startup import StartupTimeline, format_phases, process_age


def test_process_age_counts_from_the_process_start_not_from_the_import():
    # A child that sleeps before importing the module: its age at the import includes the sleep.
    code = "import time; time.sleep(0.5); from tokenmill.metrics.startup import process_age; print(process_age())"
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 0.5 <= age < 30


def test_timeline_phases_add_up_to_the_process_age():
    tl = StartupTimeline()
    time.sleep(0.05)
    first = tl.mark("one")
    time.sleep(0.1)
    second = tl.mark("two")
    assert second >= 0.1 and first >= 0.05
    assert [name for name, _ in tl.phases] == ["one", "two"]
    # The first phase starts at the process's start, so the phases cover its whole age (10 ms ticks).
    assert abs(sum(s for _, s in tl.phases) - process_age()) < 0.1


def test_format_phases():
    assert format_phases([("imports", 2.04), ("engine config", 0.96)]) == "imports 2.0 s, engine config 1.0 s"
