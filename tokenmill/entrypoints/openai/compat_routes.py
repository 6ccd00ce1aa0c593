"""Routes vLLM serves beside the OpenAI ones: SageMaker's /invocations, and the pooling / scoring routes, which
answer with the reason they cannot serve (tokenmill runs generative models only) instead of a bare 404."""
from __future__ import annotations

from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.responses import Response

from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.entrypoints.openai.serving_engine import ServingError

Handler = Callable[[Request, Any], Awaitable[Response]]

POOLING_ROUTES = ("/v1/embeddings", "/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank",
                  "/v2/rerank")


def add_compat_routes(app: FastAPI, serve_chat: Handler, serve_completion: Handler) -> None:
    """serve_chat / serve_completion: (raw request, parsed request) -> the response, as the OpenAI routes serve."""

    @app.post("/invocations")
    async def invocations(raw_request: Request) -> Response:
        """A body with `messages` is a chat completion, one with `prompt` a completion."""
        try:
            body = await raw_request.json()
        except ValueError:
            raise ServingError("The request body is not valid JSON.", 400) from None
        if isinstance(body, dict) and "messages" in body:
            model, serve = ChatCompletionRequest, serve_chat
        elif isinstance(body, dict) and "prompt" in body:
            model, serve = CompletionRequest, serve_completion
        else:
            raise ServingError("/invocations takes a chat completion body (with `messages`) or a completion body "
                               "(with `prompt`).", 400)
        try:
            request = model.model_validate(body)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        return await serve(raw_request, request)

    async def pooling_unsupported(raw_request: Request) -> Response:
        raise ServingError(f"{raw_request.url.path} needs an embedding, pooling or scoring model; tokenmill serves "
                           f"generative models only, through /v1/completions and /v1/chat/completions.", 400)
    for path in POOLING_ROUTES:
        app.add_api_route(path, pooling_unsupported, methods=["POST"], include_in_schema=False)


def add_stored_object_routes(app: FastAPI) -> None:
    """OpenAI's routes over stored chat completions and responses. tokenmill accepts `store` but keeps nothing, so
    each one is a 404 saying so (not a bare "Not Found" or "Method Not Allowed" the client cannot act on)."""

    async def stored_chat_completion(raw_request: Request) -> Response:
        raise ServingError("tokenmill stores no chat completions (store and metadata are accepted but nothing is "
                           "kept), so they cannot be listed, retrieved, updated or deleted.", 404, "completion_id",
                           "NotFoundError")

    async def stored_response(raw_request: Request) -> Response:
        raise ServingError(f"Response `{raw_request.path_params['response_id']}` not found: tokenmill stores no "
                           "responses (store is accepted but nothing is kept), so they cannot be retrieved, listed "
                           "or deleted.", 404, "response_id", "NotFoundError")

    for path, methods in (("/v1/chat/completions", ["GET"]), ("/v1/chat/completions/{completion_id}",
                                                              ["GET", "POST", "DELETE"]),
                          ("/v1/chat/completions/{completion_id}/messages", ["GET"])):
        app.add_api_route(path, stored_chat_completion, methods=methods, include_in_schema=False)
    for path, methods in (("/v1/responses/{response_id}", ["DELETE"]),
                          ("/v1/responses/{response_id}/input_items", ["GET"])):
        app.add_api_route(path, stored_response, methods=methods, include_in_schema=False)
