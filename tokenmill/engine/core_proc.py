"""The engine-core process: a busy loop around EngineCore, fed and drained over ZMQ.

Input frames: (kind, msgpack payload). ADD carries an EngineCoreRequest, ABORT a list of request ids, UTILITY a
(call_id, method name, args) tuple, SHUTDOWN nothing. Output frames: (kind, msgpack payload): OUTPUTS carries
EngineCoreOutputs, UTILITY_RESULT (call_id, result or error text), FAILED an error text.
"""
from __future__ import annotations

import os
import signal
import traceback

import msgspec
import zmq

from tokenmill.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from tokenmill.logger import init_logger

logger = init_logger(__name__)

ADD, ABORT, UTILITY, SHUTDOWN = b"A", b"X", b"U", b"S"
OUTPUTS, UTILITY_RESULT, FAILED = b"O", b"R", b"F"
_UTILITIES = {"reset_prefix_cache", "get_num_blocks"}


class EngineCoreProc:
    """Runs in its own process. Never blocks while work remains; sleeps on the input socket when idle."""

    def __init__(self, config, input_path: str, output_path: str, parent_pid: int) -> None:
        from tokenmill.engine.engine_core import EngineCore
        self.core = EngineCore(config)
        self.parent_pid = parent_pid
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PULL)
        self.input.connect(input_path)
        self.output = self.ctx.socket(zmq.PUSH)
        self.output.connect(output_path)
        self.req_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        self.encoder = msgspec.msgpack.Encoder()
        self.running = True
        self._stats_dirty = False

    def get_num_blocks(self) -> int:
        return self.core.num_blocks

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def _handle(self, kind: bytes, payload: bytes) -> None:
        if kind == ADD:
            req = self.req_decoder.decode(payload)
            try:
                self.core.add_request(req)
            except Exception as e:  # the front end checks first; this is a last line of defence
                logger.warning("Rejected request %s: %s", req.request_id, e)
                out = EngineCoreOutputs(outputs=[EngineCoreOutput(req.request_id, [],
                                                                  finish_reason=FinishReason.ABORT,
                                                                  stop_reason=str(e))])
                self.output.send_multipart([OUTPUTS, self.encoder.encode(out)])
        elif kind == ABORT:
            self.core.abort_requests(msgspec.msgpack.decode(payload))
            self._stats_dirty = True
        elif kind == UTILITY:
            call_id, name, args = msgspec.msgpack.decode(payload)
            try:
                if name not in _UTILITIES:
                    raise ValueError(f"unknown utility {name!r}")
                result, error = getattr(self, name)(*args), None
            except Exception as e:
                result, error = None, repr(e)
            self.output.send_multipart([UTILITY_RESULT, self.encoder.encode((call_id, result, error))])
        elif kind == SHUTDOWN:
            self.running = False

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.input, zmq.POLLIN)
        while self.running:
            busy = self.core.has_unfinished_requests()
            # Drain every pending message; block (briefly, to notice an orphaned process) only when idle.
            timeout = 0 if busy else 1000
            while self.running and poller.poll(timeout):
                kind, payload = self.input.recv_multipart()
                self._handle(kind, payload)
                timeout = 0
            if not self.running:
                break
            if self.core.has_unfinished_requests():
                outs = self.core.step()
                self.output.send_multipart([OUTPUTS, self.encoder.encode(outs)])
                self._stats_dirty = True
            elif self._stats_dirty:
                # Going idle (or aborts freed blocks): publish a final snapshot so gauges return to zero.
                idle = EngineCoreOutputs(scheduler_stats=self.core.scheduler.make_stats())
                self.output.send_multipart([OUTPUTS, self.encoder.encode(idle)])
                self._stats_dirty = False
            elif os.getppid() != self.parent_pid:
                logger.warning("The API server process is gone; engine core exiting.")
                break

    def close(self) -> None:
        self.input.close(linger=0)
        self.output.close(linger=1000)
        self.ctx.term()


def run_engine_core(config, input_path: str, output_path: str, ready_conn, parent_pid: int) -> None:
    """Process entry point. Reports readiness (or the start-up error) through `ready_conn`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API server decides when we stop
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    try:
        proc = EngineCoreProc(config, input_path, output_path, parent_pid)
    except BaseException as e:
        ready_conn.send({"status": "failed", "error": f"{type(e).__name__}: {e}",
                         "traceback": traceback.format_exc()})
        return
    ready_conn.send({"status": "ready", "num_blocks": proc.core.num_blocks})
    ready_conn.close()
    try:
        proc.run()
    except BaseException as e:
        logger.error("Engine core failed:\n%s", traceback.format_exc())
        try:
            proc.output.send_multipart([FAILED, f"{type(e).__name__}: {e}".encode()])
        finally:
            os._exit(1)
    proc.close()
