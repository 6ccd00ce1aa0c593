"""The single-process executor: the worker lives in the engine core's process."""
from __future__ import annotations

from tokenmill.config import TokenmillConfig
from tokenmill.core.sched_output import GrammarOutput, SchedulerOutput
from tokenmill.worker.model_runner import AsyncRunnerOutput
from tokenmill.worker.worker import Worker


class UniProcExecutor:
    """Runs every call on one local worker. Multi-rank executors will broadcast the same calls."""

    def __init__(self, config: TokenmillConfig) -> None:
        self.worker = Worker(config)
        self.worker.load_model()

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, sched: SchedulerOutput) -> None:
        """Launch the step's forward pass (returns before the device finishes)."""
        self.worker.execute_model(sched)

    def sample_tokens(self, grammar: GrammarOutput | None) -> AsyncRunnerOutput:
        """Sample the step launched by execute_model; the handle's get() returns its ModelRunnerOutput."""
        return self.worker.sample_tokens(grammar)
