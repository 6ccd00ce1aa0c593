"""Tool-call parsers: find function calls in a model's output text, whole or streamed."""
from __future__ import annotations

import abc
import uuid
from dataclasses import dataclass, field

from tokenmill.parsers.registry import ParserRegistry

tool_parsers = ParserRegistry("tool call", {
    "hermes": ("tokenmill.parsers.tool.hermes", "HermesToolParser"),
    "qwen3_coder": ("tokenmill.parsers.tool.qwen3_coder", "Qwen3CoderToolParser"),
    "llama3_json": ("tokenmill.parsers.tool.llama3_json", "Llama3JsonToolParser"),
    "mistral": ("tokenmill.parsers.tool.mistral", "MistralToolParser"),
    "deepseek_v3": ("tokenmill.parsers.tool.deepseek_v3", "DeepSeekV3ToolParser"),
    "pythonic": ("tokenmill.parsers.tool.pythonic", "PythonicToolParser"),
})


def make_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=make_tool_call_id)


@dataclass
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None  # the text outside the calls (None if there is none)


@dataclass
class ToolCallDelta:
    """One streamed piece of call number `index`: the first piece carries id and name, later ones argument text.
    The argument pieces of one call concatenate to its complete JSON arguments."""
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolStreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolStream(abc.ABC):
    """Per-request streaming state. Contract: for any split of the text into chunks, the concatenated content and
    per-index arguments of all feed()/finish() deltas equal the non-streamed `extract()` result (names and call
    count equal, ids stable across the stream)."""

    @abc.abstractmethod
    def feed(self, delta_text: str) -> ToolStreamDelta: ...

    @abc.abstractmethod
    def finish(self) -> ToolStreamDelta: ...


class ToolParser(abc.ABC):
    """Built once per server from the tokenizer; `tools` is the request's OpenAI `tools` list (dicts).
    `needs_special_tokens`: the format's markers are special tokens, so outputs must be detokenized with
    skip_special_tokens=False for the parser to see them."""

    needs_special_tokens = False

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    @abc.abstractmethod
    def extract(self, text: str, tools: list[dict] | None = None) -> ExtractedToolCalls: ...

    @abc.abstractmethod
    def new_stream(self, tools: list[dict] | None = None) -> ToolStream: ...
