"""Output constraints for `bench serve --structured-output-ratio`: which requests carry one, which one, how it is
sent, and whether the answer obeyed it.

Contract:
  * `structured_flags(n, ratio)` marks round(n * ratio) of n requests, spread evenly through the run (0.5 marks
    every second request), so structured and free requests are in flight together and a run is deterministic.
  * `constraint_for(kind, k)` is the k-th structured request's constraint: the pools below are cycled.
  * `add_constraint(payload, ...)` turns a free payload into a constrained one, with vLLM's request fields:
    `structured_outputs: {kind: spec}` on /v1/completions, and on /v1/chat/completions OpenAI's `response_format`
    json_schema for JSON schemas (structured_outputs for regex and choice, which response_format cannot express).
    Constrained requests do not send ignore_eos: they end where the grammar ends, within max_tokens.
  * `answer_is_valid(kind, spec, text)` checks an answer: the schema subset used below, a full regex match, or
    one of the choices.

Every schema bounds its answer (maxLength on strings, maxItems on arrays, bounded integers) and asks for some
minimum (minItems, minLength, required keys), so even a model with random weights writes a JSON answer of tens of
tokens that ends well inside a 256-token budget when the server is told to disable free whitespace.
"""
from __future__ import annotations

import json
import re
from typing import Any

KINDS = ("json", "regex", "choice")


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required}


def _str(lo: int, hi: int) -> dict[str, Any]:
    return {"type": "string", "minLength": lo, "maxLength": hi}


def _int(lo: int, hi: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _enum(*values: Any) -> dict[str, Any]:
    return {"type": "string" if isinstance(values[0], str) else "integer", "enum": list(values)}


def _arr(items: dict[str, Any], lo: int, hi: int) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": lo, "maxItems": hi}


_DAY = _enum("mon", "tue", "wed", "thu", "fri", "sat", "sun")
JSON_SCHEMAS: list[dict[str, Any]] = [
    _obj({"name": _str(3, 12), "age": _int(0, 120), "tags": _arr(_str(2, 8), 2, 3)}),
    _obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "price": _int(1, 9999),
          "currency": _enum("USD", "EUR", "JPY"), "in_stock": {"type": "boolean"},
          "size_cm": _obj({"w": _int(1, 500), "h": _int(1, 500), "d": _int(1, 500)})}),
    _obj({"order_id": _int(1, 99999), "status": _enum("pending", "shipped", "delivered", "cancelled"),
          "items": _arr(_obj({"sku": _str(4, 8), "qty": _int(1, 20)}), 1, 3)}),
    _obj({"city": _str(2, 12), "forecast": _arr(_obj({"day": _DAY, "high": _int(-40, 50), "low": _int(-50, 40),
                                                     "sky": _enum("sunny", "cloudy", "rain", "snow")}), 2, 3)}),
    _obj({"title": _str(4, 16), "date": {"type": "string", "pattern": "^2026-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])$"},
          "attendees": _arr(_obj({"name": _str(2, 10), "role": _enum("host", "guest", "speaker")}), 2, 3),
          "virtual": {"type": "boolean"}}),
    _obj({"rows": _arr(_arr(_int(0, 9), 3, 3), 2, 3)}),
    _obj({"rating": _int(1, 5), "sentiment": _enum("positive", "negative", "mixed"), "summary": _str(8, 24),
          "pros": _arr(_str(2, 10), 1, 2)}),
    _obj({"service": _str(3, 10), "replicas": _int(1, 16), "ports": _arr(_int(1, 65535), 1, 3),
          "env": _enum("dev", "staging", "prod"), "limits": _obj({"cpu_millis": _int(100, 64000),
                                                                   "memory_mb": _int(128, 65536)})}),
    _obj({"points": _arr(_obj({"lat": _int(-90, 90), "lon": _int(-180, 180)}), 2, 4)}),
    _obj({"label": _enum("sports", "politics", "science", "business", "arts", "health"),
          "confidence_pct": _int(0, 100), "alternatives": _arr(_enum("sports", "science", "arts"), 0, 2)}),
    _obj({"name": _str(3, 14), "servings": _int(1, 12), "vegetarian": {"type": "boolean"},
          "ingredients": _arr(_obj({"item": _str(2, 10), "grams": _int(1, 1000)}), 2, 3)}),
    _obj({"id": {"type": "string", "pattern": "^TCK-[0-9]{5}$"}, "priority": _enum("low", "medium", "high", "urgent"),
          "assignee": _obj({"name": _str(2, 10), "team": _enum("infra", "web", "ml")}),
          "labels": _arr(_str(2, 8), 0, 3)}, required=["id", "priority", "assignee"]),
]

REGEXES: list[str] = [
    r"[A-Z]{3}-[0-9]{4}",
    r"[0-9]{3}-[0-9]{3}-[0-9]{4}",
    r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    r"[a-z]{3,10}@[a-z]{3,8}\.(com|org|net)",
    r"#[0-9a-f]{6}",
    r"(GET|POST|PUT|DELETE) /[a-z]{2,8}(/[a-z0-9]{1,6}){0,3}",
    r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])",
    r"[A-Z][a-z]{2,9} [A-Z][a-z]{2,11}",
]

CHOICES: list[list[str]] = [
    ["positive", "negative", "neutral"],
    ["yes", "no"],
    ["red", "orange", "yellow", "green", "blue", "indigo", "violet"],
    ["Paris", "London", "Tokyo", "New York", "Sydney", "São Paulo"],
    ["low", "medium", "high", "critical"],
    ["true", "false", "unknown"],
]

_POOLS: dict[str, list[Any]] = {"json": JSON_SCHEMAS, "regex": REGEXES, "choice": CHOICES}


def structured_flags(n: int, ratio: float) -> list[bool]:
    """Which of n requests carry a constraint: round(n * ratio) of them, evenly interleaved with the free ones."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"--structured-output-ratio must be within [0, 1], got {ratio}.")
    count = round(n * ratio)
    # Integer Bresenham: request i is structured when the running quota count*(i+1)/n passes a new whole number.
    return [(i + 1) * count // n > i * count // n for i in range(n)]


def constraint_for(kind: str, k: int) -> Any:
    """The constraint of the k-th structured request (a schema dict, a regex, or a list of choices)."""
    if kind not in _POOLS:
        raise ValueError(f"--structured-output-kind must be one of {', '.join(KINDS)}, got {kind!r}.")
    pool = _POOLS[kind]
    return pool[k % len(pool)]


def add_constraint(payload: dict[str, Any], backend: str, kind: str, spec: Any, k: int,
                   disable_any_whitespace: bool) -> None:
    """Make `payload` (a free request built for `backend`) ask for an answer obeying `spec`, in place."""
    payload.pop("ignore_eos", None)
    if backend == "openai-chat" and kind == "json" and not disable_any_whitespace:
        payload["response_format"] = {"type": "json_schema",
                                      "json_schema": {"name": f"bench_schema_{k}", "schema": spec, "strict": True}}
        return
    constraint: dict[str, Any] = {kind: spec}
    if disable_any_whitespace:
        constraint["disable_any_whitespace"] = True
    payload["structured_outputs"] = constraint


def answer_is_valid(kind: str, spec: Any, text: str) -> bool:
    """Whether `text` obeys the constraint (for json: parses and fits the schema subset used here)."""
    if kind == "choice":
        return text in spec
    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return fits_schema(spec, value)


_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict,
          "null": type(None)}


def fits_schema(schema: dict[str, Any], value: Any) -> bool:
    """JSON-schema validation for the keywords the schemas here use (type, enum, bounds, lengths, pattern,
    properties/required, items/minItems/maxItems); other keywords are not checked."""
    if "enum" in schema and value not in schema["enum"]:
        return False
    t = schema.get("type")
    if t is None:
        return True
    if isinstance(value, bool) and t in ("integer", "number"):
        return False
    if not isinstance(value, _TYPES[t]):
        return False
    if t in ("integer", "number"):
        return schema.get("minimum", float("-inf")) <= value <= schema.get("maximum", float("inf"))
    if t == "string":
        if "pattern" in schema and re.search(schema["pattern"], value) is None:
            return False
        return schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", float("inf"))
    if t == "array":
        return (schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", float("inf"))
                and all(fits_schema(schema.get("items", {}), v) for v in value))
    if t == "object":
        props = schema.get("properties", {})
        return all(k in value for k in schema.get("required", [])) and all(
            fits_schema(props[k], v) for k, v in value.items() if k in props)
    return True
