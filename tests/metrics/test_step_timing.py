"""Slow-step and event-loop diagnostics (TOKENMILL_SLOW_STEP_MS, TOKENMILL_LOOP_LAG_MS)."""
from __future__ import annotations

import asyncio
import time

from tokenmill import envs
from tokenmill.metrics.step_timing import SlowStepLog, StepTimer, watch_event_loop




def test_slow_steps_are_logged_with_their_phases_and_batch(tm_log):
    with envs.override(TOKENMILL_SLOW_STEP_MS=20, TOKENMILL_STEP_TIMING=False):
        timer = StepTimer()
        log = SlowStepLog(timer)
    assert timer.enabled  # the phases are accounted as soon as slow steps are logged

    def step(seconds):
        with timer.phase("execute_model"):
            time.sleep(seconds)
        timer.count("eager_steps")
        return "out"

    assert log.run(lambda: step(0.0), lambda: "batch: fast") == "out"
    assert "Slow step" not in tm_log.text
    assert log.run(lambda: step(0.03), lambda: "batch: 3 requests") == "out"
    line = next(r.getMessage() for r in tm_log.records if "Slow step" in r.getMessage())
    assert "execute_model" in line and "eager_steps x1" in line and line.endswith("batch: 3 requests")


def test_slow_step_log_is_off_by_default():
    with envs.override(TOKENMILL_SLOW_STEP_MS=0, TOKENMILL_STEP_TIMING=False):
        timer = StepTimer()
        assert SlowStepLog(timer).run(lambda: 7) == 7 and not timer.enabled


def test_event_loop_stalls_are_logged(tm_log):
    async def main():
        task = asyncio.ensure_future(watch_event_loop(20, period_s=0.001))
        await asyncio.sleep(0.01)
        time.sleep(0.05)  # blocks the loop
        await asyncio.sleep(0.01)
        task.cancel()
    asyncio.run(main())
    assert any("Event loop blocked" in r.getMessage() for r in tm_log.records)
