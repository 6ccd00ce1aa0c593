"""Linear layers that own their tensor-parallel sharding and their weight loading.

Each parameter carries a `weight_loader(param, loaded, shard_id=None)` that takes the *full* checkpoint tensor and
copies this rank's slice; models only declare which checkpoint names pack into which fused parameter (q/k/v ->
qkv_proj, gate/up -> gate_up_proj). A sharded parameter also carries `full_shape`, the shape it has with one rank,
so the dummy loader can draw the full tensor and shard it exactly like a checkpoint (TP=N equals TP=1's weights).
A layer keeps the parallel state current when it was built (its rank, size and group) and communicates in that.

Column-parallel layers split the output dim and need no communication; row-parallel layers split the input dim and
sum the partial outputs with one all-reduce. With one rank every layer is a plain `F.linear`.
"""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.distributed import divide, get_parallel_state, get_tp_size, kv_heads_per_rank
from tokenmill.distributed.communication_op import tensor_model_parallel_all_reduce
from tokenmill.layers.linear_ops import linear, norm_linear, norm_linear_silu, silu_mul_linear


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"Checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter of shape "
                         f"{tuple(param.shape)}.")
    param.data.copy_(loaded)


def _copy_checked(target: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if target.shape != loaded.shape:
        raise ValueError(f"{what}: checkpoint slice of shape {tuple(loaded.shape)} does not fit "
                         f"{tuple(target.shape)}.")
    target.copy_(loaded)


def _param(shape: tuple[int, ...], full_shape: tuple[int, ...], loader, zeros: bool = False) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(shape) if zeros else torch.empty(shape), requires_grad=False)
    p.weight_loader = loader
    p.full_shape = torch.Size(full_shape)
    return p


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split evenly over the TP ranks; each rank returns its slice of y."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 out_per_rank: int | None = None) -> None:
        super().__init__()
        self.parallel = get_parallel_state()
        self.tp_size, self.tp_rank = self.parallel.tp_size, self.parallel.tp_rank
        self.in_features, self.out_features = in_features, out_features
        if out_per_rank is None:
            out_per_rank = divide(out_features, self.tp_size, "output size of a column-parallel layer")
        self.out_per_rank = out_per_rank
        self.weight = _param((out_per_rank, in_features), (out_features, in_features), self.weight_loader)
        self.bias = _param((out_per_rank,), (out_features,), self.weight_loader, zeros=True) if bias else None

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        size = param.shape[0]
        _copy_checked(param.data, loaded.narrow(0, self.tp_rank * size, size) if self.tp_size > 1 else loaded,
                      type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def forward_norm(self, x: torch.Tensor, residual: torch.Tensor | None, norm) -> tuple[torch.Tensor, torch.Tensor]:
        """self(norm(x + residual)) and x + residual (x when residual is None), the norm fused in where it pays."""
        return norm_linear(x, residual, norm, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input stacked along the output dim (gate/up): each rank holds
    its slice of every projection, in order. Checkpoint tensors arrive per projection (`shard_id`) or fused."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 shard_names: list | None = None, rank_sizes: list[int] | None = None) -> None:
        names = shard_names if shard_names is not None else list(range(len(out_sizes)))
        if rank_sizes is None:
            tp = get_tp_size()
            rank_sizes = [divide(s, tp, f"output size of shard {n!r}") for n, s in zip(names, out_sizes)]
        super().__init__(in_features, sum(out_sizes), bias, out_per_rank=sum(rank_sizes))
        # shard id -> (offset in this rank's parameter, rows here, rows in the full checkpoint tensor)
        self.shards, o = {}, 0
        for name, full, here in zip(names, out_sizes, rank_sizes):
            self.shards[name] = (o, here, full)
            o += here

    def shard_start(self, shard_id) -> int:
        """First checkpoint row of `shard_id` that this rank holds."""
        return self.tp_rank * self.shards[shard_id][1]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:  # a fused checkpoint tensor: split it in the one-rank layout, then shard each part
            pieces = loaded.split([full for _, _, full in self.shards.values()], dim=0)
            for sid, piece in zip(self.shards, pieces):
                self.weight_loader(param, piece, sid)
            return
        offset, here, full = self.shards[shard_id]
        if loaded.shape[0] != full:
            raise ValueError(f"Shard {shard_id!r}: checkpoint has {loaded.shape[0]} rows, expected {full}.")
        _copy_checked(param.data.narrow(0, offset, here), loaded.narrow(0, self.shard_start(shard_id), here),
                      f"shard {shard_id!r}")

    def forward_norm_silu(self, x: torch.Tensor, residual: torch.Tensor | None, norm,
                          down: RowParallelLinear) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a [gate | up] projection: (silu(gate) * up of norm(x + residual), x + residual) with the SiLU in the
        product's epilogue, or None where that does not pay (see linear_ops.norm_linear_silu)."""
        return norm_linear_silu(x, residual, norm, self.weight, self.bias, down.weight)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections fused, attention heads split over the TP ranks.

    Query heads divide evenly. KV heads divide evenly too when there are at least as many as ranks; otherwise each
    rank holds one KV head, replicated over the tp_size / num_kv_heads ranks whose query heads use it. `num_heads`
    and `num_kv_heads` are this rank's counts.
    """

    def __init__(self, hidden: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False) -> None:
        tp = get_tp_size()
        num_heads = divide(total_num_heads, tp, "num_attention_heads")
        num_kv_heads = kv_heads_per_rank(total_num_kv_heads, tp)
        q_full, kv_full = total_num_heads * head_dim, total_num_kv_heads * head_dim
        q_here, kv_here = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden, [q_full, kv_full, kv_full], bias, shard_names=["q", "k", "v"],
                         rank_sizes=[q_here, kv_here, kv_here])
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, num_heads, num_kv_heads
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.kv_replicas = max(tp // total_num_kv_heads, 1)

    def shard_start(self, shard_id) -> int:
        if shard_id == "q":
            return self.tp_rank * self.num_heads * self.head_dim
        return (self.tp_rank // self.kv_replicas) * self.num_kv_heads * self.head_dim


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split over the TP ranks: each rank multiplies its slice of x, one
    all-reduce sums the partial products, and the (replicated) bias is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.parallel = get_parallel_state()
        self.tp_size, self.tp_rank = self.parallel.tp_size, self.parallel.tp_rank
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = divide(in_features, self.tp_size, "input size of a row-parallel layer")
        self.weight = _param((out_features, self.in_per_rank), (out_features, in_features), self.weight_loader)
        self.bias = _param((out_features,), (out_features,), default_weight_loader, zeros=True) if bias else None

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        size = param.shape[1]
        _copy_checked(param.data, loaded.narrow(1, self.tp_rank * size, size) if self.tp_size > 1 else loaded,
                      type(self).__name__)

    def forward(self, x: torch.Tensor, act: str | None = None) -> torch.Tensor:
        """act="silu_mul": x is [gate | up] and the product takes silu(gate) * up (fused where it pays)."""
        if act not in (None, "silu_mul"):
            raise ValueError(f"RowParallelLinear: unknown act {act!r}")
        matmul = silu_mul_linear if act == "silu_mul" else linear
        if self.tp_size == 1:
            return matmul(x, self.weight, self.bias)
        y = tensor_model_parallel_all_reduce(matmul(x, self.weight), self.parallel)
        return y if self.bias is None else y + self.bias
