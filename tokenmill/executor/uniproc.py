"""Executors with one worker in this process: `uni` (a world of one rank) and `external_launcher` (torchrun
started one process per rank, and each runs its own engine core)."""
from __future__ import annotations

import time
import weakref
from typing import Any

from tokenmill import envs
from tokenmill.config import TokenmillConfig
from tokenmill.executor.abstract import Executor
from tokenmill.worker.worker import Worker


class UniProcExecutor(Executor):
    """Runs every call on the one local worker (world size 1: no process group, no communication)."""

    def __init__(self, config: TokenmillConfig) -> None:
        super().__init__(config)
        self.worker = self._make_worker(config)
        self.worker.load_model()

    def _make_worker(self, config: TokenmillConfig) -> Worker:
        return Worker(config)

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)


class ExternalLauncherExecutor(UniProcExecutor):
    """For `torchrun --nproc-per-node N script.py`: this process is one rank of a world torchrun set up.

    Every process runs its own engine core; the scheduler is deterministic and every rank samples the same ids
    (see `tokenmill.executor.abstract`), so all ranks schedule identical steps and their collectives line up
    without any message between engine cores. Under pipeline parallelism the last stage's output is broadcast to
    every rank when a step's handle is resolved (see pp_output), so every engine core sees it. The worker joins
    the world from torchrun's RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT.
    """

    def _make_worker(self, config: TokenmillConfig) -> Worker:
        pc = config.parallel_config
        missing = [n for n in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
                   if getattr(envs, n) is None]
        if missing:
            raise RuntimeError(f"distributed_executor_backend='external_launcher' needs torchrun's environment, but "
                               f"{', '.join(missing)} is not set. Start the script with torchrun "
                               f"--nproc-per-node {pc.world_size} (or python -m torch.distributed.run).")
        rank, local_rank, world = int(envs.RANK), int(envs.LOCAL_RANK), int(envs.WORLD_SIZE)
        if world != pc.world_size:
            raise ValueError(f"torchrun started {world} processes (WORLD_SIZE) but tensor_parallel_size x "
                             f"pipeline_parallel_size = {pc.world_size}; they must be equal.")
        if config.device_config.device == "cuda":
            import torch
            found = torch.cuda.device_count()
            if local_rank >= found:
                raise ValueError(f"Rank {rank} has LOCAL_RANK {local_rank}, but torch sees {found} CUDA devices on "
                                 f"this node; start at most {found} processes per node.")
        self.rank = rank
        return Worker(config, rank=rank, local_rank=local_rank, distributed_init_method="env://")

    def __init__(self, config: TokenmillConfig) -> None:
        super().__init__(config)
        # Leave the process groups before the interpreter tears down: a gloo group left alive at exit can abort
        # the process while its peers disconnect.
        self._finalizer = weakref.finalize(self, _leave_world, self.worker.parallel_state,
                                           getattr(self.worker.runner, "link", None))

    def shutdown(self) -> None:
        self._finalizer()


def _leave_world(state, link=None) -> None:
    """Every rank waits for the others before any tears its groups down, so none disconnects under a peer that is
    still using them (best effort: a dead peer makes the barrier fail, and we are leaving anyway)."""
    from tokenmill.distributed.parallel_state import destroy_distributed, drop_group_handles
    if state is not None and state.world_size > 1 and state.world_cpu_group is not None:
        import torch.distributed as dist
        try:
            if dist.is_initialized():
                dist.barrier(group=state.world_cpu_group)
                if link is not None:  # every stage has received all it will: the sends are done or finishing
                    link.drain()
        except Exception:
            pass
        # The gloo run-loop threads release each finished collective's tensors after its waiter returns, and that
        # needs the GIL: let them have it now rather than at the interpreter's teardown.
        time.sleep(0.05)
    destroy_distributed(state)
    drop_group_handles(state)
