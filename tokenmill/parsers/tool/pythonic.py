"""Pythonic tool calls, Llama 3.2 / Llama 4 style (`--tool-call-parser pythonic`).

Contract:
- A tool-call output is, after optional whitespace and an optional `<|python_start|>`, a Python list of calls with
  keyword arguments only: `[get_weather(city="Paris", days=3), search(q='x')]` (dotted names like `a.b(...)` too).
- It is parsed with `ast`, never evaluated. Argument values must be literals: str, int, float (finite), bool, None,
  lists/tuples (-> JSON arrays), dicts with string keys, unary +/- on numbers, and the JSON spellings
  `true`/`false`/`null`. Anything else (positional or `**` arguments, names, calls, f-strings, ...) or an empty list
  means the output is not a tool call: it is returned unchanged as content.
- An output that does not start with `[` (after the optional prefix) is content, unchanged.
- After the closing `]`, whitespace and an optional `<|python_end|>` are dropped; any further text is content from
  its first non-whitespace character.
- Arguments are serialized with `json.dumps(args, ensure_ascii=False)`, identically in both paths.
Streaming: leading text that may still be a call list is held back until the list's brackets close (bracket matching
aware of Python strings; an impossible start such as `[1` or `[Note` is released at once), then all calls are
emitted, one delta each (id, name, full arguments). `extract()` runs the same state machine over the whole text, so
streamed and non-streamed results agree for any chunking.
"""
from __future__ import annotations

import ast
import json
import math
import re

from tokenmill.parsers.tool.step_stream import DONE, PLAIN, StepToolParser, StepToolStream, skip_ws
from tokenmill.parsers.tool import ToolCallDelta, ToolStreamDelta, make_tool_call_id

PY_START = "<|python_start|>"
PY_END = "<|python_end|>"
_HEAD_RE = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*(\()?)?")
_OTHER_RUN = re.compile(r"[^\"'()\[\]{}]+")
_STRING_BODY = {  # whole escape sequences and characters that cannot end the string (or a one-line one)
    '"': re.compile(r'(?:\\.|[^\\\n"])*', re.S), "'": re.compile(r"(?:\\.|[^\\\n'])*", re.S),
    '"""': re.compile(r'(?:\\.|[^\\"])*', re.S), "'''": re.compile(r"(?:\\.|[^\\'])*", re.S)}
_JSON_NAMES = {"true": True, "false": False, "null": None}
_START, _LIST, _AFTER = range(3)
_PLAIN, _DONE = PLAIN, DONE


class _NotLiteral(Exception):
    pass


def _literal(node: ast.AST):
    if isinstance(node, ast.Constant):
        v = node.value
        if v is None or isinstance(v, (str, bool, int)) or (isinstance(v, float) and math.isfinite(v)):
            return v
    elif isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    elif isinstance(node, ast.Dict):
        if all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
            return {k.value: _literal(v) for k, v in zip(node.keys, node.values)}
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _literal(node.operand)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return -v if isinstance(node.op, ast.USub) else v
    elif isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    raise _NotLiteral


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def parse_call_list(src: str) -> list[tuple[str, str]] | None:
    """[(name, arguments JSON)] for a source text that is exactly a list of literal-keyword calls, else None."""
    try:
        tree = ast.parse(src.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for el in tree.body.elts:
        if not isinstance(el, ast.Call) or el.args or _dotted(el.func) is None:
            return None
        args = {}
        for kw in el.keywords:
            if kw.arg is None:
                return None
            try:
                args[kw.arg] = _literal(kw.value)
            except (_NotLiteral, RecursionError):
                return None
        calls.append((_dotted(el.func), json.dumps(args, ensure_ascii=False)))
    return calls


class ListScanner:
    """Finds the bracket closing the `[` at `start` in a growing text, skipping Python string literals; each call
    to `advance` only scans text it has not decided yet, so feeding a long call costs linear time overall."""

    def __init__(self, start: int) -> None:
        self.i, self.depth, self.quote = start, 0, ""

    def advance(self, text: str) -> int | None:
        """Index after the closing bracket; None if not closed yet; -1 if it can never be valid Python."""
        i, n = self.i, len(text)
        while i < n:
            if not self.quote:
                run = _OTHER_RUN.match(text, i)
                if run:
                    i = run.end()
                    continue
                c = text[i]
                if c in "([{":
                    self.depth += 1
                elif c in ")]}":
                    self.depth -= 1
                    if self.depth == 0:
                        self.i = i + 1
                        return i + 1
                else:  # an opening quote: one or three?
                    if n - i < 3 and text[i:] == c * (n - i):
                        break
                    self.quote = c * 3 if text.startswith(c * 3, i) else c
                    i += len(self.quote)
                    continue
                i += 1
                continue
            i = _STRING_BODY[self.quote].match(text, i).end()
            if i == n or text[i] == "\\":  # end of text, or a lone backslash at its end: wait
                break
            if text[i] == "\n":  # only stops a one-line string
                return -1
            if len(self.quote) == 1 or text.startswith(self.quote, i):
                i += len(self.quote)
                self.quote = ""
            elif n - i < 3 and text[i:] == self.quote[: n - i]:
                break  # maybe the closing triple quote
            else:
                i += 1  # a lone quote inside a triple-quoted string
        self.i = i
        return None



class PythonicToolStream(StepToolStream):
    def __init__(self) -> None:
        self._scanner: ListScanner | None = None
        self._seen_end = False
        super().__init__(_START)

    def _steps(self):
        return {_START: self._start, _LIST: self._list, _AFTER: self._after}

    def _start(self, out: ToolStreamDelta, final: bool) -> bool:
        buf = self._buf
        i = skip_ws(buf, 0)
        if buf.startswith(PY_START, i):
            i = skip_ws(buf, i + len(PY_START))
        elif i < len(buf) and PY_START.startswith(buf[i:]):
            return self._goto(_PLAIN, 0) if final else False
        if i == len(buf):
            return self._goto(_PLAIN, 0) if final else False
        if buf[i] != "[":
            return self._goto(_PLAIN, 0)
        self._scanner = ListScanner(i)
        return self._goto(_LIST, i)

    def _list(self, out: ToolStreamDelta, final: bool) -> bool:
        buf, start = self._buf, self._pos
        head = _HEAD_RE.match(buf, start)
        if head.group(1) is None and (final or head.end() < len(buf)):
            return self._goto(_PLAIN, 0)  # cannot be `[name(`
        end = self._scanner.advance(buf)
        if end is None and not final:
            return False
        calls = parse_call_list(buf[start:end]) if end and end > 0 else None
        if calls is None:
            return self._goto(_PLAIN, 0)
        for name, args in calls:
            out.tool_calls.append(ToolCallDelta(index=self._calls, id=make_tool_call_id(), name=name, arguments=args))
            self._calls += 1
        return self._goto(_AFTER, end)

    def _after(self, out: ToolStreamDelta, final: bool) -> bool:
        buf = self._buf
        i = skip_ws(buf, self._pos)
        if not self._seen_end and buf.startswith(PY_END, i):
            self._seen_end = True
            return self._goto(_AFTER, i + len(PY_END))
        if i == len(buf):
            return self._goto(_DONE, i) if final else False
        if not final and not self._seen_end and PY_END.startswith(buf[i:]):
            return False
        return self._goto(_PLAIN, i)




class PythonicToolParser(StepToolParser):
    """`[func(kw=literal, ...), ...]` tool calls parsed with `ast`; see the module docstring for the contract."""

    stream_cls = PythonicToolStream
