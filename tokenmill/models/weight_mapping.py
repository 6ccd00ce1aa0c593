"""Checkpoint names -> model parameters, declared as data by each model and applied by one loader.

A model class sets `weight_mapping = WeightMapping(...)`: which checkpoint modules stack into one parameter (q/k/v
-> qkv_proj with slot "q", "k", "v"; gate/up -> gate_up_proj), which name prefixes are renamed (a checkpoint that
nests the decoder under another module), and which tensors are skipped (rotary tables some exports carry, weights of
parts tokenmill does not run). `load_weights` walks a checkpoint once and hands each tensor to its parameter's own
`weight_loader` (tokenmill/layers/linear.py), so the tensor-parallel split and the stacked slots are the layers'
business and a format's extra tensors (`qkv_proj.weight_scale`, `gate_up_proj.qzeros`) load by the same rules.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn

from tokenmill.attention.kv_quant import kv_scale_targets, load_kv_scale
from tokenmill.distributed.pp import is_pp_missing, missing_prefixes
from tokenmill.layers.linear import default_weight_loader


@dataclass(frozen=True)
class WeightMapping:
    """How a family's checkpoint names map onto its parameters.

    stacked: checkpoint module name -> (stacked parameter's module name, slot id), matched as a whole dotted
        component (".q_proj." in "model.layers.0.self_attn.q_proj.weight").
    renamed: (checkpoint prefix, parameter prefix) pairs applied first, in order (the first match wins).
    skipped: regular expressions; a checkpoint name any of them matches (re.search) is not loaded.
    resolver: consulted first for every renamed name: (parameter name, slot id) or None to fall through to
        `stacked` (the MoE experts' per-expert names, layers/fused_moe.py `expert_param_target`).
    """
    stacked: dict[str, tuple[str, Any]] = field(default_factory=dict)
    renamed: tuple[tuple[str, str], ...] = ()
    skipped: tuple[str, ...] = ()
    resolver: Callable[[str], tuple[str, Any] | None] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "_skip", re.compile("|".join(f"(?:{p})" for p in self.skipped))
                           if self.skipped else None)

    def is_skipped(self, name: str) -> bool:
        return self._skip is not None and self._skip.search(name) is not None

    def rename(self, name: str) -> str:
        for old, new in self.renamed:
            if name.startswith(old):
                return new + name[len(old):]
        return name

    def target(self, name: str) -> tuple[str, Any]:
        """(parameter name, slot id or None) for a renamed checkpoint name."""
        if self.resolver is not None:
            hit = self.resolver(name)
            if hit is not None:
                return hit
        for ckpt, (stacked, shard_id) in self.stacked.items():
            frag = f".{ckpt}."
            if frag in name:
                return name.replace(frag, f".{stacked}.", 1), shard_id
        return name, None


LLAMA_STACKED = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def _cast(tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Floating-point tensors take the parameter's dtype; integer ones (packed weights, group indices) keep theirs
    and must match."""
    if tensor.dtype == param.dtype:
        return tensor
    if param.dtype.is_floating_point and tensor.dtype.is_floating_point:
        if param.element_size() == 1 and tensor.element_size() > 1:  # into float8: a cast would drop the scale
            raise ValueError(f"Checkpoint tensor of dtype {tensor.dtype} cannot load into a {param.dtype} "
                             "parameter: the quantization_config declares fp8 weights but this tensor is not fp8.")
        return tensor.to(param.dtype)
    raise ValueError(f"Checkpoint tensor of dtype {tensor.dtype} cannot load into a parameter of dtype "
                     f"{param.dtype}.")


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], mapping: WeightMapping,
                 tie_word_embeddings: bool = False) -> set[str]:
    """Copy checkpoint tensors into `model`'s parameters; returns the names of the parameters that were loaded.

    KV-cache scales (k_scale / v_scale / kv_scale, see attention/kv_quant.py) go into the Attention layers' scale
    buffers. Tensors of other pipeline stages are passed over. With tied embeddings the checkpoint's
    `lm_head.weight` (if any) is ignored, and a last stage that lacks the embedding fills its head's copy from
    `model.embed_tokens.weight`. An unknown name is an error naming it.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers())
    other_stages = missing_prefixes(model)
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    head_from_embedding = (tie_word_embeddings and lm_head is not None and lm_head is not embed
                           and not is_pp_missing(lm_head))
    loaded: set[str] = set()
    for name, tensor in weights:
        name = mapping.rename(name)
        if mapping.is_skipped(name):
            continue
        if head_from_embedding and name == "model.embed_tokens.weight":
            lm_head.weight.weight_loader(lm_head.weight, _cast(tensor, lm_head.weight))
            loaded.add("lm_head.weight")
        if other_stages and name.startswith(other_stages):
            continue
        targets = kv_scale_targets(name)
        if targets is not None:
            for target in targets:
                if target not in buffers:
                    raise ValueError(f"Checkpoint tensor {name!r} looks like a KV-cache scale but "
                                     f"{type(model).__name__} has no {target!r}.")
                load_kv_scale(buffers[target], tensor, name)
            continue
        if tie_word_embeddings and name == "lm_head.weight":
            continue  # the embedding is the head
        pname, shard = mapping.target(name)
        param = params.get(pname)
        if param is None:
            raise ValueError(f"Checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}; "
                             "is this the right architecture?")
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, _cast(tensor, param), shard)
        except ValueError as e:  # name the tensor: the layers' messages name only the parameter
            raise ValueError(f"Checkpoint tensor {name!r} (into {pname}): {e}") from None
        loaded.add(pname)
    return loaded


def process_weights_after_loading(model: nn.Module) -> None:
    """Let every linear layer's method prepare its weights once (repack, transpose, pre-scale)."""
    for module in model.modules():
        hook = getattr(module, "process_weights_after_loading", None)
        if hook is not None and module is not model:
            hook()
