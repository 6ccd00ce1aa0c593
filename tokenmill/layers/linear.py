"""Linear layers that own their weight loading.

Each parameter carries a `weight_loader(param, loaded, shard_id=None)`; models only declare which checkpoint names
pack into which fused parameter (q/k/v -> qkv_proj, gate/up -> gate_up_proj). Tensor parallelism will shard here,
not in model files.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"Checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter of shape "
                         f"{tuple(param.shape)}.")
    param.data.copy_(loaded)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False)
            self.bias.weight_loader = default_weight_loader
        else:
            self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim; shards are loaded by id."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 shard_names: list | None = None) -> None:
        super().__init__(in_features, sum(out_sizes), bias)
        names = shard_names if shard_names is not None else list(range(len(out_sizes)))
        offsets, o = {}, 0
        for name, size in zip(names, out_sizes):
            offsets[name] = (o, size)
            o += size
        self.shard_offsets = offsets
        for p in (self.weight, self.bias):
            if p is not None:
                p.weight_loader = self._load_shard

    def _load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            return default_weight_loader(param, loaded)
        start, size = self.shard_offsets[shard_id]
        target = param.data.narrow(0, start, size)
        if target.shape != loaded.shape:
            raise ValueError(f"Shard {shard_id!r}: checkpoint shape {tuple(loaded.shape)} does not fit "
                             f"{tuple(target.shape)}.")
        target.copy_(loaded)


class QKVLinear(MergedLinear):
    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        super().__init__(hidden, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], bias,
                         shard_names=["q", "k", "v"])


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
