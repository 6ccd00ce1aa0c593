"""Hermes-style tool calls (Hermes 2/3, Qwen2.5, Qwen3), plus the tag-delimited block machinery that other
block formats (qwen3_coder) reuse.

Output format: text, then one or more `<tool_call>\\n{"name": "...", "arguments": {...}}\\n</tool_call>` blocks.

Rules shared by every `TaggedBlock*` parser (whole and streamed output give exactly the same result):

- A block runs from an opening tag to its closing tag; a block still open at the end of the output ends there
  (a complete call whose closing tag was cut off still counts).
- A block that parses is one or more calls. A block that does not parse (invalid JSON, no name, truncated) is
  NOT a call: its raw text, tags included, becomes content. Parsing never raises.
- Content is the text before the first valid call (as vLLM), verbatim, plus the raw text of invalid blocks.
  Text outside blocks after the first valid call (usually newlines between calls) is dropped, as in vLLM.
  With no valid call, content is therefore exactly the output. Empty content is None.
- Streaming: content streams as it arrives, holding back only a possible partial opening tag at the end of the
  buffer. The first delta of a call carries id and name (arguments ""), the following ones argument text; the
  argument pieces of a call concatenate to `json.dumps(arguments, ensure_ascii=False)` of the whole-output
  parse. Ids are generated once per call. Hermes emits a call when its block closes (or at finish), because a
  block is valid only once its whole JSON parses.
"""
from __future__ import annotations

import abc

import json

from tokenmill.parsers.text_utils import partial_tag_len
from tokenmill.parsers.tool import (ExtractedToolCalls, ToolCall, ToolCallDelta, ToolParser, ToolStream,
                                    ToolStreamDelta, make_tool_call_id)

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"




def find_first_tag(text: str, tags, start: int = 0) -> tuple[int, str | None]:
    """(index, tag) of the earliest occurrence of any of `tags` in text[start:], or (-1, None)."""
    best, best_tag = -1, None
    for tag in tags:
        i = text.find(tag, start)
        if i >= 0 and (best < 0 or i < best):
            best, best_tag = i, tag
    return best, best_tag


class TaggedBlockToolParser(ToolParser):
    """Base for formats whose calls sit in tag-delimited blocks (see the module docstring for the rules).

    Subclasses set `openers` ({opening tag: closing tag}) and implement `parse_block`.
    """

    openers: dict[str, str] = {TOOL_CALL_START: TOOL_CALL_END}

    @abc.abstractmethod
    def parse_block(self, open_tag: str, body: str, tools: list[dict] | None) -> list[ToolCall]:
        """The calls of one complete block ([] if it is not a valid block). Must not raise."""

    def extract(self, text: str, tools: list[dict] | None = None) -> ExtractedToolCalls:
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while True:
            i, tag = find_first_tag(text, self.openers, pos)
            if i < 0:
                if not calls:
                    content.append(text[pos:])
                break
            if not calls:
                content.append(text[pos:i])
            close = self.openers[tag]
            start = i + len(tag)
            j = text.find(close, start)
            end = len(text) if j < 0 else j + len(close)
            block_calls = self.parse_block(tag, text[start:] if j < 0 else text[start:j], tools)
            if block_calls:
                calls.extend(block_calls)
            else:
                content.append(text[i:end])
            pos = end
            if j < 0:
                break
        return ExtractedToolCalls(tools_called=bool(calls), tool_calls=calls, content="".join(content) or None)

    def new_stream(self, tools: list[dict] | None = None) -> ToolStream:
        return BufferedBlockStream(self, tools)


class TaggedBlockStream(ToolStream):
    """Streaming state for a `TaggedBlockToolParser`: splits the text into content and blocks.

    Subclasses implement `_block_end` (and optionally `_block_progress` for incremental emission).
    """

    def __init__(self, parser: TaggedBlockToolParser, tools: list[dict] | None) -> None:
        self.parser = parser
        self.tools = tools
        self._buf = ""
        self._open: str | None = None  # opening tag of the block being read
        self._any_call = False         # a valid call was emitted: later outside text is dropped
        self._next_index = 0

    def feed(self, delta_text: str) -> ToolStreamDelta:
        self._buf += delta_text
        return self._drain(final=False)

    def finish(self) -> ToolStreamDelta:
        return self._drain(final=True)

    def _new_call(self, name: str, out: ToolStreamDelta) -> int:
        """Emit the first delta (id and name) of a new call; returns its index."""
        index = self._next_index
        self._next_index += 1
        self._any_call = True
        out.tool_calls.append(ToolCallDelta(index=index, id=make_tool_call_id(), name=name, arguments=""))
        return index

    def _block_progress(self, body: str, out: ToolStreamDelta) -> None:
        """Called with the (incomplete) block body read so far; may emit call deltas."""

    @abc.abstractmethod
    def _block_end(self, body: str, out: ToolStreamDelta) -> bool:
        """Called with the complete block body: emit its remaining call deltas; False if the block is invalid
        (its raw text then becomes content)."""

    def _drain(self, final: bool) -> ToolStreamDelta:
        out = ToolStreamDelta()
        content: list[str] = []
        openers = self.parser.openers
        while True:
            if self._open is None:
                i, tag = find_first_tag(self._buf, openers)
                if i < 0:
                    cut = len(self._buf) - (0 if final else partial_tag_len(self._buf, openers))
                    if not self._any_call:
                        content.append(self._buf[:cut])
                    self._buf = self._buf[cut:]
                    break
                if not self._any_call:
                    content.append(self._buf[:i])
                self._open, self._buf = tag, self._buf[i + len(tag):]
                continue
            close = openers[self._open]
            j = self._buf.find(close)
            if j < 0 and not final:
                self._block_progress(self._buf, out)
                break
            body = self._buf if j < 0 else self._buf[:j]
            if not self._block_end(body, out):
                content.append(self._open + body + ("" if j < 0 else close))
            self._open, self._buf = None, ("" if j < 0 else self._buf[j + len(close):])
            if j < 0:
                break
        out.content = "".join(content)
        return out


class BufferedBlockStream(TaggedBlockStream):
    """Emits each block's calls when the block is complete (name delta, then the whole arguments)."""

    def _block_end(self, body: str, out: ToolStreamDelta) -> bool:
        calls = self.parser.parse_block(self._open, body, self.tools)
        for call in calls:
            index = self._new_call(call.name, out)
            out.tool_calls.append(ToolCallDelta(index=index, arguments=call.arguments))
        return bool(calls)


def _hermes_call(obj) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if args is None:
        args = {}
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(name=name.strip(), arguments=json.dumps(args, ensure_ascii=False))


class HermesToolParser(TaggedBlockToolParser):
    """Hermes / Qwen2.5 / Qwen3 calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.

    A block is valid when its text is one JSON object with a non-empty string "name" and an "arguments" object
    (also accepted: "parameters" instead of "arguments", arguments missing -> {}, arguments double-encoded as a
    JSON string, or a JSON list of such objects -> several calls). Arguments are re-serialized with
    `json.dumps(arguments, ensure_ascii=False)`. The request's `tools` are not used.
    Other rules (content, invalid blocks, streaming): see the module docstring.
    """

    openers = {TOOL_CALL_START: TOOL_CALL_END}
    # Some Hermes-format tokenizers mark <tool_call> / </tool_call> special: skipped, the calls would come back as
    # content. vLLM's hermes parser turns skip_special_tokens off for requests with tools as well.
    needs_special_tokens = True

    def parse_block(self, open_tag: str, body: str, tools: list[dict] | None) -> list[ToolCall]:
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):
            return []
        items = obj if isinstance(obj, list) and obj else [obj]
        calls = [_hermes_call(item) for item in items]
        return [] if any(c is None for c in calls) else calls
