"""Ray plumbing for the ray executor: importing Ray, joining a cluster, checking that the world fits it, reserving
one placement-group bundle per rank, and deciding each rank's number and device from where Ray put it.

Ray is an optional dependency (`pip install 'tokenmill[ray]'`); nothing here imports it at module import time.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from tokenmill.logger import init_logger

logger = init_logger(__name__)

RAY_INSTALL_HINT = "pip install 'tokenmill[ray]'"
# A tiny amount of the `node:<ip>` resource every Ray node advertises pins a bundle to that node.
_NODE_PIN = 0.001


def import_ray():
    """The ray module, or an ImportError that says how to install it."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(f"distributed_executor_backend='ray' needs Ray, which is not installed: run "
                          f"{RAY_INSTALL_HINT} (or pip install ray), or use --distributed-executor-backend mp "
                          f"on one host.") from e
    return ray


class RaySession:
    """This process's connection to Ray, as the executor opened it.

    `connect()` joins the running Ray cluster (RAY_ADDRESS, or the one `ray start` left on this host) or starts a
    local one when none runs; a session the caller had already opened is used and left alone. While it is open,
    SIGTERM first runs `on_sigterm` (the executor's own shutdown) and disconnects, stopping a local cluster started
    here whose helper processes would otherwise outlive a process that exits at once on SIGTERM, as the engine
    core does; then it runs the handler the process had. `close()` restores that handler and disconnects.
    """

    def __init__(self, ray) -> None:
        self.ray = ray
        self.opened = False
        self._previous_sigterm: Any = None
        self._on_exit: Callable[[], None] = lambda: None

    def connect(self, on_sigterm: Callable[[], None]) -> None:
        ray = self.ray
        if ray.is_initialized():
            return
        main = threading.current_thread() is threading.main_thread()
        previous = signal.getsignal(signal.SIGTERM) if main else None
        # address=None is Ray's own "auto, else local": an existing cluster is joined, else one starts here.
        ray.init(address=None, log_to_driver=True)
        self.opened = True
        if main:
            self._previous_sigterm, self._on_exit = previous, on_sigterm
            signal.signal(signal.SIGTERM, self._on_sigterm)  # also replaces ray.init's own (raise SystemExit)

    def _on_sigterm(self, signum, frame) -> None:
        try:
            self._on_exit()  # stops threads that call into Ray: Ray ends the process if they do after shutdown
            if self.ray.is_initialized():
                self.ray.shutdown()
        except Exception:
            pass
        previous = self._previous_sigterm
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:  # the default action: die of the signal, as without us
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def close(self) -> None:
        if not self.opened:
            return
        self.opened = False
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, self._previous_sigterm if self._previous_sigterm is not None
                          else signal.SIG_DFL)
        if self.ray.is_initialized():
            self.ray.shutdown()


@dataclass
class NodeResources:
    """One alive node of the cluster: its id, IP and totals of the resources a bundle asks for."""
    node_id: str
    ip: str
    resources: dict[str, float]


def cluster_nodes(ray) -> list[NodeResources]:
    return [NodeResources(n["NodeID"], n["NodeManagerAddress"], dict(n.get("Resources", {})))
            for n in ray.nodes() if n.get("Alive")]


def check_world_fits(world_size: int, bundle: dict[str, float], nodes: list[NodeResources], driver_node_id: str,
                     what: str) -> None:
    """Raise a ValueError naming what was found when the cluster can never hold `world_size` bundles, or the
    driver's node cannot hold rank 0's (rank 0 runs in this process). `what` describes the world, e.g.
    'tensor_parallel_size 2 x pipeline_parallel_size 1 = 2 ranks'."""
    found = "; ".join(f"node {n.ip}: " + ", ".join(f"{n.resources.get(r, 0):g} {r}" for r in bundle)
                      for n in nodes) or "no alive node"
    for res, amount in bundle.items():
        need = amount * world_size
        have = sum(n.resources.get(res, 0) for n in nodes)
        # Bundles do not span nodes: only whole bundles on each node count.
        fits = sum(int(n.resources.get(res, 0) // amount) for n in nodes)
        if fits < world_size:
            raise ValueError(
                f"{what} need {need:g} {res} in the Ray cluster (one bundle of {bundle} per rank), but it has "
                f"{have:g} {res} across {len(nodes)} node(s) ({found}). Add nodes with `ray start "
                f"--address=<head-ip>:6379` or lower --tensor-parallel-size.")
    driver = next((n for n in nodes if n.node_id == driver_node_id), None)
    if driver is not None and any(driver.resources.get(r, 0) < a for r, a in bundle.items()):
        raise ValueError(f"Rank 0 runs in this process, so this node ({driver.ip}) must hold one bundle {bundle}, "
                         f"but it has " + ", ".join(f"{driver.resources.get(r, 0):g} {r}" for r in bundle) +
                         ". Start the engine on a node of the cluster that has the devices.")


def reserve_bundles(ray, world_size: int, bundle: dict[str, float], driver_ip: str, timeout_s: float) -> Any:
    """A PACK placement group with one bundle per rank; bundle 0 (rank 0) is pinned to the driver's node. Waits
    until Ray has reserved it, or raises after `timeout_s` saying what the cluster had free."""
    from ray.util.placement_group import placement_group, remove_placement_group
    bundles = [dict(bundle, **{f"node:{driver_ip}": _NODE_PIN})] + [dict(bundle) for _ in range(world_size - 1)]
    free = ray.available_resources()
    pg = placement_group(bundles, strategy="PACK", name=f"tokenmill-tp{world_size}-{time.time_ns()}")
    if any(free.get(r, 0) < a * world_size for r, a in bundle.items()):
        logger.warning("Waiting up to %.0f s for the Ray cluster to free %s for %d ranks (free now: %s).",
                       timeout_s, bundle, world_size, {r: free.get(r, 0) for r in bundle})
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        free = ray.available_resources()
        raise TimeoutError(f"The Ray cluster did not reserve {world_size} bundles of {bundle} within "
                           f"{timeout_s:.0f} s (free now: {({r: free.get(r, 0) for r in bundle})}); other jobs "
                           f"hold the resources.")
    return pg


@dataclass
class Placement:
    """Where a worker actor landed: its node and the GPU ids Ray gave it (empty on CPU)."""
    node_id: str
    ip: str
    gpu_ids: list[str]


@dataclass
class RankAssignment:
    """What one actor becomes: its world rank, its device index on its node, and the CUDA_VISIBLE_DEVICES its
    node's ranks share (None on CPU: leave the environment alone)."""
    rank: int
    local_rank: int
    visible_devices: str | None


def _gpu_key(gpu_id: str) -> tuple[int, str]:
    return (int(gpu_id), gpu_id) if gpu_id.isdigit() else (1 << 30, gpu_id)


def assign_ranks(driver: Placement, workers: list[Placement],
                 driver_visible: str | None) -> tuple[int, list[RankAssignment]]:
    """Number the actors (`workers`, in bundle order 1..N-1) and pick every rank's device.

    Ranks on the driver's node come first, then each other node's in turn, ordered by GPU id, so a TP group's
    ranks are contiguous per node. On each node the ranks share one CUDA_VISIBLE_DEVICES (every GPU our ranks hold
    there, sorted) and `local_rank` indexes it: NCCL then sees the peers on its node. Rank 0 keeps this process's
    own view (`driver_visible`, its CUDA_VISIBLE_DEVICES or None for all GPUs). Returns (rank 0's local_rank, one
    assignment per actor in the order given).
    """
    order = sorted(range(len(workers)), key=lambda i: (workers[i].node_id != driver.node_id, workers[i].ip,
                                                      workers[i].node_id, [_gpu_key(g) for g in workers[i].gpu_ids]))
    node_gpus: dict[str, list[str]] = {driver.node_id: list(driver.gpu_ids)}
    for w in workers:
        node_gpus.setdefault(w.node_id, []).extend(w.gpu_ids)
    node_gpus = {n: sorted(set(ids), key=_gpu_key) for n, ids in node_gpus.items()}
    use_gpu = bool(driver.gpu_ids)
    seen_on_node: dict[str, int] = {driver.node_id: 1}
    out: list[RankAssignment] = [None] * len(workers)  # type: ignore[list-item]  # every slot is filled below
    for rank, i in enumerate(order, start=1):
        w = workers[i]
        if use_gpu:
            if len(w.gpu_ids) != 1:
                raise RuntimeError(f"Ray gave the actor of rank {rank} GPUs {w.gpu_ids}; expected exactly one.")
            ids = node_gpus[w.node_id]
            out[i] = RankAssignment(rank, ids.index(w.gpu_ids[0]), ",".join(ids))
        else:
            local = seen_on_node.get(w.node_id, 0)
            out[i] = RankAssignment(rank, local, None)
        seen_on_node[w.node_id] = seen_on_node.get(w.node_id, 0) + 1
    rank0_local = 0
    if use_gpu:
        gpu = driver.gpu_ids[0]
        view = [v.strip() for v in driver_visible.split(",")] if driver_visible else None
        if view is None:
            if not gpu.isdigit():
                raise RuntimeError(f"Ray reserved GPU {gpu!r} for rank 0; set CUDA_VISIBLE_DEVICES in the engine's "
                                   f"environment so it can be found.")
            rank0_local = int(gpu)
        elif gpu in view:
            rank0_local = view.index(gpu)
        else:
            raise RuntimeError(f"Ray reserved GPU {gpu} of this node for rank 0, but this process's "
                               f"CUDA_VISIBLE_DEVICES={driver_visible!r} hides it. Start the engine with the "
                               f"GPUs the Ray node was started with.")
    return rank0_local, out
