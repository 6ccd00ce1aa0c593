"""The attention-backend interface and the per-step metadata every backend receives."""
from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """One step's varlen batch: request i owns query tokens [query_start_loc[i], query_start_loc[i+1]) and attends
    to the first seq_lens[i] positions of its context (cached prefix + the new tokens, causally), stored in the blocks
    listed by block_table[i]. slot_mapping[t] is where token t's K/V go (block_id * block_size + offset)."""
    num_actual_tokens: int
    slot_mapping: torch.Tensor        # [T] int64
    query_start_loc: torch.Tensor     # [B + 1] int32
    seq_lens: torch.Tensor            # [B] int32
    block_table: torch.Tensor         # [B, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: np.ndarray   # host copies, for backends that loop or plan on the host
    seq_lens_cpu: np.ndarray
    # A mixed batch captured in a CUDA graph (worker/cuda_graph.py): the device tensors are padded buffers (rows
    # past the real requests have query_len 0 and seq_len 0, tokens past them slot -1) refilled before each replay,
    # so the backend must plan for any mix of prefill and decode rows and read nothing from the host copies.
    # max_query_len is then the token capacity.
    captured_mixed: bool = False
    # Per-step plans a backend derives from the fields above once and reuses in every layer (keyed by the
    # backend; e.g. torch_ref's decode gather indices and masks). Never set by the caller.
    plans: dict = dataclasses.field(default_factory=dict, init=False, compare=False, repr=False)


class AttentionBackend(abc.ABC):
    """Stores K/V into the paged cache and computes attention for a varlen batch.

    The cache of one layer is one tensor [2, num_blocks, block_size, num_kv_heads, head_size] (K then V). A backend
    must write every token's K/V before any request reads it within the same call: a prefix hit may point at blocks
    that another request of the same step is filling.

    The cache dtype is the activation dtype or, with kv_cache_dtype=fp8*, an fp8 dtype: then K/V are stored as
    fp8(x / k_scale or v_scale) and read back multiplied by the scale (kernels/kv_fp8.py). A backend must honour
    that or raise; it must never read the scales on the host (they are device scalars, possibly under a CUDA graph).

    `sliding_window` W (None: full attention): the query at position p attends to keys (p - W, p], HF's sliding
    window; keys older than that may sit in blocks already freed and reused, so a backend must not read them (for
    any purpose the result depends on). `logits_soft_cap` c (None: off): scores become c * tanh(score / c) before
    the softmax (Gemma 2).
    """

    name: str = "abstract"

    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window}")
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap or None

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: AttentionMetadata, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, Hq*D], k/v [T, Hkv*D] -> out [T, Hq*D]. k_scale / v_scale: float32 device scalars, required when
        kv_cache is fp8 and ignored otherwise."""
