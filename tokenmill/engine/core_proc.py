"""The engine-core process: a busy loop around EngineCore for one data-parallel rank, fed and drained over ZMQ.

Start-up (see engine/launcher.py): the process connects a DEALER to the head's handshake socket and sends HELLO
{rank, pid, host}; the head answers WELCOME {inputs, outputs} (one input and one output address per client, i.e. per
API server process) or REJECT {error}. After building the EngineCore it sends READY {engine_index, num_blocks} on
every output socket and on the handshake socket, or FAILED {rank, error, traceback} on the handshake socket. The
handshake socket stays open: the head stops engines of other nodes by sending SHUTDOWN there.

Client k -> engine, on input socket k: (kind, msgpack payload...). ADD carries the EngineCoreRequests of one user
request (n > 1: its n sequences), one frame each, so they join the same step (a step that took one sequence alone
would batch, and so round, the others differently: a seeded request would not repeat), ABORT a list of request
ids, UTILITY a (call_id, method name, args) tuple, SHUTDOWN nothing. Engine -> client k, on output socket k:
OUTPUTS carries EngineCoreOutputs (the outputs of client k's requests, plus the scheduler stats every client gets),
UTILITY_RESULT (call_id, result, error text), READY as above, FAILED an error text.
"""
from __future__ import annotations

import os
import signal
import socket
import time
import traceback

import msgspec
import zmq

from tokenmill.core.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from tokenmill.logger import init_logger
from tokenmill.metrics.step_timing import SlowStepLog

logger = init_logger(__name__)
# Start-up errors that are about the user's model or options (a KV cache too small for max_model_len, a flag the
# checkpoint does not match): their message says what to change, and a traceback would bury it.
REFUSED_AT_START = (ValueError, FileNotFoundError)

# client <-> engine
ADD, ABORT, UTILITY, SHUTDOWN = b"A", b"X", b"U", b"S"
OUTPUTS, UTILITY_RESULT, FAILED, READY = b"O", b"R", b"F", b"Y"
# handshake (engine or headless node <-> head)
HELLO, NODE_HELLO, WELCOME, REJECT = b"H", b"N", b"W", b"J"
_UTILITIES = {"reset_prefix_cache", "get_num_blocks", "sleep", "wake_up", "is_sleeping", "start_profile",
              "stop_profile"}
HELLO_TIMEOUT_S = 300.0
# After a SIGTERM, how long to keep serving while waiting for the process that started us to send SHUTDOWN.
SIGTERM_GRACE_S = 60.0
_sigterm_at: list[float] = []  # when this process got SIGTERM (set by the handler)


def _on_sigterm(*_) -> None:
    """A SIGTERM for the whole process group (systemd, `kill -- -PGID`, a container runtime) reaches the API server
    and us at once. Exiting here would cut the server's graceful shutdown short (and make it report a dead engine),
    so the engine keeps serving until the server sends SHUTDOWN; it leaves on its own only if the server is gone or
    does not answer within SIGTERM_GRACE_S."""
    if not _sigterm_at:
        _sigterm_at.append(time.monotonic())


class EngineCoreProc:
    """Runs in its own process. Never blocks while work remains; sleeps on the input sockets when idle.

    Serves one or more clients: a request's outputs go to the client whose input socket added it; every client gets
    the scheduler stats of every step (each balances load over all engines). Every OUTPUTS message carries this
    engine's data-parallel rank in `engine_index`.
    """

    def __init__(self, config, engine_index: int, input_paths: list[str], output_paths: list[str],
                 parent_pid: int, control: zmq.Socket | None = None, core=None) -> None:
        from tokenmill.engine.engine_core import EngineCore
        self.core = core if core is not None else EngineCore(config)
        self.engine_index = engine_index
        self.parent_pid = parent_pid
        self.ctx = zmq.Context()
        self.inputs, self.outputs = [], []
        for path in input_paths:
            sock = self.ctx.socket(zmq.PULL)
            sock.connect(path)
            self.inputs.append(sock)
        for path in output_paths:
            sock = self.ctx.socket(zmq.PUSH)
            sock.connect(path)
            self.outputs.append(sock)
        self._client_of_socket = {sock: k for k, sock in enumerate(self.inputs)}
        self.control = control  # the handshake socket: only SHUTDOWN arrives there
        self.client_of: dict[str, int] = {}  # request id -> client index, only with several clients
        self.req_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        self.encoder = msgspec.msgpack.Encoder()
        self.running = True
        self._stats_dirty = False

    def get_num_blocks(self) -> int:
        return self.core.num_blocks

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def sleep(self, level: int) -> None:
        self.core.sleep(level)

    def wake_up(self, tags: list[str] | None) -> None:
        self.core.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.core.is_sleeping()

    def start_profile(self) -> None:
        self.core.start_profile()

    def stop_profile(self) -> None:
        self.core.stop_profile()

    def announce_ready(self, startup: dict[str, float] | None = None) -> None:
        msg = self.encoder.encode({"engine_index": self.engine_index, "num_blocks": self.core.num_blocks,
                                   "kv_capacity": self.core.kv_capacity,
                                   "startup": {**(startup or {}), **self.core.startup_seconds},
                                   "startup_compile_seconds": self.core.startup_compile_seconds})
        for sock in self.outputs:
            sock.send_multipart([READY, msg])

    def _add(self, payload: bytes, client: int) -> None:
        request_id = None
        try:
            # Decoding re-runs the sampling parameters' checks: a request they reject must end that request, not
            # this process (and with it every other request).
            request_id = _request_id(payload)
            req = self.req_decoder.decode(payload)
            self.core.add_request(req)
        except Exception as e:  # the front end checks first; this is a last line of defence
            logger.warning("Rejected request %s: %s", request_id, e)
            if request_id is not None:
                out = EngineCoreOutputs(outputs=[EngineCoreOutput(request_id, [], finish_reason=FinishReason.ABORT,
                                                                  stop_reason=str(e))],
                                        engine_index=self.engine_index)
                self.outputs[client].send_multipart([OUTPUTS, self.encoder.encode(out)])
            return
        if len(self.outputs) > 1:
            self.client_of[req.request_id] = client

    def _handle(self, kind: bytes, payloads: list[bytes], client: int) -> None:
        if kind == ADD:
            for payload in payloads:
                self._add(payload, client)
            return
        payload = payloads[0]
        if kind == ABORT:
            ids = msgspec.msgpack.decode(payload)
            self.core.abort_requests(ids)
            if self.client_of:
                for rid in ids:
                    self.client_of.pop(rid, None)
            self._stats_dirty = True
        elif kind == UTILITY:
            call_id, name, args = msgspec.msgpack.decode(payload)
            try:
                if name not in _UTILITIES:
                    raise ValueError(f"unknown utility {name!r}")
                result, error = getattr(self, name)(*args), None
            except Exception as e:
                result, error = None, str(e) or type(e).__name__
            self.outputs[client].send_multipart([UTILITY_RESULT, self.encoder.encode((call_id, result, error))])
        elif kind == SHUTDOWN:
            self.running = False

    def _send(self, outs: EngineCoreOutputs) -> None:
        outs.engine_index = self.engine_index
        if len(self.outputs) == 1:
            self.outputs[0].send_multipart([OUTPUTS, self.encoder.encode(outs)])
            return
        per_client: list[list[EngineCoreOutput]] = [[] for _ in self.outputs]
        for out in outs.outputs:
            client = self.client_of.get(out.request_id, 0)
            if out.finish_reason is not None:
                self.client_of.pop(out.request_id, None)
            per_client[client].append(out)
        for sock, mine in zip(self.outputs, per_client):
            part = EngineCoreOutputs(outputs=mine, scheduler_stats=outs.scheduler_stats, timestamp=outs.timestamp,
                                     engine_index=self.engine_index)
            sock.send_multipart([OUTPUTS, self.encoder.encode(part)])

    def run(self) -> None:
        poller = zmq.Poller()
        for sock in self.inputs:
            poller.register(sock, zmq.POLLIN)
        if self.control is not None:
            poller.register(self.control, zmq.POLLIN)
        client_of_socket = self._client_of_socket
        slow_steps = SlowStepLog()
        while self.running:
            if _sigterm_at and (os.getppid() != self.parent_pid
                                or time.monotonic() - _sigterm_at[0] > SIGTERM_GRACE_S):
                logger.warning("Engine core %d: SIGTERM and no shutdown from the server; exiting.", self.engine_index)
                break
            busy = self.core.has_unfinished_requests()
            # Drain every pending message; block (briefly, to notice an orphaned process) only when idle.
            timeout = 0 if busy else 1000
            while self.running:
                events = poller.poll(timeout)
                if not events:
                    break
                for sock, _ in events:
                    kind, *payloads = sock.recv_multipart()
                    if sock is self.control:
                        self.running = self.running and kind != SHUTDOWN
                    else:
                        self._handle(kind, payloads, client_of_socket[sock])
                timeout = 0
            if not self.running:
                break
            if self.core.has_unfinished_requests():
                self._send(slow_steps.run(self.core.step, self.core.describe_last_batch))
                self._stats_dirty = True
            elif self._stats_dirty:
                # Going idle (or aborts freed blocks): publish a final snapshot so gauges return to zero.
                self._send(EngineCoreOutputs(scheduler_stats=self.core.scheduler.make_stats()))
                self._stats_dirty = False
            elif os.getppid() != self.parent_pid:
                logger.warning("The process that started this engine core is gone; engine core exiting.")
                break

    def report_failure(self, error: str) -> None:
        for sock in self.outputs:
            sock.send_multipart([FAILED, error.encode()])

    def close(self) -> None:
        for sock in self.inputs:
            sock.close(linger=0)
        for sock in self.outputs:
            sock.close(linger=1000)
        self.ctx.term()


def _request_id(payload: bytes) -> str | None:
    """The request id of an encoded EngineCoreRequest (its first field), read without validating the rest."""
    fields = msgspec.msgpack.decode(payload)
    if isinstance(fields, list) and fields and isinstance(fields[0], str):
        return fields[0]
    return None


def _say_hello(hs: zmq.Socket, engine_index: int) -> None:
    """Introduces this engine core to the head; its answer is read by _welcome."""
    hs.send_multipart([HELLO, msgspec.msgpack.encode({"rank": engine_index, "pid": os.getpid(),
                                                      "host": socket.gethostname()})])


def _welcome(hs: zmq.Socket, engine_index: int, parent_pid: int) -> dict | None:
    """The head's answer to HELLO: its WELCOME (the client addresses), or None to exit."""
    waited = 0.0
    while not hs.poll(1000):
        waited += 1.0
        if os.getppid() != parent_pid:
            return None
        if waited >= HELLO_TIMEOUT_S:
            logger.error("Engine core %d: no answer from the head node within %.0f s.", engine_index, waited)
            return None
    kind, payload = hs.recv_multipart()
    msg = msgspec.msgpack.decode(payload)
    if kind != WELCOME:
        logger.error("Engine core %d was turned away by the head node: %s", engine_index, msg.get("error"))
        return None
    return msg


def run_engine_core(config, engine_index: int, handshake_path: str, parent_pid: int,
                    standby_times: tuple[float, float] | None = None) -> None:
    """Process entry point for data-parallel rank `engine_index`: handshake, build, announce, serve.
    standby_times: (seconds of imports, seconds then waited for the config) of a process started ahead of its
    config (engine/standby.py); else the imports are this process's age at entry (unpickling the config)."""
    from tokenmill.metrics.startup import process_age
    startup = ({"imports": process_age()} if standby_times is None
               else {"imports": standby_times[0], "waited for its config": standby_times[1]})
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the process that started us decides when we stop
    signal.signal(signal.SIGUSR1, lambda *_: os._exit(0))  # ...and says so with launcher.ENGINE_STOP_SIGNAL
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # while starting: nothing to drain yet
    ctx = zmq.Context()
    hs = ctx.socket(zmq.DEALER)
    hs.setsockopt(zmq.LINGER, 5000)  # READY / FAILED must reach the head even if we exit right after
    hs.connect(handshake_path)
    # HELLO first, then the engine is built while the head gets on with its own start-up (tokenizer, sockets);
    # the WELCOME (where the clients listen) is only needed once the engine exists.
    _say_hello(hs, engine_index)
    from tokenmill.worker import cpu_threads
    cpu_threads.FRONTEND_SHARES_CPUS = True  # the process that started us (the API server) runs on these CPUs too
    try:
        from tokenmill.engine.engine_core import EngineCore
        core = EngineCore(config)
        welcome = _welcome(hs, engine_index, parent_pid)
        if welcome is None:
            hs.close(linger=0)
            ctx.term()
            os._exit(1)
        proc = EngineCoreProc(config, engine_index, welcome["inputs"], welcome["outputs"], parent_pid, control=hs,
                              core=core)
    except BaseException as e:
        hs.send_multipart([FAILED, msgspec.msgpack.encode({"rank": engine_index, "error": f"{type(e).__name__}: {e}",
                                                           "traceback": traceback.format_exc(),
                                                           "refused": isinstance(e, REFUSED_AT_START),
                                                           "message": str(e)})])
        hs.close()
        ctx.term()
        os._exit(1)
    from tokenmill.gc_utils import freeze_gc_heap
    freeze_gc_heap(f"engine core {engine_index}")
    proc.announce_ready(startup)
    hs.send_multipart([READY, msgspec.msgpack.encode({"rank": engine_index, "num_blocks": proc.core.num_blocks})])
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        proc.run()
    except BaseException as e:
        logger.error("Engine core %d failed:\n%s", engine_index, traceback.format_exc())
        try:
            proc.report_failure(f"engine core {engine_index}: {type(e).__name__}: {e}")
        finally:
            os._exit(1)
    proc.close()
    hs.close(linger=0)
    ctx.term()
