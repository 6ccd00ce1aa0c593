"""freeze_gc_heap keeps start-up objects out of collections, and thaws what it froze before (no leak across
engines); gc_paused runs start-up imports without collections; TOKENMILL_GC_DEBUG logs slow collections."""
from __future__ import annotations

import gc
import weakref

from tokenmill import envs
from tokenmill import gc_utils


class _Node:
    def __init__(self) -> None:
        self.other = self


def test_gc_paused_freezes_what_it_made_and_restores_the_collector():
    try:
        for was_enabled in (True, False):
            (gc.enable if was_enabled else gc.disable)()
            with gc_utils.gc_paused():
                assert not gc.isenabled()
                node = _Node()
                alive = weakref.ref(node)
            assert gc.isenabled() is was_enabled
            del node
            gc.collect()
            assert alive() is not None  # frozen on leaving: no collection walks start-up's objects
            gc_utils.freeze_gc_heap("ready")  # thaws, collects, freezes: start-up's garbage goes here
            assert alive() is None
    finally:
        gc.enable()
        gc.unfreeze()


def test_frozen_cycles_survive_collections_until_the_next_freeze():
    try:
        node = _Node()  # a reference cycle: only the cyclic collector can free it
        alive = weakref.ref(node)
        gc_utils.freeze_gc_heap("test")
        assert gc.get_freeze_count() > 0
        del node
        gc.collect()
        assert alive() is not None  # frozen: full collections no longer look at it
        gc_utils.freeze_gc_heap("test again")  # a second engine: the first's frozen garbage goes now
        assert alive() is None
    finally:
        gc.unfreeze()


def test_gc_debug_logs_slow_collections(monkeypatch):
    monkeypatch.setattr(gc_utils, "_debug_installed", False)
    seen = []
    monkeypatch.setattr(gc_utils.logger, "info", lambda msg, *args: seen.append(msg % args))
    before = list(gc.callbacks)
    try:
        with envs.override(TOKENMILL_GC_DEBUG=True, TOKENMILL_GC_DEBUG_MS=0):
            gc_utils.install_gc_debug()
            gc_utils.install_gc_debug()  # once per process
        assert len(gc.callbacks) == len(before) + 1
        gc.collect()
    finally:
        gc.callbacks[:] = before
    assert any(line.startswith("gc: generation 2 collection took") for line in seen), seen
