"""OpenAI-API conformance sweep as real clients send requests: values the engine process cannot take, and malformed
messages, are 400s that name the field (not 500s or Jinja errors). Fake engine, the official `openai` client through
the TestClient's transport."""
from __future__ import annotations

import enum
import json
from typing import Optional

import openai
import pydantic
import pytest

from tests.entrypoints.openai.conftest import FakeEngine
from tests.entrypoints.openai.test_openai_conformance import MSGS, oai, scripted  # noqa: F401 (a fixture)
from tests.entrypoints.openai.test_openai_protocol_unit import assert_error, sse_events


@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", {"messages": MSGS}),
    ("/v1/completions", {"prompt": "hi"}),
])
@pytest.mark.parametrize("field", ["top_k", "priority"])
def test_ints_beyond_64_bits_are_400s_naming_the_field(make_client, route, body, field):
    """A top_k (or priority) past 2**63 could not be serialised to the engine process: the real server answered
    500 "OverflowError: can't serialize ints"; vLLM's int fields are 64-bit too. Within the range still works."""
    c, engine = make_client()
    err = assert_error(c.post(route, json={**body, field: 10 ** 20, "max_tokens": 1}), 400, field)
    assert field in err["message"]
    assert not engine.calls
    with pytest.raises(openai.BadRequestError) as e:
        oai(c).chat.completions.create(model="fake-model", messages=MSGS, max_tokens=1, extra_body={field: -10 ** 20})
    assert e.value.body["param"] == field
    if field == "top_k":  # a huge top_k that fits is no top-k (the fake engine has no priority scheduling check)
        assert c.post(route, json={**body, "top_k": 2 ** 63 - 1, "max_tokens": 1}).status_code == 200


def test_an_empty_cache_salt_is_a_400_naming_it(make_client):
    """vLLM: "cache_salt must be a non-empty string if provided"; here the engine's error came back with param
    null."""
    c, engine = make_client()
    for route, body in (("/v1/chat/completions", {"messages": MSGS}), ("/v1/completions", {"prompt": "hi"})):
        err = assert_error(c.post(route, json={**body, "cache_salt": "", "max_tokens": 1}), 400, "cache_salt")
        assert "cache_salt" in err["message"]
    assert not engine.calls
    assert c.post("/v1/completions", json={"prompt": "hi", "cache_salt": "tenant-1", "max_tokens": 1}).status_code \
        == 200


@pytest.mark.parametrize("message, says", [
    ({"role": 5, "content": "x"}, "messages[0].role must be a string"),
    ({"role": None, "content": "x"}, "messages[0].role must be a string"),
    ({"role": "user", "content": [{"text": "hi"}]}, "messages[0].content[0] needs a 'type'"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]},
     "messages[0].content[0]: content part of type 'image_url' is not supported (text only)"),
])
def test_malformed_messages_say_which_message_and_field(client, message, says):
    """These were 400s carrying a Jinja error ("can only concatenate str (not "int") to str", "'dict object' has no
    attribute 'role'") or naming no message; the openai client raises BadRequestError with the place named."""
    with pytest.raises(openai.BadRequestError) as e:
        oai(client).chat.completions.create(model="fake-model", messages=[message], max_tokens=1)
    assert says in e.value.body["message"] and e.value.body["param"] == "messages"


class _Address(pydantic.BaseModel):
    city: str
    zip: Optional[int]


class _Color(str, enum.Enum):
    red = "red"
    blue = "blue"


class _Person(pydantic.BaseModel):
    name: str
    color: _Color
    home: _Address
    others: list[_Address]


def test_required_tool_choice_takes_pydantic_tools_with_defs(make_client, scripted):
    """openai.pydantic_function_tool(Model) with nested models or enums sends parameters whose "$ref"s point at
    "#/$defs/...". "required" nests each tool's parameters inside an array schema, where those references resolved
    to nothing: 400 "Cannot find field '$defs' in #/$defs/_Color". The definitions now sit at the root (vLLM)."""
    args = {"name": "Ann", "color": "red", "home": {"city": "Oslo", "zip": None}, "others": []}
    c, engine = make_client(scripted(json.dumps([{"name": "_Person", "parameters": args}])))
    r = oai(c).beta.chat.completions.parse(model="fake-model", messages=MSGS, tool_choice="required",
                                           tools=[openai.pydantic_function_tool(_Person)])
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "_Person" and call.function.parsed_arguments == _Person(**args)
    schema = engine.calls[-1][1].structured_outputs.json
    schema = json.loads(schema) if isinstance(schema, str) else schema
    assert set(schema["$defs"]) == {"_Address", "_Color"}
    assert '"$defs":' not in json.dumps(schema["items"])
    # two tools that define one name differently cannot share the root: a 400 naming tool_choice
    clash = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "$defs": {"A": {"type": t}}}}}
        for i, t in enumerate(("string", "integer"))]
    err = assert_error(c.post("/v1/chat/completions", json={"messages": MSGS, "tools": clash,
                                                            "tool_choice": "required"}), 400, "tool_choice")
    assert "$defs/A" in err["message"]


class _FailsMidStream(FakeEngine):
    """Streams one step of output, then fails with an error no handler expects (an engine or parser bug)."""

    async def generate(self, prompt, sampling_params, request_id, priority=0):
        gen = super().generate(prompt, sampling_params, request_id, priority)
        try:
            yield await anext(gen)
            raise RuntimeError("boom in the middle of the stream")
        finally:
            await gen.aclose()


@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", {"messages": MSGS}),
    ("/v1/completions", {"prompt": "hi"}),
])
def test_an_unexpected_error_mid_stream_ends_with_an_error_event(make_client, smollm2_tokenizer, route, body):
    """vLLM ends a stream that fails with any exception with an error event and [DONE]; here only some types were
    caught, so a RuntimeError dropped the connection mid-body (the openai client saw a broken stream, not the
    error). Now: a 500 error event (logged server-side), [DONE], and the server keeps serving."""
    c, engine = make_client(_FailsMidStream(smollm2_tokenizer))
    r = c.post(route, json={**body, "max_tokens": 5, "stream": True})
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert err["code"] == 500 and err["type"] == "InternalServerError" and "boom" in err["message"]
    assert any(ev.get("choices") for ev in events[:-2])  # what was generated before the failure came first
    client = oai(c)
    with pytest.raises(openai.APIError, match="boom"):
        if route == "/v1/completions":
            list(client.completions.create(model="fake-model", prompt="hi", max_tokens=5, stream=True))
        else:
            list(client.chat.completions.create(model="fake-model", messages=MSGS, max_tokens=5, stream=True))
    assert not engine.running
    engine.__class__ = FakeEngine  # the server keeps serving
    assert c.post(route, json={**body, "max_tokens": 2}).status_code == 200
