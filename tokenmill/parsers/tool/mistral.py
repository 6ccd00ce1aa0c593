"""Mistral tool calls (`--tool-call-parser mistral`).

Contract:
- Text before `[TOOL_CALLS]` is content, unchanged. `[TOOL_CALLS]` is a special token: it is only seen when the
  request is detokenized with skip_special_tokens=False (as vLLM arranges for this parser).
- After the marker (optional whitespace) comes either
  * the older JSON form: an array `[{"name": ..., "arguments": {...}}, ...]` (a single object is accepted too;
    "parameters" for "arguments", and arguments given as a JSON string holding an object, are accepted), or
  * the newer form: `NAME[ARGS]{...}`, optionally `NAME[CALL_ID]abcDEF123[ARGS]{...}`; each call of the newer form
    has its own `[TOOL_CALLS]` marker.
- After a call section, whitespace is dropped; another `[TOOL_CALLS]` starts another section, any other text is
  content (from its first non-whitespace character), still watched for further markers.
- A section that is not valid (bad JSON, not a call, bad name) makes everything from its `[TOOL_CALLS]` marker on
  content, unchanged; earlier calls stay calls.
- Ids are 9 alphanumeric characters (Mistral's format); a valid `[CALL_ID]` from the model is kept.
- Arguments are re-serialized with `json.dumps(args, ensure_ascii=False)`, identically in both paths.
Streaming: content streams at once except a trailing partial `[TOOL_CALLS]`; a section is held back until its JSON
closes, then its calls are emitted (one delta each, with id, name and full arguments). `extract()` runs the same
state machine over the whole text, so streamed and non-streamed results agree for any chunking.
"""
from __future__ import annotations

import json
import re
import secrets
import string

from tokenmill.parsers.tool.step_stream import DONE, PLAIN, StepToolParser, StepToolStream, skip_ws
from tokenmill.parsers.text_utils import arguments_json
from tokenmill.parsers.tool import ToolCallDelta, ToolStreamDelta

BOT = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_ALNUM = string.ascii_letters + string.digits
_ID_RE = re.compile(r"[A-Za-z0-9]{9}")
_NAME_CHARS = re.compile(r"[\w.\-]*")
_HEADER_RE = re.compile(r"([\w.\-]+)(?:\[CALL_ID\]([A-Za-z0-9]+))?\[ARGS\]")
_DECODER = json.JSONDecoder(strict=False)
_CONTENT, _SECTION, _ARRAY, _HEADER, _AFTER = range(5)
_PLAIN, _DONE = PLAIN, DONE


def make_mistral_tool_call_id() -> str:
    """9 random alphanumerics, the id shape Mistral's chat templates expect."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))




def _array_calls(value) -> list[tuple[str, str]] | None:
    items = [value] if isinstance(value, dict) else value
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"].strip():
            return None
        args = arguments_json(item)
        if args is None:
            return None
        calls.append((item["name"].strip(), args))
    return calls


def _header_viable(rest: str) -> bool:
    """Can `rest` still grow into `NAME[CALL_ID]ID[ARGS]`? (It does not contain a complete header yet.)"""
    i = _NAME_CHARS.match(rest).end()
    tail = rest[i:]
    if not tail:
        return True
    if i == 0:
        return False
    if ARGS.startswith(tail) or CALL_ID.startswith(tail):
        return True
    if tail.startswith(CALL_ID):
        tail = tail[len(CALL_ID):]
        tail = tail[len(re.match(r"[A-Za-z0-9]*", tail).group()):]
        return ARGS.startswith(tail)
    return False



def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class MistralToolStream(StepToolStream):
    def __init__(self) -> None:
        self._section = 0  # where the current `[TOOL_CALLS]` section starts (content from here if it fails)
        self._json_at = 0  # where the section's JSON value starts
        self._tried = 0  # buffer length at the last failed decode (retry only once a closing bracket arrives)
        self._call_id: str | None = None
        super().__init__(_CONTENT)

    def _steps(self):
        return {_CONTENT: self._content, _SECTION: self._section_start, _ARRAY: self._array,
                _HEADER: self._header, _AFTER: self._after}

    def _fail(self) -> bool:
        return self._goto(_PLAIN, self._section)

    def _emit(self, out: ToolStreamDelta, name: str, args: str, call_id: str | None = None) -> None:
        call_id = call_id if call_id and _ID_RE.fullmatch(call_id) else make_mistral_tool_call_id()
        out.tool_calls.append(ToolCallDelta(index=self._calls, id=call_id, name=name, arguments=args))
        self._calls += 1

    def _content(self, out: ToolStreamDelta, final: bool) -> bool:
        k = self._buf.find(BOT, self._pos)
        if k < 0:
            end = len(self._buf) if final else len(self._buf) - _partial_suffix(self._buf[self._pos:], BOT)
            out.content += self._buf[self._pos:end]
            self._pos = end
            return self._goto(_DONE, end) if final else False
        out.content += self._buf[self._pos:k]
        self._section = k
        return self._goto(_SECTION, k + len(BOT))

    def _section_start(self, out: ToolStreamDelta, final: bool) -> bool:
        i = skip_ws(self._buf, self._pos)
        if i == len(self._buf):
            return self._fail() if final else False
        self._json_at = self._tried = i
        return self._goto(_ARRAY if self._buf[i] in "[{" else _HEADER, i)

    def _decode(self, final: bool):
        """The JSON value at `_json_at` as (value, end); None to wait; (None, -1) when it is invalid."""
        closer = "]" if self._buf[self._json_at] == "[" else "}"
        if not final and closer not in self._buf[max(self._tried, self._json_at):]:
            return None
        try:
            return _DECODER.raw_decode(self._buf, self._json_at)
        except ValueError:
            if final:
                return None, -1
            self._tried = len(self._buf)
            return None

    def _array(self, out: ToolStreamDelta, final: bool) -> bool:
        decoded = self._decode(final)
        if decoded is None:
            return False
        calls = _array_calls(decoded[0]) if decoded[1] >= 0 else None
        if calls is None:
            return self._fail()
        for name, args in calls:
            self._emit(out, name, args)
        return self._goto(_AFTER, decoded[1])

    def _header(self, out: ToolStreamDelta, final: bool) -> bool:
        m = _HEADER_RE.match(self._buf, self._pos)
        if m is None:
            return self._fail() if final or not _header_viable(self._buf[self._pos:]) else False
        j = skip_ws(self._buf, m.end())
        if j == len(self._buf):
            return self._fail() if final else False
        if self._buf[j] != "{":
            return self._fail()
        if self._json_at != j:
            self._json_at = self._tried = j
        decoded = self._decode(final)
        if decoded is None:
            return False
        if decoded[1] < 0 or not isinstance(decoded[0], dict):
            return self._fail()
        self._emit(out, m.group(1), json.dumps(decoded[0], ensure_ascii=False), m.group(2))
        return self._goto(_AFTER, decoded[1])

    def _after(self, out: ToolStreamDelta, final: bool) -> bool:
        i = skip_ws(self._buf, self._pos)
        if i == len(self._buf):
            return self._goto(_DONE, i) if final else False
        return self._goto(_CONTENT, i)  # a marker (or a partial one) there is handled by the content state




class MistralToolParser(StepToolParser):
    """Mistral `[TOOL_CALLS]` tool calls (JSON-array and `name[ARGS]{...}` forms); see the module docstring."""

    needs_special_tokens = True  # its markers are special tokens

    stream_cls = MistralToolStream
