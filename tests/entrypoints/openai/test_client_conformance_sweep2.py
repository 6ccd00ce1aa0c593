"""OpenAI-API conformance as current clients send requests (second sweep): the newest `openai` client's fields, roles
and HTTP details. Fake engine, the official client through the TestClient's transport; no model, no engine process."""
from __future__ import annotations

import openai
import pytest

from tests.entrypoints.openai.test_openai_conformance import MSGS, oai
from tests.entrypoints.openai.test_openai_protocol_unit import assert_error, sse_events

EFFORT_TEMPLATE = "{{ reasoning_effort | default('unset') }}{% for m in messages %}[{{ m.role }}]{{ m.content }}" \
                  "{% endfor %}"


def test_newer_openai_hints_are_accepted_and_moderation_is_a_400(make_client, tm_log):
    """The prompt-cache fields and stream_options.include_obfuscation change no text: accepted, not logged as
    ignored (the warning said the server dropped them). moderation can block a request or its answer and there is
    no moderation model: a 400 naming it on both routes, before the engine sees the request."""
    c, engine = make_client()
    client = oai(c)
    r = client.chat.completions.create(model="fake-model", messages=MSGS, max_tokens=2, prompt_cache_key="k",
                                       prompt_cache_retention="24h",
                                       extra_body={"prompt_cache_options": {"mode": "implicit", "ttl": "30m"}})
    assert r.choices[0].finish_reason == "length"
    for create in (client.chat.completions.create, client.completions.create):
        kw = {"messages": MSGS} if create == client.chat.completions.create else {"prompt": "Hello"}
        chunks = list(create(model="fake-model", max_tokens=2, stream=True, **kw,
                             stream_options={"include_usage": True, "include_obfuscation": False}))
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2
    r = c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 1, "prompt_cache_options": {"ttl": "30m"},
                                      "prompt_cache_retention": "24h"})
    assert r.status_code == 200, r.text
    assert "ignored" not in tm_log.text
    calls = len(engine.calls)
    moderation = {"model": "omni-moderation-latest", "policy": {"input": {"mode": "block"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake-model", messages=MSGS, max_tokens=2, moderation=moderation)
    assert e.value.body["param"] == "moderation" and "not supported" in e.value.body["message"]
    err = assert_error(c.post("/v1/responses", json={"input": "hi", "moderation": moderation}), 400, "moderation")
    assert "moderation" in err["message"]
    assert_error(c.post("/v1/chat/completions", json={"messages": MSGS, "prompt_cache_retention": "forever"}), 400,
                 "prompt_cache_retention")
    assert len(engine.calls) == calls


def test_every_reasoning_effort_the_client_defines_reaches_the_template(make_client):
    """The client's ReasoningEffort now includes "xhigh" and "max"; they were 400s ("must be one of ... high")."""
    c, engine = make_client(chat_template=EFFORT_TEMPLATE)
    client = oai(c)
    for effort in ("none", "minimal", "low", "medium", "high", "xhigh", "max"):
        client.chat.completions.create(model="fake-model", messages=MSGS, max_tokens=1, reasoning_effort=effort)
        assert engine.calls[-1][0]["prompt"].startswith(effort + "[")
        client.responses.create(model="fake-model", input="hi", max_output_tokens=1, reasoning={"effort": effort})
        assert engine.calls[-1][0]["prompt"].startswith(effort + "[user]")


def test_developer_messages_are_the_system_prompt_on_the_chat_route(make_client):
    """Codex, the Agents SDK and reasoning-model clients send the system prompt as role "developer". SmolLM2's
    template rendered it as an unknown "developer" turn after its own default system prompt (which it then kept);
    now it is the system prompt, as /v1/responses renders it. A template that knows the role keeps it."""
    c, engine = make_client()
    dev = [{"role": "developer", "content": "Answer in French."}, *MSGS]
    sysm = [{"role": "system", "content": "Answer in French."}, *MSGS]
    oai(c).chat.completions.create(model="fake-model", messages=dev, max_tokens=1)
    prompt = engine.calls[-1][0]["prompt"]
    oai(c).chat.completions.create(model="fake-model", messages=sysm, max_tokens=1)
    assert prompt == engine.calls[-1][0]["prompt"]
    assert prompt.startswith("<|im_start|>system\nAnswer in French.<|im_end|>") and "developer" not in prompt
    assert c.post("/tokenize", json={"messages": dev}).json() == c.post("/tokenize", json={"messages": sysm}).json()
    c.post("/v1/responses", json={"input": dev, "max_output_tokens": 1})
    assert engine.calls[-1][0]["prompt"] == prompt
    c, engine = make_client(chat_template="{% for m in messages %}{% if m.role == 'developer' %}<dev>"
                                          "{% else %}[{{ m.role }}]{% endif %}{{ m.content }}{% endfor %}")
    r = c.post("/v1/chat/completions", json={"messages": dev, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert engine.calls[-1][0]["prompt"].startswith("<dev>Answer in French.[user]")


def test_method_not_allowed_names_the_allowed_methods(client):
    """RFC 9110: a 405 carries an Allow header; the OpenAI-shaped error body used to drop it."""
    for method, path, allowed in (("PUT", "/v1/chat/completions", "POST"), ("GET", "/v1/completions", "POST"),
                                  ("POST", "/v1/models", "GET")):
        r = client.request(method, path)
        assert_error(r, 405)
        assert allowed in r.headers["allow"], (method, path, r.headers)
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", {"messages": MSGS}),
                                        ("/v1/completions", {"prompt": "Hello there"})])
def test_stream_chunk_order_per_choice_with_usage(client, path, body):
    """The order clients assemble from, per choice: the role first (chat), text deltas, one finish chunk, and after
    every choice's finish the usage chunk (no choices), then [DONE]; each chunk names the same id and created."""
    r = client.post(path, json={**body, "n": 2, "max_tokens": 3, "stream": True,
                                "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 6
    chunks = events[:-2]
    assert {(ev["id"], ev["created"]) for ev in events[:-1]} == {(events[0]["id"], events[0]["created"])}
    assert all(ev["usage"] is None and len(ev["choices"]) == 1 for ev in chunks)
    for i in (0, 1):
        mine = [ev["choices"][0] for ev in chunks if ev["choices"][0]["index"] == i]
        finishes = [ch["finish_reason"] for ch in mine]
        assert finishes[-1] == "length" and finishes[:-1] == [None] * (len(mine) - 1)
        if path == "/v1/chat/completions":
            assert mine[0]["delta"] == {"role": "assistant", "content": ""}
            assert all("role" not in ch["delta"] for ch in mine[1:])


PROMPT_TAKES = "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists."


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/completions", {"prompt": ["a", [1, 2]]}, "prompt", PROMPT_TAKES),
    ("/v1/completions", {"prompt": [1.5, 2]}, "prompt", PROMPT_TAKES),
    ("/v1/chat/completions", {"messages": MSGS, "stop": [1, 2]}, "stop", "stop must be a string or a list of strings."),
    ("/v1/chat/completions", {"messages": MSGS, "tool_choice": 5}, "tool_choice",
     'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}.'),
    ("/v1/responses", {"input": 5}, "input", "input must be a string or a list of input items."),
    ("/v1/chat/completions", {"messages": [None]}, "messages", "messages[0]: Input should be a valid dictionary"),
    ("/v1/chat/completions", {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f"}}, 3]},
     "tools", "tools[1]: Input should be a valid dictionary"),
])
def test_type_errors_read_as_one_sentence_per_field(client, path, body, param, message):
    """A value of the wrong type for a union field was reported once per union member ("prompt.list[int].0: ...;
    prompt.list[list[int]].0: ...; prompt.str: ...; prompt.list[str].1: ..."); list places read messages.0."""
    err = assert_error(client.post(path, json={**body, "max_tokens": 1}), 400, param)
    assert err["message"] == message


def test_auto_tool_choice_with_a_template_that_never_shows_tools_warns_at_start(make_client, tm_log):
    """SmolLM2's template ignores `tools`: with --enable-auto-tool-choice, "auto" requests offered the model tools
    it never saw, and nothing said so. Start-up now warns; a template that renders tools does not."""
    make_client(enable_auto_tool_choice=True, tool_call_parser="hermes")
    assert "never reads `tools`" in tm_log.text
    tm_log.clear()
    make_client(enable_auto_tool_choice=True, tool_call_parser="hermes",
                chat_template="{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}")
    make_client()
    assert "never reads `tools`" not in tm_log.text
