"""Linear layers that own their tensor-parallel split, their weight loading and a pluggable weight format.

Every layer is a `LinearBase`: it asks its `LinearMethod` (tokenmill/layers/quantization) to create the weight
parameters, keeps the bias itself, and computes `method.apply(x)` plus, when one is attached, a per-row output delta
(what multi-LoRA adds) without the model file knowing. Model code calls the layer, never a weight or a kernel.

Each parameter carries a `weight_loader(param, loaded, shard_id=None)` that takes the *full* checkpoint tensor and
copies this rank's slice; parameters say along which dims their output and input features lie (`output_dim`,
`input_dim`, see quantization/base.py), so a format's extra tensors (scales, zero points) load through the same
code as dense weights. Models only declare which checkpoint names pack into which stacked parameter (q/k/v ->
qkv_proj, gate/up -> gate_up_proj; tokenmill/models/weight_mapping.py). A sharded parameter also carries
`full_shape`, its shape with one rank, so the dummy loader can draw the full tensor and shard it exactly like a
checkpoint (TP=N runs TP=1's weights). A layer keeps the parallel state current when it was built and communicates
in that.

Column-parallel layers split the output dim and need no communication; row-parallel layers split the input dim and
sum the partial outputs with one all-reduce. With one rank every layer is a plain product.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from tokenmill.distributed import divide, get_parallel_state, get_tp_size, kv_heads_per_rank
from tokenmill.distributed.communication_op import tensor_model_parallel_all_reduce
from tokenmill.layers.quantization.base import LinearMethod, LinearShape, QuantizationConfig
from tokenmill.layers.quantization.unquantized import UnquantizedLinearMethod

# delta(x, y) adds this layer's extra output for input rows x into y in place (y = x W^T + b on this rank). A delta
# with a `prepare(x)` method gets x before the product runs too, to start the work that needs only x beside it.
OutputDelta = Callable[[torch.Tensor, torch.Tensor], None]


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


def _scaled(n: int, extent: int, features: int, what: str) -> int:
    """n features expressed in a parameter dim that holds `extent` entries for `features` features."""
    if (n * extent) % features:
        raise ValueError(f"{what}: {n} of {features} features do not map onto whole entries of a dim of {extent}.")
    return n * extent // features


class LinearBase(nn.Module):
    """y = x W^T + b for this rank's shard, W in the format of `quant_method`.

    Contract: subclasses fix the split (`LinearShape`) and implement `weight_loader`; the method creates the
    weight parameters; `process_weights_after_loading()` is called once by the model loader after every tensor
    landed. `set_output_delta(fn)` attaches a delta that is added to this rank's product (before any
    communication) for every call. With a delta the fused norm / activation kernels are not used, so the delta
    sees the very input the product sees (and the SiLU epilogue of a [gate | up] product would come before the
    delta must land). Recomputing the norm or SiLU inside the delta's own kernel instead, to keep the fused
    product, measured slower: an 8B shape's bs1 decode with one rank-16 adapter took 7.38 ms against 6.80 unfused
    (H100; 6.18 without LoRA).
    """

    def __init__(self, shape: LinearShape, bias: bool, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.parallel = get_parallel_state()
        self.tp_size, self.tp_rank = self.parallel.tp_size, self.parallel.tp_rank
        self.shape, self.prefix = shape, prefix
        self.in_features, self.out_features = shape.input_size, shape.output_size
        self.quant_method: LinearMethod = (quant_config.get_linear_method(prefix) if quant_config is not None
                                           else UnquantizedLinearMethod())
        self.quant_method.create_weights(self, shape, torch.get_default_dtype())
        for p in self.parameters(recurse=False):
            self._prepare_param(p)
        self.bias = None
        if bias:  # split like the output features, except where the output is summed over ranks (row-parallel)
            self.bias = nn.Parameter(torch.zeros(shape.output_size_per_rank), requires_grad=False)
            self.bias.output_dim = None if self.sums_over_ranks else 0
            self._prepare_param(self.bias)
        self.output_delta: OutputDelta | None = None

    # True where each rank's product is a partial sum over its input slice (then all-reduced).
    sums_over_ranks = False

    def _prepare_param(self, p: nn.Parameter) -> None:
        if not hasattr(p, "weight_loader"):
            p.weight_loader = self.weight_loader
        full = list(p.shape)
        out_dim, in_dim = getattr(p, "output_dim", None), getattr(p, "input_dim", None)
        s = self.shape
        if out_dim is not None:
            full[out_dim] = _scaled(s.output_size, p.shape[out_dim], s.output_size_per_rank, self.prefix)
        if in_dim is not None:
            full[in_dim] = _scaled(s.input_size, p.shape[in_dim], s.input_size_per_rank, self.prefix)
        p.full_shape = torch.Size(full)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    def set_output_delta(self, delta: OutputDelta | None) -> None:
        self.output_delta = delta

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        delta = self.output_delta
        if delta is None:
            return self.quant_method.apply(self, x, bias)
        prepare = getattr(delta, "prepare", None)
        if prepare is not None:
            prepare(x)
        y = self.quant_method.apply(self, x, bias)
        delta(x, y)
        return y


class ColumnParallelLinear(LinearBase):
    """y = x W^T + b with W's output rows split evenly over the TP ranks; each rank returns its slice of y."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, out_per_rank: int | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 out_sizes_per_rank: tuple[int, ...] | None = None) -> None:
        if out_per_rank is None:
            out_per_rank = divide(out_features, get_tp_size(), "output size of a column-parallel layer")
        sizes = out_sizes_per_rank if out_sizes_per_rank is not None else (out_per_rank,)
        super().__init__(LinearShape(in_features, tuple(sizes), in_features, out_features), bias, quant_config, prefix)
        self.out_per_rank = out_per_rank

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        dim = getattr(param, "output_dim", None)
        if self.tp_size > 1 and dim is not None:
            size = param.shape[dim]
            loaded = loaded.narrow(dim, self.tp_rank * size, size)
        _copy_checked(param.data, loaded, type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._product(x, self.bias)

    def forward_norm(self, x: torch.Tensor, residual: torch.Tensor | None, norm) -> tuple[torch.Tensor, torch.Tensor]:
        """self(norm(x + residual)) and x + residual (x when residual is None), the norm fused in where it pays."""
        delta = self.output_delta
        if delta is None:
            return self.quant_method.apply_norm(self, x, residual, norm, self.bias)
        h, residual = (norm(x), x) if residual is None else norm(x, residual)
        return self._product(h, self.bias), residual


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input stacked along the output dim (gate/up): each rank holds
    its slice of every projection, in order. Checkpoint tensors arrive per projection (`shard_id`) or fused."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 shard_names: list | None = None, rank_sizes: list[int] | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        names = shard_names if shard_names is not None else list(range(len(out_sizes)))
        if rank_sizes is None:
            tp = get_tp_size()
            rank_sizes = [divide(s, tp, f"output size of shard {n!r}") for n, s in zip(names, out_sizes)]
        # shard id -> (offset in this rank's output features, features here, features in the checkpoint tensor)
        self.shards, o = {}, 0
        for name, full, here in zip(names, out_sizes, rank_sizes):
            self.shards[name] = (o, here, full)
            o += here
        super().__init__(in_features, sum(out_sizes), bias, out_per_rank=sum(rank_sizes), quant_config=quant_config,
                         prefix=prefix, out_sizes_per_rank=tuple(rank_sizes))

    def shard_start(self, shard_id) -> int:
        """First checkpoint output feature of `shard_id` that this rank holds."""
        return self.tp_rank * self.shards[shard_id][1]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        dim = getattr(param, "output_dim", None)
        if dim is None:  # replicated (a scale shared by every slot)
            _copy_checked(param.data, loaded, type(self).__name__)
            return
        extent, here_total = param.shape[dim], self.out_per_rank
        if shard_id is None:  # a fused checkpoint tensor: split it in the one-rank layout, then shard each part
            full_total = sum(full for _, _, full in self.shards.values())
            sizes = [_scaled(full, loaded.shape[dim], full_total, self.prefix) for _, _, full in self.shards.values()]
            for sid, piece in zip(self.shards, loaded.split(sizes, dim=dim)):
                self.weight_loader(param, piece, sid)
            return
        offset, here, full = self.shards[shard_id]
        expected = _scaled(full, extent, here_total, self.prefix) if here_total else 0
        if loaded.shape[dim] != expected:
            raise ValueError(f"Shard {shard_id!r}: checkpoint has {loaded.shape[dim]} rows, expected {expected}.")
        scale = lambda n: _scaled(n, extent, here_total, f"shard {shard_id!r}")  # noqa: E731
        _copy_checked(param.data.narrow(dim, scale(offset), scale(here)),
                      loaded.narrow(dim, scale(self.shard_start(shard_id)), scale(here)), f"shard {shard_id!r}")

    def forward_norm_silu(self, x: torch.Tensor, residual: torch.Tensor | None, norm,
                          down: RowParallelLinear) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a [gate | up] projection: (silu(gate) * up of norm(x + residual), x + residual) with the SiLU in the
        product's epilogue, or None where that does not pay (then call forward_norm and down(..., act="silu_mul"))."""
        if self.output_delta is not None:
            return None
        return self.quant_method.apply_norm_silu(self, x, residual, norm, self.bias, down)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections fused, attention heads split over the TP ranks.

    Query heads divide evenly. KV heads divide evenly too when there are at least as many as ranks; otherwise each
    rank holds one KV head, replicated over the tp_size / num_kv_heads ranks whose query heads use it. `num_heads`
    and `num_kv_heads` are this rank's counts.
    """

    def __init__(self, hidden: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        tp = get_tp_size()
        num_heads = divide(total_num_heads, tp, "num_attention_heads")
        num_kv_heads = kv_heads_per_rank(total_num_kv_heads, tp)
        q_full, kv_full = total_num_heads * head_dim, total_num_kv_heads * head_dim
        q_here, kv_here = num_heads * head_dim, num_kv_heads * head_dim
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, num_heads, num_kv_heads
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.kv_replicas = max(tp // total_num_kv_heads, 1)
        super().__init__(hidden, [q_full, kv_full, kv_full], bias, shard_names=["q", "k", "v"],
                         rank_sizes=[q_here, kv_here, kv_here], quant_config=quant_config, prefix=prefix)

    def shard_start(self, shard_id) -> int:
        if shard_id == "q":
            return self.tp_rank * self.num_heads * self.head_dim
        return (self.tp_rank // self.kv_replicas) * self.num_kv_heads * self.head_dim


class RowParallelLinear(LinearBase):
    """y = x W^T + b with W's input columns split over the TP ranks: each rank multiplies its slice of x, one
    all-reduce sums the partial products, and the (replicated) bias is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        in_per_rank = divide(in_features, get_tp_size(), "input size of a row-parallel layer")
        super().__init__(LinearShape(in_per_rank, (out_features,), in_features, out_features), bias, quant_config,
                         prefix)
        self.in_per_rank = in_per_rank

    sums_over_ranks = True

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        dim = getattr(param, "input_dim", None)
        if self.tp_size > 1 and dim is not None:
            size = param.shape[dim]
            loaded = loaded.narrow(dim, self.tp_rank * size, size)
        _copy_checked(param.data, loaded, type(self).__name__)

    def forward(self, x: torch.Tensor, act: str | None = None) -> torch.Tensor:
        """act="silu_mul": x is [gate | up] and the product takes silu(gate) * up (fused where it pays)."""
        if act not in (None, "silu_mul"):
            raise ValueError(f"RowParallelLinear: unknown act {act!r}")
        delta = self.output_delta
        if act == "silu_mul" and delta is not None:
            from tokenmill.layers.activation import silu_and_mul
            x, act = silu_and_mul(x), None
        bias = self.bias if self.tp_size == 1 else None
        if act == "silu_mul":
            y = self.quant_method.apply_silu_mul(self, x, bias)
        else:
            y = self._product(x, bias)
        if self.tp_size == 1:
            return y
        y = tensor_model_parallel_all_reduce(y, self.parallel)
        return y if self.bias is None else y + self.bias
