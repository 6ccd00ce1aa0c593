"""CUDA graphs for decode steps: the model forward and the logits of a padded decode batch, captured per size."""
from __future__ import annotations

import bisect

import numpy as np
import torch

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.forward_context import set_forward_context
from tokenmill.logger import init_logger

logger = init_logger(__name__)


def default_capture_sizes(max_size: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 256 and of 16 beyond, capped at max_size."""
    sizes = [s for s in (1, 2, 4) if s <= max_size]
    sizes += list(range(8, min(max_size, 256) + 1, 8))
    sizes += list(range(272, max_size + 1, 16))
    if max_size not in sizes:
        sizes.append(max_size)
    return sorted(set(sizes))


class CudaGraphRunner:
    """Replays captured decode graphs.

    Contract: a batch where every request computes exactly one token, with at most `max_size` requests, runs through
    the graph of the smallest captured size that fits; padded rows have slot -1 and context length 0, so attention
    skips them and nothing is written to the cache. Inputs are copied into persistent device buffers (the graphs
    read only those), and the logits buffer of that size is returned sliced to the real batch.
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], capture_sizes: list[int],
                 max_model_len: int, max_blocks_per_req: int, device: torch.device) -> None:
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.sizes = sorted(capture_sizes)
        self.max_size = self.sizes[-1]
        self.max_model_len = max_model_len
        n = self.max_size
        # input ids, positions and slots share one buffer so one copy loads them.
        self.vec = torch.zeros((3, n), dtype=torch.long, device=device)
        self.vec[2].fill_(-1)
        self.input_ids, self.positions, self.slot_mapping = self.vec[0], self.vec[1], self.vec[2]
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_table = torch.zeros((n, max_blocks_per_req), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

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

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for size in reversed(self.sizes):  # largest first so smaller graphs reuse its memory pool
            self._forward(size)  # warm-up (Triton autotuning / compilation happens outside the capture)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.logits[size] = self._forward(size)
            pool = g.pool()
            self.graphs[size] = g
        torch.cuda.synchronize()
        logger.info("Captured CUDA graphs for %d decode batch sizes (max %d)", len(self.sizes), self.max_size)

    def can_run(self, num_reqs: int, num_tokens: int) -> bool:
        return num_tokens == num_reqs <= self.max_size and bool(self.graphs)

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
