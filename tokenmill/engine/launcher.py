"""Starting data-parallel engine cores: socket addresses, device pinning, and the head node's start-up handshake.

The head node (the process that owns the engines: the API server, or the parent of several API servers) binds a
handshake ROUTER socket: an `ipc://` path when every rank runs on this node, else
`tcp://{data_parallel_address}:{data_parallel_rpc_port}`. Every engine core, local or started by a `--headless`
node, says HELLO there and is told where its clients listen (see engine/core_proc.py for the messages).
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time

import msgspec
import zmq

from tokenmill import envs
from tokenmill.engine import standby
from tokenmill.engine.core_proc import FAILED, HELLO, NODE_HELLO, READY, REJECT, SHUTDOWN, WELCOME, run_engine_core
from tokenmill.logger import init_logger

logger = init_logger(__name__)
WAIT_LOG_INTERVAL_S = 15.0


class EngineRefusedError(ValueError):
    """An engine core refused to start with the user's model or options; the message says what to change."""


class EngineAddresses(msgspec.Struct):
    """Where the engine cores and their clients meet: `inputs[k][r]` is client k's socket for sending to engine
    rank r, `outputs[k]` client k's socket for everything the engines send back."""
    handshake: str
    inputs: list[list[str]]
    outputs: list[str]
    tmp_dir: str | None = None  # holds the ipc sockets; removed by the engines' owner at shutdown


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def make_addresses(parallel_config, num_clients: int) -> EngineAddresses:
    """ipc sockets when every rank runs on this node; TCP on data_parallel_address when other nodes join."""
    pc = parallel_config
    ranks = range(pc.data_parallel_size)
    if pc.data_parallel_size_local == pc.data_parallel_size:
        d = tempfile.mkdtemp(prefix="tokenmill-")
        return EngineAddresses(f"ipc://{d}/handshake",
                               [[f"ipc://{d}/in-{k}-{r}" for r in ranks] for k in range(num_clients)],
                               [f"ipc://{d}/out-{k}" for k in range(num_clients)], tmp_dir=d)
    host = pc.data_parallel_address
    url = f"[{host}]" if ":" in host else host
    try:
        return EngineAddresses(f"tcp://{url}:{pc.data_parallel_rpc_port}",
                               [[f"tcp://{url}:{_free_port(host)}" for _ in ranks] for _ in range(num_clients)],
                               [f"tcp://{url}:{_free_port(host)}" for _ in range(num_clients)])
    except OSError as e:
        raise ValueError(f"Cannot listen on data_parallel_address={host!r} ({e}); give an address of this "
                         "node that the other nodes can reach.") from None


def visible_cuda_devices() -> list[str]:
    env = envs.CUDA_VISIBLE_DEVICES
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    import torch
    return [str(i) for i in range(torch.cuda.device_count())]


def devices_for_rank(local_index: int, world_size: int, visible: list[str]) -> str:
    """CUDA_VISIBLE_DEVICES of the local_index-th engine core on this node: its own `world_size` devices."""
    return ",".join(visible[local_index * world_size:(local_index + 1) * world_size])


def check_devices(config, num_local: int) -> list[str] | None:
    """The visible CUDA devices (None on CPU); raises ValueError if the local engines do not fit on them."""
    if config.device_config.device != "cuda" or num_local == 0:
        return None
    if getattr(config.parallel_config, "distributed_executor_backend", None) == "ray":
        # Ray picks every rank's GPU (rank 0's too) anywhere in its cluster: the engine core must see the node's
        # GPUs as Ray does, and its ranks need not fit on this node (the ray executor checks the cluster).
        return None
    visible = visible_cuda_devices()
    ws = config.parallel_config.world_size
    if num_local * ws > len(visible):
        raise ValueError(f"data_parallel_size_local={num_local} engine cores x {ws} device(s) each need "
                         f"{num_local * ws} CUDA devices on this node, but {len(visible)} are visible "
                         f"({','.join(visible) or 'none'}). Lower data_parallel_size_local or run the other ranks "
                         "on other nodes (--headless).")
    return visible


@contextlib.contextmanager
def _environ(**values: str):
    """Spawned children copy os.environ when they start; this sets a child's variables without keeping them."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def spawn_engine_cores(config, ranks: range, handshake: str, parent_pid: int) -> dict[int, multiprocessing.Process]:
    """Starts one engine-core process per rank. On CUDA the i-th one sees only its own world_size devices; on CPU,
    unless TOKENMILL_CPU_NUM_THREADS says otherwise, they split the cores instead of each using all of them."""
    visible = check_devices(config, len(ranks))
    mp = multiprocessing.get_context("spawn")
    procs = {}
    cpu_threads = None
    if config.device_config.device == "cpu" and len(ranks) > 1 and envs.TOKENMILL_CPU_NUM_THREADS == 0:
        cpu_threads = str(max(1, (os.cpu_count() or 1) // len(ranks)))
    for i, rank in enumerate(ranks):
        if visible is not None:
            env = {"CUDA_VISIBLE_DEVICES": devices_for_rank(i, config.parallel_config.world_size, visible)}
        else:
            env = {} if cpu_threads is None else {"TOKENMILL_CPU_NUM_THREADS": cpu_threads}
        args = (config, rank, handshake, parent_pid)
        # The first rank takes the process `tokenmill serve` started ahead (its imports are done by now).
        proc = standby.take(env, args) if i == 0 else None
        if proc is None:
            proc = mp.Process(target=run_engine_core, name=f"TokenmillEngineCore_DP{rank}", args=args, daemon=True)
            with _environ(**env):
                proc.start()
        procs[rank] = proc
    return procs


# "The process that started you says: exit now." Not SIGTERM: an engine core keeps serving through a SIGTERM sent
# to the whole process group until the API server shuts it down (core_proc._on_sigterm).
ENGINE_STOP_SIGNAL = signal.SIGUSR1


def stop_processes(procs, timeout_s: float = 5.0, sig: int = ENGINE_STOP_SIGNAL) -> None:
    """Send `sig` (engine cores exit at once on ENGINE_STOP_SIGNAL), then SIGKILL whatever is left."""
    for p in procs:
        if p.is_alive() and p.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, sig)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1)


class EngineManager:
    """Owns the engine cores of a head node: binds the handshake socket, starts the local ranks
    (0 .. data_parallel_size_local-1), welcomes every rank (local, or from a --headless node) with the client
    addresses, and collects READY / FAILED.

    Contract: the constructor binds and spawns; `poll(timeout_ms)` handles handshake traffic and must be called
    until `all_ready()`; `failure()` returns the first start-up error or dead local process as a sentence (None
    while all is well); `shutdown()` asks the engines of other nodes to stop (SHUTDOWN over the handshake socket),
    terminates the local processes and removes the ipc directory.
    """

    def __init__(self, config, addresses: EngineAddresses, parent_pid: int | None = None) -> None:
        pc = config.parallel_config
        if pc.data_parallel_start_rank != 0:
            raise ValueError(f"data_parallel_start_rank={pc.data_parallel_start_rank} is for --headless nodes; "
                             "the head node runs ranks 0 .. data_parallel_size_local-1.")
        self.dp_size = pc.data_parallel_size
        self.local_ranks = range(0, pc.data_parallel_size_local)
        self.addresses = addresses
        self.ctx = zmq.Context()
        self.hs = self.ctx.socket(zmq.ROUTER)
        try:
            self.hs.bind(addresses.handshake)
        except zmq.ZMQError as e:
            self.ctx.destroy(linger=0)
            raise ValueError(f"Cannot bind the data-parallel handshake socket {addresses.handshake} ({e}); "
                             "pick another --data-parallel-rpc-port or --data-parallel-address.") from None
        self.hosts: dict[int, str] = {}  # rank -> "pid P on host H" of the engine that said HELLO
        self.idents: dict[int, bytes] = {}  # rank -> its handshake routing id
        self.node_ranks: dict[int, str] = {}  # rank -> host of the headless node that claimed it
        self.ready: dict[int, int] = {}  # rank -> number of KV blocks
        self.errors: list[str] = []
        self.refusals: set[str] = set()  # errors that are the user's to fix (see startup_error)
        self._last_wait_log = time.monotonic()
        self.procs: dict[int, multiprocessing.Process] = {}
        try:
            self.procs = spawn_engine_cores(config, self.local_ranks, addresses.handshake,
                                            os.getpid() if parent_pid is None else parent_pid)
        except BaseException:
            self.shutdown()
            raise

    @property
    def remote_ranks(self) -> list[int]:
        return [r for r in range(self.dp_size) if r not in self.local_ranks]

    def all_ready(self) -> bool:
        return len(self.ready) == self.dp_size

    def poll(self, timeout_ms: int = 0) -> None:
        while self.hs.poll(timeout_ms):
            timeout_ms = 0
            frames = self.hs.recv_multipart()
            try:  # the port is open to the network: something else may knock
                ident, kind, payload = frames
                msg = msgspec.msgpack.decode(payload)
                if not isinstance(msg, dict):
                    raise ValueError("not a mapping")
            except ValueError as e:
                logger.warning("Ignored a malformed message on the data-parallel handshake socket: %s", e)
                continue
            self._handle(ident, kind, msg)
        if not self.all_ready() and time.monotonic() - self._last_wait_log > WAIT_LOG_INTERVAL_S:
            # Local engines log their own loading; ranks of other nodes would otherwise be waited for silently.
            self._last_wait_log = time.monotonic()
            remote = [r for r in self.remote_ranks if r not in self.hosts]
            if remote:
                logger.info("Waiting for data-parallel ranks %s: start them with `tokenmill serve --headless` on "
                            "other nodes, connecting to %s.", remote, self.addresses.handshake)

    def _reply(self, ident: bytes, kind: bytes, msg: dict) -> None:
        self.hs.send_multipart([ident, kind, msgspec.msgpack.encode(msg)])

    def _handle(self, ident: bytes, kind: bytes, msg: dict) -> None:
        if kind == NODE_HELLO:
            ranks, host = msg.get("ranks"), msg.get("host", "?")
            ranks = ranks if isinstance(ranks, list) else []
            bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < self.dp_size]
            taken = [] if bad else [r for r in ranks if r in self.local_ranks or r in self.node_ranks]
            if bad or taken or not ranks:
                why = (f"ranks {bad} are outside 0..{self.dp_size - 1} (data_parallel_size={self.dp_size})" if bad
                       else f"ranks {taken} already run elsewhere (head node ranks: {list(self.local_ranks)})"
                       if taken else "it offers no ranks")
                logger.error("Turned away headless node %s: %s.", host, why)
                return self._reply(ident, REJECT, {"error": why})
            for r in ranks:
                self.node_ranks[r] = host
            logger.info("Headless node %s joined with data-parallel ranks %s.", host, ranks)
            return self._reply(ident, WELCOME, {})
        rank = msg.get("rank") if isinstance(msg.get("rank"), int) else -1
        if kind == HELLO:
            where = f"pid {msg.get('pid')} on host {msg.get('host')}"
            local = self.procs.get(rank)
            why = None
            if not 0 <= rank < self.dp_size:
                why = f"rank {rank} is outside 0..{self.dp_size - 1} (data_parallel_size={self.dp_size})"
            elif rank in self.hosts:
                why = f"rank {rank} already has an engine core ({self.hosts[rank]})"
            elif rank in self.local_ranks and (local is None or local.pid != msg.get("pid")
                                               or msg.get("host") != socket.gethostname()):
                why = f"rank {rank} runs on the head node"
            if why is not None:
                logger.error("Turned away engine core %s: %s.", where, why)
                return self._reply(ident, REJECT, {"error": why})
            self.hosts[rank], self.idents[rank] = where, ident
            self._reply(ident, WELCOME, {"inputs": [per_client[rank] for per_client in self.addresses.inputs],
                                         "outputs": list(self.addresses.outputs)})
        elif kind == READY and rank in self.hosts:
            self.ready[rank] = msg.get("num_blocks", 0)
            logger.info("Data-parallel engine core %d ready (%s): %d KV blocks.", rank, self.hosts[rank],
                        self.ready[rank])
        elif kind == FAILED and msg.get("running"):  # a headless node reports one of its engines died
            self.errors.append(str(msg.get("error")))
        elif kind == FAILED and msg.get("refused"):  # the head reports the message once; the stack is for debugging
            self.errors.append(f"engine core {rank} failed to start: {msg.get('message')}")
            self.refusals.add(self.errors[-1])
            logger.debug("Engine core %d refused to start:\n%s", rank, msg.get("traceback", ""))
        elif kind == FAILED:
            self.errors.append(f"engine core {rank} failed to start: {msg.get('error')}")
            logger.error("Engine core %d failed to start:\n%s", rank, msg.get("traceback", ""))

    def failure(self) -> str | None:
        if self.errors:
            return self.errors[0]
        return self.dead_local()

    def startup_error(self, why: str) -> Exception:
        """The exception for start-up failure `why`: EngineRefusedError when an engine core refused the user's
        model or options (the entry points print its message alone), else RuntimeError."""
        return EngineRefusedError(why) if why in self.refusals else RuntimeError(why)

    def dead_local(self) -> str | None:
        for rank, p in self.procs.items():
            if not p.is_alive():
                return (f"data-parallel engine core {rank} (pid {p.pid}) exited unexpectedly (exit code "
                        f"{p.exitcode})")
        return None

    def wait_ready(self, timeout_s: float, extra_check=None) -> None:
        """Blocks until every rank is ready; raises RuntimeError on a failure, a timeout, or `extra_check()`'s
        error text."""
        deadline = time.monotonic() + timeout_s
        while not self.all_ready():
            self.poll(200)
            why = self.failure() or (extra_check() if extra_check is not None else None)
            if why is None and time.monotonic() > deadline:
                why = (f"data-parallel engine cores {[r for r in range(self.dp_size) if r not in self.ready]} "
                       f"were not ready within {timeout_s:.0f} s")
            if why is not None:
                raise self.startup_error(why)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def shutdown(self) -> None:
        if self.ctx.closed:
            return
        for rank, ident in self.idents.items():
            if rank not in self.local_ranks:
                with contextlib.suppress(zmq.ZMQError):
                    self.hs.send_multipart([ident, SHUTDOWN, b""], flags=zmq.NOBLOCK)
        stop_processes(list(self.procs.values()))
        self.hs.close(linger=1000 if self.remote_ranks else 0)
        self.ctx.term()
        if self.addresses.tmp_dir:
            shutil.rmtree(self.addresses.tmp_dir, ignore_errors=True)
