"""A small decode graph's per-step inputs, read by the graph itself from pinned host memory (Triton).

Why: every op queued between two graph replays costs the stream a hand-off on each side. At batch 1 on the H200 the
device idled ~21 us between decode graphs for two tiny copies, the inputs in and the sampled ids out (profiled in
session 15, tools/step_gaps.py), against a 0.68 ms graph. Here the graph's first kernel reads the step's inputs
over PCIe (pinned host memory is mapped into the device's address space) and the draw's last kernel writes the
sampled ids back the same way, so nothing but the graph runs per step.

The host fills one slot of a small ring per step; the device keeps a step counter, so replay k reads slot k mod S.
A slot is filled again S steps later, when the engine (at most one step in flight) has long consumed it.

Layout of a slot (`WIDTH` columns, `size` of them used by a graph of that size): int64 rows 0-7 = input ids,
positions, KV slots, placeholder sources (-1: none), draw seeds, draw RNG positions, context lengths, then the
draw's on/off flag in row 7 column 0; and a float32 row of draw temperatures.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = tl.constexpr(8)


@triton.jit
def _load_step_kernel(stage_i_ptr, stage_f_ptr, counter_ptr, slot_ptr, vec_ptr, vec_stride, seq_ptr, temp_ptr,
                      flag_ptr, prev_ptr, size, NUM_SLOTS: tl.constexpr, WIDTH: tl.constexpr):
    c = tl.load(counter_ptr)
    s = c % NUM_SLOTS
    i = tl.arange(0, WIDTH)
    m = i < size
    row = stage_i_ptr + s * (ROWS * WIDTH) + i
    # .cv: fetch again from host memory every time (the host rewrites the slot between replays).
    ids = tl.load(row, mask=m, other=0, cache_modifier=".cv")
    pos = tl.load(row + WIDTH, mask=m, other=0, cache_modifier=".cv")
    kv_slot = tl.load(row + 2 * WIDTH, mask=m, other=-1, cache_modifier=".cv")
    src = tl.load(row + 3 * WIDTH, mask=m, other=-1, cache_modifier=".cv")
    seed = tl.load(row + 4 * WIDTH, mask=m, other=0, cache_modifier=".cv")
    rpos = tl.load(row + 5 * WIDTH, mask=m, other=0, cache_modifier=".cv")
    ctx = tl.load(row + 6 * WIDTH, mask=m, other=0, cache_modifier=".cv")
    flag = tl.load(stage_i_ptr + s * (ROWS * WIDTH) + 7 * WIDTH, cache_modifier=".cv")
    temp = tl.load(stage_f_ptr + s * WIDTH + i, mask=m, other=1.0, cache_modifier=".cv")
    take = m & (src >= 0)
    prev = tl.load(prev_ptr + tl.where(take, src, 0), mask=take, other=0)
    ids = tl.where(take, prev, ids)
    tl.store(vec_ptr + i, ids, mask=m)
    tl.store(vec_ptr + vec_stride + i, pos, mask=m)
    tl.store(vec_ptr + 2 * vec_stride + i, kv_slot, mask=m)
    tl.store(vec_ptr + 3 * vec_stride + i, src, mask=m)
    tl.store(vec_ptr + 4 * vec_stride + i, seed, mask=m)
    tl.store(vec_ptr + 5 * vec_stride + i, rpos, mask=m)
    tl.store(seq_ptr + i, ctx.to(tl.int32), mask=m)
    tl.store(temp_ptr + i, temp, mask=m)
    tl.store(flag_ptr, flag.to(tl.int32))
    tl.store(slot_ptr, s)
    tl.store(counter_ptr, c + 1)


class HostStepIO:
    """The pinned host ring a small decode graph reads its inputs from and writes its sampled ids to.

    Contract: the host calls `next_slot()` once per replay of such a graph, in replay order, fills the returned
    slot's rows (`ints[slot]`, `temps[slot]`) before the replay, and after the replay has completed (an event)
    reads that step's ids from `out[slot]`. The device's counter must equal the host's count of replays: `sync()`
    sets it (after capture, whose warm-up runs advance it, or after replays outside the engine's loop). At most
    NUM_SLOTS - 1 replays may be in flight or unread at once; the engine has one.
    """

    NUM_SLOTS = 4

    def __init__(self, width: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.width = width
        self.ints = torch.zeros((self.NUM_SLOTS, ROWS, width), dtype=torch.long, pin_memory=pin)
        self.ints[:, 2:4] = -1                   # no KV slot, no placeholder: an untouched slot is inert
        self.temps = torch.ones((self.NUM_SLOTS, width), dtype=torch.float32, pin_memory=pin)
        self.out = torch.zeros((self.NUM_SLOTS, width), dtype=torch.long, pin_memory=pin)
        self.ints_np, self.temps_np = self.ints.numpy(), self.temps.numpy()
        self.counter = torch.zeros(1, dtype=torch.long, device=device)  # replays so far (device side)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)     # the slot of the replay in progress
        self.count = 0                                                  # replays so far (host side)

    def next_slot(self) -> int:
        s = self.count % self.NUM_SLOTS
        self.count += 1
        return s

    def sync(self) -> None:
        self.counter.fill_(self.count)

    def load(self, size: int, vec: torch.Tensor, seq_lens: torch.Tensor, temps: torch.Tensor, flag: torch.Tensor,
             prev: torch.Tensor) -> None:
        """Queue the kernel that copies the next slot's first `size` columns into the graph's device buffers
        (vec: the [>= 6, n] int64 rows, stride-1 columns) and fills placeholder ids from `prev`."""
        assert size <= self.width and vec.stride(1) == 1
        _load_step_kernel[(1,)](self.ints, self.temps, self.counter, self.slot, vec, vec.stride(0), seq_lens, temps,
                                flag, prev, size, NUM_SLOTS=self.NUM_SLOTS, WIDTH=self.width)
