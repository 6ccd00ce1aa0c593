"""The engine core: schedule, execute, update. No I/O; the serving process wraps it in a busy loop."""
from __future__ import annotations

import time

from tokenmill.config import TokenmillConfig
from tokenmill.core.sched_output import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput, SchedulerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.messages import EngineCoreOutputs, EngineCoreRequest
from tokenmill.executor import get_executor_class
from tokenmill.metrics.step_timing import TIMER


class EngineCore:
    """Owns the scheduler and the executor. `step()` runs one batch and returns what requests produced.

    With async scheduling (the default on CUDA) a step launches batch N+1's forward pass before it waits for batch
    N's sampled ids: the host then applies N's output, builds N+1's grammar bitmask and launches N+1's sampling
    while the device computes, so the device never waits for the host. Requests in flight count their coming token
    as a placeholder when N+1 is scheduled; a request that stops at N has its token from N+1 dropped. `step()`
    therefore returns the outputs of the previous batch (nothing on the first call).
    """

    def __init__(self, config: TokenmillConfig) -> None:
        self.config = config
        self.executor = get_executor_class(config)(config)
        self.num_blocks = self.executor.determine_num_blocks()
        self.executor.initialize_kv_cache(self.num_blocks)
        self.scheduler = Scheduler(config, self.num_blocks)
        self.async_scheduling = bool(config.scheduler_config.async_scheduling)
        self._in_flight: tuple[SchedulerOutput, object] | None = None  # (batch, AsyncRunnerOutput)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(request)

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """The n sequences of one user request (the data-parallel stand-in keeps them on one engine)."""
        for request in requests:
            self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def step(self) -> EngineCoreOutputs:
        sched = None
        if self.scheduler.has_unfinished_requests():
            with TIMER.phase("schedule"):
                sched = self.scheduler.schedule()
            with TIMER.phase("execute_model"):
                self.executor.execute_model(sched)
        outputs = None
        if self._in_flight is not None:
            prev, handle = self._in_flight
            self._in_flight = None
            outputs = self._update(prev, handle.get())
        if sched is not None and not sched.is_empty:
            grammar = self.scheduler.get_grammar_bitmask(sched)
            with TIMER.phase("sample"):
                handle = self.executor.sample_tokens(grammar)
            if self.async_scheduling:
                self._in_flight = (sched, handle)
            else:
                outputs = self._update(sched, handle.get())
        if outputs is None:
            outputs = self.scheduler.update_from_output(sched, EMPTY_MODEL_RUNNER_OUTPUT) \
                if sched is not None else EngineCoreOutputs()
        outputs.scheduler_stats = self.scheduler.make_stats()
        outputs.timestamp = time.monotonic()
        return outputs

    def _update(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> EngineCoreOutputs:
        with TIMER.phase("update_from_output"):
            return self.scheduler.update_from_output(sched, out)

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()
