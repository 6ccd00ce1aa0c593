"""Per-step state visible to attention layers, so model forward signatures stay `forward(input_ids, positions)`."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from tokenmill.attention.backend import AttentionMetadata


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata | None
    kv_caches: list[torch.Tensor]


_CONTEXT: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("Attention ran outside set_forward_context(); the model runner must set it.")
    return _CONTEXT


@contextlib.contextmanager
def set_forward_context(attn_metadata: AttentionMetadata | None, kv_caches: list[torch.Tensor]):
    global _CONTEXT
    prev, _CONTEXT = _CONTEXT, ForwardContext(attn_metadata, kv_caches)
    try:
        yield
    finally:
        _CONTEXT = prev
