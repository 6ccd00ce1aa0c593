"""The OpenAI-compatible HTTP app: `build_app(engine, frontend_config)`, and `serve(engine, frontend)` runs it.

api_server.run_server starts the engine, then imports this module while the engine cores load the model.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import signal
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse

import tokenmill
from tokenmill import envs
from tokenmill.config.frontend import FrontendConfig
from tokenmill.engine.protocol import EngineClient, EngineDeadError
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.entrypoints.openai.protocol_responses import ResponsesRequest
from tokenmill.entrypoints.openai.protocol_tokenization import UNION_TAGS, DetokenizeRequest, TokenizeRequest
from tokenmill.entrypoints.openai.serving_chat import ChatRenderer, OpenAIServingChat
from tokenmill.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tokenmill.entrypoints.openai.middleware import (APIKeyMiddleware, HeaderCountMiddleware, JSONBodyMiddleware,
                                                     RequestIdMiddleware, add_user_middleware, error_response)
from tokenmill.entrypoints.openai.preflight import check_frontend, import_structured_backend
from tokenmill.entrypoints.openai.serving_engine import RequestTracker, ServingError, SSEStream
from tokenmill.entrypoints.openai.serving_models import OpenAIServingModels
from tokenmill.entrypoints.openai.serving_responses import OpenAIServingResponses
from tokenmill.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from tokenmill.logger import init_logger
from tokenmill.metrics.startup import SERVER, format_phases
from tokenmill.metrics.step_timing import watch_event_loop

logger = init_logger(__name__)

WATCHDOG_INTERVAL_S = 0.5


# ----------------------------------------------------------------------------------------------------------------
# responses
# ----------------------------------------------------------------------------------------------------------------
class SSEResponse(StreamingResponse):
    """A server-sent-events response that releases its engine requests however the response ends."""

    def __init__(self, stream: SSEStream) -> None:
        super().__init__(stream.body, media_type="text/event-stream")
        self._stream = stream

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._stream.close()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _serve_generation(request: Request, coro: Any) -> Response:
    """Runs a generation handler, cancelling it (which aborts its engine requests) if the client goes away."""
    handler = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        handler.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if handler not in done:
        handler.cancel()
        with contextlib.suppress(BaseException):
            await handler
        return Response(status_code=499)
    result = handler.result()
    if isinstance(result, SSEStream):
        return SSEResponse(result)
    return Response(content=result.model_dump_json(), media_type="application/json")


# Request fields typed as a union: pydantic reports one error per member ("prompt.list[int].0: ...; prompt.str: ...;
# prompt.list[str].0: ..."), which buries what the field takes; one sentence saying it replaces them.
_UNION_FIELDS = {"prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
                 "stop": "a string or a list of strings", "input": "a string or a list of input items",
                 "tool_choice": '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'}


def _loc_text(loc: list) -> str:
    """messages[0].content, as the handlers' own messages name places (pydantic writes messages.0.content)."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param, unions = [], None, set()
    for err in exc.errors():
        loc = [x for x in err.get("loc", ()) if x != "body"]
        if loc and loc[0] in UNION_TAGS:
            loc = loc[1:]
        if len(loc) > 1 and loc[0] in _UNION_FIELDS and isinstance(loc[1], str):
            if loc[0] not in unions:
                unions.add(loc[0])
                parts.append(f"{loc[0]} must be {_UNION_FIELDS[loc[0]]}.")
            param = param or loc[0]
            continue
        if err.get("type") == "json_invalid":
            parts.append(f"Invalid JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}")
            continue
        if not loc and err.get("type") in ("model_attributes_type", "dict_type"):
            parts.append("The request body must be a JSON object.")
            continue
        if not loc and err.get("type") == "missing":  # no body at all (FastAPI reports the body as missing)
            parts.append("The request body is empty; send a JSON object.")
            continue
        where = _loc_text(loc)
        if param is None:
            # A model-level check has no location; a FieldError names the field itself.
            param = str(loc[0]) if loc else getattr(err.get("ctx", {}).get("error"), "param", None)
        msg = str(err.get("msg", "invalid value"))
        if err.get("type") == "value_error":  # our own validators' messages, without pydantic's "Value error, "
            msg = msg.removeprefix("Value error, ")
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts) or "Invalid request.", param


def _non_json_media_type(request: Request) -> str | None:
    """The request's Content-Type when it names something other than JSON (the body was then never parsed)."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if request.method != "POST" or not media or media == "application/json" or media.endswith("+json"):
        return None
    return media


def _body_parse_message(exc: StarletteHTTPException) -> str | None:
    """A clearer message for FastAPI's bare "There was an error parsing the body", from the error behind it."""
    cause = exc.__cause__
    if exc.status_code != 400 or cause is None or exc.detail != "There was an error parsing the body":
        return None
    if isinstance(cause, UnicodeDecodeError):
        return (f"The request body is not valid UTF-8 (byte 0x{cause.object[cause.start]:02x} at offset "
                f"{cause.start}); send JSON encoded as UTF-8.")
    if isinstance(cause, RecursionError):
        return "The request body's JSON is nested too deeply to parse."
    return f"The request body could not be parsed as JSON: {type(cause).__name__}: {cause}"


# ----------------------------------------------------------------------------------------------------------------
# the app
# ----------------------------------------------------------------------------------------------------------------
def _lora_checker(engine: EngineClient, frontend: FrontendConfig | None):
    """The engine's adapter check (its processor's check_lora), or a refusal when LoRA is off."""
    lora_on = getattr(getattr(engine, "config", None), "lora_config", None) is not None
    processor = getattr(engine, "processor", None)

    def check(lora) -> None:
        if not lora_on:
            raise ValueError(f"LoRA adapter {lora.lora_name!r}: the server was started without --enable-lora.")
        if processor is not None:
            processor.check_lora(lora)
    return check


def _add_lora_routes(app: FastAPI, models: OpenAIServingModels, check_lora) -> None:
    """vLLM's runtime adapter routes (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True): load answers 400 for an adapter that
    cannot be served (named, the server keeps serving); unload of an unknown name 404. Unloading stops new requests
    from naming the adapter; those already running under it finish."""

    async def body_of(request: Request) -> dict:
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("lora_name"), str) or not body["lora_name"]:
            raise ServingError("The body must be a JSON object with a non-empty `lora_name`.", 400, "lora_name")
        return body

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        body = await body_of(request)
        name, path = body["lora_name"], body.get("lora_path")
        if not isinstance(path, str) or not path:
            raise ServingError("`lora_path` is required.", 400, "lora_path")
        try:
            models.add_lora(name, path, body.get("base_model_name"), check=check_lora,
                            load_inplace=bool(body.get("load_inplace", False)))
        except ValueError as e:
            raise ServingError(str(e), 400, "lora_path") from None
        return Response(content=f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        name = (await body_of(request))["lora_name"]
        if not models.remove_lora(name):
            raise ServingError(f"The lora adapter '{name}' cannot be found.", 404, "lora_name", "NotFoundError")
        return Response(content=f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")


def build_app(engine: EngineClient, frontend: FrontendConfig | None = None) -> FastAPI:
    """The FastAPI app serving `engine`. run_server sets `app.state.server` (the uvicorn server) so that a dead
    engine can stop it; `app.state.exit_code` turns 1 then."""
    frontend = frontend or FrontendConfig()
    check_frontend(frontend)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        start = getattr(engine, "start_output_handler", None)
        if start is not None:
            start()
        tasks = [asyncio.ensure_future(_watchdog(app))]
        if envs.TOKENMILL_LOOP_LAG_MS > 0:
            tasks.append(asyncio.ensure_future(watch_event_loop(envs.TOKENMILL_LOOP_LAG_MS)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()

    kwargs: dict[str, Any] = dict(title="tokenmill OpenAI-compatible API", version=tokenmill.__version__,
                                  lifespan=lifespan)
    if frontend.disable_fastapi_docs:
        kwargs.update(openapi_url=None, docs_url=None, redoc_url=None)
    if "strict_content_type" in inspect.signature(FastAPI.__init__).parameters:
        kwargs["strict_content_type"] = False  # a JSON body without a Content-Type header is still JSON
    app = FastAPI(**kwargs)
    if frontend.root_path:  # like vLLM: paths work with and without the prefix
        app.root_path = frontend.root_path

    tracker = RequestTracker()
    models = OpenAIServingModels(engine.config)
    check_lora = _lora_checker(engine, frontend)
    from tokenmill.config.lora import parse_lora_modules
    for m in parse_lora_modules(frontend.lora_modules):  # refused by name before the server listens
        models.add_lora(m.name, m.path, m.base_model_name, check=check_lora)
    renderer = ChatRenderer(engine.tokenizer, frontend)
    completion = OpenAIServingCompletion(engine, models, frontend, tracker)
    chat = OpenAIServingChat(engine, models, frontend, tracker, renderer)
    responses = OpenAIServingResponses(chat)
    tokenization = OpenAIServingTokenization(engine, models, frontend, tracker, renderer=renderer)
    if completion.default_sampling_params:
        logger.info("Default sampling parameters from the generation config: %s",
                    completion.default_sampling_params)
    app.state.engine, app.state.frontend, app.state.tracker = engine, frontend, tracker
    app.state.server, app.state.exit_code, app.state.stopping = None, 0, False

    def engine_died(why: str) -> None:
        if app.state.stopping:  # a signal stops us anyway (Ctrl+C reaches the engine process too): not an error
            return
        if app.state.exit_code == 0:
            logger.error("The engine is dead (%s); shutting the server down.", why)
        app.state.exit_code = 1
        if app.state.server is not None:
            app.state.server.should_exit = True
    app.state.engine_died = engine_died

    # ----- errors -----
    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        media = _non_json_media_type(request)
        if media is not None:
            return error_response(f"Unsupported Media Type: the body was sent as {media!r}; send it as JSON "
                                  "with 'Content-Type: application/json'.", 415, None, "UnsupportedMediaTypeError")
        message, param = _validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # The exception's headers carry what the status needs, e.g. a 405's Allow (RFC 9110 requires it).
        return error_response(_body_parse_message(exc) or str(exc.detail), exc.status_code, headers=exc.headers)

    @app.exception_handler(ServingError)
    async def _on_serving(_: Request, exc: ServingError) -> JSONResponse:
        return error_response(exc.message, exc.status, exc.param, exc.err_type)

    @app.exception_handler(EngineDeadError)
    async def _on_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        engine_died(str(exc))
        return error_response(f"The engine is dead: {exc}", 503)

    @app.exception_handler(ValueError)
    @app.exception_handler(TypeError)
    async def _on_value(_: Request, exc: Exception) -> JSONResponse:
        return error_response(str(exc), 400)

    @app.exception_handler(Exception)
    async def _on_other(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("Internal error while serving a request")
        return error_response(f"Internal server error: {type(exc).__name__}: {exc}", 500)

    # ----- routes -----
    async def health() -> Response:
        if engine.errored:
            return Response(status_code=503)
        try:
            await engine.check_health()
        except EngineDeadError:
            return Response(status_code=503)
        return Response(status_code=200)
    app.add_api_route("/health", health, methods=["GET"], operation_id="health")
    app.add_api_route("/health", health, methods=["HEAD"], operation_id="health_head",  # load-balancer probes
                      include_in_schema=False)
    app.add_api_route("/ping", health, methods=["GET"], operation_id="ping_get")
    app.add_api_route("/ping", health, methods=["POST"], operation_id="ping_post")

    @app.get("/version")
    async def version() -> dict:
        return {"version": tokenmill.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
        registry = REGISTRY
        if envs.PROMETHEUS_MULTIPROC_DIR:  # several API server processes: report all of them
            from prometheus_client import CollectorRegistry, multiprocess
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
        return Response(content=generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def show_models() -> Response:
        return Response(content=models.show_available_models().model_dump_json(), media_type="application/json")

    @app.get("/v1/models/{model_id:path}")  # OpenAI's "retrieve model"; served names may hold slashes
    async def show_model(model_id: str) -> Response:
        card = models.find(model_id)
        if card is None:
            raise ServingError(f"The model `{model_id}` does not exist.", 404, "model", "NotFoundError")
        return Response(content=card.model_dump_json(), media_type="application/json")

    if envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING:
        _add_lora_routes(app, models, check_lora)
    from tokenmill.entrypoints.openai.dev_routes import add_dev_routes
    add_dev_routes(app, engine)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> Response:
        out = await tokenization.create_tokenize(request)
        return Response(content=out.model_dump_json(), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> Response:
        out = await tokenization.create_detokenize(request)
        return Response(content=out.model_dump_json(), media_type="application/json")

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await _serve_generation(raw_request, completion.create_completion(request, raw_request))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await _serve_generation(raw_request, chat.create_chat_completion(request, raw_request))

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        return await _serve_generation(raw_request, responses.create_response(request, raw_request))

    @app.get("/v1/responses/{response_id}")
    @app.post("/v1/responses/{response_id}/cancel")
    async def stored_response(response_id: str) -> Response:
        raise ServingError(f"Response `{response_id}` not found: tokenmill stores no responses (store is accepted "
                           "but nothing is kept), so they cannot be retrieved or cancelled.", 404, "response_id",
                           "NotFoundError")

    from tokenmill.entrypoints.openai.compat_routes import add_compat_routes, add_stored_object_routes
    add_stored_object_routes(app)
    add_compat_routes(app, lambda raw, request: _serve_generation(raw, chat.create_chat_completion(request, raw)),
                      lambda raw, request: _serve_generation(raw, completion.create_completion(request, raw)))

    if frontend.enable_server_load_tracking:
        @app.get("/load")
        async def load() -> dict:
            return {"server_load": len(tracker)}

    if frontend.enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def tokenizer_info() -> dict:
            tok = engine.tokenizer
            if tok is None:
                raise ServingError("This server has no tokenizer (skip_tokenizer_init).", 400)
            return {"tokenizer_class": type(tok).__name__, "model_max_length": models.max_model_len,
                    "chat_template": renderer.chat_template or getattr(tok, "chat_template", None),
                    "special_tokens": {k: str(v) for k, v in tok.special_tokens_map.items()},
                    "vocab_size": len(tok)}

    # ----- middleware: the last added runs first -----
    app.add_middleware(CORSMiddleware, **frontend.cors_kwargs())
    api_keys = list(frontend.api_key or [])
    if not api_keys:
        env_key = envs.TOKENMILL_API_KEY or envs.VLLM_API_KEY
        if env_key:
            api_keys = [env_key]
    if api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=api_keys)
    if frontend.enable_request_id_headers:
        app.add_middleware(RequestIdMiddleware)
    app.add_middleware(HeaderCountMiddleware, max_headers=frontend.h11_max_header_count)
    app.add_middleware(JSONBodyMiddleware)
    for path in frontend.middleware:
        add_user_middleware(app, path)
    return app


async def _watchdog(app: FastAPI) -> None:
    """Stops the server (exit code 1) once the engine is dead."""
    engine = app.state.engine
    while True:
        await asyncio.sleep(WATCHDOG_INTERVAL_S)
        if engine.errored:
            try:
                await engine.check_health()
                why = "the engine core stopped"
            except EngineDeadError as e:  # says which engine and how
                why = str(e)
            app.state.engine_died(why)
            return


# ----------------------------------------------------------------------------------------------------------------
# running it
# ----------------------------------------------------------------------------------------------------------------
def _make_server(app: FastAPI, frontend: FrontendConfig):
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn, plus: in-flight requests are aborted `shutdown_timeout` seconds into a shutdown, and a SIGTERM or
        SIGINT ends the process with exit code 0 (uvicorn would re-raise the signal)."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            app.state.stopping = True
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            else:
                self.should_exit = True

        async def shutdown(self, sockets: Any = None) -> None:
            aborter = asyncio.ensure_future(_abort_after(app, frontend.shutdown_timeout))
            try:
                await super().shutdown(sockets)
            finally:
                aborter.cancel()

    kwargs: dict[str, Any] = dict(
        log_level=frontend.uvicorn_log_level, access_log=not frontend.disable_uvicorn_access_log,
        ssl_keyfile=frontend.ssl_keyfile, ssl_certfile=frontend.ssl_certfile, ssl_ca_certs=frontend.ssl_ca_certs,
        ssl_cert_reqs=frontend.ssl_cert_reqs, h11_max_incomplete_event_size=frontend.h11_max_incomplete_event_size,
        timeout_graceful_shutdown=frontend.shutdown_timeout + 5, http="h11")
    if frontend.log_config_file:
        kwargs["log_config"] = frontend.log_config_file
    if frontend.uds:
        kwargs["uds"] = frontend.uds
    else:
        kwargs.update(host=frontend.host or "0.0.0.0", port=frontend.port)
    server = Server(uvicorn.Config(app, **kwargs))
    app.state.server = server
    return server


async def _abort_after(app: FastAPI, seconds: float) -> None:
    """Shutdown: after `seconds`, abort whatever still runs (and keep sweeping until the server has stopped)."""
    await asyncio.sleep(seconds)
    while True:
        ids = list(app.state.tracker.ids)
        if ids:
            logger.info("Aborting %d request(s) still running at shutdown.", len(ids))
            with contextlib.suppress(Exception):
                await app.state.engine.abort(ids)
        await asyncio.sleep(0.5)


async def _watch_ssl_files(server: Any, frontend: FrontendConfig) -> None:
    """--enable-ssl-refresh: reload the certificate and key when their files change."""
    files = [f for f in (frontend.ssl_certfile, frontend.ssl_keyfile, frontend.ssl_ca_certs) if f]

    def stamp() -> list[float]:
        return [os.stat(f).st_mtime if os.path.exists(f) else 0.0 for f in files]
    last = stamp()
    while True:
        await asyncio.sleep(2.0)
        now = stamp()
        if now != last and server.config.ssl is not None:
            try:
                server.config.ssl.load_cert_chain(frontend.ssl_certfile, frontend.ssl_keyfile)
                if frontend.ssl_ca_certs:
                    server.config.ssl.load_verify_locations(frontend.ssl_ca_certs)
                logger.info("Reloaded the TLS certificate.")
            except Exception as e:  # a half-written file: try again at the next change
                logger.warning("Could not reload the TLS certificate: %s", e)
        last = now


async def serve(engine: EngineClient, frontend: FrontendConfig, sockets: list | None = None) -> int:
    """Serves until a signal or a dead engine; returns the exit code. `sockets`: already-listening sockets to
    serve on instead of binding host:port (several API server processes share one port that way)."""
    app = build_app(engine, frontend)
    server = _make_server(app, frontend)
    import_structured_backend()  # a no-op after api_server.run_server; frozen below with the rest of start-up
    from tokenmill.gc_utils import freeze_gc_heap
    freeze_gc_heap("API server")
    logger.info("tokenmill %s serving %s on %s", tokenmill.__version__,
                ", ".join(app.state.engine.config.model_config.served_model_name or []), frontend.url)
    _log_ready(engine)
    ssl_task = None
    if frontend.enable_ssl_refresh and frontend.ssl_certfile:
        ssl_task = asyncio.ensure_future(_watch_ssl_files(server, frontend))
    try:
        await server.serve(sockets=sockets)
    finally:
        if ssl_task is not None:
            ssl_task.cancel()
    return app.state.exit_code


def _log_ready(engine: EngineClient) -> None:
    """The start-up breakdown of this process (from its own start) and of the first engine core's."""
    if not SERVER.phases:  # serve() of a caller that started the engine itself (several API servers, tests)
        return
    SERVER.mark("API start")
    phases = dict(SERVER.phases)
    core, compiled = getattr(getattr(engine, "client", None), "engine_startup", (None, None))
    detail = ""
    if core:
        inner = [(k, v) for k, v in core.items() if k != "total"]
        if compiled is not None:
            inner.append(("of which kernel compile", compiled))
        detail = f" (the engine core's process: {format_phases(inner)})"
    logger.info("Server ready in %.1f s: %s%s", SERVER.total(), format_phases(list(phases.items())), detail)

