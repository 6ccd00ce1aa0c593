"""AsyncLLM: the serving engine. Tokenizing and detokenizing happen here; the engine core runs in its own process."""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Callable

from tokenmill.config import TokenmillConfig
from tokenmill.config.engine_args import create_engine_config
from tokenmill.core.messages import SchedulerStats
from tokenmill.engine.core_client import AsyncMPClient
from tokenmill.engine.launcher import EngineAddresses
from tokenmill.engine.llm_engine import FrontEnd, default_sampling_kwargs
from tokenmill.engine.output_collector import RequestOutputCollector
from tokenmill.engine.processor import PromptType
from tokenmill.engine.protocol import EngineClient, EngineDeadError
from tokenmill.logger import init_logger
from tokenmill.metrics.loggers import StatLogger
from tokenmill.metrics.stats import IterationStats
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

logger = init_logger(__name__)


class AsyncLLM(EngineClient):
    """Per-request async streams over the engine-core processes (one per data-parallel rank).

    One background task drains the cores' outputs, detokenizes them and routes each to its request's queue. A
    request whose consumer goes away (client disconnect, cancelled task) is aborted in its core, freeing its blocks.
    With several API server processes, each has its own AsyncLLM with its `client_index` and the engines'
    `addresses` (the engines then belong to the parent process).
    """

    def __init__(self, config: TokenmillConfig, log_stats: bool = True, log_interval_s: float | None = 10.0,
                 client_index: int = 0, addresses: EngineAddresses | None = None,
                 while_starting: Callable[[], object] | None = None) -> None:
        """`while_starting`: this process's own start-up work (the server imports its app), run while the engine
        cores start, after the tokenizer has loaded."""
        self.config = config
        # Start the engine cores first: they load the model while this process loads the tokenizer.
        self.client = AsyncMPClient(config, wait=False, client_index=client_index, addresses=addresses)
        try:
            front = FrontEnd(config, log_stats=True)
            if while_starting is not None:
                while_starting()
        except BaseException:
            self.client.shutdown()
            raise
        self.tokenizer, self.generation_config = front.tokenizer, front.generation_config
        self.processor, self.output_processor = front.processor, front.output_processor
        self.client.wait_ready()
        self.processor.num_blocks = self.client.num_blocks
        # With several API servers the first one logs the engines' summary lines.
        self.stat_logger = StatLogger(config, self.client.num_blocks,
                                      log_interval_s if log_stats and client_index == 0 else None,
                                      num_engines=self.client.num_engines, record_engine_counters=client_index == 0,
                                      kv_capacity=self.client.kv_capacity)
        self._queues: dict[str, RequestOutputCollector] = {}
        self._output_task: asyncio.Task | None = None
        self.sleep_level = 0  # 0: awake; else the level of the sleep() the engines are in (some parts may be awake)

    @classmethod
    def from_engine_args(cls, engine_args: Any = None, log_stats: bool = True, **kwargs: Any) -> "AsyncLLM":
        """From an AsyncEngineArgs (vLLM's form) and/or engine arguments as keywords."""
        from tokenmill.config.engine_args import engine_kwargs
        return cls(create_engine_config(**engine_kwargs(engine_args, kwargs)), log_stats=log_stats)

    @property
    def engine_core_pid(self) -> int | None:
        return self.client.pid

    @property
    def engine_core_pids(self) -> list[int]:
        """Process ids of the local engine cores, in data-parallel rank order."""
        return self.client.engine_pids

    @property
    def errored(self) -> bool:
        return not self.client.is_alive()

    async def check_health(self) -> None:
        if self.errored:
            raise EngineDeadError(self.client.dead_error or "the engine core process is not running")

    def get_default_sampling_params(self) -> dict[str, Any]:
        return default_sampling_kwargs(self.generation_config)

    def last_stats(self) -> SchedulerStats | None:
        return self.stat_logger.last

    async def reset_prefix_cache(self) -> bool:
        return all(await self._on_engines("reset_prefix_cache"))

    # ----- sleep mode (needs enable_sleep_mode; worker/sleep.py) and the torch profiler, on every engine -----
    async def sleep(self, level: int = 1) -> None:
        await self._on_engines("sleep", level)
        self.sleep_level = level
        self._record_sleep_level()

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._on_engines("wake_up", tags)
        if not await self.is_sleeping():
            self.sleep_level = 0
            self._record_sleep_level()

    async def is_sleeping(self) -> bool:
        return any(await self._on_engines("is_sleeping"))

    @property
    def sleeping(self) -> bool:
        return self.sleep_level > 0

    async def start_profile(self) -> None:
        await self._on_engines("start_profile")

    async def stop_profile(self) -> None:
        await self._on_engines("stop_profile")

    async def _on_engines(self, name: str, *args: Any) -> list:
        """A utility of the engine cores on every engine; an engine's exception comes back as a RuntimeError
        carrying its message."""
        self._ensure_output_task()  # the results come back on the output socket
        return await self.client.call_utility_all(name, *args)

    def _record_sleep_level(self) -> None:
        for e in self.stat_logger.engines:
            e.set_sleep_level(self.sleep_level)

    # ----- requests -----
    async def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str,
                       priority: int = 0, lora_request: Any = None) -> AsyncIterator[RequestOutput]:
        self._ensure_output_task()
        if self.errored:
            raise EngineDeadError(self.client.dead_error or "the engine core is not running")
        if request_id in self._queues:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        if self.sleep_level:
            raise RuntimeError("The engine is sleeping: call wake_up() before generating.")
        text, reqs = self.processor.process(request_id, prompt, sampling_params, priority=priority,
                                            lora_request=lora_request)
        queue = RequestOutputCollector(delta=sampling_params.output_kind == RequestOutputKind.DELTA)
        self._queues[request_id] = queue
        for i, r in enumerate(reqs):
            self.output_processor.add_request(r, text, parent_id=request_id, index=i, n=len(reqs), queue=queue)
        finished = False
        try:
            await self.client.add_requests(reqs)
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:  # cancelled, disconnected or failed: free the request's blocks in the core
                self.client.abort_nowait(self._drop(request_id))

    async def abort(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        await self.client.abort([eid for rid in ids for eid in self._drop(rid)])

    def _drop(self, request_id: str) -> list[str]:
        """Forget a user request (or one sequence) in the front end; returns the engine ids to abort. Its
        sequences count as finished with reason "abort" in the metrics (vllm:request_success_total and the
        per-request histograms) of the engine that ran them: vLLM leaves client aborts out of them."""
        stats = IterationStats(time.time(), time.monotonic())
        engine_ids = self.output_processor.abort_requests(request_id, stats)
        if stats.finished:
            self.stat_logger.record_step(None, stats, self.client.owner(engine_ids[0]) or 0)
        return engine_ids

    # ----- background output handling -----
    def start_output_handler(self) -> None:
        """Start reading the engines' outputs now (needs a running event loop). The API server calls it at
        start-up: the engines send every step's stats to every API server process, and one that has served no
        request yet must still drain them (else the engines block once the socket's buffer is full), and the first
        one must record the per-step metrics whether or not requests reach it."""
        self._ensure_output_task()

    def _ensure_output_task(self) -> None:
        if self._output_task is None or self._output_task.done():
            self._output_task = asyncio.get_running_loop().create_task(self._output_loop())

    async def _output_loop(self) -> None:
        try:
            while True:
                outs = await self.client.get_output()
                result = self.output_processor.process_outputs(outs.outputs, outs.timestamp)
                if result.reqs_to_abort:
                    await self.client.abort(result.reqs_to_abort)
                self.stat_logger.record_step(outs.scheduler_stats, result.iteration_stats, outs.engine_index)
        except EngineDeadError as e:
            for q in list(self._queues.values()):
                q.put_nowait(e)
        except Exception as e:  # a bug here must not leave requests hanging
            logger.exception("Output handler failed")
            self.client._mark_dead(f"output handler failed: {e!r}")
            for q in list(self._queues.values()):
                q.put_nowait(EngineDeadError(str(e)))

    def shutdown(self) -> None:
        if self._output_task is not None:
            self._output_task.cancel()
        self.client.shutdown()
