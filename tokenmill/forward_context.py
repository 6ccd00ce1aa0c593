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
    # Hybrid models: the step's recurrent-state view (worker/state_cache.RecurrentStep), None otherwise.
    recurrent: object | None = None
    # A KV cache in several layer groups (worker/kv_group_tables.py): each layer's own metadata, by layer index.
    layer_metadata: list[AttentionMetadata] | None = None


_CONTEXT: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("Attention ran outside set_forward_context(); the model runner must set it.")
    return _CONTEXT


@contextlib.contextmanager
def set_forward_context(attn_metadata: AttentionMetadata | None, kv_caches: list[torch.Tensor],
                        layer_metadata: list[AttentionMetadata] | None = None, recurrent: object | None = None):
    global _CONTEXT
    prev, _CONTEXT = _CONTEXT, ForwardContext(attn_metadata, kv_caches, recurrent=recurrent,
                                              layer_metadata=layer_metadata)
    try:
        yield
    finally:
        _CONTEXT = prev
