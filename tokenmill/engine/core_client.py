"""The API server's side of the engine cores: start them (or join ones started for it), route requests, receive
outputs."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import shutil
import time

import msgspec
import zmq
import zmq.asyncio

from tokenmill.core.messages import EngineCoreOutputs, EngineCoreRequest
from tokenmill.engine.core_proc import ABORT, ADD, FAILED, OUTPUTS, READY, UTILITY, UTILITY_RESULT
from tokenmill.engine.launcher import EngineAddresses, EngineManager, make_addresses
from tokenmill.engine.load_balancer import DPLoadBalancer
from tokenmill.engine.protocol import EngineDeadError
from tokenmill.logger import init_logger

logger = init_logger(__name__)
SEND_WAIT_MS = 5000  # how long a send may wait for an engine's input connection before the engine counts as gone


class AsyncMPClient:
    """Talks to the `data_parallel_size` engine-core processes over ZMQ (asyncio side).

    Without `addresses` this client owns the engines: it starts the local ranks and runs the start-up handshake
    (EngineManager). With `addresses` (several API server processes) the engines belong to the parent process and
    this client is client number `client_index` among them.

    Contract: once `wait_ready()` returns, every engine is up and `num_blocks` is the smallest KV cache among
    them. `add_requests(reqs)` sends the sequences of one user request to one engine (DPLoadBalancer's choice) and
    returns its index; `abort(ids)` sends each id to the engine that owns it. `get_output()` returns the next
    EngineCoreOutputs of any engine (`engine_index` says which) and raises EngineDeadError once any engine is dead:
    a replica that dies stops the whole server, as one engine does.
    """

    def __init__(self, config, start_timeout_s: float = 1800.0, wait: bool = True, client_index: int = 0,
                 addresses: EngineAddresses | None = None) -> None:
        pc = config.parallel_config
        self.num_engines = pc.data_parallel_size
        self.client_index = client_index
        owns = addresses is None
        self.addresses = make_addresses(pc, 1) if owns else addresses
        self.manager: EngineManager | None = None
        self.ctx = zmq.Context()
        self._sync: list[zmq.Socket] = []
        try:
            for path in self.addresses.inputs[client_index]:
                # No high-water mark: a send only fails when the engine is not connected at all (see _send).
                self._sync.append(self._bind(zmq.PUSH, path, sndhwm=0))
            out = self._bind(zmq.PULL, self.addresses.outputs[client_index])
            self._sync.append(out)
            self._monitor_sync = out.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            if owns:
                self.manager = EngineManager(config, self.addresses)
        except BaseException:
            self._close_sockets()
            if owns and self.addresses.tmp_dir:
                shutil.rmtree(self.addresses.tmp_dir, ignore_errors=True)
            raise
        # asyncio views of the same sockets; the synchronous ones own them (start-up and shutdown use those)
        self.inputs = [zmq.asyncio.Socket.shadow(s.underlying) for s in self._sync[:-1]]
        self.output = zmq.asyncio.Socket.shadow(out.underlying)
        self._monitor = zmq.asyncio.Socket.shadow(self._monitor_sync.underlying)
        self._poller = zmq.asyncio.Poller()
        self._poller.register(self.output, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self.encoder = msgspec.msgpack.Encoder()
        self.out_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._utility_futures: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self.dead_error: str | None = None
        self.balancer = DPLoadBalancer(self.num_engines, config.cache_config.block_size,
                                       affinity_blocks=4 if config.cache_config.enable_prefix_caching else 0)
        self._owner: dict[str, int] = {}  # engine request id -> engine index, only with several engines
        self._start_timeout_s = start_timeout_s
        self.num_blocks: int | None = None
        self.kv_capacity: list | None = None  # the first engine's per layer group (core/kv_cache_groups.kv_capacity)
        # The first engine's start-up phases (seconds by name) and kernel compile seconds (None: not tracked).
        self.engine_startup: tuple[dict[str, float] | None, float | None] = (None, None)
        if wait:
            self.wait_ready()

    def _bind(self, kind: int, path: str, sndhwm: int | None = None) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        if sndhwm is not None:
            sock.setsockopt(zmq.SNDHWM, sndhwm)
        try:
            sock.bind(path)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            raise ValueError(f"Cannot listen on {path} for the engine cores: {e}") from None
        return sock

    def wait_ready(self) -> None:
        """Blocks until every engine core has loaded the model and sized its KV cache (or raises its error)."""
        deadline = time.monotonic() + self._start_timeout_s
        ready: dict[int, int] = {}
        out = self._sync[-1]
        try:
            while len(ready) < self.num_engines or (self.manager is not None and not self.manager.all_ready()):
                if self.manager is not None:
                    self.manager.poll(0)
                    why = self.manager.failure()
                    if why is not None:
                        raise self.manager.startup_error(why)
                if out.poll(100):
                    kind, payload = out.recv_multipart()
                    if kind == READY:
                        msg = msgspec.msgpack.decode(payload)
                        ready[msg["engine_index"]] = msg["num_blocks"]
                        if msg["engine_index"] == 0 or self.kv_capacity is None:
                            self.kv_capacity = msg.get("kv_capacity")
                            self.engine_startup = (msg.get("startup"), msg.get("startup_compile_seconds"))
                    elif kind == FAILED:
                        raise RuntimeError(payload.decode(errors="replace"))
                if time.monotonic() > deadline:
                    missing = [r for r in range(self.num_engines) if r not in ready]
                    raise RuntimeError(f"data-parallel engine cores {missing} were not ready within "
                                       f"{self._start_timeout_s:.0f} s")
        except BaseException:
            self.shutdown()
            raise
        self.num_blocks = min(ready.values())
        if self.num_engines > 1:
            logger.info("%d data-parallel engine cores ready; KV blocks per engine: %s", self.num_engines,
                        [ready[r] for r in range(self.num_engines)])

    @property
    def pid(self) -> int | None:
        """The first local engine core's process id (None when this client does not own local engines)."""
        pids = self.engine_pids
        return pids[0] if pids else None

    @property
    def engine_pids(self) -> list[int]:
        return self.manager.pids if self.manager is not None else []

    def is_alive(self) -> bool:
        """Also usable before any request started the output loop: checks the local processes and whether an
        engine's connection dropped."""
        if self.ctx.closed:  # shut down
            return False
        if self.dead_error is None:
            if self._monitor_sync.poll(0):
                self._monitor_sync.recv_multipart()
                self._mark_dead(self._why_disconnected())
            elif self.manager is not None and self.manager.dead_local() is not None:
                self._mark_dead(self.manager.dead_local())
        return self.dead_error is None

    @property
    def num_unfinished(self) -> int:
        """Engine requests routed and not yet finished or aborted (tracked only with several engines)."""
        return len(self._owner)

    def owner(self, request_id: str) -> int | None:
        """The engine running engine request `request_id`, while it is unfinished."""
        return 0 if self.num_engines == 1 else self._owner.get(request_id)

    # ----- requests -----
    async def add_requests(self, reqs: list[EngineCoreRequest]) -> int:
        """Sends the sequences of one user request (they share the prompt) to one engine; returns its index."""
        if self.num_engines == 1:
            engine = 0
        else:
            engine = self.balancer.choose(reqs[0].prompt_token_ids, len(reqs))
            for r in reqs:
                self._owner[r.request_id] = engine
        # One message: the engine adds them all before its next step (engine/core_proc.py).
        await self._send(engine, [ADD, *(self.encoder.encode(r) for r in reqs)])
        return engine

    async def _send(self, engine: int, frames: list[bytes]) -> None:
        """Sends without blocking; waits (briefly) only while the engine's input connection is not up."""
        sock = self._sync[engine]
        try:
            return sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        if await self.inputs[engine].poll(SEND_WAIT_MS, zmq.POLLOUT):
            with contextlib.suppress(zmq.Again):
                return sock.send_multipart(frames, flags=zmq.NOBLOCK)
        self._mark_dead(self.dead_error or f"data-parallel engine core {engine} is not connected")
        raise EngineDeadError(self.dead_error)

    def _by_engine(self, request_ids: list[str]) -> dict[int, list[str]]:
        if self.num_engines == 1:
            return {0: list(request_ids)}
        groups: dict[int, list[str]] = {}
        for rid in request_ids:
            engine = self._owner.pop(rid, None)
            if engine is not None:
                groups.setdefault(engine, []).append(rid)
        return groups

    def abort_nowait(self, request_ids: list[str]) -> None:
        """Usable from synchronous cleanup code: queues the abort without awaiting."""
        if request_ids and self.dead_error is None:
            for engine, ids in self._by_engine(request_ids).items():
                with contextlib.suppress(zmq.Again):  # not connected: the engine is gone and so are its requests
                    self._sync[engine].send_multipart([ABORT, self.encoder.encode(ids)], flags=zmq.NOBLOCK)

    async def abort(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_error is None:
            for engine, ids in self._by_engine(request_ids).items():
                await self._send(engine, [ABORT, self.encoder.encode(ids)])

    async def call_utility(self, name: str, *args, engine: int = 0):
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._utility_futures[call_id] = fut
        await self._send(engine, [UTILITY, self.encoder.encode((call_id, name, list(args)))])
        return await fut

    async def call_utility_all(self, name: str, *args) -> list:
        """Runs a utility on every engine; the results in engine order."""
        return list(await asyncio.gather(*[self.call_utility(name, *args, engine=e)
                                           for e in range(self.num_engines)]))

    # ----- outputs -----
    async def get_output(self) -> EngineCoreOutputs:
        """Waits for the next outputs; watches the engines so a dead one is reported within a second."""
        while True:
            events = dict(await self._poller.poll(1000))
            if self.output in events:
                kind, payload = await self.output.recv_multipart()
                if kind == OUTPUTS:
                    outs = self.out_decoder.decode(payload)
                    if self.num_engines > 1:
                        self._track(outs)
                    return outs
                if kind == UTILITY_RESULT:
                    call_id, result, error = msgspec.msgpack.decode(payload)
                    fut = self._utility_futures.pop(call_id, None)
                    if fut is not None and not fut.done():
                        fut.set_exception(RuntimeError(error)) if error else fut.set_result(result)
                    continue
                if kind == FAILED:
                    self._mark_dead(payload.decode(errors="replace"))
            if self._monitor in events:
                await self._monitor.recv_multipart()
                self._mark_dead(self._why_disconnected())
            elif not events and self.manager is not None and self.manager.dead_local() is not None:
                self._mark_dead(self.manager.dead_local())
            if self.dead_error is not None:
                raise EngineDeadError(self.dead_error)

    def _track(self, outs: EngineCoreOutputs) -> None:
        owner = self._owner
        for o in outs.outputs:
            if o.finish_reason is not None:
                owner.pop(o.request_id, None)
        if outs.scheduler_stats is not None:
            self.balancer.record_stats(outs.engine_index, outs.scheduler_stats)

    def _why_disconnected(self) -> str:
        if self.manager is not None:
            # A local process that just closed its sockets is finishing its exit; a headless node reports which of
            # its engines died over the handshake socket.
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:
                self.manager.poll(20)
                why = self.manager.failure()
                if why is not None:
                    return why
        return ("lost the connection to a data-parallel engine core (its process or its node went away); see the "
                "log of the node that ran it")

    def _mark_dead(self, why: str) -> None:
        if self.dead_error is None:
            self.dead_error = why
            logger.error("Engine core is dead: %s", why)
        for fut in self._utility_futures.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(why))
        self._utility_futures.clear()

    # ----- shutdown -----
    def shutdown(self) -> None:
        try:
            if self.manager is not None:
                self.manager.shutdown()
        finally:
            self._close_sockets()

    def _close_sockets(self) -> None:
        if self.ctx.closed:
            return
        if self._sync:
            with contextlib.suppress(zmq.ZMQError):
                self._sync[-1].disable_monitor()
        monitor = getattr(self, "_monitor_sync", None)
        if monitor is not None:
            monitor.close(linger=0)
        for sock in self._sync:
            sock.close(linger=0)
        self._sync = []
        self.ctx.term()
