"""Llama 3.x JSON tool calls (`--tool-call-parser llama3_json`).

Contract:
- A tool-call output is, after optional leading whitespace and an optional `<|python_tag|>`, one or more JSON
  objects `{"name": "...", "parameters": {...}}` ("arguments" is accepted too; a JSON *string* holding an object is
  decoded; a missing one means `{}`), separated by `;` and/or whitespace (Llama 3.2 emits several joined by `;`).
- An output that does not start that way, or whose first object is not valid JSON / not a call, is plain content,
  returned unchanged (whitespace and python_tag included).
- Once at least one call was parsed, the text after the last call (and its separator) that does not start another
  valid call is content, from its first non-whitespace character on; a bare trailing `;` or whitespace is dropped.
- Arguments are re-serialized with `json.dumps(args, ensure_ascii=False)`, identically in both paths.
Streaming: text that can still turn into a call (leading whitespace, the python tag, an open `{...`) is held back;
a call is emitted (one delta carrying id, name and the full arguments) once its object closes; everything that turns
out not to be a call is released as content, at the latest by finish(). `extract()` runs this same state machine
over the whole text, so streamed and non-streamed results agree for any chunking.
"""
from __future__ import annotations

import json

from tokenmill.parsers.tool.step_stream import DONE, PLAIN, StepToolParser, StepToolStream, skip_ws
from tokenmill.parsers.text_utils import arguments_json
from tokenmill.parsers.tool import ToolCallDelta, ToolStreamDelta, make_tool_call_id

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder(strict=False)  # tolerate raw control characters (newlines) inside strings
_START, _CALL, _SEP = range(3)
_PLAIN, _DONE = PLAIN, DONE


def call_from_object(obj) -> tuple[str, str] | None:
    """(name, arguments JSON) when `obj` is a Llama call object, else None."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    args = arguments_json(obj, ("parameters", "arguments"))
    return None if args is None else (name.strip(), args)



class Llama3JsonToolStream(StepToolStream):
    def __init__(self) -> None:
        self._tried = 0  # buffer length at the last failed JSON decode (retry only once a new '}' arrives)
        super().__init__(_START)

    def _steps(self):
        return {_START: self._start, _CALL: self._call, _SEP: self._sep}

    def _start(self, out: ToolStreamDelta, final: bool) -> bool:
        buf = self._buf
        i = skip_ws(buf, 0)
        if buf.startswith(PYTHON_TAG, i):
            i = skip_ws(buf, i + len(PYTHON_TAG))
        elif i < len(buf) and PYTHON_TAG.startswith(buf[i:]):
            return self._goto(_PLAIN, 0) if final else False  # maybe a python tag being written
        if i == len(buf):
            return self._goto(_PLAIN, 0) if final else False
        if buf[i] == "{":
            self._tried = i
            return self._goto(_CALL, i)
        return self._goto(_PLAIN, 0)

    def _call(self, out: ToolStreamDelta, final: bool) -> bool:
        if not final and "}" not in self._buf[max(self._tried, self._pos):]:
            return False
        try:
            obj, end = _DECODER.raw_decode(self._buf, self._pos)
        except ValueError:  # unfinished (wait) or invalid (content at finish)
            if not final:
                self._tried = len(self._buf)
                return False
            obj, end = None, 0
        call = call_from_object(obj)
        if call is None:  # not a call: everything (no call yet) or the rest from this object on is content
            return self._goto(_PLAIN, 0 if self._calls == 0 else self._pos)
        out.tool_calls.append(ToolCallDelta(index=self._calls, id=make_tool_call_id(), name=call[0],
                                            arguments=call[1]))
        self._calls += 1
        return self._goto(_SEP, end)

    def _sep(self, out: ToolStreamDelta, final: bool) -> bool:
        buf = self._buf
        i = skip_ws(buf, self._pos)
        if i < len(buf) and buf[i] == ";":
            i = skip_ws(buf, i + 1)
        if i == len(buf):
            return self._goto(_DONE, i) if final else False
        if buf[i] == "{":
            self._tried = i
            return self._goto(_CALL, i)
        return self._goto(_PLAIN, i)




class Llama3JsonToolParser(StepToolParser):
    """Llama 3.x `{"name": ..., "parameters": {...}}` tool calls; see the module docstring for the contract."""

    stream_cls = Llama3JsonToolStream
