"""Attention backends by name, imported lazily."""
from __future__ import annotations

import importlib

import torch

_BACKENDS = {
    "TORCH_REF": ("tokenmill.attention.backends.torch_ref", "TorchRefBackend"),
    "TRITON": ("tokenmill.attention.backends.triton_attn", "TritonAttentionBackend"),
}


def supported_backends() -> list[str]:
    return list(_BACKENDS)


def get_attention_backend(name: str | None, device: torch.device) -> type:
    if not name:
        # Triton kernels on CUDA; the pure-torch reference everywhere else (CPU).
        name = "TRITON" if torch.device(device).type == "cuda" else "TORCH_REF"
    key = name.upper()
    if key not in _BACKENDS:
        raise ValueError(f"Unknown attention backend {name!r}; available: {', '.join(_BACKENDS)}.")
    module, cls = _BACKENDS[key]
    return getattr(importlib.import_module(module), cls)
