"""The `mp` executor: rank 0 runs in the engine core's process, ranks 1..N-1 in local worker processes.

Each call is published once to every worker (see rpc_broadcast) and then run by rank 0 itself; rank 0's result is
returned, except a step's sampled output under pipeline parallelism, which the last stage sends back (see
pp_output): `sample_tokens` then returns at once and the handle waits for it. A monitor thread waits on the workers' sentinels: when one dies it records which rank and how, kills
the other workers and aborts NCCL communicators, so a collective in flight fails instead of hanging and every later
call raises an error that names the rank.
"""
from __future__ import annotations

import multiprocessing.connection
import os
import shutil
import tempfile
import threading
import weakref
from typing import Any, Callable

import torch

from tokenmill.config import TokenmillConfig
from tokenmill.config.parallel import DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT
from tokenmill.distributed import ParallelState, abort_distributed, destroy_distributed, get_open_port
from tokenmill.core.sched_output import GrammarOutput
from tokenmill.executor.abstract import Executor, WorkerDiedError, call_while_healthy
from tokenmill.executor.launcher import LocalProcessLauncher, WorkerHandle, WorkerLauncher, WorkerSpec
from tokenmill.executor.rpc_broadcast import CALL, SHUTDOWN, RpcBroadcaster
from tokenmill.logger import init_logger
from tokenmill.worker.pp_output import ResultReceiver
from tokenmill.worker.worker import Worker

logger = init_logger(__name__)

# How long rank 0 waits, after its own call failed, for the monitor to notice the dead worker that caused it
# (gloo reports the closed socket a moment before the process is reaped).
_FAILURE_GRACE_S = 3.0
_DESTROY_TIMEOUT_S = 15.0  # rank 0 leaving the world together with the workers at shutdown
_DEFAULT_START_TIMEOUT_S = 600.0


def _torch_distributed_initialized() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


class _WorkerGroup:
    """The worker handles, the RPC sockets and the monitor thread; owns no reference to the executor, so a
    forgotten executor is garbage-collected and its `weakref.finalize` stops the workers."""

    def __init__(self, rpc: RpcBroadcaster, tmpdir: str) -> None:
        self.rpc, self.tmpdir = rpc, tmpdir
        self.results: ResultReceiver | None = None  # pipeline parallelism: the last stage's outputs
        self.handles: list[WorkerHandle] = []
        self.failure: str | None = None
        self.failed_rank: int | None = None
        self._described: str | None = None
        self.failed = threading.Event()
        self.closing = False
        self._stop_r, self._stop_w = os.pipe()
        self.monitor: threading.Thread | None = None
        self.owns_world = False  # set once this executor may join the process group (and so must leave it)
        self.parallel_state: ParallelState | None = None  # rank 0's, once it has joined
        self.num_threads = torch.get_num_threads()  # rank 0's Worker narrows it on CPU; the host process keeps it

    def start_monitor(self) -> None:
        self.monitor = threading.Thread(target=self._watch, name="tokenmill-worker-monitor", daemon=True)
        self.monitor.start()

    def _watch(self) -> None:
        by_fd = {h.sentinel: h for h in self.handles}
        ready = multiprocessing.connection.wait([*by_fd, self._stop_r])
        if self.closing or self._stop_r in ready:
            return
        dead = by_fd[next(fd for fd in ready if fd in by_fd)]
        pid = getattr(dead, "pid", None)
        self.failed_rank = dead.rank
        self.failure = (f"Worker rank {dead.rank}" + (f" (pid {pid})" if pid else "") +
                        f" {dead.exit_description()}; the engine has stopped.")
        logger.error("%s", self.failure)
        self.failed.set()
        abort_distributed(self.parallel_state)
        for h in self.handles:
            if h is not dead:
                h.kill()

    def describe_failure(self) -> str:
        """The failure line plus the traceback the dead rank reported, when it reported one (main thread only:
        it reads the reply socket; the answer is kept, so it works after `close` too)."""
        if self._described is None:
            text = self.failure or "A worker rank failed."
            error = None
            if self.failed_rank is not None and not self.closing:
                error = self.rpc.worker_error(self.failed_rank)
            self._described = f"{text}\nIts error:\n{error}" if error else text
        return self._described

    def close(self) -> None:
        if self.closing:
            return
        self.closing = True
        os.write(self._stop_w, b"x")
        try:
            self.rpc.send(SHUTDOWN)
        except Exception:
            pass
        if self.owns_world:
            # Leave the world while the workers leave it too: NCCL's teardown waits for its peers, so rank 0
            # destroying only after they exited (or were killed for waiting on it) hung. Bounded, then aborted.
            leaving = threading.Thread(target=destroy_distributed, args=(self.parallel_state,),
                                       name="tokenmill-destroy-world", daemon=True)
            leaving.start()
            leaving.join(_DESTROY_TIMEOUT_S)
            if leaving.is_alive():
                logger.warning("Leaving the distributed world took over %.0f s; aborting it.", _DESTROY_TIMEOUT_S)
                abort_distributed(self.parallel_state)
        for h in self.handles:
            h.stop(grace_s=5.0)
        for h in self.handles:
            getattr(h, "close", lambda: None)()
        if self.monitor is not None:
            self.monitor.join(2.0)
        self.rpc.close()
        if self.results is not None:
            self.results.close()
        for fd in (self._stop_r, self._stop_w):
            os.close(fd)
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        torch.set_num_threads(self.num_threads)


class MultiprocExecutor(Executor):
    """Tensor parallelism on one host: see the module docstring. `launcher` decides how ranks 1..N-1 start."""

    def __init__(self, config: TokenmillConfig, launcher: WorkerLauncher | None = None) -> None:
        super().__init__(config)
        pc = config.parallel_config
        self.world_size = pc.world_size
        tmpdir = tempfile.mkdtemp(prefix="tokenmill-tp-")
        rpc = RpcBroadcaster(f"ipc://{tmpdir}/rpc", f"ipc://{tmpdir}/replies")
        self.group = _WorkerGroup(rpc, tmpdir)
        self._finalizer = weakref.finalize(self, self.group.close)
        result_addr = None
        if pc.pipeline_parallel_size > 1:
            result_addr = f"ipc://{tmpdir}/results"
            self.group.results = ResultReceiver(result_addr, self.check_health)
        start_timeout = float(pc.distributed_timeout_seconds or _DEFAULT_START_TIMEOUT_S)
        try:
            if _torch_distributed_initialized():
                raise RuntimeError("This process already belongs to a torch.distributed world (another engine with "
                                   "tensor parallelism?); one such engine can run per process at a time.")
            self.group.owns_world = True
            init_method = self._init_method(pc)
            launcher = launcher or LocalProcessLauncher()
            for rank in range(1, self.world_size):
                spec = WorkerSpec(config, rank, rank, init_method, f"ipc://{tmpdir}/rpc", f"ipc://{tmpdir}/replies",
                                  result_addr)
                self.group.handles.append(launcher.launch(spec))
            self.group.start_monitor()
            self.driver = self._wait_for(lambda: Worker(config, rank=0, local_rank=0,
                                                        distributed_init_method=init_method),
                                         start_timeout, "joining the process group")
            self.group.parallel_state = self.driver.parallel_state
            rpc.wait_subscribers(set(range(1, self.world_size)), start_timeout, self.check_health)
            self.collective_rpc("load_model")
        except BaseException:
            self.shutdown()
            raise

    @property
    def workers(self) -> list[WorkerHandle]:
        return self.group.handles

    @staticmethod
    def _init_method(pc) -> str:
        if (pc.master_addr, pc.master_port) == (DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT):
            # One host and no explicit address: a free port, so engines on one host never collide.
            return f"tcp://127.0.0.1:{get_open_port()}"
        return f"tcp://{pc.master_addr}:{pc.master_port}"

    def _wait_for(self, fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
        return call_while_healthy(fn, timeout_s, what, self.check_health)

    def check_health(self) -> None:
        if self.group.failure is not None:
            raise WorkerDiedError(self.group.describe_failure())

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.group.failure is not None or self.group.closing:
            raise WorkerDiedError(self.group.describe_failure() if self.group.failure else
                                  "The tensor-parallel executor has been shut down.")
        self.group.rpc.send(CALL, (method, args, kwargs))
        try:
            result = getattr(self.driver, method)(*args, **kwargs)
        except BaseException as e:
            # A collective broken by a dead peer raises RuntimeError here; name the rank that died instead.
            if isinstance(e, RuntimeError) and self.group.failed.wait(_FAILURE_GRACE_S):
                msg = self.group.describe_failure()
                self.shutdown()
                raise WorkerDiedError(msg) from e
            self.shutdown()  # the ranks are out of step now: the engine cannot continue
            raise
        if self.group.failure is not None:
            # A rank died during the call; aborted NCCL collectives may have let it finish on garbage.
            msg = self.group.describe_failure()
            self.shutdown()
            raise WorkerDiedError(msg)
        return result

    def sample_tokens(self, grammar: GrammarOutput | None):
        handle = self.collective_rpc("sample_tokens", grammar)
        if self.group.results is None:
            return handle
        # Rank 0 is the first stage and sampled nothing; the last stage's output comes back through the result
        # path (a failure there surfaces through check_health while the handle waits).
        return self.group.results.handle()

    def shutdown(self) -> None:
        self._finalizer()
