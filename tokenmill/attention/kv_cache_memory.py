"""Zero-filled tensors for the KV cache whose host pages are supplied when first written, not at allocation.

`torch.zeros` on the CPU writes every byte of a cache that a light workload mostly never uses. On a virtual machine
whose host backs a guest page only when it is first written (this project's 2-core CI machines: about 3.6 s per
GiB of never-touched memory), a 1 GiB CPU KV cache held the server's start-up for 3.4 s. An anonymous private
mapping is zero-filled by the kernel page by page as each is first written, which is all the cache needs: a slot is
written before it is read, and a never-written one read under a mask holds zeros (finite, so a masked product stays
zero); the cost of a page moves to the first step that writes it. On a GPU `torch.zeros` is one fast fill.
"""
from __future__ import annotations

import math
import mmap

import torch


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A contiguous tensor of zeros; on the CPU, backed by an anonymous private mapping that holds its memory for
    as long as the tensor (or a view of it) lives."""
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # frombuffer keeps a reference to the mapping; it is unmapped when the last tensor over it is freed.
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


def available_host_bytes() -> int | None:
    """The host memory the kernel reports as available for new allocations (MemAvailable), or None where there is
    no /proc/meminfo. Because the CPU cache's pages are taken on first write, a cache larger than this would not
    fail at start-up but later, mid-serving, when the kernel runs out of pages: the worker checks it first."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
