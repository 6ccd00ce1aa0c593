"""What the API server checks and loads before it serves: front-end options it cannot honour fail before the engine
starts, and the structured-output backend is imported before the first request needs it. Nothing here imports the
HTTP app, so api_server.run_server can do the checks before anything heavy."""
from __future__ import annotations

import importlib

from tokenmill.config.frontend import FrontendConfig
from tokenmill.logger import init_logger

logger = init_logger(__name__)


def check_frontend(frontend: FrontendConfig) -> None:
    """Front-end options that are accepted by the parser but need features tokenmill does not have yet."""
    from tokenmill.structured import StructuredOutputsConfig
    # Unknown keys, backends and options tokenmill cannot honour yet fail here, before the engine starts.
    StructuredOutputsConfig.from_dict(frontend.structured_outputs_config).check_supported()
    frontend.check_tls_files()


def import_structured_backend() -> None:
    """Imports xgrammar now, not on the first constrained request: loading it blocked the event loop (every stream)
    for ~250 ms on the H200 host."""
    try:
        importlib.import_module("tokenmill.structured.backend_xgrammar")
    except ImportError as e:  # a broken install: serve anyway; constrained requests fail with this error
        logger.warning("Structured outputs are unavailable: %s", e)
