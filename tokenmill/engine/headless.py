"""A `--headless` node: runs only its data-parallel engine cores, which serve the head node's API server(s)."""
from __future__ import annotations

import os
import signal
import socket
import time

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from tokenmill.engine.core_proc import FAILED, NODE_HELLO, REJECT
from tokenmill.engine.launcher import spawn_engine_cores, stop_processes
from tokenmill.logger import init_logger

logger = init_logger(__name__)
EXIT_GRACE_S = 5.0


class HeadlessNode:
    """Joins the head node at `tcp://{data_parallel_address}:{data_parallel_rpc_port}` with ranks
    data_parallel_start_rank .. +data_parallel_size_local-1, then starts those engine cores and watches them.

    Contract of `run()` (returns the exit code): 0 when a signal stops the node or the head shut the engines down;
    1 when the head turns the node away, an engine core dies, or the connection to the head is lost (the engines
    are stopped then). The head may start before or after this node.
    """

    def __init__(self, config) -> None:
        pc = config.parallel_config
        self.config = config
        self.ranks = range(pc.data_parallel_start_rank, pc.data_parallel_start_rank + pc.data_parallel_size_local)
        if not self.ranks:
            raise ValueError("--headless with data_parallel_size_local=0 would run no engine core; give the number "
                             "of ranks this node runs (--data-parallel-size-local).")
        host = pc.data_parallel_address
        self.handshake = f"tcp://[{host}]:{pc.data_parallel_rpc_port}" if ":" in host else \
            f"tcp://{host}:{pc.data_parallel_rpc_port}"
        self.stopping = False

    def _on_signal(self, *_) -> None:
        self.stopping = True

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        ctx = zmq.Context()
        node = ctx.socket(zmq.DEALER)
        monitor = node.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        node.connect(self.handshake)
        procs: dict = {}
        try:
            if not self._join(node):
                return 0 if self.stopping else 1
            procs = spawn_engine_cores(self.config, self.ranks, self.handshake, os.getpid())
            return self._watch(procs, node, monitor)
        finally:
            stop_processes(list(procs.values()))
            node.disable_monitor()
            monitor.close(linger=0)
            node.close(linger=1000)
            ctx.term()

    def _join(self, node: zmq.Socket) -> bool:
        node.send_multipart([NODE_HELLO, msgspec.msgpack.encode({"ranks": list(self.ranks),
                                                                "host": socket.gethostname()})])
        logger.info("Headless node: data-parallel ranks %s, joining the head node at %s.", list(self.ranks),
                    self.handshake)
        t0 = last_log = time.monotonic()
        while not node.poll(500):
            if self.stopping:
                return False
            if time.monotonic() - last_log > 30:
                last_log = time.monotonic()
                logger.info("Still waiting for the head node at %s (%.0f s).", self.handshake, last_log - t0)
        kind, payload = node.recv_multipart()
        if kind == REJECT:
            logger.error("The head node turned this node away: %s.", msgspec.msgpack.decode(payload).get("error"))
            return False
        return True

    def _watch(self, procs: dict, node: zmq.Socket, monitor: zmq.Socket) -> int:
        while True:
            if self.stopping:
                logger.info("Headless node stopping its engine cores.")
                return 0
            dead = [(r, p) for r, p in procs.items() if not p.is_alive()]
            if dead:
                rank, proc = dead[0]
                if proc.exitcode != 0:  # tell the head which rank died (it only sees a dropped connection)
                    node.send_multipart([FAILED, msgspec.msgpack.encode(
                        {"rank": rank, "running": True, "error": f"data-parallel engine core {rank} (pid {proc.pid} "
                                                                 f"on {socket.gethostname()}) exited unexpectedly "
                                                                 f"(exit code {proc.exitcode})"})])
                return self._finish(procs, "an engine core exited")
            while monitor.poll(0):
                if recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED:
                    return self._finish(procs, "lost the connection to the head node")
            time.sleep(0.5)

    def _finish(self, procs: dict, what: str) -> int:
        """A clean stop of the head sends SHUTDOWN to every engine: if they all exit 0 soon, so do we."""
        deadline = time.monotonic() + EXIT_GRACE_S
        while time.monotonic() < deadline and any(p.is_alive() for p in procs.values()):
            time.sleep(0.1)
        codes = {r: p.exitcode for r, p in procs.items()}
        if all(c == 0 for c in codes.values()):
            logger.info("The head node stopped this node's engine cores; exiting.")
            return 0
        logger.error("Headless node: %s (engine exit codes by rank: %s); stopping.", what, codes)
        return 1


def run_headless(engine_kwargs: dict) -> int:
    """`tokenmill serve --headless ...`: returns the exit code."""
    from tokenmill.config.engine_args import create_engine_config
    try:
        node = HeadlessNode(create_engine_config(**engine_kwargs))
    except (ValueError, TypeError, FileNotFoundError) as e:
        logger.error("Cannot start the headless node: %s", e)
        return 1
    return node.run()
