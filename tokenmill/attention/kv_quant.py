"""Checkpoint KV-cache scales: which checkpoint tensors carry them and how they land in the Attention layers'
scale buffers. The fp8 number format those scales serve is kernels/kv_fp8.py.
"""
from __future__ import annotations

import torch

# Checkpoint suffixes that carry KV scales, by producer: llm-compressor / compressed-tensors put them on the
# projections (k_proj.k_scale), ModelOpt and Quark on the attention module (self_attn.k_scale), older ModelOpt
# exports call them output_scale, and AutoFP8-era checkpoints have one kv_scale for both.
_KV_SCALE_SUFFIXES: dict[str, tuple[str, ...]] = {
    ".k_proj.k_scale": ("k_scale",), ".v_proj.v_scale": ("v_scale",),
    ".k_proj.output_scale": ("k_scale",), ".v_proj.output_scale": ("v_scale",),
    ".attn.k_scale": ("k_scale",), ".attn.v_scale": ("v_scale",),
    ".k_scale": ("k_scale",), ".v_scale": ("v_scale",),
    ".kv_scale": ("k_scale", "v_scale"),
}


def kv_scale_targets(name: str, attn_prefix: str = "attn") -> list[str] | None:
    """The Attention buffers a checkpoint tensor fills, or None when `name` is no KV scale.

    `model.layers.3.self_attn.k_proj.k_scale` -> [`model.layers.3.self_attn.attn.k_scale`]; `attn_prefix` is the
    attribute under which the model's attention module keeps its Attention layer."""
    for suffix, buffers in _KV_SCALE_SUFFIXES.items():
        if name.endswith(suffix):
            module = name[: -len(suffix)]
            return [f"{module}.{attn_prefix}.{b}" for b in buffers]
    return None


def load_kv_scale(buffer: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    """Copy a checkpoint scale into a layer's scalar buffer in place (the buffer's address must not change: CUDA
    graphs and kernels hold it). Only per-tensor scales are supported."""
    if tensor.numel() != 1:
        raise ValueError(f"Checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; tokenmill supports only "
                         "per-tensor KV scales (one number per layer).")
    value = float(tensor.reshape(()).float())
    if not value > 0.0 or value == float("inf"):
        raise ValueError(f"Checkpoint tensor {name!r} holds the KV scale {value}; a scale must be positive and "
                         "finite.")
    buffer.fill_(value)
