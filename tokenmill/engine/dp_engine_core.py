"""EngineCore's interface over data-parallel engine-core processes, for the offline (synchronous) LLMEngine."""
from __future__ import annotations

import asyncio
import queue
import threading
import weakref

from tokenmill.core.messages import (EngineCoreOutputs, EngineCoreRequest, SchedulerStats,
                                     combine_scheduler_stats)
from tokenmill.engine.core_client import AsyncMPClient


class DPEngineCore:
    """Stands in for EngineCore in LLMEngine when data_parallel_size > 1.

    An AsyncMPClient runs on a private event loop in a daemon thread; a task there drains the engines' outputs into
    a thread-safe queue (so utility calls are answered even between steps). `step()` returns what the engines have
    sent since the last call (waiting for at least one message while requests are unfinished), with the scheduler
    stats summed over the engines. The engine processes stop when this object is collected or at exit.
    """

    def __init__(self, config) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="TokenmillDPClient", daemon=True)
        self._thread.start()
        self._outputs: queue.Queue = queue.Queue()
        try:
            self.client: AsyncMPClient = self._run(self._start(config))
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            raise
        self.num_blocks = self.client.num_blocks
        self._stats: dict[int, SchedulerStats] = {}
        self._finalizer = weakref.finalize(self, _shutdown, self.client, self._loop, self._thread, self._drainer)

    async def _start(self, config) -> AsyncMPClient:
        client = AsyncMPClient(config)
        self._drainer = asyncio.get_running_loop().create_task(self._drain(client))
        return client

    async def _drain(self, client: AsyncMPClient) -> None:
        try:
            while True:
                self._outputs.put(await client.get_output())
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # EngineDeadError: every later step raises it
            self._outputs.put(e)

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # ----- EngineCore's interface -----
    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._run(self.client.add_requests(requests))

    def add_request(self, request: EngineCoreRequest) -> None:
        self.add_requests([request])

    def abort_requests(self, request_ids: list[str]) -> None:
        self._run(self.client.abort(list(request_ids)))

    def has_unfinished_requests(self) -> bool:
        return self.client.num_unfinished > 0 or not self._outputs.empty()

    def step(self) -> EngineCoreOutputs:
        merged: list = []
        items = []
        while not items:
            try:
                items.append(self._outputs.get(timeout=0.1))
            except queue.Empty:
                if self.client.num_unfinished == 0:
                    break
        while True:
            try:
                items.append(self._outputs.get_nowait())
            except queue.Empty:
                break
        for item in items:
            if isinstance(item, BaseException):
                self._outputs.put(item)  # stays dead
                raise item
            merged.extend(item.outputs)
            if item.scheduler_stats is not None:
                self._stats[item.engine_index] = item.scheduler_stats
        return EngineCoreOutputs(outputs=merged, scheduler_stats=combine_scheduler_stats(list(self._stats.values())))

    def reset_prefix_cache(self) -> bool:
        return all(self._run(self.client.call_utility_all("reset_prefix_cache")))

    def shutdown(self) -> None:
        self._finalizer()


def _shutdown(client: AsyncMPClient, loop: asyncio.AbstractEventLoop, thread: threading.Thread,
              drainer: asyncio.Task) -> None:
    async def stop() -> None:
        drainer.cancel()
        client.shutdown()
    try:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
