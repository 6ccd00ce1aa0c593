"""Issue acceptance over HTTP with the embedded SmolLM2: JSON-schema answers always validate (20 varied schemas),
regex and choice answers always match, and forced tool choices always give calls that parse and fit the schema."""
from __future__ import annotations

import json
import re

import pytest

from tests.entrypoints.openai.server_utils import RemoteServer

pytestmark = pytest.mark.slow
_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict}


def fits(schema: dict, value) -> bool:
    """The subset of JSON-schema validation the schemas below use."""
    t = schema.get("type")
    if "enum" in schema and value not in schema["enum"]:
        return False
    if t is None:
        return True
    if t == "integer" and isinstance(value, bool) or t == "number" and isinstance(value, bool):
        return False
    if not isinstance(value, _TYPES[t]):
        return False
    if t in ("integer", "number"):
        return schema.get("minimum", -1e308) <= value <= schema.get("maximum", 1e308)
    if t == "array":
        return (schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 10**9)
                and all(fits(schema.get("items", {}), v) for v in value))
    if t == "object":
        props = schema.get("properties", {})
        return all(k in value for k in schema.get("required", [])) and all(
            fits(props[k], v) for k, v in value.items() if k in props)
    if t == "string":
        return schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", 10**9)
    return True


def obj(props: dict, required=None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required}


S, I, N, B = {"type": "string", "maxLength": 30}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
SCHEMAS = [
    obj({"name": S}), obj({"age": {"type": "integer", "minimum": 0, "maximum": 120}}), obj({"ok": B}),
    obj({"price": {"type": "number", "minimum": 0, "maximum": 1000}}),
    obj({"color": {"type": "string", "enum": ["red", "green", "blue"]}}),
    obj({"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}}),
    obj({"user": obj({"id": I, "name": S})}), obj({"a": S, "b": I, "c": B}),
    obj({"points": {"type": "array", "items": obj({"x": I, "y": I}), "maxItems": 2}}),
    obj({"title": S, "year": {"type": "integer", "minimum": 1900, "maximum": 2100}}),
    obj({"city": S, "country": S}, required=["city"]), obj({"level": {"type": "integer", "enum": [1, 2, 3]}}),
    obj({"matrix": {"type": "array", "items": {"type": "array", "items": I, "maxItems": 2}, "maxItems": 2}}),
    obj({"meta": obj({"k": S, "v": N})}), obj({"flag": B, "count": {"type": "integer", "minimum": 0, "maximum": 9}}),
    obj({"answer": {"type": "string", "enum": ["yes", "no"]}, "confidence": N}),
    obj({"items": {"type": "array", "items": obj({"sku": S, "qty": I}), "minItems": 1, "maxItems": 2}}),
    obj({"first": S, "last": S, "email": S}), obj({"temperature": {"type": "number", "minimum": -50, "maximum": 60}}),
    obj({"summary": S, "keywords": {"type": "array", "items": S, "maxItems": 3}}),
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": obj(
    {"city": S, "days": {"type": "integer", "minimum": 1, "maximum": 7}})}},
    {"type": "function", "function": {"name": "search", "parameters": obj({"query": S})}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = RemoteServer(["--max-model-len", "2048", "--disable-log-stats"],
                       str(tmp_path_factory.mktemp("so") / "server.log"))
    srv.wait_healthy(120)
    yield srv
    srv.stop()


def chat(c, content: str, **body) -> dict:
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                             "max_tokens": 160, "temperature": 0.7, "seed": 1, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_json_schemas_always_validate(server):
    with server.client(timeout=300) as c:
        for i, schema in enumerate(SCHEMAS):
            choice = chat(c, "Reply with a JSON object about anything.", response_format={
                "type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
            assert choice["finish_reason"] == "stop", (i, choice)
            assert fits(schema, json.loads(choice["message"]["content"])), (i, choice["message"]["content"])


def test_regex_choice_and_forced_tools(server):
    with server.client(timeout=300) as c:
        for seed in range(3):
            text = chat(c, "A code please.", seed=seed, structured_outputs={"regex": r"[A-Z]{2}[0-9]{3}"})
            assert re.fullmatch(r"[A-Z]{2}[0-9]{3}", text["message"]["content"])
            pick = chat(c, "Pick a fruit.", seed=seed, structured_outputs={"choice": ["apple", "pear", "plum"]})
            assert pick["message"]["content"] in ("apple", "pear", "plum")
        named = chat(c, "Weather in Paris?", tools=TOOLS,
                     tool_choice={"type": "function", "function": {"name": "get_weather"}})
        (call,) = named["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert fits(TOOLS[0]["function"]["parameters"], json.loads(call["function"]["arguments"]))
        required = chat(c, "Find cats, then the weather in Oslo.", tools=TOOLS, tool_choice="required",
                        max_tokens=300)
        assert required["finish_reason"] == "tool_calls" and required["message"]["tool_calls"]
        for call in required["message"]["tool_calls"]:
            fn = next(t["function"] for t in TOOLS if t["function"]["name"] == call["function"]["name"])
            assert fits(fn["parameters"], json.loads(call["function"]["arguments"]))
