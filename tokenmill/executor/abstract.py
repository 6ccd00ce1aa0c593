"""The executor interface the engine core drives: one generic `collective_rpc`, plus named shortcuts.

How sampling works with more than one rank (no broadcast of sampled ids is needed): the LM head all-gathers its
logits, so every tensor-parallel rank holds identical full logits; every rank runs the same sampler, whose random
draws are counter-based (seed, output position) and batch-invariant, so all ranks sample identical token ids and
keep identical runner state. Rank 0's result is what the executor returns; the other ranks' results are dropped.
Under pipeline parallelism only the last stage samples; its output reaches rank 0 through worker/pp_output.py.
"""
from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from typing import Any, Callable

from tokenmill.config import TokenmillConfig
from tokenmill.core.sched_output import GrammarOutput, SchedulerOutput
from tokenmill.worker.model_runner import AsyncRunnerOutput


class WorkerDiedError(RuntimeError):
    """A worker rank died or failed; the engine has stopped."""


def call_while_healthy(fn: Callable[[], Any], timeout_s: float, what: str, check: Callable[[], None]) -> Any:
    """Run a start-up step of rank 0 that blocks on the other ranks (joining the process group) in a helper
    thread, calling `check` meanwhile, so a worker that dies surfaces at once instead of after the rendezvous
    timeout."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=run, name="tokenmill-rank0-start", daemon=True)
    t.start()
    deadline = time.monotonic() + timeout_s
    while t.is_alive():
        t.join(0.05)
        check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"Rank 0 timed out after {timeout_s:.0f} s {what}.")
    if "error" in box:
        raise box["error"]
    return box["result"]


class Executor(ABC):
    """Runs Worker methods on every rank.

    Contract: `collective_rpc(name, *args, **kwargs)` calls `Worker.<name>` on every rank, in the same order on
    every rank, and returns rank 0's result. The per-step protocol is not spelled out anywhere below the engine
    core: a new Worker method is reachable by name without touching executors or worker loops. After a rank fails,
    every later call raises (the engine has stopped); `shutdown()` releases processes and process groups and may be
    called more than once.
    """

    def __init__(self, config: TokenmillConfig) -> None:
        self.config = config

    @property
    def max_concurrent_batches(self) -> int:
        """How many launched steps may be unresolved at once: one per pipeline stage, so every stage has work
        (the engine core launches the next micro-batch before it waits for the oldest)."""
        return self.config.parallel_config.pipeline_parallel_size

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> Any:
        ...

    def determine_num_blocks(self) -> int:
        return self.collective_rpc("determine_num_blocks")

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", num_blocks)

    def execute_model(self, sched: SchedulerOutput) -> None:
        """Launch the step's forward pass on every rank (returns before the devices finish)."""
        self.collective_rpc("execute_model", sched)

    def sample_tokens(self, grammar: GrammarOutput | None) -> AsyncRunnerOutput:
        """Sample the step launched by execute_model on every rank; the returned handle's get() gives the step's
        output (rank 0's, or under pipeline parallelism the last stage's)."""
        return self.collective_rpc("sample_tokens", grammar)

    def check_health(self) -> None:
        """Raises if a rank has died (cheap; no communication)."""

    def shutdown(self) -> None:
        """Stop worker processes and leave the process groups."""
