"""One-to-all messages from rank 0 to the worker ranks over ZMQ PUB/SUB, and a PUSH/PULL channel back.

Rank 0 publishes one message per call (a pickled (kind, body) pair); every worker receives every message in
order. Workers answer only handshake pings and report their own failures: results stay with each rank, because
rank 0's is the one returned. Nothing here touches a device, so a step's broadcast never waits on the GPU.
"""
from __future__ import annotations

import pickle
import time
import traceback
from typing import Any, Callable

import zmq

PING, CALL, SHUTDOWN = "ping", "call", "shutdown"
PONG, ERROR = "pong", "error"


class RpcBroadcaster:
    """Rank 0's end: `send` publishes to every subscribed worker; `wait_subscribers` makes sure they all are."""

    def __init__(self, pub_addr: str, reply_addr: str) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 0)  # never drop: a worker that lags must still see every call
        self.pub.bind(pub_addr)
        self.replies = self.ctx.socket(zmq.PULL)
        self.replies.setsockopt(zmq.RCVHWM, 0)
        self.replies.bind(reply_addr)
        self.errors: dict[int, str] = {}

    def send(self, kind: str, body: Any = None) -> None:
        self.pub.send(pickle.dumps((kind, body), protocol=pickle.HIGHEST_PROTOCOL), copy=False)

    def wait_subscribers(self, ranks: set[int], timeout_s: float, check: Callable[[], None]) -> None:
        """PUB/SUB drops messages sent before a subscription arrives, so ping until every rank has answered one.
        `check` raises if a worker died meanwhile."""
        waiting, deadline = set(ranks), time.monotonic() + timeout_s
        while waiting:
            check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"Worker ranks {sorted(waiting)} did not answer within {timeout_s:.0f} s.")
            self.send(PING)
            while self.replies.poll(50):
                kind, rank, text = pickle.loads(self.replies.recv())
                if kind == PONG:
                    waiting.discard(rank)
                elif kind == ERROR:
                    self.errors[rank] = text
        self._drain()

    def _drain(self) -> None:
        while self.replies.poll(0):
            kind, rank, text = pickle.loads(self.replies.recv())
            if kind == ERROR:
                self.errors[rank] = text

    def worker_error(self, rank: int, wait_s: float = 0.5) -> str | None:
        """The traceback text rank `rank` reported before exiting, if it reported one."""
        deadline = time.monotonic() + wait_s
        self._drain()
        while rank not in self.errors and self.replies.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            self._drain()
        return self.errors.get(rank)

    def close(self) -> None:
        self.pub.close(linger=0)
        self.replies.close(linger=0)
        self.ctx.term()


class RpcSubscriber:
    """A worker's end: `recv` returns the next (kind, body); `pong` and `report_error` answer rank 0."""

    def __init__(self, pub_addr: str, reply_addr: str, rank: int) -> None:
        self.rank = rank
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(pub_addr)
        self.reply = self.ctx.socket(zmq.PUSH)
        self.reply.connect(reply_addr)

    def recv(self) -> tuple[str, Any]:
        return pickle.loads(self.sub.recv(copy=False).buffer)

    def pong(self) -> None:
        self.reply.send(pickle.dumps((PONG, self.rank, None)))

    def report_error(self) -> None:
        """Send the current exception's traceback to rank 0 (called from an except block)."""
        self.reply.send(pickle.dumps((ERROR, self.rank, traceback.format_exc())))

    def close(self) -> None:
        self.sub.close(linger=0)
        self.reply.close(linger=1000)  # let an error report reach rank 0
        self.ctx.term()
