"""Hands one request's outputs from the output loop to its `generate()` consumer, merging what piles up."""
from __future__ import annotations

import asyncio

from tokenmill.outputs import RequestOutput


class RequestOutputCollector:
    """One request's mailbox between the output loop (producer) and the task streaming it (consumer).

    Contract: `put_nowait` never blocks; `get` waits for the next item. With DELTA outputs, what arrives before the
    consumer takes the previous output is merged into it, so a slow consumer (a busy API server, a slow client)
    gets one output covering every step since its last read instead of a backlog of one per step, as vLLM does.
    CUMULATIVE and FINAL_ONLY outputs replace the pending one (the newer one holds everything). An exception is
    delivered after the output pending before it.
    """

    __slots__ = ("_pending", "_error", "_ready", "_delta")

    def __init__(self, delta: bool) -> None:
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self._delta = delta

    def put_nowait(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = item
        elif self._pending is None or not self._delta:
            self._pending = item
        else:
            merge_delta(self._pending, item)
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        while True:
            if self._pending is not None:
                out, self._pending = self._pending, None
                return out
            if self._error is not None:
                return self._error
            self._ready.clear()
            await self._ready.wait()


def merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    """Fold DELTA output `new` (the later one) into `into`: text, token ids and logprobs are appended per sequence
    index; finish state, metrics and counters are the newer ones; prompt logprobs stay with the first."""
    by_index = {o.index: o for o in into.outputs}
    for o in new.outputs:
        old = by_index.get(o.index)
        if old is None:
            into.outputs.append(o)
            by_index[o.index] = o
            continue
        old.text += o.text
        old.token_ids = [*old.token_ids, *o.token_ids]
        if o.logprobs is not None:
            old.logprobs = [*(old.logprobs or []), *o.logprobs]
        old.cumulative_logprob = o.cumulative_logprob
        old.finish_reason, old.stop_reason = o.finish_reason, o.stop_reason
    into.outputs.sort(key=lambda o: o.index)
    into.finished = new.finished
    into.metrics = new.metrics
    into.num_cached_tokens = new.num_cached_tokens
    if into.prompt_logprobs is None:
        into.prompt_logprobs = new.prompt_logprobs
