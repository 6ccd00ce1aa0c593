"""CUDA graphs: the model forward and logits of padded batches, captured per size.

Decode graphs (one token per request) are captured per batch size. Mixed graphs cover small batches that also hold
prefill chunks (requests arriving while others decode, the common case when serving): captured per token capacity,
each for up to a fixed number of requests, so such a step costs one replay instead of hundreds of eager launches
(~20-40 ms of host time per step on the H200 host for a 30-layer model, against ~2.5 ms for a graph).
"""
from __future__ import annotations

import bisect

import numpy as np
import torch

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.forward_context import set_forward_context
from tokenmill.logger import init_logger

logger = init_logger(__name__)


MIXED_TOKEN_SIZES = (16, 32, 64, 128, 256, 512)


def mixed_capture_sizes(max_tokens: int, max_reqs: int) -> list[tuple[int, int]]:
    """(token capacity, request capacity) of each mixed graph: powers of two from 16 up to max_tokens."""
    return [(t, min(t, max_reqs)) for t in MIXED_TOKEN_SIZES if t <= max_tokens]


def pad_mixed_inputs(size: int, reqs: int, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                     query_start_loc: np.ndarray, seq_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A mixed batch laid out for a graph of `size` tokens and `reqs` requests: ([3, size] int64 ids / positions /
    slots, [2 * reqs + 1] int32 query_start_loc then seq_lens, [reqs] int64 index of each request's last token).

    Padding tokens get slot -1 (nothing is stored); padding requests start where the real tokens end, with no query
    and no context, so both attention kernels skip them; their logits row reads token 0 and is never used."""
    n, b = len(input_ids), len(seq_lens)
    vec = np.zeros((3, size), dtype=np.int64)
    vec[0, :n], vec[1, :n], vec[2, :n] = input_ids, positions, slots
    vec[2, n:] = -1
    ints = np.zeros(2 * reqs + 1, dtype=np.int32)
    ints[:b + 1] = query_start_loc
    ints[b + 1:reqs + 1] = query_start_loc[-1]
    ints[reqs + 1:reqs + 1 + b] = seq_lens
    last = np.zeros(reqs, dtype=np.int64)
    last[:b] = query_start_loc[1:] - 1
    return vec, ints, last


def _pinned(a: np.ndarray) -> torch.Tensor:
    t = torch.empty(a.shape, dtype=torch.from_numpy(a[:0]).dtype, pin_memory=True)
    np.copyto(t.numpy(), a, casting="no")
    return t


def default_capture_sizes(max_size: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 256 and of 16 beyond, capped at max_size."""
    sizes = [s for s in (1, 2, 4) if s <= max_size]
    sizes += list(range(8, min(max_size, 256) + 1, 8))
    sizes += list(range(272, max_size + 1, 16))
    if max_size not in sizes:
        sizes.append(max_size)
    return sorted(set(sizes))


class CudaGraphRunner:
    """Replays captured decode and mixed-batch graphs.

    Contract: a batch where every request computes exactly one token, with at most `max_size` requests, runs through
    the decode graph of the smallest captured size that fits (`can_run`, `load_inputs`, `replay`); padded rows have
    slot -1 and context length 0, so attention skips them and nothing is written to the cache. Any other batch that
    fits a mixed graph's token and request capacities (`mixed_size`) runs through it (`load_mixed`, `replay_mixed`),
    laid out by `pad_mixed_inputs`; it returns the logits of each request's last token. Inputs are copied into
    persistent device buffers (the graphs read only those), and the logits buffer of the graph is returned sliced
    to the real batch (overwritten when that graph replays again).
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], capture_sizes: list[int],
                 max_model_len: int, max_blocks_per_req: int, device: torch.device,
                 mixed_sizes: list[tuple[int, int]] | None = None) -> None:
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.sizes = sorted(capture_sizes)
        self.max_size = self.sizes[-1]
        self.max_model_len = max_model_len
        self.mixed_sizes = sorted(mixed_sizes or [])
        self.mixed_token_sizes = [t for t, _ in self.mixed_sizes]
        self.mixed_reqs = dict(self.mixed_sizes)
        n = max([self.max_size] + self.mixed_token_sizes)
        r = max([self.max_size] + list(self.mixed_reqs.values()))
        # input ids, positions and slots share one buffer so one copy loads them.
        self.vec = torch.zeros((3, n), dtype=torch.long, device=device)
        self.vec[2].fill_(-1)
        self.input_ids, self.positions, self.slot_mapping = self.vec[0], self.vec[1], self.vec[2]
        self.seq_lens = torch.zeros(r, dtype=torch.int32, device=device)
        self.block_table = torch.zeros((r, max_blocks_per_req), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(r + 1, dtype=torch.int32, device=device)
        # Mixed graphs: query_start_loc then seq_lens in one buffer (one copy), and each request's last token.
        self.mixed_ints = torch.zeros(2 * r + 1, dtype=torch.int32, device=device)
        self.last_token = torch.zeros(r, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.mixed_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.mixed_logits: dict[int, torch.Tensor] = {}
        self.mixed_replays = 0  # steps run through a mixed graph (tests, diagnostics)

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_actual_tokens=size, slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size], max_query_len=1, max_seq_len=self.max_model_len,
            query_start_loc_cpu=np.arange(size + 1), seq_lens_cpu=np.full(size, self.max_model_len))

    def _forward(self, size: int) -> torch.Tensor:
        with set_forward_context(self._metadata(size), self.kv_caches):
            hidden = self.model(self.input_ids[:size], self.positions[:size])
            return self.model.compute_logits(hidden)

    def _mixed_metadata(self, size: int) -> AttentionMetadata:
        reqs = self.mixed_reqs[size]
        return AttentionMetadata(
            num_actual_tokens=size, slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.mixed_ints[:reqs + 1], seq_lens=self.mixed_ints[reqs + 1:2 * reqs + 1],
            block_table=self.block_table[:reqs], max_query_len=size, max_seq_len=self.max_model_len,
            query_start_loc_cpu=np.zeros(reqs + 1, dtype=np.int64), seq_lens_cpu=np.zeros(reqs, dtype=np.int64),
            captured_mixed=True)

    def _forward_mixed(self, size: int) -> torch.Tensor:
        with set_forward_context(self._mixed_metadata(size), self.kv_caches):
            hidden = self.model(self.input_ids[:size], self.positions[:size])
            return self.model.compute_logits(hidden[self.last_token[:self.mixed_reqs[size]]])

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        # Largest first so smaller graphs reuse its memory pool. Captured while the buffers hold padding only
        # (no query, slot -1): the warm-up run compiles the Triton kernels outside the capture and writes nothing.
        jobs = [(t, self._forward_mixed, self.mixed_graphs, self.mixed_logits) for t in self.mixed_token_sizes]
        jobs += [(s, self._forward, self.graphs, self.logits) for s in self.sizes]
        for size, forward, graphs, logits in sorted(jobs, key=lambda j: -j[0]):
            forward(size)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                logits[size] = forward(size)
            pool = g.pool()
            graphs[size] = g
        torch.cuda.synchronize()
        logger.info("Captured CUDA graphs for %d decode batch sizes (max %d) and %d mixed batch sizes (max %s "
                    "tokens)", len(self.sizes), self.max_size, len(self.mixed_token_sizes),
                    self.mixed_token_sizes[-1] if self.mixed_token_sizes else 0)

    def load(self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, query_start_loc: np.ndarray,
             seq_lens: np.ndarray, block_table: np.ndarray, allow_mixed: bool = True) -> tuple[bool, int] | None:
        """Load a batch into the smallest graph that holds it: a decode graph when every request computes one
        token, else (with allow_mixed) a mixed graph. Returns the graph for `run` as (mixed, size), or None when
        no graph fits (the batch runs eagerly)."""
        num_reqs, num_tokens = len(seq_lens), len(input_ids)
        if self.can_run(num_reqs, num_tokens):
            return False, self.load_inputs(input_ids, positions, slots, seq_lens, block_table)
        size = self.mixed_size(num_reqs, num_tokens) if allow_mixed else None
        if size is None:
            return None
        self.load_mixed(size, input_ids, positions, slots, query_start_loc, seq_lens, block_table)
        return True, size

    def run(self, graph: tuple[bool, int], n: int) -> torch.Tensor:
        """Replay a graph `load` returned; the logits of the batch's first n requests."""
        mixed, size = graph
        return self.replay_mixed(size, n) if mixed else self.replay(size, n)

    def can_run(self, num_reqs: int, num_tokens: int) -> bool:
        return num_tokens == num_reqs <= self.max_size and bool(self.graphs)

    def mixed_size(self, num_reqs: int, num_tokens: int) -> int | None:
        """The token capacity of the smallest mixed graph that holds this batch, or None."""
        i = bisect.bisect_left(self.mixed_token_sizes, num_tokens)
        for size in self.mixed_token_sizes[i:]:
            if num_reqs <= self.mixed_reqs[size] and size in self.mixed_graphs:
                return size
        return None

    def load_mixed(self, size: int, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                   query_start_loc: np.ndarray, seq_lens: np.ndarray, block_table: np.ndarray) -> None:
        """Copy a mixed batch into the buffers of the graph of `size` tokens (fresh pinned staging, as in
        load_inputs)."""
        reqs = self.mixed_reqs[size]
        vec, ints, last = pad_mixed_inputs(size, reqs, input_ids, positions, slots, query_start_loc, seq_lens)
        staged = [_pinned(a) for a in (vec, ints, last, block_table.astype(np.int32, copy=False))]
        n, nb = block_table.shape
        bt = staged[3]
        self.vec[:, :size].copy_(staged[0], non_blocking=True)
        self.mixed_ints[:2 * reqs + 1].copy_(staged[1], non_blocking=True)
        self.last_token[:reqs].copy_(staged[2], non_blocking=True)
        self.block_table[:n, :nb].copy_(bt, non_blocking=True)

    def replay_mixed(self, size: int, n: int) -> torch.Tensor:
        """Run the mixed graph of `size` tokens on the loaded inputs; the logits of the first n requests' last
        tokens."""
        self.mixed_graphs[size].replay()
        self.mixed_replays += 1
        return self.mixed_logits[size][:n]

    def load_inputs(self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, seq_lens: np.ndarray,
                    block_table: np.ndarray) -> int:
        """Copy a batch into the persistent buffers of the smallest graph that fits; returns that graph's size.

        The host rows go through fresh pinned buffers (three copies per step): with async scheduling the next
        step is prepared while this one's copies may still be queued, so a reused staging buffer could be
        overwritten under them."""
        n = len(input_ids)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        vec = torch.empty((3, size), dtype=torch.long, pin_memory=True)
        v = vec.numpy()
        v[0, :n], v[1, :n], v[2, :n] = input_ids, positions, slots
        v[0, n:], v[1, n:], v[2, n:] = 0, 0, -1
        lens = torch.zeros(size, dtype=torch.int32, pin_memory=True)
        lens.numpy()[:n] = seq_lens
        nb = block_table.shape[1]
        bt = torch.empty((n, nb), dtype=torch.int32, pin_memory=True)
        bt.numpy()[:] = block_table
        self.vec[:, :size].copy_(vec, non_blocking=True)
        self.seq_lens[:size].copy_(lens, non_blocking=True)
        self.block_table[:n, :nb].copy_(bt, non_blocking=True)
        return size

    def replay(self, size: int, n: int) -> torch.Tensor:
        """Run the graph of `size` on the loaded inputs; the logits of the first n rows."""
        self.graphs[size].replay()
        return self.logits[size][:n]
