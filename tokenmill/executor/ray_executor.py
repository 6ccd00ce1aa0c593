"""The `ray` executor: rank 0 runs in the engine core's process, ranks 1..N-1 are Ray actors placed on the nodes of
a Ray cluster (one placement-group bundle per rank, PACK strategy), so tensor parallelism can span hosts.

Per step, `execute_model` and `sample_tokens` are sent fire-and-forget to every actor (Ray runs one caller's
calls to an actor in order) and then run by rank 0 itself; nothing comes back from the actors. A monitor thread
waits on each actor's `watch` call and on the step calls in flight: when an actor dies or one of its calls fails,
it records which rank and how, aborts NCCL communicators and kills the other actors, so a collective in flight
fails instead of hanging and every later call raises an error naming the rank (the path the mp executor uses).
Start-up and other non-step calls wait for every actor and name the rank that failed.
"""
from __future__ import annotations

import collections
import threading
import weakref
from typing import Any

import torch

from tokenmill import envs
from tokenmill.config import TokenmillConfig
from tokenmill.config.parallel import DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT
from tokenmill.core.sched_output import GrammarOutput, SchedulerOutput
from tokenmill.distributed import ParallelState, abort_distributed, destroy_distributed, get_open_port
from tokenmill.executor.abstract import Executor, WorkerDiedError, call_while_healthy
from tokenmill.executor.ray_utils import (RAY_INSTALL_HINT, Placement, RaySession, assign_ranks, check_world_fits,
                                          cluster_nodes, import_ray, reserve_bundles)
from tokenmill.logger import init_logger
from tokenmill.worker.model_runner import AsyncRunnerOutput
from tokenmill.worker.worker import Worker

logger = init_logger(__name__)

_FAILURE_GRACE_S = 3.0  # how long rank 0, after its own call failed, waits for the monitor to name the dead rank
_DEFAULT_START_TIMEOUT_S = 600.0
_MONITOR_POLL_S = 0.1
_SHUTDOWN_GRACE_S = 5.0


class _ActorGroup:
    """The actors, the placement group and the monitor thread; holds no reference to the executor, so a forgotten
    executor is garbage-collected and its `weakref.finalize` releases the actors."""

    def __init__(self, ray, session: RaySession) -> None:
        self.ray, self.session = ray, session
        self.actors: list[Any] = []        # ranks 1..N-1, index = rank - 1
        self.info: list[Placement] = []    # where each of them runs
        self.pids: list[int] = []
        self.holder = None                 # the actor that only holds rank 0's bundle (CUDA)
        self.pg = None
        self.failure: str | None = None
        self.failed = threading.Event()
        self.closing = False
        self._lock = threading.Lock()
        self.submitted: collections.deque = collections.deque()  # (ref, rank, method) of step calls in flight
        self.monitor: threading.Thread | None = None
        self.owns_world = False
        self.parallel_state: ParallelState | None = None
        self.num_threads = torch.get_num_threads()  # rank 0's Worker narrows it on CPU; the host process keeps it

    def where(self, rank: int) -> str:
        p = self.info[rank - 1]
        return f"Tensor-parallel worker rank {rank} (Ray actor pid {self.pids[rank - 1]} on {p.ip})"

    def fail(self, rank: int, how: str, error: str | None = None) -> None:
        """Record the first failure, then stop every rank: a collective in flight must fail, not hang."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = f"{self.where(rank)} {how}; the engine has stopped." + (
                f"\nIts error:\n{error}" if error else "")
        logger.error("%s", self.failure)
        self.failed.set()
        abort_distributed(self.parallel_state)
        for a in self.actors:
            self._kill(a)

    def start_monitor(self, watch_refs: dict) -> None:
        self.monitor = threading.Thread(target=self._watch, args=(watch_refs,), name="tokenmill-ray-monitor",
                                        daemon=True)
        self.monitor.start()

    def _watch(self, watch_refs: dict) -> None:
        ray = self.ray
        pending: dict = {}
        while not self.closing and self.failure is None:
            while self.submitted:
                ref, rank, method = self.submitted.popleft()
                pending[ref] = (rank, method)
            refs = [*watch_refs, *pending]
            try:
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=_MONITOR_POLL_S, fetch_local=False)
            except Exception as e:  # Ray itself went away (interpreter exit, ray.shutdown)
                if not self.closing:
                    logger.warning("The Ray monitor stopped: %s", e)
                return
            for ref in ready:
                if ref in watch_refs:
                    rank, method = watch_refs[ref], None
                else:
                    rank, method = pending.pop(ref)
                try:
                    error = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    self.fail(rank, f"died ({_last_line(e)})")
                    return
                except Exception as e:  # a call failed before or after its body ran (e.g. unpickling)
                    self.fail(rank, f"failed in {method}", str(e))
                    return
                if method is None:  # watch returned: one of the actor's calls raised
                    self.fail(rank, "failed", error)
                    return

    def close(self) -> None:
        if self.closing:
            return
        self.closing = True
        ray = self.ray
        if self.monitor is not None:
            self.monitor.join(2 * _MONITOR_POLL_S + 1.0)
        try:
            if ray.is_initialized():
                if self.failure is None and self.actors:
                    refs = [a.shutdown.remote() for a in self.actors]
                    ray.wait(refs, num_returns=len(refs), timeout=_SHUTDOWN_GRACE_S)
                for a in [*self.actors, self.holder]:
                    if a is not None:
                        self._kill(a)
                if self.pg is not None:
                    from ray.util.placement_group import remove_placement_group
                    remove_placement_group(self.pg)
        except Exception as e:  # the cluster may be gone already; we are leaving anyway
            logger.debug("Releasing Ray actors: %s", e)
        if self.owns_world:
            destroy_distributed(self.parallel_state)
        torch.set_num_threads(self.num_threads)
        self.session.close()

    def _kill(self, actor) -> None:
        try:
            self.ray.kill(actor, no_restart=True)
        except Exception as e:
            logger.debug("ray.kill: %s", e)


def _last_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[-1] if lines else type(e).__name__


class RayExecutor(Executor):
    """Tensor parallelism over a Ray cluster: see the module docstring."""

    def __init__(self, config: TokenmillConfig) -> None:
        super().__init__(config)
        ray = import_ray()
        pc = config.parallel_config
        self.world_size = pc.world_size
        self._ray = ray
        self.group = _ActorGroup(ray, RaySession(ray))
        self._finalizer = weakref.finalize(self, self.group.close)
        self.group.session.connect(on_sigterm=self.group.close)
        start_timeout = float(pc.distributed_timeout_seconds or _DEFAULT_START_TIMEOUT_S)
        try:
            self._start(config, start_timeout)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, config: TokenmillConfig, timeout_s: float) -> None:
        from tokenmill.executor.ray_worker import RayWorkerActor
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        ray, group, pc = self._ray, self.group, config.parallel_config
        use_gpu = config.device_config.device == "cuda"
        bundle = {"GPU": 1.0, "CPU": 1.0} if use_gpu else {"CPU": 1.0}
        driver_node = ray.get_runtime_context().get_node_id()
        nodes = cluster_nodes(ray)
        # The address this node registered with Ray: what its `node:<ip>` resource and the other nodes know.
        driver_ip = next((n.ip for n in nodes if n.node_id == driver_node), None) or ray.util.get_node_ip_address()
        logger.info("Ray cluster: %s", "; ".join(f"{n.ip}: {n.resources.get('GPU', 0):g} GPU, "
                                                 f"{n.resources.get('CPU', 0):g} CPU" for n in nodes))
        check_world_fits(self.world_size, bundle, nodes, driver_node,
                         f"tensor_parallel_size {pc.tensor_parallel_size} x pipeline_parallel_size "
                         f"{pc.pipeline_parallel_size} = {self.world_size} ranks")
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            raise RuntimeError("This process already belongs to a torch.distributed world (another engine with "
                               "tensor parallelism?); one such engine can run per process at a time.")
        group.pg = reserve_bundles(ray, self.world_size, bundle, driver_ip, timeout_s)
        # NVLink multicast off unless the user set it
        env = {envs.NCCL_NVLS_ENABLE_NAME: envs.NCCL_NVLS_ENABLE or "0",
               envs.TORCH_SYMM_MEM_DISABLE_MULTICAST_NAME: envs.TORCH_SYMM_MEM_DISABLE_MULTICAST or "1"}

        def actor(bundle_index: int):
            return RayWorkerActor.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_restarts=0, max_task_retries=0,
                runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group.pg, placement_group_bundle_index=bundle_index)).remote()

        workers = [actor(i) for i in range(1, self.world_size)]
        if use_gpu:
            group.holder = actor(0)  # holds rank 0's GPU in Ray's books and tells us which one it is
        try:
            found = ray.get([a.placement.remote() for a in workers] +
                            ([group.holder.placement.remote()] if use_gpu else []), timeout=timeout_s)
        except Exception as e:
            raise RuntimeError(f"The Ray actors of ranks 1..{self.world_size - 1} did not start (is the same "
                               f"tokenmill installed on every node, e.g. {RAY_INSTALL_HINT}?): {e}") from e
        placements = [Placement(n, ip, gpus) for n, ip, gpus, _ in found]
        driver = placements.pop() if use_gpu else Placement(driver_node, driver_ip, [])
        rank0_local, assignments = assign_ranks(driver, placements[:len(workers)], envs.CUDA_VISIBLE_DEVICES)
        by_rank = sorted(range(len(workers)), key=lambda i: assignments[i].rank)
        group.actors = [workers[i] for i in by_rank]
        group.info = [placements[i] for i in by_rank]
        group.pids = [found[i][3] for i in by_rank]
        init_method = self._init_method(pc, driver_ip, all(p.node_id == driver_node for p in placements))
        watch_refs = {a.watch.remote(): rank for rank, a in enumerate(group.actors, start=1)}
        group.start_monitor(watch_refs)
        group.owns_world = True
        joins = [(rank, workers[i].init_worker.remote(config, rank, assignments[i].local_rank, init_method,
                                                     assignments[i].visible_devices))
                 for rank, i in enumerate(by_rank, start=1)]
        self.driver = call_while_healthy(
            lambda: Worker(config, rank=0, local_rank=rank0_local, distributed_init_method=init_method),
            timeout_s, "joining the process group", self.check_health)
        group.parallel_state = self.driver.parallel_state
        self._gather(joins, "init_worker")
        logger.info("Ray executor: rank 0 in this process on %s; ranks 1-%d as actors on %s", driver_ip,
                    self.world_size - 1, ", ".join(sorted({p.ip for p in group.info})))
        self.collective_rpc("load_model")

    @staticmethod
    def _init_method(pc, driver_ip: str, one_node: bool) -> str:
        if (pc.master_addr, pc.master_port) != (DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT):
            return f"tcp://{pc.master_addr}:{pc.master_port}"
        host = "127.0.0.1" if one_node else driver_ip  # loopback when no rank is off this host
        return f"tcp://{host}:{get_open_port(host)}"

    @property
    def actors(self) -> list[Any]:
        """The Ray actors of ranks 1..N-1, in rank order."""
        return self.group.actors

    def check_health(self) -> None:
        if self.group.failure is not None:
            raise WorkerDiedError(self.group.failure)

    def _check_usable(self) -> None:
        if self.group.failure is not None or self.group.closing:
            raise WorkerDiedError(self.group.failure or "The ray executor has been shut down.")

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run on every rank and wait for all of them (start-up and other rare calls)."""
        self._check_usable()
        refs = [(rank, a.execute_method.remote(method, args, kwargs))
                for rank, a in enumerate(self.group.actors, start=1)]
        result = self._run_local(method, args, kwargs)
        self._gather(refs, method)
        return result

    def execute_model(self, sched: SchedulerOutput) -> None:
        self._step_rpc("execute_model", sched)

    def sample_tokens(self, grammar: GrammarOutput | None) -> AsyncRunnerOutput:
        return self._step_rpc("sample_tokens", grammar)

    def _step_rpc(self, method: str, *args: Any) -> Any:
        """Per-step calls: no wait for the actors; the monitor collects their results in the background."""
        self._check_usable()
        submitted = self.group.submitted
        for rank, a in enumerate(self.group.actors, start=1):
            submitted.append((a.execute_method.remote(method, args, {}), rank, method))
        return self._run_local(method, args, {})

    def _run_local(self, method: str, args: tuple, kwargs: dict) -> Any:
        try:
            result = getattr(self.driver, method)(*args, **kwargs)
        except BaseException as e:
            # A collective broken by a dead peer raises RuntimeError here; name the rank that died instead.
            if isinstance(e, RuntimeError) and self.group.failed.wait(_FAILURE_GRACE_S):
                msg = self.group.failure
                self.shutdown()
                raise WorkerDiedError(msg) from e
            self.shutdown()  # the ranks are out of step now: the engine cannot continue
            raise
        if self.group.failure is not None:
            # A rank died during the call; aborted NCCL collectives may have let it finish on garbage.
            msg = self.group.failure
            self.shutdown()
            raise WorkerDiedError(msg)
        return result

    def _gather(self, refs: list[tuple[int, Any]], method: str) -> None:
        """Wait for every actor's call to `method`; an error names the rank (and stops the engine)."""
        ray = self._ray
        waiting = [ref for _, ref in refs]
        while waiting:
            _, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=_MONITOR_POLL_S, fetch_local=False)
            if self.group.failure is not None:
                msg = self.group.failure
                self.shutdown()
                raise WorkerDiedError(msg)
        for rank, ref in refs:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                self.group.fail(rank, f"died during {method} ({_last_line(e)})")
            except Exception as e:
                self.group.fail(rank, f"failed in {method}", str(e))
            if self.group.failure is not None:
                msg = self.group.failure
                self.shutdown()
                raise WorkerDiedError(msg)

    def shutdown(self) -> None:
        self._finalizer()
