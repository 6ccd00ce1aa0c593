"""A worker rank's process: join the world, then run every call rank 0 broadcasts until told to stop.

The loop knows no step protocol: each message names a Worker method and its arguments. Started by
`LocalProcessLauncher` as `python -m tokenmill.executor.worker_proc DEATH_FD` with a pickled WorkerSpec on stdin.
"""
from __future__ import annotations

import os
import pickle
import signal
import sys
import threading

from tokenmill.logger import init_logger

logger = init_logger(__name__)


def _exit_when_parent_goes(stdin) -> None:
    """stdin stays open while the engine lives; EOF means it stopped or died, so leave at once (even from inside
    a collective that will never complete)."""
    try:
        while stdin.read(65536):
            pass
    except (OSError, ValueError):
        pass
    os._exit(0)


def run_worker(spec) -> int:
    """Serve rank 0's broadcasts until SHUTDOWN (returns 0); on any error, report it to rank 0 and return 1."""
    from tokenmill.distributed import destroy_distributed
    from tokenmill.executor.rpc_broadcast import CALL, PING, SHUTDOWN, RpcSubscriber
    from tokenmill.worker.worker import Worker

    rpc = RpcSubscriber(spec.rpc_addr, spec.reply_addr, spec.rank)
    try:
        worker = Worker(spec.config, rank=spec.rank, local_rank=spec.local_rank,
                        distributed_init_method=spec.distributed_init_method,
                        result_addr=getattr(spec, "result_addr", None))
        while True:
            kind, body = rpc.recv()
            if kind == PING:
                rpc.pong()
            elif kind == CALL:
                method, args, kwargs = body
                getattr(worker, method)(*args, **kwargs)
            elif kind == SHUTDOWN:
                break
    except BaseException as e:
        if isinstance(e, ValueError):  # the user's model or options (rank 0 raises the same): the message suffices
            logger.error("Worker rank %d failed: %s", spec.rank, e)
        else:
            logger.exception("Worker rank %d failed", spec.rank)
        rpc.report_error()
        rpc.close()
        return 1
    worker.close()
    destroy_distributed(worker.parallel_state)
    rpc.close()
    return 0


def main() -> None:
    # Ctrl-C or a SIGTERM for the whole process group reaches the workers too: rank 0 decides when they stop (it
    # sends SHUTDOWN), and a worker whose engine is gone leaves by itself (_exit_when_parent_goes).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    death_fd = int(sys.argv[1])
    os.set_inheritable(death_fd, False)  # only this process may hold the pipe rank 0 watches
    stdin = sys.stdin.buffer
    spec = pickle.load(stdin)
    threading.Thread(target=_exit_when_parent_goes, args=(stdin,), name="tokenmill-parent-watch",
                     daemon=True).start()
    code = run_worker(spec)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: nothing left to flush, and it can hang on torch's threads


if __name__ == "__main__":
    main()
