"""POST /v1/responses: OpenAI's Responses API for text generation, served by the chat route's machinery.

Contract of `OpenAIServingResponses`:
- `create_response(request, raw_request)` returns a `ResponsesResponse` (not streamed) or an `SSEStream` of
  Responses events: the two shapes `_serve_generation` serves, so a client that goes away aborts the engine request.
- A request becomes the equivalent ChatCompletionRequest (instructions + input -> messages, max_output_tokens ->
  max_completion_tokens, text.format -> response_format, temperature, top_p, seed, user) and OpenAIServingChat runs
  it: chat template, generation-config defaults, structured outputs, reasoning parser and length checks are exactly
  the chat route's. Its errors come back with the Responses field names.
- Nothing is stored. Fields that would change the result but cannot be honoured (tools, previous_response_id,
  reasoning effort, background, non-text input items, ...) are a 400 naming the field, never ignored.
- Output: a `reasoning` item when the server's reasoning parser split some off, then one assistant `message` with one
  `output_text` part. A response cut short by the token limit is `incomplete` (reason max_output_tokens); its stream
  ends with `response.incomplete`, as OpenAI's does, otherwise with `response.completed`.
- Streaming turns each chat chunk into at most a few events (one JSON parse, one dump); the text is kept as pieces
  and joined once per item.
"""
from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator

from pydantic import ValidationError

from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, ChatCompletionResponse
from tokenmill.entrypoints.openai.protocol_responses import ResponsesRequest, ResponsesResponse
from tokenmill.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenmill.entrypoints.openai.serving_engine import ServingError, SSEStream, random_id

# Responses roles -> chat roles. "developer" is OpenAI's new name for system prompts; most open models' chat
# templates know only "system" (some reject other roles), so it is rendered as one.
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text")  # output_text: an earlier answer passed back as history
# Chat field names in the errors of the chat machinery -> the Responses field the client actually sent.
_FIELD_NAMES = {"max_completion_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}


def input_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of `instructions` and `input`; anything but text messages is a ServingError."""
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
        return messages
    for i, item in enumerate(request.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind != "message":
            raise ServingError(f"{where}: input items of type {kind!r} are not supported by tokenmill (only "
                               "messages with text content).", 400, f"{where}.type")
        role = item.get("role")
        if role not in _ROLES:
            raise ServingError(f"{where}.role must be one of user, system, developer, assistant; got {role!r}.",
                               400, f"{where}.role")
        content = item.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                ptype = part.get("type") if isinstance(part, dict) else None
                if ptype not in _TEXT_PARTS:
                    raise ServingError(f"{where}.content[{j}]: content of type {ptype!r} is not supported by "
                                       "tokenmill (text only: input_text, output_text).", 400,
                                       f"{where}.content[{j}].type")
                if not isinstance(part.get("text"), str):
                    raise ServingError(f"{where}.content[{j}].text must be a string.", 400,
                                       f"{where}.content[{j}].text")
                parts.append({"type": "text", "text": part["text"]})
            content = parts  # the chat template's content format decides how parts are joined, as for chat
        elif not isinstance(content, str):
            raise ServingError(f"{where}.content must be a string or a list of input_text parts.", 400,
                               f"{where}.content")
        messages.append({"role": _ROLES[role], "content": content})
    if not messages:
        raise ServingError("input must contain at least one message.", 400, "input")
    return messages


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text` -> the chat route's response_format (None for plain text). Checked here so errors name text.*."""
    if text is None:
        return None
    if text.get("verbosity") not in (None, "medium"):
        raise ServingError(f"text.verbosity={text['verbosity']!r} is not supported by tokenmill (only 'medium').",
                           400, "text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise ServingError(f"text.format.type must be text, json_object or json_schema; got {kind!r}.", 400,
                           "text.format.type")
    if not isinstance(fmt.get("name"), str) or not fmt["name"]:
        raise ServingError("text.format.name must be a non-empty string when text.format.type is 'json_schema'.",
                           400, "text.format.name")
    if not isinstance(fmt.get("schema"), dict):
        raise ServingError("text.format.schema must be the JSON schema (an object) of the output.", 400,
                           "text.format.schema")
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
    return {"type": "json_schema", "json_schema": spec}


def _renamed(e: ServingError) -> ServingError:
    # Only the unambiguous field name is rewritten in the text ("messages" is also plain English there).
    message = e.message.replace("max_completion_tokens", "max_output_tokens")
    return ServingError(message, e.status, _FIELD_NAMES.get(e.param or "", e.param), e.err_type)


def _usage(u: dict[str, Any] | None) -> dict[str, Any] | None:
    if u is None:
        return None
    prompt, completion = u.get("prompt_tokens") or 0, u.get("completion_tokens") or 0
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    # Reasoning tokens are not counted apart by the engine (they are within output_tokens); the prefix cache has no
    # billed writes to report (the openai package requires cache_write_tokens).
    return {"input_tokens": prompt, "output_tokens": completion, "total_tokens": prompt + completion,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


class _Item:
    """One output item (a message, or the reasoning before it) and its text so far."""
    __slots__ = ("kind", "id", "index", "pieces", "text")

    def __init__(self, kind: str, suffix: str, index: int) -> None:
        self.kind, self.index = kind, index
        self.id = ("msg_" if kind == "message" else "rs_") + suffix
        self.pieces: list[str] = []
        self.text = ""

    def part(self, text: str) -> dict[str, Any]:
        if self.kind == "message":
            return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {"type": "reasoning_text", "text": text}

    def json(self, status: str, content: bool = True) -> dict[str, Any]:
        parts = [self.part(self.text)] if content else []
        if self.kind == "message":
            return {"type": "message", "id": self.id, "status": status, "role": "assistant", "content": parts}
        return {"type": "reasoning", "id": self.id, "status": status, "summary": [], "content": parts}


class _Events:
    """Formats SSE events, numbering them."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, payload: dict[str, Any]) -> str:
        payload["type"] = kind
        payload["sequence_number"] = self.seq
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def open(self, item: _Item) -> list[str]:
        ref = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        return [self("response.output_item.added", {"output_index": item.index,
                                                     "item": item.json("in_progress", content=False)}),
                self("response.content_part.added", {**ref, "part": item.part("")})]

    def delta(self, item: _Item, text: str) -> str:
        if item.kind == "message":
            return self("response.output_text.delta", {"item_id": item.id, "output_index": item.index,
                                                       "content_index": 0, "delta": text, "logprobs": []})
        return self("response.reasoning_text.delta", {"item_id": item.id, "output_index": item.index,
                                                      "content_index": 0, "delta": text})

    def close(self, item: _Item, status: str) -> list[str]:
        item.text = "".join(item.pieces)
        ref = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        done = {**ref, "text": item.text, "logprobs": []} if item.kind == "message" else {**ref, "text": item.text}
        kind = "response.output_text.done" if item.kind == "message" else "response.reasoning_text.done"
        return [self(kind, done),
                self("response.content_part.done", {**ref, "part": item.part(item.text)}),
                self("response.output_item.done", {"output_index": item.index, "item": item.json(status)})]


class OpenAIServingResponses:

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create_response(self, request: ResponsesRequest,
                              raw_request: Any = None) -> ResponsesResponse | SSEStream:
        self.chat.check_model(request.model)
        bad = request.unsupported_fields()
        if bad:
            raise ServingError("; ".join(f"{name}: {why}" for name, why in bad) + ".", 400, bad[0][0])
        chat_request = self._chat_request(request)
        try:
            result = await self.chat.create_chat_completion(chat_request, raw_request)
        except ServingError as e:
            raise _renamed(e) from None
        if isinstance(result, SSEStream):
            return SSEStream(self._stream(request, result.body), result.sources)
        return self._from_chat(request, result)

    def _chat_request(self, request: ResponsesRequest) -> ChatCompletionRequest:
        fields: dict[str, Any] = dict(
            model=request.model, messages=input_messages(request), max_completion_tokens=request.max_output_tokens,
            temperature=request.temperature, top_p=request.top_p, seed=request.seed,
            user=request.user or request.safety_identifier, response_format=response_format(request.text),
            stream=request.stream)
        if request.stream:
            fields["stream_options"] = {"include_usage": True}  # the final usage chunk fills response.usage
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err.get("loc", ()))
            raise _renamed(ServingError(f"{loc}: {err.get('msg')}", 400, loc.split(".")[0] or None)) from None

    # ----- the Response object -----
    def _response(self, request: ResponsesRequest, suffix: str, created: int, output: list[dict[str, Any]],
                  status: str, usage: dict[str, Any] | None = None,
                  error: dict[str, Any] | None = None) -> ResponsesResponse:
        defaults = self.chat.default_sampling_params
        return ResponsesResponse(
            id=f"resp_{suffix}", created_at=created, model=self.chat.models.model_name, status=status,
            incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None, error=error,
            output=output, usage=usage, instructions=request.instructions, metadata=request.metadata or {},
            parallel_tool_calls=request.parallel_tool_calls is not False, tool_choice=request.tool_choice or "auto",
            temperature=request.temperature if request.temperature is not None else defaults.get("temperature", 1.0),
            top_p=request.top_p if request.top_p is not None else defaults.get("top_p", 1.0),
            max_output_tokens=request.max_output_tokens, text=request.text or {"format": {"type": "text"}},
            user=request.user)

    def _from_chat(self, request: ResponsesRequest, res: ChatCompletionResponse) -> ResponsesResponse:
        choice = res.choices[0]
        suffix = _suffix(res.id)
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        items = []
        if choice.message.reasoning:
            items.append(_Item("reasoning", suffix, 0))
            items[-1].text = choice.message.reasoning
        if choice.message.content or not items:
            items.append(_Item("message", suffix, len(items)))
            items[-1].text = choice.message.content or ""
        output = [item.json("completed") for item in items[:-1]] + [items[-1].json(status)]
        return self._response(request, suffix, res.created, output, status, _usage(res.usage.model_dump()))

    # ----- streaming -----
    async def _stream(self, request: ResponsesRequest, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        event = _Events()
        created = int(time.time())
        suffix: str | None = None
        items: list[_Item] = []
        finish_reason = usage = error = None
        try:
            async for chunk in chunks:
                data = chunk[len("data: "):]
                if data.startswith("[DONE]"):
                    break
                obj = json.loads(data)
                if "error" in obj:
                    error = obj["error"]
                    break
                if suffix is None:  # the chat route's first chunk (the role) comes before any token
                    suffix, created = _suffix(obj["id"]), obj.get("created", created)
                    snapshot = self._response(request, suffix, created, [], "in_progress").model_dump(mode="json")
                    yield event("response.created", {"response": snapshot})
                    yield event("response.in_progress", {"response": snapshot})
                if obj.get("usage"):
                    usage = obj["usage"]
                for choice in obj["choices"]:
                    delta = choice["delta"]
                    for kind, text in (("reasoning", delta.get("reasoning")), ("message", delta.get("content"))):
                        if not text:
                            continue
                        if not items or items[-1].kind != kind:
                            if items:
                                for e in event.close(items[-1], "completed"):
                                    yield e
                            items.append(_Item(kind, suffix, len(items)))
                            for e in event.open(items[-1]):
                                yield e
                        items[-1].pieces.append(text)
                        yield event.delta(items[-1], text)
                    finish_reason = choice.get("finish_reason") or finish_reason
        finally:
            await chunks.aclose()
        suffix = suffix or random_id()
        if error is not None:
            yield event("error", {"code": str(error.get("code")), "message": error.get("message", ""),
                                  "param": error.get("param")})
            for item in items:  # the text so far, also of the item left open
                item.text = "".join(item.pieces)
            output = [item.json("incomplete") for item in items]
            failed = self._response(request, suffix, created, output, "failed", _usage(usage),
                                    {"code": "server_error" if (error.get("code") or 500) >= 500
                                     else "invalid_prompt", "message": error.get("message", "")})
            yield event("response.failed", {"response": failed.model_dump(mode="json")})
            return
        status = "incomplete" if finish_reason == "length" else "completed"
        if not items:  # nothing generated: still one (empty) message, as in the non-streamed response
            items.append(_Item("message", suffix, 0))
            for e in event.open(items[-1]):
                yield e
        for e in event.close(items[-1], status):
            yield e
        output = [item.json("completed") for item in items[:-1]] + [items[-1].json(status)]
        final = self._response(request, suffix, created, output, status, _usage(usage))
        yield event("response.completed" if status == "completed" else "response.incomplete",
                    {"response": final.model_dump(mode="json")})


def _suffix(chat_id: str) -> str:
    """The chat completion's id without its prefix: the response and its items share it (resp_X, msg_X)."""
    return chat_id[len("chatcmpl-"):] if chat_id.startswith("chatcmpl-") else chat_id
