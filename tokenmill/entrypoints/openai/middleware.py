"""The API server's ASGI middleware (plain ASGI, so streaming and disconnect detection pass through untouched):
API keys, request ids, the header-count limit, JSON bodies sent without a JSON content type, and user middleware
given by import path (--middleware)."""
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

# Content types a JSON body arrives under from clients that forget the header: curl -d sends a form type, some
# HTTP libraries text/plain. Everything the API accepts by POST is JSON, so these are read as JSON.
_JSON_BY_MISTAKE = (b"application/x-www-form-urlencoded", b"text/plain")


def error_response(message: str, status: int, param: str | None = None, err_type: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, err_type), status_code=status, headers=headers)


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


class JSONBodyMiddleware:
    """POST bodies sent as application/x-www-form-urlencoded (curl -d without -H) or text/plain are parsed as
    JSON: a valid body then just works, and an invalid one gets the JSON parse error instead of a type error."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST":
            headers = scope.get("headers") or []
            for k, (name, value) in enumerate(headers):
                if name == b"content-type" and value.split(b";")[0].strip().lower() in _JSON_BY_MISTAKE:
                    headers = list(headers)
                    headers[k] = (b"content-type", b"application/json")
                    scope = dict(scope, headers=headers)
                    break
        await self.app(scope, receive, send)
