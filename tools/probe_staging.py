"""Host cost of staging a small host->device / device->host copy while the GPU is busy (GPU machine): fresh pinned
buffers, views into one pinned arena, and separate persistent pinned tensors. A copy that blocks on the queued work
shows up as milliseconds. Usage: python3 tools/probe_staging.py"""
from __future__ import annotations

import time

import numpy as np
import torch

dev = torch.device("cuda")
a = torch.randn(4096, 4096, device=dev)
arena = torch.empty((4, 1 << 20), dtype=torch.uint8, pin_memory=True)
persist = [torch.empty(64, dtype=torch.int64, pin_memory=True) for _ in range(4)]
src = np.arange(64, dtype=np.int64)
d_src = torch.arange(64, device=dev)


def busy():
    for _ in range(40):
        torch.mm(a, a, out=a)  # ~40 x 0.2 ms of queued GPU work


def staging(kind, i):
    """A pinned int64[64] host buffer of the given kind (what each copy's host side costs to obtain is timed too)."""
    if kind == "fresh":
        return torch.empty(64, dtype=torch.int64, pin_memory=True)
    if kind == "arena_view":
        return arena[i % 4, 128:128 + 512].view(torch.int64)
    return persist[i % 4]


def h2d(kind, i):
    t = staging(kind, i)
    np.copyto(t.numpy(), src)
    return t.to(dev, non_blocking=True)


def d2h(kind, i):
    t = staging(kind, i)
    t.copy_(d_src, non_blocking=True)
    return t


for kind in ("fresh", "arena_view", "persistent", "fresh", "arena_view", "persistent"):
    for name, fn in (("h2d", h2d), ("d2h", d2h)):
        torch.cuda.synchronize()
        busy()
        t = time.perf_counter()
        for i in range(50):
            fn(kind, i)
        dt = (time.perf_counter() - t) / 50
        pending = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        print(f"{kind:<11} {name}: {dt * 1e6:8.1f} us per copy (GPU still busy after: {pending})")
ev = torch.cuda.Event()
ev.record()
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(1000):
    ev.query()
print(f"event.query: {(time.perf_counter() - t) * 1e3:.2f} us")
print("arena view is_pinned:", arena[1, 128:640].view(torch.int64).is_pinned())
