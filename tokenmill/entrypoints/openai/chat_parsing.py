"""Reasoning and tool-call parsing of chat outputs (--reasoning-parser, --enable-auto-tool-choice
--tool-call-parser): whole responses and streams, with one code path so both give the same result."""
from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from tokenmill.config.frontend import FrontendConfig
from tokenmill.parsers.reasoning import ReasoningParser, ReasoningStream, reasoning_parsers
from tokenmill.parsers.tool import ToolCall, ToolParser, ToolStream, make_tool_call_id, tool_parsers


def tool_call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


@dataclass
class ParsedChoice:
    content: str | None
    reasoning: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class StreamPiece:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def add_call(self, entry: dict[str, Any]) -> None:
        """Append a tool-call delta, merged into the previous one of the same call: one chunk carries at most one
        entry per call index, as OpenAI streams them (some clients keep only the first entry of an index)."""
        last = self.tool_calls[-1] if self.tool_calls else None
        if last is None or last["index"] != entry["index"] or ("id" in entry and "id" in last):
            self.tool_calls.append(entry)
            return
        for key in ("id", "type"):
            if key in entry:
                last[key] = entry[key]
        fn, new = last.setdefault("function", {}), entry.get("function", {})
        if "name" in new:
            fn["name"] = fn.get("name", "") + new["name"]
        fn["arguments"] = fn.get("arguments", "") + new.get("arguments", "")


class ChoiceStream:
    """One choice's streaming state: text -> (reasoning | content) -> (content | tool-call deltas)."""

    def __init__(self, reasoning: ReasoningStream | None, tools: ToolStream | None, include_reasoning: bool,
                 max_calls: int | None = None) -> None:
        self.reasoning, self.tools, self.include_reasoning = reasoning, tools, include_reasoning
        self.max_calls = max_calls  # parallel_tool_calls false: 1 (the calls after the first are dropped)
        self.tools_called = False

    def _route(self, reasoning_text: str, content: str, final: bool) -> StreamPiece:
        piece = StreamPiece(reasoning=reasoning_text if self.include_reasoning else "")
        if self.tools is None:
            piece.content = content
            return piece
        d = self.tools.feed(content) if content else None
        parts = [d] if d is not None else []
        if final:
            parts.append(self.tools.finish())
        for p in parts:
            piece.content += p.content
            for tc in p.tool_calls:
                if self.max_calls is not None and tc.index >= self.max_calls:
                    continue
                self.tools_called = True
                entry: dict[str, Any] = {"index": tc.index, "function": {"arguments": tc.arguments}}
                if tc.id is not None:
                    entry["id"], entry["type"] = tc.id, "function"
                if tc.name is not None:
                    entry["function"]["name"] = tc.name
                piece.add_call(entry)
        return piece

    def feed(self, delta_text: str) -> StreamPiece:
        if self.reasoning is None:
            return self._route("", delta_text, final=False)
        d = self.reasoning.feed(delta_text)
        return self._route(d.reasoning, d.content, final=False)

    def finish(self) -> StreamPiece:
        if self.reasoning is None:
            return self._route("", "", final=True)
        d = self.reasoning.finish()
        return self._route(d.reasoning, d.content, final=True)


# OpenAI: "Omitting parameters defines a function with an empty parameter list". A bare {"type": "object"} let a
# forced call to such a function invent arguments, which break a client that calls fn(**arguments).
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def _parameters(fn: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema a forced call's arguments follow (None and {} both mean no parameters)."""
    return dict(fn.get("parameters") or _NO_PARAMETERS)


def forced_tool_schema(tools: list[dict] | None, tool_choice: Any,
                       max_calls: int | None = None) -> tuple[dict, str | None] | None:
    """tool_choice "required" or {"type": "function", "function": {"name": N}} -> (JSON schema the output must
    follow, the named function or None for "required"); None for other choices. ValueError for bad choices.
    max_calls bounds the number of calls "required" may make (parallel_tool_calls false: 1)."""
    if tool_choice != "required" and not isinstance(tool_choice, dict):
        return None
    if not tools:
        raise ValueError(f"tool_choice {tool_choice!r} needs `tools`.")
    fns = {t.get("function", {}).get("name"): t.get("function", {}) for t in tools}
    if tool_choice == "required":
        # Each tool's parameters sit deep in this schema, so their "$defs" (pydantic's nested models, which
        # "#/$defs/X" references resolve from the root) move to the root, as vLLM does.
        defs: dict[str, dict[str, Any]] = {}
        items = []
        for name, fn in fns.items():
            params = _parameters(fn)
            for key in ("$defs", "definitions"):
                for def_name, def_schema in (params.pop(key, None) or {}).items():
                    if defs.setdefault(key, {}).setdefault(def_name, def_schema) != def_schema:
                        raise ValueError(f"tools define {key}/{def_name} differently; tool_choice \"required\" "
                                         "needs one schema per definition name across the tools.")
            items.append({"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                           "parameters": params},
                          "required": ["name", "parameters"]})
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}, **defs}
        if max_calls is not None:
            schema["maxItems"] = max_calls
        return schema, None
    name = (tool_choice.get("function") or {}).get("name")
    if name not in fns:
        raise ValueError(f"tool_choice names the function {name!r}, which is not in `tools` "
                         f"({', '.join(map(str, fns))}).")
    return _parameters(fns[name]), name


class _ArrayItems:
    """The complete top-level objects of a JSON array whose text arrives in pieces (strings and escapes aware)."""

    def __init__(self) -> None:
        self.text, self.depth, self.in_str, self.escaped, self.start = "", 0, False, False, -1

    def feed(self, piece: str) -> list[str]:
        done: list[str] = []
        base = len(self.text)
        self.text += piece
        for i, ch in enumerate(piece, base):
            if self.in_str:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_str = False
            elif ch == '"':
                self.in_str = True
            elif ch in "[{":
                self.depth += 1
                if self.depth == 2 and ch == "{":
                    self.start = i
            elif ch in "]}":
                if self.depth == 2 and ch == "}" and self.start >= 0:
                    done.append(self.text[self.start:i + 1])
                    self.start = -1
                self.depth -= 1
        return done

    @property
    def open_item(self) -> str | None:
        """The text of the top-level object still open (cut short), or None."""
        return self.text[self.start:] if self.start >= 0 else None


_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*(.*)', re.DOTALL)


def truncated_required_call(item: str | None) -> dict[str, Any] | None:
    """A "required" list item cut short (max_tokens, a stop string) -> the tool_calls entry of what was generated:
    its name and the raw, possibly incomplete, parameters text as the arguments, as vLLM streams such a call and
    OpenAI returns it. None until the name is complete and the parameters have begun (nothing to call yet)."""
    if not item:
        return None
    with contextlib.suppress(ValueError):  # only the item's closing brace is missing
        obj = json.loads(item + "}")
        if isinstance(obj, dict) and isinstance(obj.get("name"), str) and "parameters" in obj:
            return tool_call_json(ToolCall(name=obj["name"], arguments=json.dumps(obj["parameters"],
                                                                                 ensure_ascii=False)))
    m = _CALL_HEAD.match(item)
    if m is None:
        return None
    try:
        name = json.loads(m.group(1))
    except ValueError:
        return None
    return tool_call_json(ToolCall(name=name, arguments=m.group(2)))


class ForcedToolStream:
    """Streaming for forced tool calls: a named call streams its arguments as they come; "required" (a JSON
    list of calls) emits each call, whole, as soon as its list item is complete. With a reasoning stream the
    output's reasoning part streams as reasoning first and only the answer is the call(s), as in vLLM (the grammar
    starts after the end of reasoning too). Same feed/finish contract as ChoiceStream."""

    def __init__(self, name: str | None, reasoning: ReasoningStream | None = None,
                 include_reasoning: bool = True) -> None:
        self.name, self.id, self.started = name, make_tool_call_id(), False
        self.items, self.count = _ArrayItems(), 0
        self.reasoning, self.include_reasoning = reasoning, include_reasoning
        self.tools_called = True

    def _calls(self, text: str, final: bool) -> StreamPiece:
        if self.name is None:
            entries = []
            for item in self.items.feed(text):
                for call in parse_required_calls(f"[{item}]"):
                    entries.append({"index": self.count, "id": call["id"], "type": "function",
                                    "function": call["function"]})
                    self.count += 1
            return StreamPiece(tool_calls=entries)
        if not text and (self.started or not final):
            return StreamPiece()  # the call starts with its first argument text (or, if there is none, at the end)
        entry: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
        if not self.started:
            self.started = True
            entry.update(id=self.id, type="function")
            entry["function"]["name"] = self.name
        return StreamPiece(tool_calls=[entry])

    def feed(self, delta_text: str) -> StreamPiece:
        if self.reasoning is None:
            return self._calls(delta_text, final=False)
        d = self.reasoning.feed(delta_text)
        piece = self._calls(d.content, final=False)
        piece.reasoning = d.reasoning if self.include_reasoning else ""
        return piece

    def _cut_call(self, piece: StreamPiece) -> StreamPiece:
        # Every complete "required" call went out as its item closed; one cut short (max_tokens) goes out now with
        # what was generated of it, as parse_required_calls returns it.
        if self.name is None:
            call = truncated_required_call(self.items.open_item)
            if call is not None:
                piece.tool_calls.append({"index": self.count, "id": call["id"], "type": "function",
                                         "function": call["function"]})
                self.count += 1
        return piece

    def finish(self) -> StreamPiece:
        if self.reasoning is None:
            return self._cut_call(self._calls("", final=True))
        d = self.reasoning.finish()
        piece = self._cut_call(self._calls(d.content, final=True))
        piece.reasoning = d.reasoning if self.include_reasoning else ""
        return piece


def parse_required_calls(text: str) -> list[dict[str, Any]]:
    """The JSON list a "required" tool choice produced -> tool_calls entries. Output cut short (max_tokens) keeps
    its complete items and the call it was cut in (name and partial arguments text), as streaming does."""
    cut = None
    try:
        items = json.loads(text)
    except ValueError:
        items, scan = [], _ArrayItems()
        for item in scan.feed(text):
            with contextlib.suppress(ValueError):
                items.append(json.loads(item))
        cut = truncated_required_call(scan.open_item)
    if not isinstance(items, list):
        return []
    calls = [tool_call_json(ToolCall(name=i["name"], arguments=json.dumps(i.get("parameters", {}),
                                                                        ensure_ascii=False)))
             for i in items if isinstance(i, dict) and "name" in i]
    return calls + [cut] if cut is not None else calls


class RequestParsing:
    """What one request needs: whether its output has a reasoning part and whether tool calls are parsed."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, request_tools: list | None,
                 opens_reasoning: bool, thinking_enabled: bool, include_reasoning: bool,
                 forced: tuple[dict, str | None] | None = None, max_calls: int | None = None) -> None:
        self.reasoning, self.tools, self.request_tools = reasoning, tools, request_tools
        self.opens, self.enabled, self.include_reasoning = opens_reasoning, thinking_enabled, include_reasoning
        self.forced = forced  # (schema, function name or None for "required"): the output IS the call(s)
        self.max_calls = max_calls  # None: any number of calls; 1 when the request sets parallel_tool_calls false

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None or self.forced is not None

    def parse(self, text: str) -> ParsedChoice:
        reasoning, content = (None, text)
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract(text, self.opens, self.enabled)
        if self.forced is not None:
            name, answer = self.forced[1], content or ""
            calls = [tool_call_json(ToolCall(name=name, arguments=answer))] if name else parse_required_calls(answer)
            return ParsedChoice(content=None, reasoning=reasoning if self.include_reasoning else None,
                                tool_calls=calls[:self.max_calls])
        calls: list[dict[str, Any]] = []
        if self.tools is not None and content:
            got = self.tools.extract(content, self.request_tools)
            if got.tools_called:
                calls = [tool_call_json(c) for c in got.tool_calls][:self.max_calls]
                content = got.content
        return ParsedChoice(content=content, reasoning=reasoning if self.include_reasoning else None,
                            tool_calls=calls)

    def new_stream(self) -> ChoiceStream | ForcedToolStream:
        r = self.reasoning.new_stream(self.opens, self.enabled) if self.reasoning is not None else None
        if self.forced is not None:
            return ForcedToolStream(self.forced[1], r, self.include_reasoning)
        t = self.tools.new_stream(self.request_tools) if self.tools is not None else None
        return ChoiceStream(r, t, self.include_reasoning, self.max_calls)


class ChatParsing:
    """The server's parsers, built once from the front-end flags (plugins are loaded first)."""

    def __init__(self, tokenizer: Any, frontend: FrontendConfig) -> None:
        if frontend.reasoning_parser_plugin:
            reasoning_parsers.load_plugin(frontend.reasoning_parser_plugin)
        if frontend.tool_parser_plugin:
            tool_parsers.load_plugin(frontend.tool_parser_plugin)
        self.reasoning = reasoning_parsers.get(frontend.reasoning_parser)(tokenizer) \
            if frontend.reasoning_parser else None
        self.tools = tool_parsers.get(frontend.tool_call_parser)(tokenizer) \
            if frontend.enable_auto_tool_choice and frontend.tool_call_parser else None

    def for_request(self, prompt_text: str, tools: list | None, tool_choice: Any, template_kwargs: dict,
                    include_reasoning: bool, parallel_tool_calls: bool | None = None) -> RequestParsing:
        """tool_choice: None (= auto when the server parses tools), "none", "auto", "required" or a named
        function (the last two force the output to be the call(s), through structured outputs).
        parallel_tool_calls false: at most one call is returned (and "required" may make only one)."""
        max_calls = 1 if parallel_tool_calls is False else None
        forced = forced_tool_schema(tools, tool_choice, max_calls)
        use_tools = self.tools is not None and bool(tools) and tool_choice in (None, "auto")
        opens = self.reasoning.prompt_opens_reasoning(prompt_text) if self.reasoning is not None else False
        enabled = template_kwargs.get("enable_thinking", True) is not False
        return RequestParsing(self.reasoning, self.tools if use_tools else None, tools, opens,
                              enabled, include_reasoning, forced, max_calls)
