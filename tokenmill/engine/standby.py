"""An engine-core process started before its config exists, so that its imports overlap the API server's.

`tokenmill serve` spends most of its start-up importing torch, transformers and tokenmill in the API server, and
torch, triton and tokenmill in the engine core (seconds each on a GPU host). `prestart()`, called by the CLI before
its own heavy imports, spawns a process that does the engine core's imports and then waits on a pipe; the
launcher's first local engine core takes it (`take()`) and sends it its config and its per-rank environment instead
of spawning a fresh one. The process has not touched CUDA when the environment arrives, so CUDA_VISIBLE_DEVICES still applies.

A standby that is never taken (a bad flag, several engines or API servers) exits when the pipe closes: when this
process sends it None (`discard()`), or dies.
"""
from __future__ import annotations

import multiprocessing
import os

_standby: tuple[multiprocessing.Process, object] | None = None


def prestart() -> None:
    """Spawns the standby engine-core process (once per process; a no-op after the first call)."""
    global _standby
    if _standby is not None:
        return
    mp = multiprocessing.get_context("spawn")
    recv, send = mp.Pipe(duplex=False)
    proc = mp.Process(target=_standby_main, args=(recv,), name="TokenmillEngineCore_DP0", daemon=True)
    proc.start()
    recv.close()
    _standby = (proc, send)


def take(env: dict[str, str], args: tuple) -> multiprocessing.Process | None:
    """Hands `run_engine_core(*args)` to the standby process, with `env` set first; returns the process, or None
    when there is no live standby (the caller spawns one)."""
    global _standby
    if _standby is None:
        return None
    proc, send = _standby
    _standby = None
    if not proc.is_alive():
        send.close()
        return None
    try:
        send.send((env, args))
    except (OSError, EOFError):
        proc.kill()
        return None
    finally:
        send.close()
    return proc


def discard() -> None:
    """Lets an untaken standby exit."""
    global _standby
    if _standby is not None:
        proc, send = _standby
        _standby = None
        try:
            send.send(None)
        except (OSError, EOFError):
            pass
        send.close()
        proc.join(5)


def _standby_main(recv) -> None:
    """The standby's entry point: import what every engine core needs, then wait for its work."""
    import signal
    import time
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as an engine core: the process that started us decides

    from tokenmill.gc_utils import gc_paused
    from tokenmill.metrics.startup import process_age
    with gc_paused():
        import torch
        if torch.version.cuda is not None:  # the GPU kernels' compiler; importing it touches no device
            import triton  # noqa: F401
            import triton.language  # noqa: F401
        # Not transformers: the config arrives as a snapshot of plain values (config/model.py), and transformers
        # (seconds of imports) loads only where a feature calls into it.
        from tokenmill.engine import core_proc, engine_core  # noqa: F401
        from tokenmill.worker import worker  # noqa: F401
    imported = process_age()
    t = time.monotonic()
    try:
        msg = recv.recv()
    except (EOFError, OSError):
        return
    finally:
        recv.close()
    if msg is None:
        return
    env, args = msg
    os.environ.update(env)
    from tokenmill import envs
    envs.reset()
    core_proc.run_engine_core(*args, standby_times=(imported, time.monotonic() - t))
