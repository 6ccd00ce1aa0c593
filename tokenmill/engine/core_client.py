"""The API server's side of the engine-core process: start it, send requests, receive outputs."""
from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
import tempfile

import msgspec
import zmq
import zmq.asyncio

from tokenmill.engine.core_proc import ABORT, ADD, FAILED, OUTPUTS, UTILITY, UTILITY_RESULT, run_engine_core
from tokenmill.engine.messages import EngineCoreOutputs, EngineCoreRequest
from tokenmill.engine.protocol import EngineDeadError
from tokenmill.logger import init_logger

logger = init_logger(__name__)


class AsyncMPClient:
    """Starts the engine core in a spawned process and talks to it over ZMQ IPC sockets (asyncio side).

    Contract: the constructor returns once the engine is ready (or raises its start-up error). `get_output()`
    returns the next EngineCoreOutputs and raises EngineDeadError once the process has died.
    """

    def __init__(self, config, start_timeout_s: float = 1800.0, wait: bool = True) -> None:
        self._dir = tempfile.mkdtemp(prefix="tokenmill-")
        in_path = f"ipc://{self._dir}/input"
        out_path = f"ipc://{self._dir}/output"
        self.ctx = zmq.asyncio.Context()
        self.input = self.ctx.socket(zmq.PUSH)
        self.input.bind(in_path)
        self.output = self.ctx.socket(zmq.PULL)
        self.output.bind(out_path)
        self.encoder = msgspec.msgpack.Encoder()
        self.out_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._utility_futures: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self.dead_error: str | None = None

        mp = multiprocessing.get_context("spawn")
        parent_conn, child_conn = mp.Pipe(duplex=False)
        self.proc = mp.Process(target=run_engine_core, name="TokenmillEngineCore",
                               args=(config, in_path, out_path, child_conn, os.getpid()), daemon=True)
        self.proc.start()
        child_conn.close()
        self._ready_conn, self._start_timeout_s = parent_conn, start_timeout_s
        self.num_blocks: int | None = None
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Blocks until the engine core has loaded the model and sized its KV cache (or raises its error)."""
        msg = self._wait_ready(self._ready_conn, self._start_timeout_s)
        if msg.get("status") != "ready":
            self.shutdown()
            raise RuntimeError(msg.get("error", "the engine core failed to start")) from None
        self.num_blocks = msg["num_blocks"]

    def _wait_ready(self, conn, timeout_s: float) -> dict:
        waited = 0.0
        while waited < timeout_s:
            if conn.poll(0.5):
                try:
                    return conn.recv()
                except EOFError:
                    break
            waited += 0.5
            if not self.proc.is_alive():
                break
        code = self.proc.exitcode
        return {"status": "failed", "error": f"the engine core process exited during start-up (exit code {code}); "
                                             "see its log above"}

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def is_alive(self) -> bool:
        return self.dead_error is None and self.proc.is_alive()

    async def add_requests(self, reqs: list[EngineCoreRequest]) -> None:
        for r in reqs:
            await self.input.send_multipart([ADD, self.encoder.encode(r)])

    def abort_nowait(self, request_ids: list[str]) -> None:
        """Usable from synchronous cleanup code: queues the abort without awaiting."""
        if request_ids and self.dead_error is None:
            self.input.send_multipart([ABORT, self.encoder.encode(list(request_ids))])

    async def abort(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_error is None:
            await self.input.send_multipart([ABORT, self.encoder.encode(list(request_ids))])

    async def call_utility(self, name: str, *args):
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._utility_futures[call_id] = fut
        await self.input.send_multipart([UTILITY, self.encoder.encode((call_id, name, list(args)))])
        return await fut

    async def get_output(self) -> EngineCoreOutputs:
        """Waits for the next outputs; watches the process so a dead engine is reported within a second."""
        while True:
            if await self.output.poll(1000):
                kind, payload = await self.output.recv_multipart()
                if kind == OUTPUTS:
                    return self.out_decoder.decode(payload)
                if kind == UTILITY_RESULT:
                    call_id, result, error = msgspec.msgpack.decode(payload)
                    fut = self._utility_futures.pop(call_id, None)
                    if fut is not None and not fut.done():
                        fut.set_exception(RuntimeError(error)) if error else fut.set_result(result)
                    continue
                if kind == FAILED:
                    self._mark_dead(payload.decode(errors="replace"))
            elif not self.proc.is_alive():
                self._mark_dead(f"the engine core process exited unexpectedly (exit code {self.proc.exitcode})")
            if self.dead_error is not None:
                raise EngineDeadError(self.dead_error)

    def _mark_dead(self, why: str) -> None:
        if self.dead_error is None:
            self.dead_error = why
            logger.error("Engine core is dead: %s", why)
        for fut in self._utility_futures.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(why))
        self._utility_futures.clear()

    def shutdown(self) -> None:
        try:
            if self.proc.is_alive():
                self.proc.terminate()  # the core exits at once on SIGTERM; in-flight work was drained above us
                self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()
        finally:
            self.input.close(linger=0)
            self.output.close(linger=0)
            self.ctx.term()
            for name in ("input", "output"):
                try:
                    os.unlink(os.path.join(self._dir, name))
                except OSError:
                    pass
            try:
                os.rmdir(self._dir)
            except OSError:
                pass
