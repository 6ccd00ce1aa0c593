"""Waiting queues: first-come-first-served, or by (priority, arrival time)."""
from __future__ import annotations

import heapq
from collections import deque
from typing import Iterator

from tokenmill.core.request import Request


class FCFSQueue:
    """Arrival order; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, r: Request) -> None:
        self._q.append(r)

    def prepend(self, r: Request) -> None:
        self._q.appendleft(r)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, r: Request) -> None:
        self._q.remove(r)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    """Lowest `priority` value first, then earliest arrival (vLLM's convention)."""

    def __init__(self) -> None:
        self._h: list[Request] = []

    def add(self, r: Request) -> None:
        heapq.heappush(self._h, r)

    prepend = add  # a preempted request keeps its place by priority

    def peek(self) -> Request:
        return self._h[0]

    def pop(self) -> Request:
        return heapq.heappop(self._h)

    def remove(self, r: Request) -> None:
        self._h.remove(r)
        heapq.heapify(self._h)

    def __len__(self) -> int:
        return len(self._h)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._h))


def make_queue(policy: str) -> FCFSQueue | PriorityQueue:
    return PriorityQueue() if policy == "priority" else FCFSQueue()
