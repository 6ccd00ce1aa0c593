"""Start the real API server in a subprocess on a free loopback port (or a Unix socket) and stop it."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, found by scanning /proc (no psutil needed)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(entry))
    return out


def engine_core_pid(server_pid: int) -> int:
    for child in child_pids(server_pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ")
        except OSError:
            continue
        if b"spawn_main" in cmd:
            return child
    raise RuntimeError(f"no engine-core child of {server_pid}")


class RemoteServer:
    """`argv` after the command; `cmd` defaults to `python -m tokenmill.entrypoints.openai.api_server`."""

    def __init__(self, argv: list[str], log_path: str, cmd: list[str] | None = None, uds: str | None = None,
                 env: dict | None = None, api_key: str | None = None):
        self.uds = uds
        self.port = None if uds else free_port()
        cmd = cmd or [sys.executable, "-m", "tokenmill.entrypoints.openai.api_server"]
        where = ["--uds", uds] if uds else ["--host", "127.0.0.1", "--port", str(self.port)]
        self.log_path = log_path
        self._log = open(log_path, "wb")
        full_env = dict(os.environ, TOKENMILL_CPU_KVCACHE_SPACE_GIB="1", **(env or {}))
        self.proc = subprocess.Popen(cmd + argv + where, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
                                     start_new_session=True)
        self.api_key = api_key
        self.started_s: float | None = None

    @property
    def url(self) -> str:
        return "http://localhost" if self.uds else f"http://127.0.0.1:{self.port}"

    def client(self, **kw) -> httpx.Client:
        transport = httpx.HTTPTransport(uds=self.uds) if self.uds else None
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.url, transport=transport, timeout=kw.pop("timeout", 60), headers=headers,
                            **kw)

    def wait_healthy(self, timeout: float = 60.0) -> float:
        t0 = time.monotonic()
        with self.client(timeout=2) as c:
            while time.monotonic() - t0 < timeout:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
                try:
                    if c.get("/health").status_code == 200:
                        self.started_s = time.monotonic() - t0
                        return self.started_s
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"server not healthy after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-20000:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode
