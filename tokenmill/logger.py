"""The package logger: one `tokenmill` logger with a compact format, level from TOKENMILL_LOGGING_LEVEL (or vLLM's
VLLM_LOGGING_LEVEL)."""
from __future__ import annotations

import logging
import sys

_configured = False
# The names logging accepts (logging.getLevelNamesMapping() would list them, but only from Python 3.11 on).
LEVELS = ("CRITICAL", "FATAL", "ERROR", "WARN", "WARNING", "INFO", "DEBUG", "NOTSET")


def log_level() -> str:
    """The level TOKENMILL_LOGGING_LEVEL, else VLLM_LOGGING_LEVEL, asks for (INFO when neither is set)."""
    from tokenmill import envs
    for name in ("TOKENMILL_LOGGING_LEVEL", "VLLM_LOGGING_LEVEL"):
        value = getattr(envs, name)
        if value:
            if value.strip().upper() not in LEVELS:
                raise ValueError(f"{name}={value!r}: choose one of {', '.join(LEVELS)}")
            return value.strip().upper()
    return "INFO"


def init_logger(name: str) -> logging.Logger:
    global _configured
    if not _configured:
        root = logging.getLogger("tokenmill")
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(log_level())
        root.propagate = False
        _configured = True
    return logging.getLogger(name)
