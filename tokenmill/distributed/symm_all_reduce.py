"""One-shot all-reduce of small tensors through torch's symmetric memory, for the TP group of one host's GPUs.

Why: at decode batch sizes each all-reduce carries a few KB to a few hundred KB (tokens x hidden), where NCCL's ring
protocol is latency-bound and a Llama-3-8B step makes 65 of them. The one-shot kernel copies the local input into a
buffer every rank can address over NVLink, meets its peers at a device-side barrier, and has each rank read every
peer's buffer and sum: one kernel per all-reduce, no host involvement, so it is captured in CUDA graphs like any
other kernel. Larger tensors (prefill chunks) stay on NCCL, whose bandwidth wins there.

Only the peer-to-peer ("one-shot") kernels are used: NVLink multicast (multimem) stays off, as the device rules
require; `enable_symmetric_all_reduce` sets TORCH_SYMM_MEM_DISABLE_MULTICAST=1 unless the user chose otherwise.
"""
from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from tokenmill import envs
from tokenmill.logger import init_logger

logger = init_logger(__name__)

# Above this the one-shot kernel's all-to-all reads lose to NCCL's ring (vLLM's custom all-reduce and SGLang draw
# their one-shot lines at 256 KB-1 MB for two to eight GPUs). 512 tokens x 4096 x bf16 = 4 MB does not qualify;
# decode batches of up to 128 tokens at hidden 4096 (1 MB) do.
MAX_BYTES = 1 << 20
_DTYPES = (torch.float32, torch.bfloat16)  # what torch's one-shot kernel dispatches on
_ALIGN = 16


class SymmetricAllReduce:
    """Sums tensors of at most MAX_BYTES over a process group's GPUs with one kernel.

    Check-then-act: `can_reduce(x)` says whether `reduce(x)` applies; the decision depends only on x's size,
    dtype and device, so every rank of the group takes the same path for the same collective. `reduce` is a
    collective: all ranks call it in the same order with equally shaped tensors. It returns a new tensor.
    """

    def __init__(self, group: Any, device: torch.device, max_bytes: int = MAX_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem
        self.group_name: str = group.group_name
        self.device = device
        self.max_bytes = max_bytes
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None and not symm_mem.is_symm_mem_enabled_for_group(self.group_name):
            with warnings.catch_warnings():  # needed before torch 2.9, a deprecated no-op since
                warnings.simplefilter("ignore", FutureWarning)
                enable(self.group_name)
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)
        ops = torch.ops.symm_mem
        self._copy_op = getattr(ops, "one_shot_all_reduce_copy", None)
        self._op = ops.one_shot_all_reduce

    def can_reduce(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return (x.device == self.device and x.dtype in _DTYPES and x.is_contiguous()
                and 0 < nbytes <= self.max_bytes and nbytes % _ALIGN == 0)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        staged = self.buffer[:x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        if self._copy_op is not None:  # copy-in fused into the reduce kernel
            return self._copy_op(staged, x, "sum", self.group_name)
        staged.copy_(x)
        return self._op(staged, "sum", self.group_name)


def group_hosts(cpu_group: Any) -> set[str]:
    """The host names of a group's ranks (a collective over the gloo group)."""
    import socket

    import torch.distributed as dist
    hosts: list[Any] = [None] * dist.get_world_size(cpu_group)
    dist.all_gather_object(hosts, socket.gethostname(), group=cpu_group)
    return set(hosts)


def enable_symmetric_all_reduce(group: Any, cpu_group: Any, device: torch.device) -> SymmetricAllReduce | None:
    """The one-shot all-reduce for `group` (every rank of it must call this together), or None where it cannot
    run: not CUDA, a torch without symmetric memory, or a failed set-up (e.g. GPUs without peer access) on any
    rank. The ranks agree over `cpu_group` (gloo), so they never take different paths. None keeps NCCL for every
    all-reduce, which is always correct."""
    if device.type != "cuda":
        return None
    import torch.distributed as dist
    os.environ.setdefault(envs.TORCH_SYMM_MEM_DISABLE_MULTICAST_NAME, "1")
    hosts = group_hosts(cpu_group)
    if len(hosts) > 1:  # peer-to-peer loads need every rank's GPU on this host
        logger.info("TP group spans %d hosts: NCCL for every all-reduce.", len(hosts))
        return None
    ar: SymmetricAllReduce | None = None
    try:
        ar = SymmetricAllReduce(group, device)
    except Exception as e:  # noqa: BLE001 - any failure here only costs speed
        logger.warning("Symmetric-memory all-reduce unavailable (%s: %s); using NCCL for every all-reduce.",
                       type(e).__name__, e)
    ok = torch.tensor([int(ar is not None)], dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=cpu_group)
    if not int(ok.item()):
        return None
    assert ar is not None
    logger.info("One-shot symmetric-memory all-reduce on for tensors up to %d KiB (NCCL above).",
                ar.max_bytes >> 10)
    return ar
