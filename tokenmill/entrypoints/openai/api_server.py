"""Starting the OpenAI-compatible server: `run_server(engine_kwargs, frontend)` builds the engine's config, starts
the engine cores, then serves app.py's FastAPI app.

`python -m tokenmill.entrypoints.openai.api_server --model ...` works like vLLM's module entry point.

The engine core (its process already importing, engine/standby.py) can do nothing until this process has built
the config and sent it, so this module imports nothing of the HTTP app (FastAPI, the OpenAI protocol models,
uvicorn, xgrammar: about 0.5 s on 2 CPU cores) before that: the app is imported while the engine cores load the
model.
"""
from __future__ import annotations

import asyncio
import sys
from typing import Any

from tokenmill.config.frontend import FrontendConfig
from tokenmill.entrypoints.openai.preflight import check_frontend, import_structured_backend
from tokenmill.gc_utils import gc_paused
from tokenmill.logger import init_logger
from tokenmill.metrics.startup import SERVER

logger = init_logger(__name__)


def _import_app() -> None:
    import uvicorn  # noqa: F401

    import tokenmill.entrypoints.openai.app  # noqa: F401
    import_structured_backend()


def run_server(engine_kwargs: dict[str, Any], frontend: FrontendConfig) -> None:
    """Starts the engine, serves until stopped, then exits: 0 after SIGTERM/SIGINT, 1 if the engine died.
    `--headless` runs only this node's data-parallel engine cores; `--api-server-count N` runs N API servers."""
    try:
        check_frontend(frontend)
    except ValueError as e:  # a bad front-end option: say so before loading the model, no traceback
        logger.error("Cannot start the server: %s", e)
        sys.exit(1)
    from tokenmill.config.scheduler import server_defaults
    engine_kwargs = server_defaults(engine_kwargs)
    if frontend.headless or frontend.api_server_count > 1:
        from tokenmill.engine import standby
        standby.discard()  # the engine cores belong to other processes here
        if frontend.headless:
            from tokenmill.engine.headless import run_headless
            code = run_headless(engine_kwargs)
        else:
            from tokenmill.entrypoints.openai.app import serve
            from tokenmill.entrypoints.openai.multi_server import run_api_servers
            code = run_api_servers(engine_kwargs, frontend, serve)
        if code:
            sys.exit(code)
        return
    if frontend.disable_frontend_multiprocessing:
        logger.warning("--disable-frontend-multiprocessing has no effect: tokenmill's API server always talks to "
                       "an engine core running in its own process.")

    SERVER.mark("interpreter and imports")

    async def main() -> int:
        from tokenmill.config.engine_args import create_engine_config, engine_kwargs as merge_kwargs
        from tokenmill.engine.async_llm import AsyncLLM
        try:
            with gc_paused():  # imports (transformers, the app) and the tokenizer: objects that live on
                config = create_engine_config(**merge_kwargs(None, engine_kwargs))
                SERVER.mark("engine config")
                engine = AsyncLLM(config, log_stats=not frontend.disable_log_stats, while_starting=_import_app)
            SERVER.mark("tokenizer and engine core")
        except (ValueError, TypeError, FileNotFoundError) as e:  # a bad model or option: say so, no traceback
            logger.error("Cannot start the engine: %s", e)
            return 1
        try:
            from tokenmill.entrypoints.openai.app import serve
            return await serve(engine, frontend)
        finally:
            engine.shutdown()

    code = asyncio.run(main())
    if code:
        sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    with gc_paused():
        from tokenmill.config.args import parse_serve_args
    engine_kwargs, frontend = parse_serve_args(sys.argv[1:] if argv is None else argv,
                                               prog="python -m tokenmill.entrypoints.openai.api_server")
    run_server(engine_kwargs, frontend)


if __name__ == "__main__":
    main()
