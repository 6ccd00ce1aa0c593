"""`--api-server-count N` (N > 1): N API server processes on one port, each talking to every engine core.

This parent process owns the engine cores (EngineManager: the local ranks and the handshake for headless nodes)
and supervises everything; it serves no HTTP itself. Each child binds its own listening socket with SO_REUSEPORT,
so the kernel spreads connections over them, and builds its own AsyncLLM as client `k` of the engines. Metrics go
through prometheus_client's multiprocess mode, so /metrics on any of them shows the whole server. What a child
serves is passed in (api_server.run_server passes app.serve), so this supervisor does not import the app.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from typing import Any, Awaitable, Callable

from tokenmill.config.frontend import FrontendConfig
from tokenmill.engine.launcher import EngineAddresses, EngineManager, make_addresses, stop_processes
from tokenmill.logger import init_logger

logger = init_logger(__name__)
STOP_GRACE_S = 30.0
# serve(engine, frontend, sockets=[...]) -> exit code: one API server on already-listening sockets.
ServeFn = Callable[..., Awaitable[int]]


def reuseport_socket(frontend: FrontendConfig) -> socket.socket:
    """A listening TCP socket on the server's host:port that other processes may bind too (SO_REUSEPORT)."""
    host = frontend.host or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, frontend.port))
    except OSError as e:
        sock.close()
        raise ValueError(f"Cannot listen on {host}:{frontend.port}: {e}") from None
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def _api_server_main(engine_kwargs: dict[str, Any], frontend: FrontendConfig, index: int,
                     addresses: EngineAddresses, serve: ServeFn) -> None:
    """Child process `index`: one AsyncLLM (client `index` of the engines) and one `serve` on the shared port."""
    from tokenmill.config.engine_args import create_engine_config
    from tokenmill.engine.async_llm import AsyncLLM

    async def main() -> int:
        engine = AsyncLLM(create_engine_config(**engine_kwargs), log_stats=not frontend.disable_log_stats,
                          client_index=index, addresses=addresses)
        try:
            return await serve(engine, frontend, sockets=[reuseport_socket(frontend)])
        finally:
            engine.shutdown()

    sys.exit(asyncio.run(main()))


class APIServerSupervisor:
    """Starts the engines and `frontend.api_server_count` API server processes, and keeps them together.

    Contract of `run()` (returns the exit code): a SIGTERM/SIGINT stops the API servers (each finishes or aborts
    its requests per --shutdown-timeout), then the engines, and returns 0. An engine core that fails or dies, or an
    API server that exits on its own, stops everything and returns 1 (or that server's exit code).
    """

    def __init__(self, engine_kwargs: dict[str, Any], frontend: FrontendConfig, serve: ServeFn) -> None:
        from tokenmill.config.engine_args import create_engine_config
        self.engine_kwargs, self.frontend, self.serve = engine_kwargs, frontend, serve
        self.config = create_engine_config(**engine_kwargs)
        reuseport_socket(frontend).close()  # a port taken by another program fails here, with a clear message
        self.stopping = False
        self.servers: list[multiprocessing.Process] = []
        self.manager: EngineManager | None = None

    def _on_signal(self, *_) -> None:
        self.stopping = True

    def run(self) -> int:
        n = self.frontend.api_server_count
        prom_dir = tempfile.mkdtemp(prefix="tokenmill-prometheus-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = prom_dir  # the children inherit it; it must precede their imports
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        addresses = make_addresses(self.config.parallel_config, n)
        try:
            self.manager = EngineManager(self.config, addresses)
            mp = multiprocessing.get_context("spawn")
            for k in range(n):
                proc = mp.Process(target=_api_server_main, name=f"TokenmillAPIServer_{k}",
                                  args=(self.engine_kwargs, self.frontend, k, addresses, self.serve))
                proc.start()
                self.servers.append(proc)
            logger.info("Started %d API server processes on port %d.", n, self.frontend.port)
            return self._supervise()
        finally:
            self._stop_servers()
            if self.manager is not None:
                self.manager.shutdown()
            shutil.rmtree(prom_dir, ignore_errors=True)

    def _supervise(self) -> int:
        manager = self.manager
        while True:
            manager.poll(200)
            if self.stopping:
                return 0
            why = manager.failure()
            if why is not None:
                logger.error("Stopping the server: %s.", why)
                return 1
            for k, proc in enumerate(self.servers):
                if not proc.is_alive():
                    logger.error("API server %d exited (exit code %s); stopping the server.", k, proc.exitcode)
                    return proc.exitcode or 1

    def _stop_servers(self) -> None:
        alive = [p for p in self.servers if p.is_alive()]
        for p in alive:
            p.terminate()  # SIGTERM: uvicorn's graceful shutdown, bounded by --shutdown-timeout
        deadline = time.monotonic() + self.frontend.shutdown_timeout + STOP_GRACE_S
        for p in alive:
            p.join(max(0.0, deadline - time.monotonic()))
        stop_processes(alive, timeout_s=1.0, sig=signal.SIGTERM)


def run_api_servers(engine_kwargs: dict[str, Any], frontend: FrontendConfig, serve: ServeFn) -> int:
    """Runs `frontend.api_server_count` API server processes, each running `serve`, until stopped; the exit code.
    `serve` must be picklable by reference (a module-level function): the children are spawned."""
    try:
        supervisor = APIServerSupervisor(engine_kwargs, frontend, serve)
    except (ValueError, TypeError, FileNotFoundError) as e:
        logger.error("Cannot start the server: %s", e)
        return 1
    return supervisor.run()
