"""POST /v1/responses: OpenAI's Responses API for text generation, served by the chat route's machinery.

Contract of `OpenAIServingResponses`:
- `create_response(request, raw_request)` returns a `ResponsesResponse` (not streamed) or an `SSEStream` of
  Responses events: the two shapes `_serve_generation` serves, so a client that goes away aborts the engine request.
- A request becomes the equivalent ChatCompletionRequest (instructions + input -> messages, max_output_tokens ->
  max_completion_tokens, text.format -> response_format, temperature, top_p, seed, user) and OpenAIServingChat runs
  it: chat template, generation-config defaults, structured outputs, reasoning parser and length checks are exactly
  the chat route's. Its errors come back with the Responses field names.
- Function tools (flat Responses shape) become chat tools and tool_choice the chat tool_choice, so calls are parsed
  by the chat route's machinery: the server's --tool-call-parser for "auto", the forced-call grammar for "required"
  or a named function. Input items `function_call` / `function_call_output` become the assistant's tool_calls and
  `tool` messages, so a client can send a tool's result back; a `reasoning` item sent back becomes the reasoning
  (`reasoning_content`) of the assistant turn it opens, as templates that render earlier thinking read it.
- Nothing is stored. Fields that would change the result but cannot be honoured (previous_response_id, reasoning
  summaries, background, non-function tools, non-text input items, ...) are a 400 naming the field, never ignored.
  reasoning.effort is the chat route's reasoning_effort: the chat template's variable of that name (a template
  without one makes it a 400 naming reasoning).
- Output: a `reasoning` item when the server's reasoning parser split some off, then an assistant `message` with one
  `output_text` part (when there is text, or nothing else), then one `function_call` item per call. A response cut
  short by the token limit is `incomplete` (reason max_output_tokens) and so is its last item (a call cut short
  keeps its partial arguments); its stream ends with `response.incomplete`, as OpenAI's does, otherwise with
  `response.completed`.
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
_FIELD_NAMES = {"max_completion_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format",
                "reasoning_effort": "reasoning"}


def input_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of `instructions` and `input`; anything but text messages is a ServingError."""
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
        return messages
    call_names: dict[str, str] = {}
    for i, item in enumerate(request.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "function_call":
            call = _function_call_input(item, where)
            call_names[call["id"]] = call["function"]["name"]
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # one assistant turn: its text, then its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            continue
        if kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise ServingError(f"{where}.call_id must be the call_id of the function_call it answers.", 400,
                                   f"{where}.call_id")
            tool_msg = {"role": "tool", "tool_call_id": call_id,
                        "content": _text_content(item.get("output"), f"{where}.output")}
            if call_id in call_names:
                tool_msg["name"] = call_names[call_id]
            messages.append(tool_msg)
            continue
        if kind == "reasoning":
            thought = _reasoning_input(item, where)
            if thought:  # opens the assistant turn its answer (the next message item) completes
                messages.append({"role": "assistant", "content": None, "reasoning_content": thought,
                                 "reasoning": thought})
            continue
        if kind != "message":
            raise ServingError(f"{where}: input items of type {kind!r} are not supported by tokenmill (only "
                               "messages with text content, reasoning, function_call and function_call_output).",
                               400, f"{where}.type")
        role = item.get("role")
        if role not in _ROLES:
            raise ServingError(f"{where}.role must be one of user, system, developer, assistant; got {role!r}.",
                               400, f"{where}.role")
        content = _text_content(item.get("content"), f"{where}.content")
        last = messages[-1] if messages else None
        if (_ROLES[role] == "assistant" and last is not None and last["role"] == "assistant"
                and last.get("reasoning") and last["content"] is None and not last.get("tool_calls")):
            last["content"] = content
        else:
            messages.append({"role": _ROLES[role], "content": content})
    if not messages:
        raise ServingError("input must contain at least one message.", 400, "input")
    return messages


def _text_content(content: Any, where: str) -> str | list[dict[str, str]]:
    """A string, or a list of input_text / output_text parts -> chat content (text parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ServingError(f"{where} must be a string or a list of input_text parts.", 400, where)
    parts = []
    for j, part in enumerate(content):
        ptype = part.get("type") if isinstance(part, dict) else None
        if ptype not in _TEXT_PARTS:
            raise ServingError(f"{where}[{j}]: content of type {ptype!r} is not supported by tokenmill (text only: "
                               "input_text, output_text).", 400, f"{where}[{j}].type")
        if not isinstance(part.get("text"), str):
            raise ServingError(f"{where}[{j}].text must be a string.", 400, f"{where}[{j}].text")
        parts.append({"type": "text", "text": part["text"]})
    return parts  # the chat template's content format decides how parts are joined, as for chat


def _reasoning_input(item: dict[str, Any], where: str) -> str:
    """An earlier reasoning output item sent back -> its text (content's reasoning_text parts, else the summary's
    summary_text parts), for the assistant turn it belongs to. Encrypted reasoning cannot be read here."""
    if item.get("encrypted_content"):
        raise ServingError(f"{where}.encrypted_content: encrypted reasoning is not supported by tokenmill (send the "
                           "reasoning item as this server returned it).", 400, f"{where}.encrypted_content")
    texts = []
    for key, ptype in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list) or not all(isinstance(p, dict) and p.get("type", ptype) == ptype
                                                  and isinstance(p.get("text"), str) for p in parts):
            raise ServingError(f"{where}.{key} must be a list of {ptype} parts ({{\"type\": \"{ptype}\", "
                               f"\"text\": ...}}).", 400, f"{where}.{key}")
        texts.append("\n".join(p["text"] for p in parts))
    return texts[0] or texts[1]


def _function_call_input(item: dict[str, Any], where: str) -> dict[str, Any]:
    """An earlier function_call output item sent back -> a chat tool_calls entry (its call_id is the call's id)."""
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str) or (key != "arguments" and not item[key]):
            raise ServingError(f"{where}.{key} must be a {'' if key == 'arguments' else 'non-empty '}string (a "
                               "function_call item as the response returned it).", 400, f"{where}.{key}")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools ({"type": "function", "name", "description", "parameters", "strict"}, flat) -> the
    chat route's tools; any other tool type is a 400 naming it."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ServingError(f"{where}.type {kind!r} is not supported by tokenmill (only function tools: the "
                               "server runs no built-in tools).", 400, f"{where}.type")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            hint = (' (Responses tools are flat: {"type": "function", "name": ..., "parameters": ...}, not nested '
                    'under "function" as in chat)') if "function" in tool else ""
            raise ServingError(f"{where}.name must be a non-empty string{hint}.", 400, f"{where}.name")
        fn: dict[str, Any] = {"name": name}
        if tool.get("parameters") is not None:
            if not isinstance(tool["parameters"], dict):
                raise ServingError(f"{where}.parameters must be a JSON schema (an object).", 400,
                                   f"{where}.parameters")
            fn["parameters"] = tool["parameters"]
        if tool.get("description") is not None:
            if not isinstance(tool["description"], str):
                raise ServingError(f"{where}.description must be a string.", 400, f"{where}.description")
            fn["description"] = tool["description"]
        if tool.get("strict") is not None:
            fn["strict"] = tool["strict"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """Responses tool_choice -> the chat route's ({"type": "function", "name": N} -> {"type": "function",
    "function": {"name": N}})."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str) \
            and choice["name"]:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ServingError('tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}; got '
                       f"{choice!r}.", 400, "tool_choice")


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
    message = e.message.replace("max_completion_tokens", "max_output_tokens").replace("reasoning_effort=",
                                                                                        "reasoning.effort=")
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


_ID_PREFIX = {"message": "msg_", "reasoning": "rs_", "function_call": "fc_"}


class _Item:
    """One output item (a message, the reasoning before it, or a function call) and its text (a call's arguments)
    so far."""
    __slots__ = ("kind", "id", "index", "pieces", "text", "name", "call_id")

    def __init__(self, kind: str, suffix: str, index: int, name: str = "", call_id: str = "") -> None:
        self.kind, self.index = kind, index
        self.id = _ID_PREFIX[kind] + suffix + (f"_{index}" if kind == "function_call" else "")
        self.pieces: list[str] = []
        self.text = ""
        self.name, self.call_id = name, call_id

    def part(self, text: str) -> dict[str, Any]:
        if self.kind == "message":
            return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {"type": "reasoning_text", "text": text}

    def json(self, status: str, content: bool = True) -> dict[str, Any]:
        if self.kind == "function_call":
            return {"type": "function_call", "id": self.id, "call_id": self.call_id, "name": self.name,
                    "arguments": self.text if content else "", "status": status}
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
        added = self("response.output_item.added", {"output_index": item.index,
                                                     "item": item.json("in_progress", content=False)})
        if item.kind == "function_call":
            return [added]
        ref = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        return [added, self("response.content_part.added", {**ref, "part": item.part("")})]

    def delta(self, item: _Item, text: str) -> str:
        if item.kind == "function_call":
            return self("response.function_call_arguments.delta", {"item_id": item.id, "output_index": item.index,
                                                                   "delta": text})
        if item.kind == "message":
            return self("response.output_text.delta", {"item_id": item.id, "output_index": item.index,
                                                       "content_index": 0, "delta": text, "logprobs": []})
        return self("response.reasoning_text.delta", {"item_id": item.id, "output_index": item.index,
                                                      "content_index": 0, "delta": text})

    def close(self, item: _Item, status: str) -> list[str]:
        item.text = "".join(item.pieces)
        if item.kind == "function_call":
            return [self("response.function_call_arguments.done", {"item_id": item.id, "output_index": item.index,
                                                                   "name": item.name, "arguments": item.text}),
                    self("response.output_item.done", {"output_index": item.index, "item": item.json(status)})]
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
            stream=request.stream, tools=chat_tools(request.tools), tool_choice=chat_tool_choice(request.tool_choice),
            parallel_tool_calls=request.parallel_tool_calls, reasoning_effort=(request.reasoning or {}).get("effort"))
        if not request.tools and fields["tool_choice"] in ("auto", "none"):
            del fields["tool_choice"]  # no tools to choose from: nothing to parse, as before tools were supported
        if request.stream:
            fields["stream_options"] = {"include_usage": True}  # the final usage chunk fills response.usage
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err.get("loc", ()))
            param = loc.split(".")[0] or getattr(err.get("ctx", {}).get("error"), "param", None)  # a FieldError's
            msg = str(err.get("msg")).removeprefix("Value error, ")
            raise _renamed(ServingError(f"{loc}: {msg}" if loc else msg, 400, param)) from None

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
            user=request.user, tools=request.tools or [], reasoning=request.reasoning)

    def _from_chat(self, request: ResponsesRequest, res: ChatCompletionResponse) -> ResponsesResponse:
        choice = res.choices[0]
        suffix = _suffix(res.id)
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        items = []
        if choice.message.reasoning:
            items.append(_Item("reasoning", suffix, 0))
            items[-1].text = choice.message.reasoning
        calls = choice.message.tool_calls or []
        if choice.message.content or not (items or calls):
            items.append(_Item("message", suffix, len(items)))
            items[-1].text = choice.message.content or ""
        for call in calls:
            items.append(_Item("function_call", suffix, len(items), call["function"]["name"], call["id"]))
            items[-1].text = call["function"]["arguments"]
        output = [item.json("completed") for item in items[:-1]] + [items[-1].json(status)]
        return self._response(request, suffix, res.created, output, status, _usage(res.usage.model_dump()))

    # ----- streaming -----
    async def _stream(self, request: ResponsesRequest, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        event = _Events()
        created = int(time.time())
        suffix: str | None = None
        items: list[_Item] = []
        calls: dict[int, _Item] = {}  # the chat stream's tool call index -> its item
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
                    for call in delta.get("tool_calls") or ():
                        if call.get("id") is not None or call["index"] not in calls:  # a new call
                            if items:
                                for e in event.close(items[-1], "completed"):
                                    yield e
                            fn = call.get("function") or {}
                            items.append(_Item("function_call", suffix, len(items), fn.get("name") or "",
                                               call.get("id") or ""))
                            calls[call["index"]] = items[-1]
                            for e in event.open(items[-1]):
                                yield e
                        text = (call.get("function") or {}).get("arguments")
                        if text:
                            calls[call["index"]].pieces.append(text)
                            yield event.delta(calls[call["index"]], text)
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
