"""The package logger: one `tokenmill` logger with a compact format, level from TOKENMILL_LOGGING_LEVEL."""
from __future__ import annotations

import logging
import sys

_configured = False


def init_logger(name: str) -> logging.Logger:
    global _configured
    if not _configured:
        from tokenmill import envs
        root = logging.getLogger("tokenmill")
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(envs.TOKENMILL_LOGGING_LEVEL.upper())
        root.propagate = False
        _configured = True
    return logging.getLogger(name)
