"""DeepSeek-V3 tool calls (`--tool-call-parser deepseek_v3`).

Format (special tokens; seen only with skip_special_tokens=False):
  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
  ```json
  {...}
  ```<｜tool▁call▁end｜><｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>
Contract:
- Text before `<｜tool▁calls▁begin｜>` is content, unchanged. Whitespace between the tokens of a block is ignored;
  a missing final `<｜tool▁calls▁end｜>` is tolerated. Text after `<｜tool▁calls▁end｜>` is content (from its first
  non-whitespace character), still watched for another block.
- Inside a call, the V3 body `TYPE<｜tool▁sep｜>NAME```json {...}```` (fence and whitespace loose) and the V3.1 body
  `NAME<｜tool▁sep｜>{...}` are both accepted; arguments must be a JSON object.
- Anything else inside a block (bad JSON, stray text, an unclosed call at the end) makes the text content, unchanged:
  the whole block from `<｜tool▁calls▁begin｜>` if none of its calls was emitted yet, else from the failing point on.
- Arguments are re-serialized with `json.dumps(args, ensure_ascii=False)`, identically in both paths.
Streaming: content streams at once except a trailing partial begin token; each call is held back until its
`<｜tool▁call▁end｜>`, then emitted as one delta (id, name, full arguments). `extract()` runs the same state machine
over the whole text, so streamed and non-streamed results agree for any chunking.
"""
from __future__ import annotations

import json
import re

from tokenmill.parsers.tool.step_stream import DONE, PLAIN, StepToolParser, StepToolStream, skip_ws
from tokenmill.parsers.tool import ToolCallDelta, ToolStreamDelta, make_tool_call_id

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
_V3_REST = re.compile(r"\s*([^\s`{]+)\s*(?:```[A-Za-z]*)?\s*(\{.*\})\s*(?:```)?\s*", re.S)
_DECODER = json.JSONDecoder(strict=False)
_CONTENT, _BLOCK, _AFTER = range(3)
_PLAIN, _DONE = PLAIN, DONE


def parse_call_body(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) for the text between call-begin and call-end, or None when it is not a call."""
    head, sep, rest = body.partition(TOOL_SEP)
    if not sep:
        return None
    head = head.strip()
    if rest.lstrip().startswith("{"):  # V3.1: NAME<sep>{...}
        name, args_text = head, rest.strip()
    else:  # V3: function<sep>NAME\n```json\n{...}\n```
        m = _V3_REST.fullmatch(rest)
        if not head or m is None:
            return None
        name, args_text = m.group(1), m.group(2)
    if not name or any(c.isspace() for c in name):
        return None
    try:
        args = _DECODER.decode(args_text)
    except ValueError:
        return None
    return (name, json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None



def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class DeepSeekV3ToolStream(StepToolStream):
    def __init__(self) -> None:
        self._block = 0  # where the current calls block starts
        self._block_calls = 0
        super().__init__(_CONTENT)

    def _steps(self):
        return {_CONTENT: self._content, _BLOCK: self._in_block, _AFTER: self._after}

    def _content(self, out: ToolStreamDelta, final: bool) -> bool:
        k = self._buf.find(CALLS_BEGIN, self._pos)
        if k < 0:
            end = len(self._buf) if final else len(self._buf) - _partial_suffix(self._buf[self._pos:], CALLS_BEGIN)
            out.content += self._buf[self._pos:end]
            self._pos = end
            return self._goto(_DONE, end) if final else False
        out.content += self._buf[self._pos:k]
        self._block, self._block_calls = k, 0
        return self._goto(_BLOCK, k + len(CALLS_BEGIN))

    def _fail(self, at: int) -> bool:
        return self._goto(_PLAIN, self._block if self._block_calls == 0 else at)

    def _in_block(self, out: ToolStreamDelta, final: bool) -> bool:
        buf = self._buf
        i = skip_ws(buf, self._pos)
        rest = buf[i:]
        if rest.startswith(CALL_BEGIN):
            k = buf.find(CALL_END, i + len(CALL_BEGIN))
            if k < 0:
                return self._fail(i) if final else False
            call = parse_call_body(buf[i + len(CALL_BEGIN):k])
            if call is None:
                return self._fail(i)
            out.tool_calls.append(ToolCallDelta(index=self._calls, id=make_tool_call_id(), name=call[0],
                                                arguments=call[1]))
            self._calls += 1
            self._block_calls += 1
            return self._goto(_BLOCK, k + len(CALL_END))
        if rest.startswith(CALLS_END):
            return self._fail(i) if self._block_calls == 0 else self._goto(_AFTER, i + len(CALLS_END))
        if not rest or CALL_BEGIN.startswith(rest) or CALLS_END.startswith(rest):
            if not final:
                return False
            return self._goto(_DONE, len(buf)) if not rest and self._block_calls else self._fail(i)
        return self._fail(i)

    def _after(self, out: ToolStreamDelta, final: bool) -> bool:
        i = skip_ws(self._buf, self._pos)
        if i == len(self._buf):
            return self._goto(_DONE, i) if final else False
        return self._goto(_CONTENT, i)




class DeepSeekV3ToolParser(StepToolParser):
    """DeepSeek-V3 `<｜tool▁calls▁begin｜>` tool calls (V3.1 bodies accepted too); see the module docstring."""

    needs_special_tokens = True  # its markers are special tokens

    stream_cls = DeepSeekV3ToolStream
