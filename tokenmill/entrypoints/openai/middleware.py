"""The API server's ASGI middleware (plain ASGI, so streaming and disconnect detection pass through untouched):
API keys, request ids, the header-count limit, the JSON content type of request bodies, and user middleware given
by import path (--middleware)."""
from __future__ import annotations

import hashlib
import hmac
import importlib
import inspect
import uuid
from typing import Any

from fastapi import FastAPI
from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import JSONResponse

from tokenmill.entrypoints.openai.serving_engine import GENERATED_REQUEST_ID, error_body

def error_response(message: str, status: int, param: str | None = None, err_type: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, err_type), status_code=status)


def _route_path(scope: dict) -> str:
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class APIKeyMiddleware:
    """Every /v1/* request must carry `Authorization: Bearer <one of the keys>` (compared in constant time)."""

    def __init__(self, app: Any, api_keys: list[str]) -> None:
        self.app = app
        self.digests = [hashlib.sha256(f"Bearer {k}".encode()).digest() for k in api_keys]

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS" \
                or not _route_path(scope).startswith("/v1"):
            return await self.app(scope, receive, send)
        given = hashlib.sha256(Headers(scope=scope).get("authorization", "").encode()).digest()
        ok = False
        for digest in self.digests:  # fixed-length digests, no early exit: timing reveals nothing about keys
            ok |= hmac.compare_digest(given, digest)
        if not ok:
            response = error_response(
                "Unauthorized: missing or invalid API key (send 'Authorization: Bearer <key>').", 401, None,
                "AuthenticationError")
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


class RequestIdMiddleware:
    """Echoes the client's X-Request-Id, or generates one (which then also names the completion, unless the body
    gives a request_id)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = Headers(scope=scope).get("x-request-id")
        if not request_id:
            request_id = uuid.uuid4().hex
            scope = dict(scope)
            scope[GENERATED_REQUEST_ID] = request_id

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append("X-Request-Id", request_id)
            await send(message)
        await self.app(scope, receive, send_with_id)


class HeaderCountMiddleware:
    """--h11-max-header-count: requests with more headers get a 431."""

    def __init__(self, app: Any, max_headers: int) -> None:
        self.app = app
        self.max_headers = max_headers

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and len(scope.get("headers", ())) > self.max_headers:
            response = error_response(f"Too many request headers (at most {self.max_headers}).", 431)
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


def add_user_middleware(app: FastAPI, path: str) -> None:
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(f"--middleware {path!r} must be an import path like 'package.module.Name'.")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"Cannot import --middleware {path!r}: {e}") from None
    if inspect.isclass(obj):
        app.add_middleware(obj)
    elif inspect.iscoroutinefunction(obj):
        app.middleware("http")(obj)
    else:
        raise ValueError(f"--middleware {path!r} is neither a class nor an async function.")


class JSONContentTypeMiddleware:
    """POSTs to the JSON endpoints must say `Content-Type: application/json`, as vLLM requires: any other type (or
    none, e.g. curl -d without -H, which sends a form type) is a 400 naming the header, instead of a guess at what
    the body holds."""

    def __init__(self, app: Any, paths: frozenset[str]) -> None:
        self.app = app
        self.paths = paths

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST" and _route_path(scope) in self.paths:
            given = Headers(scope=scope).get("content-type", "")
            if given.split(";")[0].strip().lower() != "application/json":
                shown = f"Content-Type {given!r}" if given else "no Content-Type header"
                response = error_response(
                    f"Unsupported Media Type: Only 'application/json' is allowed (the request has {shown}; send "
                    "the JSON body with the header 'Content-Type: application/json').", 400)
                return await response(scope, receive, send)
        await self.app(scope, receive, send)
