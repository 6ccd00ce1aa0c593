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

from tokenmill import envs
from tokenmill.attention.backend import AttentionMetadata
from tokenmill.forward_context import set_forward_context
from tokenmill.kernels.triton_placeholders import fill_placeholders
from tokenmill.kernels.triton_sampling import race_argmax
from tokenmill.kernels.triton_step_inputs import HostStepIO
from tokenmill.logger import init_logger
from tokenmill.worker.transfer import PinnedRing

logger = init_logger(__name__)


MIXED_TOKEN_SIZES = (16, 32, 64, 128, 256, 512)
# Decode graphs up to this size also carry the plain temperature draw. It saves the host the sampler's metadata and
# launches, which is what bounds a small batch's step; on the H200 the nano-vllm throughput workload (batches up to
# 256) ran 2-4% slower with the draw in every graph (session 10: 25,380 against 26,033 tok/s without it, same host).
# Sizes between 1 and 256 were not measured: 16 is a conservative cut.
SAMPLE_IN_GRAPH_MAX_SIZE = 16


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


_DECODE_PAD = np.array([[0], [0], [-1], [-1], [0], [0]], dtype=np.int64)  # no KV slot, no placeholder


def _fill_decode_rows(v: np.ndarray, temps: np.ndarray, size: int, input_ids: np.ndarray, positions: np.ndarray,
                      slots: np.ndarray, fix_src: np.ndarray | None, race: tuple | None) -> None:
    """The first six int64 rows of a decode graph's inputs (ids, positions, KV slots, placeholder sources, draw
    seeds, draw RNG positions) and its draw temperatures, in whichever staging holds them: the batch's rows, then
    inert padding rows up to `size`. Without `race` the draw's rows keep stale values (its flag is off)."""
    n = len(input_ids)
    v[0, :n], v[1, :n], v[2, :n] = input_ids, positions, slots
    v[3, :n] = -1 if fix_src is None else fix_src
    if race is not None:
        v[4, :n], v[5, :n], temps[:n] = race
    v[:6, n:size] = _DECODE_PAD
    temps[n:size] = 1.0


def _pinned(a: np.ndarray) -> torch.Tensor:
    # Plain memory without CUDA: the input staging is also checked on the CPU (tests/worker).
    t = torch.empty(a.shape, dtype=torch.from_numpy(a[:0]).dtype, pin_memory=torch.cuda.is_available())
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
    to the real batch (overwritten when that graph replays again). With host IO, a decode graph of up to
    SAMPLE_IN_GRAPH_MAX_SIZE rows does that copy itself, from the host ring slot `load` filled (`last_io_slot`),
    and its draw also writes the ids to that slot's `host_io.out` row: every load of such a graph must be
    followed by exactly one replay of it, else `sync_host_io()`.
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], capture_sizes: list[int],
                 max_model_len: int, max_blocks_per_req: int, device: torch.device,
                 mixed_sizes: list[tuple[int, int]] | None = None, prev_sampled: torch.Tensor | None = None,
                 host_io: bool | None = None) -> None:
        """host_io: decode graphs of up to SAMPLE_IN_GRAPH_MAX_SIZE rows read their inputs from, and write their
        drawn ids to, pinned host memory themselves (HostStepIO), so no copy op runs between replays. Default:
        on CUDA unless TOKENMILL_GRAPH_HOST_IO=0."""
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.sizes = sorted(capture_sizes)
        self.max_size = self.sizes[-1]
        self.max_model_len = max_model_len
        self.mixed_sizes = sorted(mixed_sizes or [])
        self.mixed_token_sizes = [t for t, _ in self.mixed_sizes]
        self.mixed_reqs = dict(self.mixed_sizes)
        n = max([self.max_size] + self.mixed_token_sizes)
        r = max([self.max_size] + list(self.mixed_reqs.values()))
        # One byte buffer holds every per-step input of a decode graph, so a decode step loads them with one copy
        # from one pinned staging buffer: int64 rows (input ids, positions, slots, placeholder sources, and the
        # in-graph draw's seeds and RNG positions), then int32 context lengths, float32 temperatures and the draw's
        # on/off flag.
        self._vec_bytes = 6 * n * 8
        self._arena = torch.zeros(self._vec_bytes + 4 * r + 4 * n + 8, dtype=torch.uint8, device=device)
        self.vec = self._arena[:self._vec_bytes].view(torch.long).view(6, n)
        self.vec[2:4].fill_(-1)
        self.input_ids, self.positions, self.slot_mapping = self.vec[0], self.vec[1], self.vec[2]
        self.fix_src = self.vec[3]   # >= 0: the input id is prev_sampled[fix_src] (async placeholder), else -1
        self.race_seeds, self.race_pos = self.vec[4], self.vec[5]
        tail = self._arena[self._vec_bytes:].view(torch.int32)
        self.seq_lens = tail[:r]
        self.race_temp = tail[r:r + n].view(torch.float32)
        self.race_flag = tail[r + n:r + n + 1]   # 1: the decode graph samples (plain draw) into prev_sampled
        self._staging = PinnedRing(self._arena.numel())
        # The previous step's sampled ids (the runner copies them here after sampling); the graphs read them.
        self.prev_sampled = prev_sampled if prev_sampled is not None else torch.zeros(r, dtype=torch.long,
                                                                                        device=device)
        self.block_table = torch.zeros((r, max_blocks_per_req), dtype=torch.int32, device=device)
        # What the device block table holds (as of the last queued copy): an unchanged table is not copied again
        # (a decode step changes it only when a request crosses into a new block or the batch changes).
        self._bt_mirror = np.zeros((r, max_blocks_per_req), dtype=np.int32)
        self.query_start_loc = torch.arange(r + 1, dtype=torch.int32, device=device)
        # Mixed graphs: query_start_loc then seq_lens in one buffer (one copy), and each request's last token.
        self.mixed_ints = torch.zeros(2 * r + 1, dtype=torch.int32, device=device)
        self.last_token = torch.zeros(r, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.mixed_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.mixed_logits: dict[int, torch.Tensor] = {}
        if host_io is None:
            host_io = device.type == "cuda" and envs.TOKENMILL_GRAPH_HOST_IO
        self.host_io = HostStepIO(SAMPLE_IN_GRAPH_MAX_SIZE, device) if host_io else None
        self.last_io_slot: int | None = None  # the host-IO slot of the decode graph loaded last (None: not one)
        self.mixed_replays = 0  # steps run through a mixed graph (tests, diagnostics)
        self.sampled_replays = 0  # decode steps whose tokens the graph drew itself (tests, diagnostics)

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_actual_tokens=size, slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size], max_query_len=1, max_seq_len=self.max_model_len,
            query_start_loc_cpu=np.arange(size + 1), seq_lens_cpu=np.full(size, self.max_model_len))

    def _uses_host_io(self, size: int) -> bool:
        return self.host_io is not None and size <= self.host_io.width

    def _forward(self, size: int) -> torch.Tensor:
        io = self.host_io if self._uses_host_io(size) else None
        if io is not None:
            io.load(size, self.vec, self.seq_lens, self.race_temp, self.race_flag, self.prev_sampled)
        else:
            fill_placeholders(self.input_ids[:size], self.fix_src[:size], self.prev_sampled)
        with set_forward_context(self._metadata(size), self.kv_caches):
            hidden = self.model(self.input_ids[:size], self.positions[:size])
            logits = self.model.compute_logits(hidden)
        # The plain temperature draw, done by the graph when the step's flag says so (every row plain): the ids
        # land in prev_sampled, where the next step's graph reads them, and in the host ring (host IO) or a copy
        # the runner queues.
        if size <= SAMPLE_IN_GRAPH_MAX_SIZE:
            race_argmax(logits, self.race_seeds[:size], self.race_pos[:size], self.race_temp[:size],
                        out=self.prev_sampled[:size], flag=self.race_flag,
                        host_out=io.out if io is not None else None, host_slot=io.slot if io is not None else None)
        return logits

    def _mixed_metadata(self, size: int) -> AttentionMetadata:
        reqs = self.mixed_reqs[size]
        return AttentionMetadata(
            num_actual_tokens=size, slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.mixed_ints[:reqs + 1], seq_lens=self.mixed_ints[reqs + 1:2 * reqs + 1],
            block_table=self.block_table[:reqs], max_query_len=size, max_seq_len=self.max_model_len,
            query_start_loc_cpu=np.zeros(reqs + 1, dtype=np.int64), seq_lens_cpu=np.zeros(reqs, dtype=np.int64),
            captured_mixed=True)

    def _forward_mixed(self, size: int) -> torch.Tensor:
        fill_placeholders(self.input_ids[:size], self.fix_src[:size], self.prev_sampled)
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
        self.sync_host_io()
        logger.info("Captured CUDA graphs for %d decode batch sizes (max %d) and %d mixed batch sizes (max %s "
                    "tokens)", len(self.sizes), self.max_size, len(self.mixed_token_sizes),
                    self.mixed_token_sizes[-1] if self.mixed_token_sizes else 0)

    def sync_host_io(self) -> None:
        """Set the device's host-IO step counter to the host's count. Needed after the small decode graphs ran
        outside `load` + `replay` pairs (capture's warm-up runs, tools that replay a graph back to back)."""
        if self.host_io is not None:
            self.host_io.sync()

    def load(self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, query_start_loc: np.ndarray,
             seq_lens: np.ndarray, block_table: np.ndarray, allow_mixed: bool = True,
             fix_src: np.ndarray | None = None, race: tuple | None = None) -> tuple[bool, int] | None:
        """Load a batch into the smallest graph that holds it: a decode graph when every request computes one
        token, else (with allow_mixed) a mixed graph. fix_src (per token, -1 = none) marks placeholder ids that the
        graph takes from prev_sampled. race = (seeds, RNG positions, temperatures) per request makes a decode graph
        also draw the plain temperature sample into prev_sampled. Returns the graph for `run` as (mixed, size), or
        None when no graph fits (the batch runs eagerly)."""
        num_reqs, num_tokens = len(seq_lens), len(input_ids)
        self.last_io_slot = None
        if self.can_run(num_reqs, num_tokens):
            return False, self.load_inputs(input_ids, positions, slots, seq_lens, block_table, fix_src, race)
        size = self.mixed_size(num_reqs, num_tokens) if allow_mixed else None
        if size is None:
            return None
        self.load_mixed(size, input_ids, positions, slots, query_start_loc, seq_lens, block_table, fix_src)
        return True, size

    def run(self, graph: tuple[bool, int], n: int) -> torch.Tensor:
        """Replay a graph `load` returned; the logits of the batch's first n requests."""
        mixed, size = graph
        return self.replay_mixed(size, n) if mixed else self.replay(size, n)

    def can_run(self, num_reqs: int, num_tokens: int) -> bool:
        return num_tokens == num_reqs <= self.max_size and bool(self.graphs)

    def can_sample(self, num_reqs: int, num_tokens: int) -> bool:
        """True when this batch runs through a decode graph that carries the plain temperature draw."""
        return (self.can_run(num_reqs, num_tokens)
                and self.sizes[bisect.bisect_left(self.sizes, num_reqs)] <= SAMPLE_IN_GRAPH_MAX_SIZE)

    def mixed_size(self, num_reqs: int, num_tokens: int) -> int | None:
        """The token capacity of the smallest mixed graph that holds this batch, or None."""
        i = bisect.bisect_left(self.mixed_token_sizes, num_tokens)
        for size in self.mixed_token_sizes[i:]:
            if num_reqs <= self.mixed_reqs[size] and size in self.mixed_graphs:
                return size
        return None

    def load_mixed(self, size: int, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                   query_start_loc: np.ndarray, seq_lens: np.ndarray, block_table: np.ndarray,
                   fix_src: np.ndarray | None = None) -> None:
        """Copy a mixed batch into the buffers of the graph of `size` tokens (fresh pinned staging: with async
        scheduling the next step is prepared while this one's copies may still be queued)."""
        reqs = self.mixed_reqs[size]
        vec, ints, last = pad_mixed_inputs(size, reqs, input_ids, positions, slots, query_start_loc, seq_lens)
        vec4 = np.full((4, size), -1, dtype=np.int64)
        vec4[:3] = vec
        if fix_src is not None:
            vec4[3, :len(fix_src)] = fix_src
        staged = [_pinned(a) for a in (vec4, ints, last)]
        self.vec[:4, :size].copy_(staged[0], non_blocking=True)
        self.mixed_ints[:2 * reqs + 1].copy_(staged[1], non_blocking=True)
        self.last_token[:reqs].copy_(staged[2], non_blocking=True)
        self._load_block_table(block_table)

    def _load_block_table(self, block_table: np.ndarray) -> None:
        """Copy the batch's block table rows unless the device already holds exactly these."""
        n, nb = block_table.shape
        if np.array_equal(self._bt_mirror[:n, :nb], block_table):
            return
        self._bt_mirror[:n, :nb] = block_table
        self.block_table[:n, :nb].copy_(_pinned(block_table.astype(np.int32, copy=False)), non_blocking=True)

    def replay_mixed(self, size: int, n: int) -> torch.Tensor:
        """Run the mixed graph of `size` tokens on the loaded inputs; the logits of the first n requests' last
        tokens."""
        self.mixed_graphs[size].replay()
        self.mixed_replays += 1
        return self.mixed_logits[size][:n]

    def load_inputs(self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, seq_lens: np.ndarray,
                    block_table: np.ndarray, fix_src: np.ndarray | None = None, race: tuple | None = None) -> int:
        """Copy a batch into the persistent buffers of the smallest graph that fits; returns that graph's size.

        Everything but the block table goes in one copy from a pinned ring buffer (PinnedRing: never one whose
        previous copy may still be queued); the block table only when it changed. race: as in `load`."""
        n = len(input_ids)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        if race is not None and size > SAMPLE_IN_GRAPH_MAX_SIZE:
            raise ValueError(f"the decode graph of size {size} does not sample (see can_sample)")
        self.last_io_slot = None
        if self._uses_host_io(size):
            self.last_io_slot = self._load_host_io(size, input_ids, positions, slots, seq_lens, fix_src, race)
            self._load_block_table(block_table)
            return size
        src, arr = self._staging.next()
        width = self.vec.shape[1]
        tail = arr[self._vec_bytes:].view(np.int32)
        r = self.seq_lens.shape[0]
        _fill_decode_rows(arr[:self._vec_bytes].view(np.int64).reshape(6, width), tail[r:r + width].view(np.float32),
                          size, input_ids, positions, slots, fix_src, race)
        tail[:n] = seq_lens
        tail[n:size] = 0
        tail[r + width] = race is not None
        # Whole buffer, whatever size: bytes past `size` reach only buffers this graph does not read.
        self._arena.copy_(src, non_blocking=True)
        self._staging.queued()
        self._load_block_table(block_table)
        return size

    def _load_host_io(self, size: int, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                      seq_lens: np.ndarray, fix_src: np.ndarray | None, race: tuple | None) -> int:
        """Fill the next host-IO slot (the graph's first kernel copies it to the device buffers); its index."""
        io = self.host_io
        slot = io.next_slot()
        n = len(input_ids)
        v = io.ints_np[slot]
        _fill_decode_rows(v, io.temps_np[slot], size, input_ids, positions, slots, fix_src, race)
        v[6, :n] = seq_lens
        v[6, n:size] = 0
        v[7, 0] = race is not None
        return slot

    def replay(self, size: int, n: int) -> torch.Tensor:
        """Run the graph of `size` on the loaded inputs; the logits of the first n rows."""
        self.graphs[size].replay()
        return self.logits[size][:n]
