"""How worker ranks come to life: a launcher starts one process (or actor) per rank and hands back a handle the
executor can watch. The mp executor uses local processes; a Ray launcher would return actor-backed handles."""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass

from tokenmill import envs
from tokenmill.config import TokenmillConfig


@dataclass
class WorkerSpec:
    """Everything a worker rank needs to join: the config, its place in the world, and rank 0's RPC addresses
    (result_addr: where the pipeline's output rank sends sampled outputs; None without pipeline parallelism)."""
    config: TokenmillConfig
    rank: int
    local_rank: int
    distributed_init_method: str
    rpc_addr: str
    reply_addr: str
    result_addr: str | None = None


class WorkerHandle(ABC):
    """A started worker. `sentinel` is a file descriptor that becomes readable when the worker is gone."""
    rank: int

    @property
    @abstractmethod
    def sentinel(self) -> int: ...

    @abstractmethod
    def exit_description(self, wait_s: float = 1.0) -> str:
        """How the worker ended, e.g. 'exited with code 1' or 'was killed by SIGKILL'."""

    @abstractmethod
    def stop(self, grace_s: float) -> None:
        """Let the worker exit by itself for up to `grace_s` seconds, then kill it."""

    @abstractmethod
    def kill(self) -> None: ...


class WorkerLauncher(ABC):
    """Starts worker ranks 1..N-1 (rank 0 lives in the engine core's process)."""

    @abstractmethod
    def launch(self, spec: WorkerSpec) -> WorkerHandle: ...


class LocalProcessHandle(WorkerHandle):
    """A worker in a child process. Its stdin stays open for its lifetime: closing it (or our death) tells the
    worker to exit, and a pipe only the child holds open tells us when it has gone, whatever the cause."""

    def __init__(self, rank: int, proc: subprocess.Popen, death_fd: int) -> None:
        self.rank, self.proc, self._death_fd = rank, proc, death_fd

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def sentinel(self) -> int:
        return self._death_fd

    def exit_description(self, wait_s: float = 1.0) -> str:
        try:
            code = self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            return "stopped responding"
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with code {code}"

    def stop(self, grace_s: float) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        try:
            os.close(self._death_fd)
        except OSError:
            pass


class LocalProcessLauncher(WorkerLauncher):
    """Starts each rank as `python -m tokenmill.executor.worker_proc`: a fresh interpreter (safe with CUDA, and
    unlike multiprocessing it also works from the daemonic engine-core process and never re-imports the user's
    script). The pickled WorkerSpec goes through the child's stdin."""

    def launch(self, spec: WorkerSpec) -> LocalProcessHandle:
        env = dict(os.environ)
        if envs.NCCL_NVLS_ENABLE is None:
            env[envs.NCCL_NVLS_ENABLE_NAME] = "0"  # NVLink multicast stays off unless the user chose otherwise
        if envs.TORCH_SYMM_MEM_DISABLE_MULTICAST is None:
            env[envs.TORCH_SYMM_MEM_DISABLE_MULTICAST_NAME] = "1"
        # The child must import this very tokenmill, wherever the parent found it.
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        read_fd, write_fd = os.pipe()
        try:
            proc = subprocess.Popen([sys.executable, "-m", "tokenmill.executor.worker_proc", str(write_fd)],
                                    stdin=subprocess.PIPE, pass_fds=(write_fd,), env=env)
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        payload = pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)

        def write() -> None:  # in a thread: a spec larger than the pipe buffer must not serialize start-ups
            try:
                proc.stdin.write(payload)
                proc.stdin.flush()
            except (BrokenPipeError, ValueError, OSError):
                pass  # the child died at once (the monitor reports how) or was stopped already

        threading.Thread(target=write, name=f"tokenmill-spec-rank{spec.rank}", daemon=True).start()
        return LocalProcessHandle(spec.rank, proc, read_fd)
