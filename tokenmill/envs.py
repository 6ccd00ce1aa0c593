"""Every TOKENMILL_* environment variable, typed, in one place. Read lazily so tests can monkeypatch os.environ."""
from __future__ import annotations

import os
from typing import Any, Callable


def _bool(name: str, default: bool) -> Callable[[], bool]:
    return lambda: os.environ.get(name, str(int(default))).strip().lower() in ("1", "true", "yes", "on")


def _str(name: str, default: str | None) -> Callable[[], str | None]:
    return lambda: os.environ.get(name, default)


def _int(name: str, default: int) -> Callable[[], int]:
    return lambda: int(os.environ.get(name, str(default)))


_VARIABLES: dict[str, Callable[[], Any]] = {
    # Where converted tokenizers and other derived artefacts are cached.
    "TOKENMILL_CACHE_DIR": _str("TOKENMILL_CACHE_DIR", os.path.expanduser("~/.cache/tokenmill")),
    # Log level of the `tokenmill` logger.
    "TOKENMILL_LOGGING_LEVEL": _str("TOKENMILL_LOGGING_LEVEL", "INFO"),
    # Default attention backend name (see tokenmill/attention/registry.py); empty = pick by device.
    "TOKENMILL_ATTENTION_BACKEND": _str("TOKENMILL_ATTENTION_BACKEND", ""),
    # KV cache size on CPU when neither kv_cache_memory_bytes nor num_gpu_blocks_override is given.
    "TOKENMILL_CPU_KVCACHE_SPACE_GIB": _int("TOKENMILL_CPU_KVCACHE_SPACE_GIB", 1),
    # Number of torch intra-op threads on CPU (0 = torch's default).
    "TOKENMILL_CPU_NUM_THREADS": _int("TOKENMILL_CPU_NUM_THREADS", 0),
    # Accumulate per-phase step times (schedule / execute / update / graph vs eager) for benchmarks.
    "TOKENMILL_STEP_TIMING": _bool("TOKENMILL_STEP_TIMING", False),
    # API key for the server when --api-key is not given.
    "TOKENMILL_API_KEY": _str("TOKENMILL_API_KEY", None),
    # Not ours, read here so every variable lives in one place: the CUDA devices this process may use (each local
    # data-parallel engine core gets its own slice of them).
    "CUDA_VISIBLE_DEVICES": _str("CUDA_VISIBLE_DEVICES", None),
    # prometheus_client's multiprocess directory; set by tokenmill when several API server processes share the
    # metrics (--api-server-count > 1).
    "PROMETHEUS_MULTIPROC_DIR": _str("PROMETHEUS_MULTIPROC_DIR", None),
}


def __getattr__(name: str) -> Any:
    if name in _VARIABLES:
        return _VARIABLES[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(_VARIABLES)
