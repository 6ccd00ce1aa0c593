"""Qwen3-Coder tool calls: an XML-like format with raw-text parameter values typed through the tool's schema.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Block, content and invalid-block rules are those of `hermes.TaggedBlockToolParser`. Specific to this format:

- A `<tool_call>` block holds one or more `<function=NAME>` sections; a bare `<function=...>...</function>`
  without the `<tool_call>` wrapper is also accepted (Qwen3-Coder sometimes omits it). A block without any
  function with a valid name (non-empty, no whitespace or angle brackets) is invalid -> raw content.
- Tolerant ends, as the model sometimes omits closing tags: a function ends at `</function>`, the next
  `<function=`, or the end of its block; a parameter at `</parameter>`, the next `<parameter=`, or the end of its
  function. Text between parameters is ignored.
- Values are raw text: one leading and one trailing "\\n" are stripped, then the value is typed by the request
  tool's JSON schema for that parameter (`convert_value`). Without a schema: JSON if the text is JSON, else the
  string. A parameter name repeated within one call keeps its FIRST value (so streaming never has to retract).
- Arguments are `json.dumps(dict_of_parameters, ensure_ascii=False)`.
- Streaming is incremental: a call's id and name are emitted as soon as `<function=NAME>` is complete, each
  parameter (`{"key": value` / `, "key": value`) once its closing tag arrives, and `}` when the function ends.
"""
from __future__ import annotations

import ast
import json
import math
import re

from tokenmill.parsers.tool import ToolCall, ToolCallDelta, ToolStreamDelta
from tokenmill.parsers.tool.hermes import (TOOL_CALL_END, TOOL_CALL_START, TaggedBlockStream, TaggedBlockToolParser,
                                           find_first_tag)

FUNCTION_START = "<function="
FUNCTION_END = "</function>"
PARAMETER_START = "<parameter="
PARAMETER_END = "</parameter>"
_VALID_NAME = re.compile(r"[^\s<>]+")


class _Function:
    """One `<function=...>` section as scanned so far. `params` holds only complete (key, raw value) pairs."""

    def __init__(self, name: str | None, name_known: bool, params: list[tuple[str, str]], complete: bool) -> None:
        self.name, self.name_known, self.params, self.complete = name, name_known, params, complete


def _scan_function(body: str, complete: bool) -> _Function:
    """Scan the text after `<function=`; `complete` says it is the whole section (its end was found)."""
    gt = body.find(">")
    if gt < 0:
        return _Function(None, complete, [], complete)
    name = body[:gt].strip()
    name = name if _VALID_NAME.fullmatch(name) else None
    params: list[tuple[str, str]] = []
    p = body.find(PARAMETER_START, gt + 1)
    while p >= 0:
        s = p + len(PARAMETER_START)
        e, _ = find_first_tag(body, (PARAMETER_END, PARAMETER_START), s)
        if e < 0 and not complete:
            break  # the value is still being written
        seg = body[s:] if e < 0 else body[s:e]
        k = seg.find(">")
        if k >= 0 and seg[:k].strip():
            params.append((seg[:k].strip(), seg[k + 1:]))
        if e < 0:
            break
        p = body.find(PARAMETER_START, e)
    return _Function(name, True, params, complete)


def scan_functions(text: str, final: bool) -> list[_Function]:
    """Scan the `<function=...>` sections of a block's text; `final`: the text is the whole block."""
    fns = []
    pos = text.find(FUNCTION_START)
    while pos >= 0:
        start = pos + len(FUNCTION_START)
        end, _ = find_first_tag(text, (FUNCTION_END, FUNCTION_START), start)
        fns.append(_scan_function(text[start:] if end < 0 else text[start:end], complete=end >= 0 or final))
        if end < 0:
            break
        pos = text.find(FUNCTION_START, end)
    return fns


def _reject_constant(name: str):
    raise ValueError(f"non-finite number {name}")


def _json(text: str):
    """json.loads without NaN/Infinity; raises ValueError."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError as e:
        raise ValueError("too deeply nested") from e


def _schema_types(schema) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    if isinstance(t, str):
        types = {t}
    else:
        types = {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            types |= _schema_types(sub)
    if not types and isinstance(schema.get("properties"), dict):
        types.add("object")
    return types


def _typed(text: str, t: str):
    """`text` parsed as JSON-schema type `t`; raises ValueError when it is not one."""
    s = text.strip()
    if t == "null" and s.lower() in ("null", "none"):
        return None
    if t == "boolean" and s.lower() in ("true", "false"):
        return s.lower() == "true"
    if t == "integer":
        if re.fullmatch(r"[+-]?\d+", s):
            return int(s)
        v = float(s)  # "3.0" is an integer
        if math.isfinite(v) and v.is_integer():
            return int(v)
    if t == "number":
        v = float(s)
        if math.isfinite(v):
            return int(s) if re.fullmatch(r"[+-]?\d+", s) else v
    if t in ("object", "array"):
        try:
            v = _json(s)
        except ValueError:
            v = ast.literal_eval(s)  # Python-style literals: single quotes, True/None
        if isinstance(v, dict if t == "object" else list):
            return v
    raise ValueError(f"not a {t}")


def convert_value(raw: str, schema) -> object:
    """Type a raw parameter value with its JSON schema (None when the tool or parameter has no schema).

    One leading and one trailing newline are stripped. string: kept as text (a string-or-null schema turns
    "null" into None). integer/number/boolean/null/
    object/array: parsed from the text (objects and arrays also from Python literals); when the text fits none
    of the schema's types it stays a string. No schema: JSON if the text parses as JSON, else the string.
    """
    text = raw[1:] if raw.startswith("\n") else raw
    text = text[:-1] if text.endswith("\n") else text
    types = _schema_types(schema)
    if not types:
        try:
            return _json(text.strip())
        except ValueError:
            return text
    if "string" in types and not ("null" in types and text.strip().lower() in ("null", "none")):
        return text
    for t in ("null", "boolean", "integer", "number", "object", "array"):
        if t in types:
            try:
                return _typed(text, t)
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                continue
    return text


def _param_schemas(tools: list[dict] | None) -> dict[str, dict]:
    """{function name: {parameter name: schema}} from an OpenAI `tools` list."""
    out: dict[str, dict] = {}
    for tool in tools or []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


def _pair(key: str, raw: str, schemas: dict[str, dict], fn_name: str) -> str:
    value = convert_value(raw, schemas.get(fn_name, {}).get(key))
    return f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"


class Qwen3CoderToolParser(TaggedBlockToolParser):
    """Qwen3-Coder `<tool_call><function=NAME><parameter=KEY>value</parameter></function></tool_call>` calls,
    values typed through the request's tool schemas. Rules: see the module docstring."""

    openers = {TOOL_CALL_START: TOOL_CALL_END, FUNCTION_START: FUNCTION_END}

    @staticmethod
    def block_text(open_tag: str, body: str) -> str:
        return FUNCTION_START + body if open_tag == FUNCTION_START else body

    def parse_block(self, open_tag: str, body: str, tools: list[dict] | None) -> list[ToolCall]:
        schemas = _param_schemas(tools)
        calls = []
        for fn in scan_functions(self.block_text(open_tag, body), final=True):
            if fn.name is None:
                continue
            seen: set[str] = set()
            pairs = []
            for key, raw in fn.params:
                if key not in seen:
                    seen.add(key)
                    pairs.append(_pair(key, raw, schemas, fn.name))
            calls.append(ToolCall(name=fn.name, arguments="{" + ", ".join(pairs) + "}"))
        return calls

    def new_stream(self, tools: list[dict] | None = None) -> "Qwen3CoderStream":
        return Qwen3CoderStream(self, tools)


class Qwen3CoderStream(TaggedBlockStream):
    """Incremental streaming of Qwen3-Coder blocks (name first, then one argument piece per parameter)."""

    def __init__(self, parser: Qwen3CoderToolParser, tools: list[dict] | None) -> None:
        super().__init__(parser, tools)
        self._schemas = _param_schemas(tools)
        self._fns: list[dict] = []  # per function of the current block: index, params consumed, keys, closed

    def _advance(self, body: str, final: bool, out: ToolStreamDelta) -> None:
        for k, fn in enumerate(scan_functions(self.parser.block_text(self._open, body), final)):
            if k == len(self._fns):
                if not fn.name_known:
                    break
                index = None if fn.name is None else self._new_call(fn.name, out)
                self._fns.append({"index": index, "used": 0, "keys": set(), "closed": False})
            st = self._fns[k]
            if st["index"] is None or st["closed"]:
                continue
            pieces = []
            for key, raw in fn.params[st["used"]:]:
                if key not in st["keys"]:
                    pieces.append(("{" if not st["keys"] else ", ") + _pair(key, raw, self._schemas, fn.name))
                    st["keys"].add(key)
            st["used"] = len(fn.params)
            if fn.complete:
                pieces.append("}" if st["keys"] else "{}")
                st["closed"] = True
            if pieces:
                out.tool_calls.append(ToolCallDelta(index=st["index"], arguments="".join(pieces)))

    def _block_progress(self, body: str, out: ToolStreamDelta) -> None:
        self._advance(body, final=False, out=out)

    def _block_end(self, body: str, out: ToolStreamDelta) -> bool:
        self._advance(body, final=True, out=out)
        valid = any(st["index"] is not None for st in self._fns)
        self._fns = []
        return valid
