"""Executors: how the engine core reaches its workers. `get_executor_class` maps
`--distributed-executor-backend` (resolved in ParallelConfig) to a class; implementations are imported lazily."""
from __future__ import annotations

from tokenmill.config import TokenmillConfig


def get_executor_class(config: TokenmillConfig) -> type:
    pc = config.parallel_config
    backend = pc.distributed_executor_backend
    if pc.world_size == 1 and backend in ("uni", "mp", "ray"):
        # mp or ray with one rank has no worker to start: rank 0, in this process, is the whole world.
        from tokenmill.executor.uniproc import UniProcExecutor
        return UniProcExecutor
    if backend == "mp":
        from tokenmill.executor.multiproc import MultiprocExecutor
        return MultiprocExecutor
    if backend == "ray":
        from tokenmill.executor.ray_executor import RayExecutor
        return RayExecutor
    if backend == "external_launcher":
        from tokenmill.executor.uniproc import ExternalLauncherExecutor
        return ExternalLauncherExecutor
    raise ValueError(f"distributed_executor_backend={backend!r} is not supported yet by tokenmill "
                     f"(world size {pc.world_size}); use uni, mp, ray or external_launcher.")
