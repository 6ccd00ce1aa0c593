"""The attention layer models use: it finds its KV cache and the step's metadata in the forward context."""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.forward_context import get_forward_context


class Attention(nn.Module):
    def __init__(self, layer_idx: int, num_heads: int, head_size: int, num_kv_heads: int, scale: float,
                 backend_cls: type) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.impl = backend_cls(num_heads, head_size, num_kv_heads, scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        if ctx.attn_metadata is None:  # profiling run without a cache: skip attention math
            return q
        return self.impl.forward(q, k, v, ctx.kv_caches[self.layer_idx], ctx.attn_metadata)
