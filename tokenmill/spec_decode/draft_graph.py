"""A draft model's whole steady-state proposal as one CUDA graph per batch size.

In steady decoding a request's draft cache lacks at most its last two tokens (the bonus token, and the last
accepted draft when all k were accepted). The graph feeds both (re-feeding a position the cache already holds
writes the same KV again), takes draft 1 from the second one's logits, then runs k - 1 one-token steps feeding each
draft back: k + 1 forwards and k argmaxes, one replay, every input from the host (tokens, positions, block table),
so nothing waits between them. KV slots are computed inside the graph from the block table; positions past a row's
blocks write to the scratch block.
"""
from __future__ import annotations

import bisect

import numpy as np
import torch

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.forward_context import set_forward_context
from tokenmill.logger import init_logger

logger = init_logger(__name__)


class DraftProposalGraphs:
    """Contract: `propose(batch, rows)` returns [len(rows), k] greedy drafts (host int64) for rows whose draft cache
    holds every position below num_tokens - 2 (the caller checks), at most `max_size` rows. With `capture` the
    bodies are captured per size (CUDA); without, the same body runs eagerly (the CPU, and tests)."""

    def __init__(self, model, kv_caches: list[torch.Tensor], sizes: list[int], k: int, block_size: int,
                 max_blocks: int, max_model_len: int, scratch_block: int, vocab: int, device: torch.device,
                 capture: bool) -> None:
        self.model, self.kv_caches, self.k, self.bs = model, kv_caches, k, block_size
        self.sizes, self.max_size = sorted(sizes), max(sizes)
        self.max_len, self.scratch, self.vocab, self.device = max_model_len, scratch_block, vocab, device
        n = self.max_size
        self.ids2 = torch.zeros((n, 2), dtype=torch.long, device=device)
        self.pos0 = torch.zeros(n, dtype=torch.long, device=device)
        self.table = torch.zeros((n, max_blocks), dtype=torch.int32, device=device)
        self.nblocks = torch.zeros(n, dtype=torch.int32, device=device)
        self.out = torch.zeros((n, k), dtype=torch.long, device=device)
        self._rows = torch.arange(n, device=device)
        self._rows2 = torch.arange(2 * n, device=device) // 2
        self._step = torch.tensor([0, 1], dtype=torch.long, device=device)
        self._qsl = torch.arange(2 * n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.proposals = 0  # calls of propose (tests, diagnostics)
        if capture:
            self._capture()

    # ----- the body -----
    def _slots(self, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        col = pos // self.bs
        held = col < self.nblocks[rows]
        block = self.table[rows, col.clamp(max=self.table.shape[1] - 1)].long()
        return torch.where(held, block, self.scratch) * self.bs + pos % self.bs

    def _metadata(self, s: int, q: int, slots, seq_lens, host_seq_lens) -> AttentionMetadata:
        qsl_cpu = np.arange(s + 1, dtype=np.int64) * q
        # Captured: the host copies say "any length up to max_model_len" (the kernels read the device tensors).
        ctx_cpu = host_seq_lens if host_seq_lens is not None else np.full(s, self.max_len, dtype=np.int64)
        return AttentionMetadata(
            num_actual_tokens=s * q, slot_mapping=slots, query_start_loc=self._qsl[:s + 1] * q,
            seq_lens=seq_lens.to(torch.int32), block_table=self.table[:s], max_query_len=q,
            max_seq_len=int(ctx_cpu.max()) if host_seq_lens is not None else self.max_len,
            query_start_loc_cpu=qsl_cpu, seq_lens_cpu=ctx_cpu)

    def _greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)[:, :self.vocab].argmax(dim=-1)

    def _body(self, s: int, host_pos0: np.ndarray | None = None) -> None:
        pos = (self.pos0[:s, None] + self._step).reshape(-1)
        md = self._metadata(s, 2, self._slots(self._rows2[:2 * s], pos), self.pos0[:s] + 2,
                            None if host_pos0 is None else host_pos0 + 2)
        with set_forward_context(md, self.kv_caches):
            hidden = self.model(self.ids2[:s].reshape(-1), pos)
        x = self._greedy(hidden[1::2])
        self.out[:s, 0] = x
        rows = self._rows[:s]
        for i in range(1, self.k):
            p = self.pos0[:s] + 1 + i
            md = self._metadata(s, 1, self._slots(rows, p), p + 1, None if host_pos0 is None else host_pos0 + 2 + i)
            with set_forward_context(md, self.kv_caches):
                hidden = self.model(x, p)
            x = self._greedy(hidden)
            self.out[:s, i] = x

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        # Padding rows only while capturing: no blocks (every write goes to the scratch block).
        for s in sorted(self.sizes, reverse=True):
            self._body(s)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self._body(s)
            pool = g.pool()
            self.graphs[s] = g
        torch.cuda.synchronize()
        logger.info("Captured the draft model's proposal (%d forwards) for %d batch sizes (max %d)", self.k + 1,
                    len(self.sizes), self.max_size)

    # ----- one proposal -----
    @torch.inference_mode()
    def propose(self, batch, rows: np.ndarray) -> np.ndarray:
        n = len(rows)
        s = self.sizes[bisect.bisect_left(self.sizes, n)] if self.graphs else n
        n_tok = batch.num_tokens[rows].astype(np.int64)
        ids2 = np.zeros((s, 2), dtype=np.int64)
        ids2[:n] = batch.token_ids[rows[:, None], n_tok[:, None] - 2 + np.arange(2)]
        pos0 = np.zeros(s, dtype=np.int64)
        pos0[:n] = n_tok - 2
        nblocks = np.zeros(s, dtype=np.int32)
        nblocks[:n] = batch.num_blocks[rows]
        width = int(nblocks.max())
        table = np.zeros((s, width), dtype=np.int32)
        table[:n] = batch.block_table[rows, :width]
        self.ids2[:s].copy_(_staged(ids2), non_blocking=True)
        self.pos0[:s].copy_(_staged(pos0), non_blocking=True)
        self.nblocks[:s].copy_(_staged(nblocks), non_blocking=True)
        self.table[:s, :width].copy_(_staged(table), non_blocking=True)
        self.proposals += 1
        if self.graphs:
            self.graphs[s].replay()
        else:
            self._body(s, pos0)
        return self.out[:n].cpu().numpy()


def _staged(a: np.ndarray) -> torch.Tensor:
    t = torch.from_numpy(a)
    return t.pin_memory() if torch.cuda.is_available() else t
