"""vLLM's development routes, served when VLLM_SERVER_DEV_MODE=1: the ones RL frameworks call between rollouts.

POST /sleep?level=1|2     release the model's device memory (needs --enable-sleep-mode; no request may be running)
POST /wake_up[?tags=...]  take it back ("weights", "kv_cache"; repeated tags or none for both)
GET  /is_sleeping         {"is_sleeping": bool}
POST /reset_prefix_cache  drop the prefix cache's cached blocks (after a weight update)

While the engine sleeps, generation requests are a 503 saying so (serving_engine.check_awake). POST /start_profile
and /stop_profile are served when VLLM_TORCH_PROFILER_DIR is set, as in vLLM.
"""
from __future__ import annotations

from fastapi import FastAPI, Query
from starlette.responses import JSONResponse, Response

from tokenmill import envs
from tokenmill.engine.protocol import EngineClient
from tokenmill.entrypoints.openai.serving_engine import ServingError
from tokenmill.logger import init_logger

logger = init_logger(__name__)

WAKE_TAGS = ("weights", "kv_cache")


async def _call(what: str, coro) -> None:
    """An engine utility's failure (sleep mode off, requests still running, the profiler not started) is the
    caller's to fix: a 400 with the engine's message."""
    try:
        await coro
    except RuntimeError as e:
        raise ServingError(f"{what}: {e}", 400) from None


def add_dev_routes(app: FastAPI, engine: EngineClient) -> None:
    if envs.VLLM_SERVER_DEV_MODE:
        logger.warning("VLLM_SERVER_DEV_MODE is set: /sleep, /wake_up, /is_sleeping and /reset_prefix_cache are "
                       "served; do not expose them to untrusted clients.")

        @app.post("/sleep")
        async def sleep(level: str = Query("1")) -> Response:
            if level not in ("1", "2"):
                raise ServingError(f"level must be 1 (weights kept in host memory) or 2 (weights discarded), got "
                                   f"{level!r}.", 400, "level")
            await _call("sleep", engine.sleep(int(level)))
            return Response(status_code=200)

        @app.post("/wake_up")
        async def wake_up(tags: list[str] | None = Query(None)) -> Response:
            bad = [t for t in tags or [] if t not in WAKE_TAGS]
            if bad:
                raise ServingError(f"unknown tag(s) {bad}: the parts are {list(WAKE_TAGS)}.", 400, "tags")
            await _call("wake_up", engine.wake_up(tags or None))
            return Response(status_code=200)

        @app.get("/is_sleeping")
        async def is_sleeping() -> JSONResponse:
            return JSONResponse({"is_sleeping": await engine.is_sleeping()})

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache() -> Response:
            if not await engine.reset_prefix_cache():
                raise ServingError("The prefix cache could not be reset: requests are still running.", 400)
            return Response(status_code=200)

    if envs.VLLM_TORCH_PROFILER_DIR:
        @app.post("/start_profile")
        async def start_profile() -> Response:
            await _call("start_profile", engine.start_profile())
            return Response(status_code=200)

        @app.post("/stop_profile")
        async def stop_profile() -> Response:
            await _call("stop_profile", engine.stop_profile())
            return Response(status_code=200)
