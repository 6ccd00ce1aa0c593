"""The interface the API server uses to talk to an engine (`AsyncLLM` implements it; tests may fake it)."""
from __future__ import annotations

import abc
from typing import Any, AsyncIterator

from tokenmill.config import TokenmillConfig
from tokenmill.core.messages import SchedulerStats
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine-core process died; every request fails and the server must exit."""


class EngineClient(abc.ABC):
    """Asynchronous access to a running engine.

    Contract:
    - `generate` validates and tokenizes first: a bad prompt or parameter raises ValueError before anything is
      yielded (the server maps it to a 400). It then yields RequestOutputs following `sampling_params.output_kind`
      (DELTA for streaming, FINAL_ONLY for one-shot). Closing or cancelling the iterator aborts the request and
      frees its KV blocks.
    - `errored` turns true once the engine is dead; `generate` then raises EngineDeadError.
    """

    config: TokenmillConfig
    tokenizer: Any  # a transformers tokenizer, or None with skip_tokenizer_init

    @abc.abstractmethod
    def generate(self, prompt: str | dict | list[int], sampling_params: SamplingParams, request_id: str,
                 priority: int = 0) -> AsyncIterator[RequestOutput]:
        ...

    @abc.abstractmethod
    async def abort(self, request_id: str | list[str]) -> None:
        ...

    @property
    @abc.abstractmethod
    def errored(self) -> bool:
        ...

    @abc.abstractmethod
    async def check_health(self) -> None:
        """Raises EngineDeadError if the engine is not alive."""

    @abc.abstractmethod
    def get_default_sampling_params(self) -> dict[str, Any]:
        """Defaults from the model's generation config (and --override-generation-config), as SamplingParams kwargs."""

    @abc.abstractmethod
    def last_stats(self) -> SchedulerStats | None:
        """The latest scheduler snapshot (running/waiting, KV usage, prefix-cache counters)."""

    @abc.abstractmethod
    async def reset_prefix_cache(self) -> bool:
        ...

    # Sleep mode and the profiler (the server's dev routes); a failure in an engine is a RuntimeError.
    @abc.abstractmethod
    async def sleep(self, level: int = 1) -> None:
        ...

    @abc.abstractmethod
    async def wake_up(self, tags: list[str] | None = None) -> None:
        ...

    @abc.abstractmethod
    async def is_sleeping(self) -> bool:
        ...

    @abc.abstractmethod
    async def start_profile(self) -> None:
        ...

    @abc.abstractmethod
    async def stop_profile(self) -> None:
        ...

    @abc.abstractmethod
    def shutdown(self) -> None:
        ...
