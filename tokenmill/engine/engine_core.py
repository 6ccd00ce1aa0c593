"""The engine core: schedule, execute, update. No I/O; the serving process wraps it in a busy loop."""
from __future__ import annotations

import time

from tokenmill.config import TokenmillConfig
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.messages import EngineCoreOutputs, EngineCoreRequest
from tokenmill.executor.uniproc import UniProcExecutor
from tokenmill.metrics.step_timing import TIMER


class EngineCore:
    """Owns the scheduler and the executor. `step()` runs one batch and returns what each request produced."""

    def __init__(self, config: TokenmillConfig) -> None:
        self.config = config
        self.executor = UniProcExecutor(config)
        self.num_blocks = self.executor.determine_num_blocks()
        self.executor.initialize_kv_cache(self.num_blocks)
        self.scheduler = Scheduler(config, self.num_blocks)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(request)

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """The n sequences of one user request (the data-parallel stand-in keeps them on one engine)."""
        for request in requests:
            self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats(), timestamp=time.monotonic())
        with TIMER.phase("schedule"):
            sched = self.scheduler.schedule()
        with TIMER.phase("execute_model"):
            out = self.executor.execute_model(sched)
        with TIMER.phase("update_from_output"):
            outputs = self.scheduler.update_from_output(sched, out)
        outputs.scheduler_stats = self.scheduler.make_stats()
        outputs.timestamp = time.monotonic()
        return outputs

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()
