"""CUDA graphs: the model forward and logits of padded batches, captured per shape.

Uniform graphs hold batches where every request computes the same number of tokens q (q = 1: decode; q = k + 1:
verifying k draft tokens), keyed by (batch size, q). Mixed graphs cover small batches that also hold prefill
chunks (requests arriving while others decode, the common case when serving): captured per token capacity, each
for up to a fixed number of requests, so such a step costs one replay instead of hundreds of eager launches
(~20-40 ms of host time per step on the H200 host for a 30-layer model, against ~2.5 ms for a graph).

Every graph takes its step inputs the same way: its first kernel reads them from a pinned host ring slot that the
host filled (kernels/triton_step_inputs.py), so no copy runs between replays; only the block table is copied,
when it changed. A model whose KV cache is in several layer groups (sliding-window layers beside full ones,
core/kv_cache_groups.py) has a slot mapping and block table per group: the groups after the first are copied
before the replay (their slot mapping each step, their table when it changed). Every graph writes its logits into
one shared [max rows, vocab] buffer: graphs replay one at a time on one stream and the step's logits are consumed
before the next replay.
"""
from __future__ import annotations

import bisect
import dataclasses
import time
from typing import NamedTuple

import numpy as np
import torch

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.forward_context import set_forward_context
from tokenmill.kernels.triton_sampling import race_argmax
from tokenmill.kernels.triton_step_inputs import (CTX, FLAG, IDS, LAST, POS, QSL, RPOS, SEEDS, SLOTS, SRC,
                                                  HostStepIO)
from tokenmill.logger import init_logger

logger = init_logger(__name__)


# Decode graphs up to this size also carry the plain temperature draw. It saves the host the sampler's metadata and
# launches, which is what bounds a small batch's step; on the H200 the nano-vllm throughput workload (batches up to
# 256) ran 2-4% slower with the draw in every graph (25,380 against 26,033 tok/s without it, same host). Sizes
# between 1 and 256 were not measured: 16 is a conservative cut.
SAMPLE_IN_GRAPH_MAX_SIZE = 16
_TOKEN_PAD = np.array([[0], [0], [-1], [-1]], dtype=np.int64)  # ids, positions, KV slots, sources: inert


class GraphKey(NamedTuple):
    """A captured graph: q > 0 is the uniform graph of `size` requests with q tokens each; q == 0 the mixed graph
    of `size` tokens."""
    size: int
    q: int


def _write_mixed(tok: np.ndarray, qsl: np.ndarray, ctx: np.ndarray, last: np.ndarray, size: int, reqs: int,
                 input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, query_start_loc: np.ndarray,
                 seq_lens: np.ndarray) -> None:
    n, b = len(input_ids), len(seq_lens)
    tok[0, :n], tok[1, :n], tok[2, :n] = input_ids, positions, slots
    tok[:3, n:size] = _TOKEN_PAD[:3]
    qsl[:b + 1] = query_start_loc
    qsl[b + 1:reqs + 1] = query_start_loc[-1]
    ctx[:b] = seq_lens
    ctx[b:reqs] = 0
    last[:b] = query_start_loc[1:] - 1
    last[b:reqs] = 0


def pad_mixed_inputs(size: int, reqs: int, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                     query_start_loc: np.ndarray, seq_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A mixed batch laid out for a graph of `size` tokens and `reqs` requests: ([3, size] int64 ids / positions /
    slots, [2 * reqs + 1] int32 query_start_loc then seq_lens, [reqs] int64 index of each request's last token).

    Padding tokens get slot -1 (nothing is stored); padding requests start where the real tokens end, with no query
    and no context, so both attention kernels skip them; their logits row reads token 0 and is never used. (The
    graphs' host ring holds the same layout, written by the same code.)"""
    tok = np.zeros((3, size), dtype=np.int64)
    qsl, ctx, last = (np.zeros(k, dtype=np.int64) for k in (reqs + 1, reqs, reqs))
    _write_mixed(tok, qsl, ctx, last, size, reqs, input_ids, positions, slots, query_start_loc, seq_lens)
    return tok, np.concatenate([qsl, ctx]).astype(np.int32), last


def _pinned(a: np.ndarray) -> torch.Tensor:
    # Plain memory without CUDA: the input staging is also checked on the CPU (tests/worker).
    t = torch.empty(a.shape, dtype=torch.from_numpy(a[:0]).dtype, pin_memory=torch.cuda.is_available())
    np.copyto(t.numpy(), a, casting="no")
    return t


class CudaGraphRunner:
    """Captures and replays the uniform and mixed graphs.

    Contract: `load` picks the smallest captured graph that holds a batch (`uniform_key`: every request computes
    the same q tokens, at most the largest size captured for that q; else, with allow_mixed, `mixed_size`), fills
    the next host ring slot with the batch padded to that graph (padding tokens have KV slot -1, padding requests
    context 0, so attention skips them and nothing is written to the cache), copies the block table if it changed,
    and returns the graph's key; `run` replays it. Every `load` that returns a key must be followed by exactly one
    `run` of that key (the graph's first kernel consumes the slot), else `sync_host_io()`. `run` returns views of
    the shared logits buffer (a uniform graph: every token's logits, request after request; a mixed graph: each
    request's last token's), overwritten by the next replay. A q == 1 graph of up to SAMPLE_IN_GRAPH_MAX_SIZE
    requests also draws the plain temperature sample when `load` got `race` inputs: into `prev_sampled` and into
    the slot's row of `host_io.out` (`last_io_slot`).
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], capture_sizes: list[int],
                 max_model_len: int, max_blocks_per_req: int, device: torch.device,
                 mixed_sizes: list[tuple[int, int]] | None = None, prev_sampled: torch.Tensor | None = None,
                 vocab_size: int = 0, dtype: torch.dtype = torch.float32,
                 verify_sizes: dict[int, list[int]] | None = None, recurrent=None,
                 layer_group: list[int] | None = None) -> None:
        """verify_sizes: q -> the batch sizes to capture with q tokens per request (verifying q - 1 drafts; each a
        decode size; CompilationConfig.verify_capture_sizes). recurrent: a
        worker/state_cache.GraphRecurrentStep for models with recurrent layers (decode graphs only; `load` then
        takes each request's state slot). layer_group: each layer's KV cache group when there are several (then
        `load` takes the step's slot mapping and block table of every group after the first)."""
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.recurrent = recurrent
        if recurrent is not None and (mixed_sizes or verify_sizes):
            raise ValueError("recurrent-state models capture decode graphs (one token per request) only")
        self.sizes = sorted(capture_sizes)
        self.max_size = self.sizes[-1]
        self.max_model_len = max_model_len
        self.sizes_by_q = {1: self.sizes}
        for q, sizes in (verify_sizes or {}).items():
            if q > 1 and sizes:
                if not set(sizes) <= set(self.sizes):
                    raise ValueError(f"verify graph sizes {sizes} must be decode sizes {self.sizes}")
                self.sizes_by_q[q] = sorted(sizes)
        self.mixed_sizes = sorted(mixed_sizes or [])
        self.mixed_token_sizes = [t for t, _ in self.mixed_sizes]
        self.mixed_reqs = dict(self.mixed_sizes)
        t = max([sizes[-1] * q for q, sizes in self.sizes_by_q.items()] + self.mixed_token_sizes)
        r = max([self.max_size] + list(self.mixed_reqs.values()))
        # The graphs' device inputs, written by their first kernel from the host ring: token rows (ids, positions,
        # KV slots), request rows (draw seeds, draw RNG positions, last-token indices), query_start_loc, context
        # lengths, draw temperatures and the draw's on/off flag.
        self.tok = torch.zeros((3, t), dtype=torch.long, device=device)
        self.tok[2].fill_(-1)
        self.input_ids, self.positions, self.slot_mapping = self.tok[0], self.tok[1], self.tok[2]
        self.req = torch.zeros((3, r), dtype=torch.long, device=device)
        self.race_seeds, self.race_pos, self.last_token = self.req[0], self.req[1], self.req[2]
        self.query_start_loc = torch.zeros(r + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(r, dtype=torch.int32, device=device)
        self.race_temp = torch.ones(r, dtype=torch.float32, device=device)
        self.race_flag = torch.zeros(1, dtype=torch.int32, device=device)
        self.host_io = HostStepIO(max(t, r + 1), SAMPLE_IN_GRAPH_MAX_SIZE, device)
        self._arange = np.arange(r + 1, dtype=np.int64)
        # The previous step's sampled ids (the runner copies them here after sampling); the graphs read them.
        self.prev_sampled = prev_sampled if prev_sampled is not None else torch.zeros(r, dtype=torch.long,
                                                                                        device=device)
        self.block_table = torch.zeros((r, max_blocks_per_req), dtype=torch.int32, device=device)
        # What the device block table holds (as of the last queued copy): an unchanged table is not copied again
        # (a decode step changes it only when a request crosses into a new block or the batch changes).
        self._bt_mirror = np.zeros((r, max_blocks_per_req), dtype=np.int32)
        self.layer_group = layer_group
        extra = max(layer_group) if layer_group else 0
        self.group_slots = torch.full((extra, t), -1, dtype=torch.long, device=device)
        self.group_block_table = torch.zeros((extra, r, max_blocks_per_req), dtype=torch.int32, device=device)
        self._group_bt_mirror = np.zeros((extra, r, max_blocks_per_req), dtype=np.int32)
        rows = max([sizes[-1] * q for q, sizes in self.sizes_by_q.items()] + list(self.mixed_reqs.values()))
        self.logits = torch.empty((rows, vocab_size), dtype=dtype, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}   # (batch size, q) -> uniform graph
        self.mixed_graphs: dict[int, torch.cuda.CUDAGraph] = {}          # token capacity -> mixed graph
        self.last_io_slot: int | None = None  # the ring slot of the graph loaded last (None: nothing loaded)
        self.mixed_replays = 0  # steps run through a mixed graph (tests, diagnostics)
        self.sampled_replays = 0  # decode steps whose tokens the graph drew itself (tests, diagnostics)

    # ----- shapes -----
    def tokens_and_reqs(self, key: GraphKey) -> tuple[int, int]:
        return (key.size * key.q, key.size) if key.q else (key.size, self.mixed_reqs[key.size])

    def draws(self, key: GraphKey) -> bool:
        """Whether the graph carries the plain temperature draw."""
        return key.q == 1 and key.size <= SAMPLE_IN_GRAPH_MAX_SIZE

    def uniform_key(self, num_reqs: int, num_tokens: int, query_start_loc: np.ndarray | None = None
                    ) -> GraphKey | None:
        """The smallest captured uniform graph for a batch of num_reqs requests and num_tokens tokens, or None.
        q = num_tokens / num_reqs; for q > 1 query_start_loc must show every request with exactly q tokens (with
        q == 1 every scheduled request has at least one, so all have one)."""
        if num_reqs == 0 or num_tokens % num_reqs:
            return None
        q = num_tokens // num_reqs
        sizes = self.sizes_by_q.get(q)
        if sizes is None or num_reqs > sizes[-1]:
            return None
        if q > 1 and (query_start_loc is None or not (np.diff(query_start_loc) == q).all()):
            return None
        key = GraphKey(sizes[bisect.bisect_left(sizes, num_reqs)], q)
        return key if (key.size, q) in self.graphs else None

    def mixed_size(self, num_reqs: int, num_tokens: int) -> int | None:
        """The token capacity of the smallest mixed graph that holds this batch, or None."""
        i = bisect.bisect_left(self.mixed_token_sizes, num_tokens)
        for size in self.mixed_token_sizes[i:]:
            if num_reqs <= self.mixed_reqs[size] and size in self.mixed_graphs:
                return size
        return None

    def can_sample(self, num_reqs: int, num_tokens: int) -> bool:
        """True when this batch runs through a graph that carries the plain temperature draw."""
        key = self.uniform_key(num_reqs, num_tokens)
        return key is not None and self.draws(key)

    # ----- capture -----
    def _metadata(self, key: GraphKey) -> AttentionMetadata:
        tokens, reqs = self.tokens_and_reqs(key)
        if key.q:
            return AttentionMetadata(
                num_actual_tokens=tokens, slot_mapping=self.slot_mapping[:tokens],
                query_start_loc=self.query_start_loc[:reqs + 1], seq_lens=self.seq_lens[:reqs],
                block_table=self.block_table[:reqs], max_query_len=key.q, max_seq_len=self.max_model_len,
                query_start_loc_cpu=self._arange[:reqs + 1] * key.q, seq_lens_cpu=np.full(reqs, self.max_model_len))
        return AttentionMetadata(
            num_actual_tokens=tokens, slot_mapping=self.slot_mapping[:tokens],
            query_start_loc=self.query_start_loc[:reqs + 1], seq_lens=self.seq_lens[:reqs],
            block_table=self.block_table[:reqs], max_query_len=tokens, max_seq_len=self.max_model_len,
            query_start_loc_cpu=np.zeros(reqs + 1, dtype=np.int64), seq_lens_cpu=np.zeros(reqs, dtype=np.int64),
            captured_mixed=True)

    def _layer_metadata(self, key: GraphKey, md: AttentionMetadata) -> list[AttentionMetadata] | None:
        """Per layer, its group's view of the graph's metadata (None: one group)."""
        if not self.layer_group:
            return None
        tokens, reqs = self.tokens_and_reqs(key)
        per_group = [md] + [dataclasses.replace(md, slot_mapping=self.group_slots[g, :tokens],
                                                block_table=self.group_block_table[g, :reqs])
                            for g in range(self.group_slots.shape[0])]
        return [per_group[g] for g in self.layer_group]

    def _forward(self, key: GraphKey) -> None:
        """What a graph runs: load the step's inputs from the ring, the model, the logits into the shared buffer,
        and (q == 1, small) the plain temperature draw when the step's flag says so."""
        tokens, reqs = self.tokens_and_reqs(key)
        io = self.host_io
        self.load_step_inputs(key)
        recurrent = None if self.recurrent is None else self.recurrent.view(reqs)
        md = self._metadata(key)
        with set_forward_context(md, self.kv_caches, self._layer_metadata(key, md), recurrent=recurrent):
            hidden = self.model(self.input_ids[:tokens], self.positions[:tokens])
        if not key.q:
            hidden = hidden[self.last_token[:reqs]]
        logits = self.logits[:hidden.shape[0]]
        self.model.compute_logits(hidden, out=logits)
        if self.draws(key):
            race_argmax(logits, self.race_seeds[:reqs], self.race_pos[:reqs], self.race_temp[:reqs],
                        out=self.prev_sampled[:reqs], flag=self.race_flag, host_out=io.out, host_slot=io.slot)

    def load_step_inputs(self, key: GraphKey) -> None:
        """The graph's first kernel: the next ring slot into the device buffers, as graph `key` reads them."""
        tokens, reqs = self.tokens_and_reqs(key)
        self.host_io.load(tokens, reqs, self.tok, self.req, self.query_start_loc, self.seq_lens, self.race_temp,
                          self.race_flag, self.prev_sampled)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        # Largest first so smaller graphs reuse its memory pool. Captured while the ring holds inert slots only
        # (no KV slot, no context): the warm-up run compiles the Triton kernels outside the capture and writes
        # nothing to the cache.
        keys = [GraphKey(t, 0) for t in self.mixed_token_sizes]
        keys += [GraphKey(s, q) for q, sizes in self.sizes_by_q.items() for s in sizes]
        t0 = time.perf_counter()
        warm = 0.0
        for key in sorted(keys, key=lambda k: -self.tokens_and_reqs(k)[0]):
            t = time.perf_counter()
            self._forward(key)
            torch.cuda.synchronize()
            warm += time.perf_counter() - t
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self._forward(key)
            pool = g.pool()
            if key.q:
                self.graphs[key.size, key.q] = g
            else:
                self.mixed_graphs[key.size] = g
        torch.cuda.synchronize()
        self.sync_host_io()
        logger.info("Captured CUDA graphs for %d decode batch sizes (max %d) and %d mixed batch sizes (max %s "
                    "tokens) in %.2f s (warm-up runs %.2f s); logits buffer %d rows", len(self.sizes), self.max_size,
                    len(self.mixed_token_sizes), self.mixed_token_sizes[-1] if self.mixed_token_sizes else 0,
                    time.perf_counter() - t0, warm, self.logits.shape[0])

    def sync_host_io(self) -> None:
        """Set the device's ring counter to the host's count. Needed after graphs ran outside `load` + `run`
        pairs (capture's warm-up runs, tools that replay a graph back to back)."""
        self.host_io.sync()

    # ----- one step -----
    def load(self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, query_start_loc: np.ndarray,
             seq_lens: np.ndarray, block_table: np.ndarray, allow_mixed: bool = True,
             fix_src: np.ndarray | None = None, race: tuple | None = None,
             state_slots: np.ndarray | None = None,
             groups: list[tuple[np.ndarray, np.ndarray]] | None = None) -> GraphKey | None:
        """Fill the next ring slot for the smallest graph that holds the batch; its key for `run`, or None when
        no graph fits (the batch runs eagerly; nothing was filled). fix_src (per token, -1 = none) marks placeholder
        ids that the graph takes from prev_sampled. race = (seeds, RNG positions, temperatures) per request makes
        a graph that `draws` also draw the plain temperature sample. state_slots: each request's recurrent-state
        slot (required with `recurrent`; every request must continue from its slot's state). groups: the (slot
        mapping, block table) of each KV cache group after the first (required with `layer_group`)."""
        num_reqs, num_tokens = len(seq_lens), len(input_ids)
        self.last_io_slot = None
        if self.layer_group and (groups is None or len(groups) != self.group_slots.shape[0]):
            raise ValueError(f"a model with {self.group_slots.shape[0] + 1} KV cache groups needs the slot mapping "
                             "and block table of every group after the first")
        key = self.uniform_key(num_reqs, num_tokens, query_start_loc)
        if self.recurrent is not None:
            if state_slots is None:
                raise ValueError("a recurrent-state model's graph needs the requests' state slots")
            if key is None:
                return None
            self.recurrent.load(state_slots, key.size)
        if key is None:
            size = self.mixed_size(num_reqs, num_tokens) if allow_mixed else None
            if size is None:
                return None
            key = GraphKey(size, 0)
        if race is not None and not self.draws(key):
            raise ValueError(f"the graph {tuple(key)} does not sample (see can_sample)")
        io = self.host_io
        slot = io.next_slot()
        v = io.ints_np[slot]
        tokens, reqs = self.tokens_and_reqs(key)
        if key.q:
            self._fill_uniform(v, io.temps_np[slot], key, input_ids, positions, slots, seq_lens, race)
        else:
            _write_mixed(v, v[QSL], v[CTX], v[LAST], tokens, reqs, input_ids, positions, slots, query_start_loc,
                         seq_lens)
            v[FLAG, 0] = 0
        v[SRC, :num_tokens] = -1 if fix_src is None else fix_src
        v[SRC, num_tokens:tokens] = -1
        self._load_table(self.block_table, self._bt_mirror, block_table)
        for g, (group_slots, table) in enumerate(groups or ()):
            staged = np.full(tokens, -1, dtype=np.int64)  # padding tokens store nothing in this group either
            staged[:num_tokens] = group_slots
            self.group_slots[g, :tokens].copy_(_pinned(staged), non_blocking=True)
            self._load_table(self.group_block_table[g], self._group_bt_mirror[g], table)
        self.last_io_slot = slot
        return key

    def _fill_uniform(self, v: np.ndarray, temps: np.ndarray, key: GraphKey, input_ids: np.ndarray,
                      positions: np.ndarray, slots: np.ndarray, seq_lens: np.ndarray, race: tuple | None) -> None:
        """A uniform batch in a ring slot: the real tokens, then inert tokens; padding requests with context 0
        (q == 1: one query token each, as decode rows; q > 1: an empty query, as the mixed layout's). Without
        `race` the draw's rows keep stale values (its flag is off)."""
        size, q = key
        n, t = len(seq_lens), len(input_ids)
        v[IDS, :t], v[POS, :t], v[SLOTS, :t] = input_ids, positions, slots
        v[IDS:SLOTS + 1, t:size * q] = _TOKEN_PAD[:3]
        v[CTX, :n] = seq_lens
        v[CTX, n:size] = 0
        if q == 1:
            v[QSL, :size + 1] = self._arange[:size + 1]
        else:
            v[QSL, :n + 1] = self._arange[:n + 1] * q
            v[QSL, n + 1:size + 1] = t
        v[FLAG, 0] = race is not None
        if race is not None:
            v[SEEDS, :n], v[RPOS, :n], temps[:n] = race
            v[SEEDS:RPOS + 1, n:size] = 0
            temps[n:size] = 1.0

    @staticmethod
    def _load_table(device_table: torch.Tensor, mirror: np.ndarray, block_table: np.ndarray) -> None:
        """Copy the batch's block table rows unless the device already holds exactly these (`mirror`: what it
        holds as of the last queued copy)."""
        n, nb = block_table.shape
        if np.array_equal(mirror[:n, :nb], block_table):
            return
        mirror[:n, :nb] = block_table
        device_table[:n, :nb].copy_(_pinned(block_table.astype(np.int32, copy=False)), non_blocking=True)

    def run(self, key: GraphKey, n: int) -> torch.Tensor:
        """Replay the graph `load` returned; the logits of the batch's first n requests (all their tokens in a
        uniform graph, their last in a mixed one)."""
        if key.q:
            self.graphs[key.size, key.q].replay()
            return self.logits[:n * key.q]
        self.mixed_graphs[key.size].replay()
        self.mixed_replays += 1
        return self.logits[:n]
