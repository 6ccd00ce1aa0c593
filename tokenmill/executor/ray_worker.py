"""A worker rank as a Ray actor. Imports ray at import time: only the ray executor imports this module, after
`ray_utils.import_ray()` has checked that Ray is installed."""
from __future__ import annotations

import os
import threading
import traceback
from typing import Any

import ray

from tokenmill.logger import init_logger

logger = init_logger(__name__)


@ray.remote(concurrency_groups={"watch": 1})
class RayWorkerActor:
    """Hosts one rank's Worker (ranks 1..N-1), or only holds rank 0's reserved bundle (never given a worker).

    Contract: methods of the default group run one at a time in the order the executor sent them (Ray keeps a
    caller's order for a single-threaded actor), which is what keeps every rank's collectives in step. `watch`
    runs in its own thread: it returns the traceback once any call of this actor has failed, and its result
    turns into an ActorDiedError if the actor dies, so the executor learns of either at once. After a failure the
    actor is useless (its rank is out of step) and is killed by the executor.
    """

    def __init__(self) -> None:
        self.worker = None
        self._failed = threading.Event()
        self._error: str | None = None

    def placement(self) -> tuple[str, str, list[str], int]:
        """(node id, node IP, GPU ids Ray gave this actor, pid)."""
        return (ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(),
                [str(g) for g in ray.get_gpu_ids()], os.getpid())

    def init_worker(self, config, rank: int, local_rank: int, init_method: str,
                    visible_devices: str | None) -> None:
        """Join the world as `rank` (blocks until every rank has joined)."""
        if visible_devices is not None:
            # Before CUDA initializes in this process: the ranks of a node see the same GPUs, so NCCL finds its
            # peers on the node and `local_rank` indexes this rank's own GPU.
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
        from tokenmill.worker.worker import Worker
        self._guarded(lambda: setattr(self, "worker", Worker(config, rank=rank, local_rank=local_rank,
                                                             distributed_init_method=init_method)))

    def execute_method(self, method: str, args: tuple, kwargs: dict) -> None:
        """Run `Worker.<method>`; the result stays here (rank 0's is the one the executor returns)."""
        self._guarded(lambda: getattr(self.worker, method)(*args, **kwargs))

    def _guarded(self, fn) -> Any:
        try:
            return fn()
        except BaseException:
            self._error = traceback.format_exc()
            logger.error("Worker rank %s failed:\n%s", getattr(self.worker, "rank", "?"), self._error)
            self._failed.set()
            raise

    @ray.method(concurrency_group="watch")
    def watch(self) -> str | None:
        self._failed.wait()
        return self._error

    def shutdown(self) -> None:
        """Leave the process groups (the executor kills the actor afterwards)."""
        if self.worker is not None:
            from tokenmill.distributed import destroy_distributed
            destroy_distributed(self.worker.parallel_state)
