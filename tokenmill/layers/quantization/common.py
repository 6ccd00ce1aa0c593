"""What the weight formats share: matching a layer against a checkpoint's module lists, per-slot scale loading,
and the errors a refused configuration raises.

Checkpoint configs name modules as the checkpoint has them (`model.layers.0.self_attn.q_proj`), while a stacked
layer's prefix is its fused name (`...self_attn.qkv_proj`): `checkpoint_modules` expands the one into the others so
that an ignore list or a target regex is matched against the names its author wrote.
"""
from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

# fused parameter module -> the checkpoint modules stacked into it (tokenmill/models/weight_mapping.py's rule)
_STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def checkpoint_modules(prefix: str) -> list[str]:
    """The checkpoint module names whose tensors land in the layer `prefix` (itself when it is not stacked)."""
    head, _, last = prefix.rpartition(".")
    parts = _STACKED.get(last)
    if parts is None:
        return [prefix]
    return [f"{head}.{p}" if head else p for p in parts]


def name_matches(name: str, pattern: str) -> bool:
    """A module-list entry as vLLM / compressed-tensors read it: `re:<regex>` (re.match on the name), else the
    module name itself, a dotted suffix of it (`lm_head`, `self_attn.o_proj`) or a dotted prefix (`model.layers.0`)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern) or name.startswith(pattern + ".")


def layer_matches(prefix: str, patterns: Iterable[str], what: str) -> bool:
    """Whether the layer `prefix` is named by `patterns`; a stacked layer must be named whole (all of its checkpoint
    modules or its fused name) or not at all, else its slots would need two formats."""
    patterns = list(patterns)
    if not patterns:
        return False
    if any(name_matches(prefix, p) for p in patterns):
        return True
    parts = checkpoint_modules(prefix)
    hits = [any(name_matches(n, p) for p in patterns) for n in parts]
    if any(hits) and not all(hits):
        named = [n for n, h in zip(parts, hits) if h]
        raise ValueError(f"quantization_config's {what} names {named} but not the other modules stacked into "
                         f"{prefix} ({parts}); tokenmill runs a stacked layer in one format.")
    return all(hits)


def refuse(method: str, what: str, value, supported: str, prefix: str | None = None) -> ValueError:
    """The start-up error for a configuration no kernel here implements."""
    where = f" (first layer it applies to: {prefix})" if prefix else ""
    return ValueError(f"quantization {method!r}: {what} {value!r} is not supported{where}. Supported: {supported}.")


def slot_names(layer: nn.Module) -> list:
    """The stacked slots of a layer in order (q, k, v / gate, up), or [None] for a plain layer."""
    shards = getattr(layer, "shards", None)
    return list(shards) if shards else [None]


def per_slot_param(layer: nn.Module, name: str) -> nn.Parameter:
    """A float32 parameter holding one scalar per stacked slot, loaded from a checkpoint scalar per slot (or one
    scalar for a fused checkpoint tensor, which every slot takes)."""
    slots = slot_names(layer)
    p = nn.Parameter(torch.zeros(len(slots), dtype=torch.float32), requires_grad=False)

    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.numel() != 1:
            raise ValueError(f"{layer.prefix}.{name}: expected one scale per tensor, the checkpoint has shape "
                             f"{tuple(loaded.shape)}.")
        if shard_id is None:
            param.data.fill_(loaded.reshape(()).float())
        else:
            param.data[slots.index(shard_id)] = loaded.reshape(()).float()

    p.weight_loader = load
    layer.register_parameter(name, p)
    return p


def replace_param(layer: nn.Module, name: str, value: torch.Tensor) -> None:
    """Swap a parameter for its processed form (the old storage is freed with its last reference)."""
    if hasattr(layer, name):
        delattr(layer, name)
    layer.register_parameter(name, nn.Parameter(value, requires_grad=False))
