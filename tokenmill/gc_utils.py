"""Keep Python's garbage collector off the step loop.

An engine holds hundreds of thousands of long-lived objects from start-up (one per KV block: 371k for an H200's
pool of a small model, plus modules, the tokenizer and the model's Python objects). A full collection walks all of
them: ~100 ms on this CI machine, tens of ms on the GPU host, during which no step runs and no token streams out.
`freeze_gc_heap()` moves what start-up built into the permanent generation once the engine (or the API server) is
ready, so later collections only look at objects made while serving. `TOKENMILL_GC_DEBUG=1` logs every collection
that takes longer than `TOKENMILL_GC_DEBUG_MS` milliseconds, with its generation.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import os
import time

from tokenmill import envs
from tokenmill.logger import init_logger

logger = init_logger(__name__)

_debug_installed = False
_thaw_at_exit_registered = False


@contextlib.contextmanager
def gc_paused():
    """No garbage collection inside, and what is alive on leaving is frozen (as by `freeze_gc_heap`, less the
    collection). For start-up imports: they allocate millions of objects that nearly all live on, so the collections
    they set off find little and cost 12% of `tokenmill serve`'s import time (2 CPU cores). Left unfrozen, those
    objects would all be walked by the first collection after. The start-up's one full collection stays where it
    was: `freeze_gc_heap` (thaw, collect, freeze) when the process is ready. The collector is left on or off as it
    was found."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def freeze_gc_heap(what: str) -> None:
    """Collect once, then exempt every object alive now from future collections. Call when start-up is done.

    Objects frozen by an earlier call (an earlier engine in the same process, say) are thawed first, so whatever
    of them has become garbage since is collected now rather than never."""
    global _thaw_at_exit_registered
    t = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    if not _thaw_at_exit_registered:
        # The interpreter's last collections skip frozen objects: extension objects (triton's nanobind bindings)
        # then outlive it and print leak warnings at exit.
        atexit.register(gc.unfreeze)
        _thaw_at_exit_registered = True
    logger.debug("%s: froze %d start-up objects out of garbage collection (%.0f ms)", what, gc.get_freeze_count(),
                 1000 * (time.perf_counter() - t))
    install_gc_debug()


def install_gc_debug() -> None:
    """With TOKENMILL_GC_DEBUG set, log slow collections of this process (once per process)."""
    global _debug_installed
    if _debug_installed or not envs.TOKENMILL_GC_DEBUG:
        return
    _debug_installed = True
    threshold_s = envs.TOKENMILL_GC_DEBUG_MS / 1000.0
    started = [0.0]

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        took = time.perf_counter() - started[0]
        if took >= threshold_s:
            logger.info("gc: generation %d collection took %.1f ms (%d collected, %d uncollectable; pid %d, %d "
                        "objects tracked)", info["generation"], 1000 * took, info.get("collected", 0),
                        info.get("uncollectable", 0), os.getpid(), len(gc.get_objects()))
    gc.callbacks.append(callback)
