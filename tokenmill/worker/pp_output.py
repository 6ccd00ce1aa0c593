"""The result path of pipeline parallelism: only the last stage samples, but the engine core lives with the first.

The output rank (last stage, TP rank 0) sends each step's ModelRunnerOutput to the driver. Under the mp executor it
goes through a ZMQ PUSH socket to the driver's PULL socket (`ResultSender` / `ResultReceiver`), read when the
engine core resolves the step's handle, so launching a micro-batch never waits for the pipeline. Under
external_launcher every rank runs its own engine core and needs every output, so the output rank broadcasts it
over the world's CPU group when the handle is resolved (`BroadcastOutput`); all ranks resolve handles in the same
order because their schedulers are identical.
"""
from __future__ import annotations

import pickle
from typing import Callable

import zmq

from tokenmill.core.sched_output import ModelRunnerOutput
from tokenmill.distributed.parallel_state import ParallelState


def output_rank(state: ParallelState) -> int:
    """The world rank whose sampled output is the step's result: the last stage's TP rank 0."""
    return (state.pp_size - 1) * state.tp_size


class ResultSender:
    """The output rank's end: `send` pushes one step's output to the driver (never blocks on it)."""

    def __init__(self, addr: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.connect(addr)

    def send(self, out: ModelRunnerOutput) -> None:
        self.sock.send(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL), copy=False)

    def close(self) -> None:
        self.sock.close(linger=1000)
        self.ctx.term()


class ResultReceiver:
    """The driver's end. `handle()` is called once per launched step, in launch order; each handle's `get()`
    returns that step's output (outputs arrive in launch order: every stage runs micro-batches in order).
    `check` raises when a worker has died, so a wait never outlives the pipeline."""

    def __init__(self, addr: str, check: Callable[[], None]) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.bind(addr)
        self.check = check
        self._launched = 0
        self._received: dict[int, ModelRunnerOutput] = {}
        self._next_recv = 0

    def handle(self) -> "RemoteOutput":
        self._launched += 1
        return RemoteOutput(self, self._launched - 1)

    def wait(self, seq: int) -> ModelRunnerOutput:
        while seq not in self._received:
            self.check()
            if self.sock.poll(100):
                self._received[self._next_recv] = pickle.loads(self.sock.recv())
                self._next_recv += 1
        return self._received.pop(seq)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


class RemoteOutput:
    """A step's result that the output rank sends; `get()` waits for it (idempotent)."""

    def __init__(self, receiver: ResultReceiver, seq: int) -> None:
        self._receiver, self._seq = receiver, seq
        self._result: ModelRunnerOutput | None = None

    def get(self) -> ModelRunnerOutput:
        if self._result is None:
            self._result = self._receiver.wait(self._seq)
        return self._result


class BroadcastOutput:
    """external_launcher: the output rank's result, broadcast to every rank when `get()` is called (idempotent;
    every rank must call it, in the same order)."""

    def __init__(self, state: ParallelState, out: ModelRunnerOutput | None) -> None:
        self._state, self._out, self._done = state, out, False

    def get(self) -> ModelRunnerOutput:
        if not self._done:
            import torch.distributed as dist
            box = [self._out]
            dist.broadcast_object_list(box, src=output_rank(self._state), group=self._state.world_cpu_group)
            self._out, self._done = box[0], True
        return self._out
