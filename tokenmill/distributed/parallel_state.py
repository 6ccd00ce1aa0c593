"""Process groups for tensor and pipeline parallelism, and the rank/size queries layers use.

Ranks are laid out tensor-parallel first: world rank = pp_rank * tp_size + tp_rank, so one pipeline stage's TP
group is a contiguous block of ranks (on one host, contiguous GPUs). Each group has a device group (NCCL on CUDA,
gloo on CPU) for activations and a gloo CPU group for small host-side agreements (e.g. the KV block count).

`init_distributed` returns a ParallelState; it is not installed globally. A worker builds its model inside
`use_parallel_state(state)`, and the parallel layers keep the state they were built with, so a one-rank engine
built later in the same process (the current state is then the one-rank default) neither shards nor communicates.
A world of size 1 creates no process group at all and the communication ops return their input untouched, so the
single-process path pays nothing.
"""
from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.logger import init_logger

logger = init_logger(__name__)


@dataclass
class ParallelState:
    """Where this process sits in the world. Groups are None when the world has one rank."""
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    backend: str | None = None
    tp_group: Any = None        # device group of this rank's TP group
    tp_cpu_group: Any = None    # gloo group over the same ranks
    pp_group: Any = None
    pp_cpu_group: Any = None
    world_cpu_group: Any = None  # gloo group over every rank
    owns_world: bool = False     # we called init_process_group (so we destroy it), vs. joined the caller's world
    tp_fast_all_reduce: Any = None  # SymmetricAllReduce for small TP all-reduces on CUDA, None: NCCL only


_SINGLE = ParallelState()
_STATE = _SINGLE  # the state layers see while they are built (see use_parallel_state)


@contextlib.contextmanager
def use_parallel_state(state: ParallelState):
    """Make `state` the one `get_tp_size()` and friends answer from, e.g. while a worker builds its model."""
    global _STATE
    prev, _STATE = _STATE, state
    try:
        yield state
    finally:
        _STATE = prev


def get_parallel_state() -> ParallelState:
    return _STATE


def get_tp_size() -> int:
    return _STATE.tp_size


def get_tp_rank() -> int:
    return _STATE.tp_rank


def get_pp_size() -> int:
    return _STATE.pp_size


def get_pp_rank() -> int:
    return _STATE.pp_rank


def get_tp_group():
    return _STATE.tp_group


def get_world_cpu_group():
    return _STATE.world_cpu_group


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(world_size: int, rank: int, local_rank: int, *, tp_size: int, pp_size: int = 1,
                     backend: str | None = None, device: torch.device | None = None,
                     init_method: str = "env://", timeout_s: float | None = None,
                     adopt_existing: bool = False) -> ParallelState:
    """Join the world and build the TP and PP groups (every rank must call this with the same sizes).

    backend: None picks NCCL for a CUDA `device`, gloo otherwise. init_method: "env://" (torchrun's MASTER_ADDR/
    MASTER_PORT) or "tcp://host:port". timeout_s: None keeps torch's default. adopt_existing: a world the caller
    already initialized (a torchrun script that set up torch.distributed itself) is joined instead of refused; it
    must have the same size and this rank. A world of size 1 only records the local rank and returns.
    """
    if tp_size * pp_size != world_size:
        raise ValueError(f"tensor_parallel_size {tp_size} x pipeline_parallel_size {pp_size} = {tp_size * pp_size} "
                         f"does not equal the world size {world_size}.")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size} ranks.")
    if world_size == 1:
        return ParallelState(local_rank=local_rank)
    import torch.distributed as dist
    device = device or torch.device("cpu")
    backend = backend or default_backend(device)
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
    owns_world = not dist.is_initialized()
    if not owns_world:
        if not adopt_existing:
            raise RuntimeError("torch.distributed is already initialized in this process; one tokenmill engine with "
                               "tensor parallelism can live in a process at a time (shut the other one down first).")
        if (dist.get_world_size(), dist.get_rank()) != (world_size, rank):
            raise ValueError(f"The existing torch.distributed world has size {dist.get_world_size()} and this "
                             f"process is rank {dist.get_rank()}, but the engine needs size {world_size}, rank "
                             f"{rank}.")
        backend = dist.get_backend()
    else:
        if backend == "nccl":
            # NVLink multicast (NVLS) stays off, as the device rules require; a user's explicit setting wins.
            from tokenmill import envs
            os.environ.setdefault(envs.NCCL_NVLS_ENABLE_NAME, "0")
            os.environ.setdefault(envs.TORCH_SYMM_MEM_DISABLE_MULTICAST_NAME, "1")
        kwargs: dict[str, Any] = dict(backend=backend, init_method=init_method, world_size=world_size, rank=rank)
        if timeout is not None:
            kwargs["timeout"] = timeout
        if backend == "nccl":
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)

    def new_group(ranks: list[int], group_backend: str):
        return dist.new_group(ranks, backend=group_backend, timeout=timeout)

    # Every rank creates every group, in the same order (torch requires it), and keeps the ones it belongs to. A
    # group spanning the whole world reuses the world's communicators instead of opening more.
    world = list(range(world_size))
    world_cpu = dist.group.WORLD if backend == "gloo" else new_group(world, "gloo")
    state = ParallelState(world_size=world_size, rank=rank, local_rank=local_rank, tp_size=tp_size,
                          tp_rank=rank % tp_size, pp_size=pp_size, pp_rank=rank // tp_size, backend=backend,
                          world_cpu_group=world_cpu, owns_world=owns_world)

    def groups(ranks: list[int]):
        if ranks == world:
            return dist.group.WORLD, world_cpu
        dev = new_group(ranks, backend)
        return dev, (dev if backend == "gloo" else new_group(ranks, "gloo"))

    for stage in range(pp_size):
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        dev, cpu = groups(ranks)
        if rank in ranks:
            state.tp_group, state.tp_cpu_group = dev, cpu
    for tp_rank in range(tp_size):
        ranks = list(range(tp_rank, world_size, tp_size))
        dev, cpu = groups(ranks)
        if rank in ranks:
            state.pp_group, state.pp_cpu_group = dev, cpu
    logger.info("Rank %d/%d joined (%s): tp rank %d/%d, pp rank %d/%d", rank, world_size, backend, state.tp_rank,
                tp_size, state.pp_rank, pp_size)
    return state


def destroy_distributed(state: ParallelState | None) -> None:
    """Leave the world `state` belongs to: all of it when we created it, only our subgroups in an adopted one.
    None means rank 0 never finished joining: a world initialized meanwhile is then the one this engine started.
    Safe to call more than once."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return
    if state is not None and state.world_size <= 1:
        return
    if state is not None and state.owns_world and state.backend == "nccl":
        _forget_nccl_world()
        return
    if state is None or state.owns_world:
        groups = [None]
    else:
        groups = {id(g): g for g in (state.tp_group, state.tp_cpu_group, state.pp_group, state.pp_cpu_group,
                                     state.world_cpu_group) if g is not None and g is not dist.group.WORLD}.values()
    for g in groups:
        try:
            dist.destroy_process_group(g)
        except Exception as e:  # a peer already gone can make teardown fail; we are leaving anyway
            logger.debug("destroy_process_group: %s", e)


def drop_group_handles(state: ParallelState | None) -> None:
    """After destroy_distributed: release the state's handles on its groups, so their C++ objects go now and join
    their gloo run-loop threads (torch releases the GIL for that). Left to the interpreter's teardown, a run-loop
    thread still releasing a finished collective's tensors needs the GIL while Python finalizes, and that aborts
    the process ("terminate called without an active exception", seen under torchrun on a loaded 2-core machine).
    Only for a rank whose peers have passed a barrier with it: closing the connections under a peer still in a
    collective would fail that peer."""
    if state is None:
        return
    state.tp_group = state.tp_cpu_group = state.pp_group = state.pp_cpu_group = state.world_cpu_group = None
    state.tp_fast_all_reduce = None


def _forget_nccl_world() -> None:
    """Leave an NCCL world this engine created without tearing its communicators down.

    After CUDA graphs have captured NCCL collectives, both destroy_process_group and _abort_process_group hang on
    every rank (pytorch/pytorch#115388; both ranks of a TP=2 engine stuck in them on the H200). The world is
    unregistered the way torch's own teardown does it, so a later engine in this process can init a new one; the
    old groups are never freed (their destructors would block the same way, at the latest when the interpreter
    exits) and go with the process."""
    import ctypes

    import torch.distributed as dist
    c10d = dist.distributed_c10d
    w = c10d._world
    for pg in list(w.pg_map.keys()):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))
    try:
        c10d._update_default_pg(None)
        for table in (w.pg_map, w.pg_names, w.pg_group_ranks, w.pg_backend_config, w.pg_to_tag, w.tags_to_pg,
                      w.pg_coalesce_state):
            table.clear()
        c10d._unregister_all_process_groups()
        w.group_count = 0
    except Exception as e:  # private torch internals: if they moved, leave the world registered
        logger.warning("Could not unregister the NCCL process groups: %s", e)


def abort_distributed(state: ParallelState | None) -> None:
    """Unblock collectives stuck on a dead peer. gloo fails by itself when a peer's socket closes; NCCL would wait
    for its timeout, so its communicators are aborted (best effort: the engine is stopping)."""
    if state is None or state.world_size <= 1 or state.backend != "nccl":
        return
    import torch.distributed as dist
    try:
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None:
            abort()
    except Exception as e:
        logger.warning("Aborting the NCCL process group failed: %s", e)
