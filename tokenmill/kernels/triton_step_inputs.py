"""A CUDA graph's per-step inputs, read by the graph itself from pinned host memory (Triton).

Why: every op queued between two graph replays costs the stream a hand-off on each side (at batch 1 on an H200 the
device idled ~21 us between decode graphs for two tiny copies, against a 0.68 ms graph). Here the graph's first
kernel reads the step's inputs over PCIe (pinned host memory is mapped into the device's address space) and the
in-graph draw writes the sampled ids back the same way, so nothing but the graph runs per step. It is the only way
the graphs take their inputs (worker/cuda_graph.py); only the block table, large and rarely changed, is a copy.

The host fills one slot of a small ring per replay; the device keeps a replay counter, so replay k reads slot
k mod S. A slot is filled again S replays later, when the engine (at most one step in flight) has long consumed it.

Layout of a slot, int64 rows of `width` columns (a graph of T tokens and R requests uses the first T or R + 1):
  0 input ids, 1 positions, 2 KV slots, 3 placeholder sources (-1: none; else the id is prev[src])   [T]
  4 draw seeds, 5 draw RNG positions, 6 context lengths, 8 each request's last-token index            [R]
  7 query_start_loc                                                                                  [R + 1]
  9 column 0: the in-graph draw's on/off flag
and a float32 row of draw temperatures [R].
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = tl.constexpr(10)
IDS, POS, SLOTS, SRC, SEEDS, RPOS, CTX, QSL, LAST, FLAG = range(10)
# Inert values of each row: what a column the host has not filled holds (no KV write, no placeholder, no context,
# the draw off; query_start_loc is 0, 1, 2, ... instead, see HostStepIO).
INERT = (0, 0, -1, -1, 0, 0, 0, 0, 0, 0)
_BLOCK = 256  # columns per loop iteration of the one program


# One compiled variant for every graph: the sizes are plain runtime ints (a graph bakes its own into the launch).
@triton.jit(do_not_specialize=["tokens", "reqs", "span"])
def _load_step_kernel(ring_ptr, temps_ring_ptr, counter_ptr, slot_ptr, tok_ptr, tok_stride, req_ptr, req_stride,
                      qsl_ptr, seq_ptr, temp_ptr, flag_ptr, prev_ptr, tokens, reqs, span,
                      NUM_SLOTS: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    # One program: the replay counter is read and advanced once, with no other program racing for it. Every host
    # read of a column block is issued before any of them is used, so a step costs one PCIe round trip per block
    # of `span` = max(tokens, reqs + 1) columns (one block up to 256), plus the device gather of placeholder ids.
    c = tl.load(counter_ptr)
    s = c % NUM_SLOTS
    base = ring_ptr + s * (ROWS * WIDTH)
    # .cv: fetch again from host memory every time (the host rewrites the slot between replays).
    flag = tl.load(base + 9 * WIDTH, cache_modifier=".cv")
    for start in range(0, span, BLOCK):
        i = start + tl.arange(0, BLOCK)
        mt = i < tokens
        mr = i < reqs
        mq = i < reqs + 1
        ids = tl.load(base + i, mask=mt, other=0, cache_modifier=".cv")
        pos = tl.load(base + WIDTH + i, mask=mt, other=0, cache_modifier=".cv")
        kv_slot = tl.load(base + 2 * WIDTH + i, mask=mt, other=-1, cache_modifier=".cv")
        src = tl.load(base + 3 * WIDTH + i, mask=mt, other=-1, cache_modifier=".cv")
        seed = tl.load(base + 4 * WIDTH + i, mask=mr, other=0, cache_modifier=".cv")
        rpos = tl.load(base + 5 * WIDTH + i, mask=mr, other=0, cache_modifier=".cv")
        ctx = tl.load(base + 6 * WIDTH + i, mask=mr, other=0, cache_modifier=".cv")
        qsl = tl.load(base + 7 * WIDTH + i, mask=mq, other=0, cache_modifier=".cv")
        last = tl.load(base + 8 * WIDTH + i, mask=mr, other=0, cache_modifier=".cv")
        temp = tl.load(temps_ring_ptr + s * WIDTH + i, mask=mr, other=1.0, cache_modifier=".cv")
        take = mt & (src >= 0)
        prev = tl.load(prev_ptr + tl.where(take, src, 0), mask=take, other=0)
        tl.store(tok_ptr + i, tl.where(take, prev, ids), mask=mt)
        tl.store(tok_ptr + tok_stride + i, pos, mask=mt)
        tl.store(tok_ptr + 2 * tok_stride + i, kv_slot, mask=mt)
        tl.store(req_ptr + i, seed, mask=mr)
        tl.store(req_ptr + req_stride + i, rpos, mask=mr)
        tl.store(req_ptr + 2 * req_stride + i, last, mask=mr)
        tl.store(seq_ptr + i, ctx.to(tl.int32), mask=mr)
        tl.store(temp_ptr + i, temp, mask=mr)
        tl.store(qsl_ptr + i, qsl.to(tl.int32), mask=mq)
    tl.store(flag_ptr, flag.to(tl.int32))
    tl.store(slot_ptr, s)
    tl.store(counter_ptr, c + 1)


class HostStepIO:
    """The pinned host ring the CUDA graphs read their step inputs from and the in-graph draw writes its ids to.

    Contract: the host calls `next_slot()` once per replay, in replay order, fills the returned slot
    (`ints_np[slot]`, `temps_np[slot]`, every column the graph reads) before the replay, and after the replay has
    completed (an event) reads that step's drawn ids from `out[slot]`. Each `next_slot()` must be followed by
    exactly one replay of a graph that starts with `load`; the device's counter must equal the host's count of
    slots handed out, and `sync()` sets it (after capture, whose warm-up runs advance it, or after replays outside
    that pairing). At most NUM_SLOTS - 1 replays may be in flight or unread at once; the engine has one.
    """

    NUM_SLOTS = 4

    def __init__(self, width: int, draw_width: int, device: torch.device) -> None:
        """width: columns of a slot (the largest graph's tokens, or requests + 1); draw_width: the largest batch
        the in-graph draw covers."""
        pin = device.type == "cuda"
        self.width = width
        self.ints = torch.tensor(INERT, dtype=torch.long).view(1, -1, 1).repeat(self.NUM_SLOTS, 1, width)
        # query_start_loc of an untouched slot: one query token per request, as a decode batch of padding rows
        # (context 0: attention skips them).
        self.ints[:, QSL] = torch.arange(width)
        self.temps = torch.ones((self.NUM_SLOTS, width), dtype=torch.float32)
        self.out = torch.zeros((self.NUM_SLOTS, max(draw_width, 1)), dtype=torch.long)
        if pin:
            self.ints, self.temps, self.out = self.ints.pin_memory(), self.temps.pin_memory(), self.out.pin_memory()
        self.ints_np, self.temps_np = self.ints.numpy(), self.temps.numpy()
        self.counter = torch.zeros(1, dtype=torch.long, device=device)  # replays so far (device side)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)     # the slot of the replay in progress
        self.count = 0                                                  # slots handed out (host side)

    def next_slot(self) -> int:
        s = self.count % self.NUM_SLOTS
        self.count += 1
        return s

    def sync(self) -> None:
        self.counter.fill_(self.count)

    def load(self, tokens: int, reqs: int, tok: torch.Tensor, req: torch.Tensor, qsl: torch.Tensor,
             seq_lens: torch.Tensor, temps: torch.Tensor, flag: torch.Tensor, prev: torch.Tensor) -> None:
        """Queue the kernel that copies the next slot into a graph's device buffers: tok [>= 3, >= tokens] int64
        (ids with placeholders filled from `prev`, positions, KV slots), req [>= 3, >= reqs] int64 (draw seeds,
        draw RNG positions, last-token indices), qsl [>= reqs + 1] and seq_lens [>= reqs] int32, temps [>= reqs]
        float32, flag [1] int32. Rows must have stride-1 columns."""
        assert tokens <= self.width and reqs + 1 <= self.width and tok.stride(1) == 1 and req.stride(1) == 1
        _load_step_kernel[(1,)](self.ints, self.temps, self.counter, self.slot, tok, tok.stride(0), req,
                                req.stride(0), qsl, seq_lens, temps, flag, prev, tokens, reqs, max(tokens, reqs + 1),
                                NUM_SLOTS=self.NUM_SLOTS, WIDTH=self.width, BLOCK=_BLOCK, num_warps=4)
