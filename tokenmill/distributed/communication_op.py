"""Collectives the parallel layers and the worker use. Each is the identity in a world of one rank.

Each takes the ParallelState to communicate in; None means the current one (`use_parallel_state`). Layers pass the
state they were built with, so what runs never depends on which state is current at call time.
"""
from __future__ import annotations

import torch

from tokenmill.distributed.parallel_state import ParallelState, get_parallel_state


def tensor_model_parallel_all_reduce(x: torch.Tensor, state: ParallelState | None = None) -> torch.Tensor:
    """The sum of `x` over the TP group: a new tensor from the one-shot kernel for small CUDA tensors (see
    symm_all_reduce.py), otherwise `x` itself, summed in place by NCCL / gloo. Use the return value."""
    st = state or get_parallel_state()
    if st.tp_size == 1:
        return x
    fast = st.tp_fast_all_reduce
    if fast is not None and fast.can_reduce(x):
        return fast.reduce(x)
    import torch.distributed as dist
    dist.all_reduce(x, group=st.tp_group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1,
                                     state: ParallelState | None = None) -> torch.Tensor:
    """Concatenate every TP rank's `x` along `dim` (rank order); every rank gets the whole result."""
    st = state or get_parallel_state()
    if st.tp_size == 1:
        return x
    import torch.distributed as dist
    dim = dim % x.dim()
    x = x.contiguous()
    if st.backend == "nccl":
        # One gather into a [tp, *x.shape] buffer, then move the rank axis next to `dim`.
        out = torch.empty((st.tp_size, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=st.tp_group)
        out = out.movedim(0, dim)
        return out.reshape(*x.shape[:dim], st.tp_size * x.shape[dim], *x.shape[dim + 1:])
    parts = [torch.empty_like(x) for _ in range(st.tp_size)]
    dist.all_gather(parts, x, group=st.tp_group)  # gloo has no all_gather_into_tensor
    return torch.cat(parts, dim=dim)


def world_min(value: int, state: ParallelState | None = None) -> int:
    """The minimum of an integer over every rank, agreed on the CPU group (no device sync)."""
    st = state or get_parallel_state()
    if st.world_size == 1:
        return value
    import torch.distributed as dist
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=st.world_cpu_group)
    return int(t.item())
