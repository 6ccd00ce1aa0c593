"""Protocol tests of the OpenAI routes against a fake engine (no model, no engine process)."""
from __future__ import annotations

import json

import pytest

from tests.entrypoints.openai.conftest import FakeEngine, post_then_disconnect
from tokenmill import envs
from tokenmill.sampling_params import RequestOutputKind


def sse_events(text: str) -> list:
    events = []
    for block in text.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def assert_error(resp, status, param=None):
    assert resp.status_code == status, resp.text
    body = resp.json()
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


# ----- simple routes -----
def test_health_version_ping_models(client, fake_engine):
    assert client.get("/health").status_code == 200
    assert client.get("/health").content == b""
    assert client.head("/health").status_code == 200
    assert client.get("/ping").status_code == 200
    assert client.post("/ping").status_code == 200
    import tokenmill
    assert client.get("/version").json() == {"version": tokenmill.__version__}
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    ids = [m["id"] for m in models["data"]]
    assert ids == ["fake-model", "fake-alias"]
    card = models["data"][0]
    assert card["object"] == "model" and card["owned_by"] == "tokenmill" and card["root"] == "/models/fake"
    assert card["max_model_len"] == 256 and card["parent"] is None and isinstance(card["created"], int)
    assert card["permission"][0]["object"] == "model_permission"


def test_health_503_when_dead(make_client, smollm2_tokenizer):
    c, engine = make_client()
    engine.dead = True
    assert c.get("/health").status_code == 503
    r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert_error(r, 503)
    assert c.app.state.exit_code == 1


def test_metrics_and_docs(make_client):
    c, _ = make_client()
    r = c.get("/metrics")
    assert r.status_code == 200 and "text/plain" in r.headers["content-type"]
    assert c.get("/openapi.json").status_code == 200
    assert c.get("/docs").status_code == 200
    assert c.get("/redoc").status_code == 200
    c2, _ = make_client(disable_fastapi_docs=True)
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert_error(c2.get(path), 404)


# ----- completions -----
def test_completion_basic(client, fake_engine):
    r = client.post("/v1/completions", json={"model": "fake-model", "prompt": "Hello world", "max_tokens": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == "fake-model" and body["system_fingerprint"].startswith("tokenmill-")
    ch = body["choices"][0]
    assert ch["finish_reason"] == "length" and ch["index"] == 0 and ch["logprobs"] is None
    assert "stop_reason" in ch
    u = body["usage"]
    assert u["completion_tokens"] == 3 and u["total_tokens"] == u["prompt_tokens"] + 3


def test_completion_alias_name_and_unknown_model(client):
    r = client.post("/v1/completions", json={"model": "fake-alias", "prompt": "a", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == "fake-model"
    err = assert_error(client.post("/v1/completions", json={"model": "nope", "prompt": "a"}), 404, "model")
    assert err["type"] == "NotFoundError"


def test_completion_prompt_forms(make_client, smollm2_tokenizer):
    c, engine = make_client()
    ids = smollm2_tokenizer.encode("one two three")
    r = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert engine.calls[-1][0]["prompt_token_ids"] == ids
    r = c.post("/v1/completions", json={"prompt": ["a b", "c d e"], "max_tokens": 2, "n": 2})
    body = r.json()
    assert [ch["index"] for ch in body["choices"]] == [0, 1, 2, 3]
    r = c.post("/v1/completions", json={"prompt": [ids, ids[:2]], "max_tokens": 2})
    assert len(r.json()["choices"]) == 2
    assert r.json()["usage"]["prompt_tokens"] == len(ids) + 2
    assert_error(c.post("/v1/completions", json={"prompt": []}), 400, "prompt")
    assert_error(c.post("/v1/completions", json={"prompt": [10 ** 9]}), 400, "prompt")
    assert_error(c.post("/v1/completions", json={"prompt": ["a", 1]}), 400)


def test_completion_sampling_params_mapping(make_client):
    c, engine = make_client()
    body = {"prompt": "x", "max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
            "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.25, "seed": 7,
            "stop": ["a", "b"], "stop_token_ids": [3], "ignore_eos": True, "min_tokens": 1,
            "skip_special_tokens": False, "spaces_between_special_tokens": False,
            "include_stop_str_in_output": True, "logit_bias": {"5": 200}, "allowed_token_ids": [1, 2, 3],
            "bad_words": ["zz"], "logprobs": 2, "priority": 0, "user": "me", "truncate_prompt_tokens": 4}
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    _, p, _, _ = engine.calls[-1]
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.7, 0.9, 5, 0.1, 1.2)
    assert (p.presence_penalty, p.frequency_penalty, p.seed, p.stop) == (0.5, 0.25, 7, ["a", "b"])
    assert p.stop_token_ids == [3] and p.ignore_eos and p.min_tokens == 1 and not p.skip_special_tokens
    assert not p.spaces_between_special_tokens and p.include_stop_str_in_output
    assert p.logit_bias == {5: 100.0} and p.allowed_token_ids == [1, 2, 3] and p.bad_words == ["zz"]
    assert p.logprobs == 2 and p.max_tokens == 5 and p.output_kind == RequestOutputKind.FINAL_ONLY


def test_generation_config_defaults(make_client, smollm2_tokenizer):
    engine = FakeEngine(smollm2_tokenizer, defaults={"temperature": 0.3, "top_k": 20, "max_tokens": 4})
    c, _ = make_client(engine)
    c.post("/v1/completions", json={"prompt": "x", "max_tokens": 10})
    p = engine.calls[-1][1]
    assert p.temperature == 0.3 and p.top_k == 20 and p.max_tokens == 4
    c.post("/v1/completions", json={"prompt": "x", "temperature": 1.0, "max_tokens": 2})
    p = engine.calls[-1][1]
    assert p.temperature == 1.0 and p.max_tokens == 2


def test_completion_logprobs_echo(make_client, smollm2_tokenizer):
    c, engine = make_client()
    r = c.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 2, "logprobs": 2})
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 2 and len(lp["token_logprobs"]) == 2 and lp["text_offset"][0] == 0
    assert all(len(t) == 3 for t in lp["top_logprobs"])  # chosen + 2
    r = c.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 2, "logprobs": 1, "echo": True})
    ch = r.json()["choices"][0]
    n_prompt = len(smollm2_tokenizer.encode("Hello there"))
    assert ch["text"].startswith("Hello there")
    assert len(ch["logprobs"]["tokens"]) == n_prompt + 2
    assert ch["logprobs"]["token_logprobs"][0] is None and ch["logprobs"]["top_logprobs"][0] is None
    assert engine.calls[-1][1].prompt_logprobs == 1
    r = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1, "logprobs": 1,
                                        "return_tokens_as_token_ids": True})
    assert r.json()["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")


def test_completion_stream(client):
    r = client.post("/v1/completions", json={"prompt": "Hello world foo", "max_tokens": 4, "stream": True,
                                             "stream_options": {"include_usage": True,
                                                                "continuous_usage_stats": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(ch["object"] == "text_completion" for ch in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert all("usage" in ch for ch in chunks)
    text = "".join(ch["choices"][0]["text"] for ch in chunks[:-1])
    finals = [ch["choices"][0]["finish_reason"] for ch in chunks[:-1]]
    assert finals[-1] == "length" and all(f is None for f in finals[:-1])
    r2 = client.post("/v1/completions", json={"prompt": "Hello world foo", "max_tokens": 4})
    assert r2.json()["choices"][0]["text"] == text


def test_stream_n_and_batch(client):
    r = client.post("/v1/completions", json={"prompt": ["a b c", "d e f"], "n": 2, "max_tokens": 3,
                                             "stream": True})
    events = sse_events(r.text)[:-1]
    texts: dict[int, str] = {}
    for ev in events:
        for ch in ev["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
    assert sorted(texts) == [0, 1, 2, 3]
    full = client.post("/v1/completions", json={"prompt": ["a b c", "d e f"], "n": 2, "max_tokens": 3}).json()
    assert {c["index"]: c["text"] for c in full["choices"]} == texts


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "a b c", "n": 2}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]})])
def test_stream_usage_is_null_before_the_usage_chunk(client, path, body):
    """OpenAI: with include_usage every chunk but the last carries "usage": null; without it, no usage key."""
    r = client.post(path, json={**body, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}})
    chunks = sse_events(r.text)[:-1]
    assert len(chunks) > 2 and all("usage" in ch and ch["usage"] is None for ch in chunks[:-1]), chunks
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0
    for opts in (None, {}, {"include_usage": False}, {"include_usage": False, "continuous_usage_stats": True}):
        extra = {} if opts is None else {"stream_options": opts}
        r = client.post(path, json={**body, "max_tokens": 2, "stream": True, **extra})
        assert not any("usage" in ch for ch in sse_events(r.text)[:-1]), opts  # as OpenAI: usage only when asked


def test_continuous_usage_stats_alone_asks_for_usage(client):
    """vLLM's continuous_usage_stats without include_usage: usage in every chunk and the final usage chunk."""
    r = client.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 2, "stream": True,
                                             "stream_options": {"continuous_usage_stats": True}})
    chunks = sse_events(r.text)[:-1]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0
    assert all(ch["usage"] is not None for ch in chunks[:-1]), chunks


def test_stream_echo_with_usage_force(make_client):
    c, _ = make_client(enable_force_include_usage=True)
    r = c.post("/v1/completions", json={"prompt": "Echo me", "max_tokens": 2, "stream": True, "echo": True})
    events = sse_events(r.text)
    assert events[0]["choices"][0]["text"].startswith("Echo me")
    assert events[-2]["usage"]["completion_tokens"] == 2


# ----- chat -----
MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]


def test_chat_basic_and_stream(client):
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "max_completion_tokens": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    assert body["usage"]["completion_tokens"] == 3
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 3, "stream": True,
                                                  "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert events[0]["object"] == "chat.completion.chunk"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-2])
    assert content == msg["content"]
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 3


def test_invocations_dispatch_by_body(client):
    """SageMaker's /invocations: `messages` -> a chat completion, `prompt` -> a completion, else a clear 400."""
    r = client.post("/invocations", json={"messages": MSGS, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion"
    r = client.post("/invocations", json={"prompt": "Hello", "max_tokens": 2, "stream": True})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and events[0]["object"] == "text_completion"
    assert "messages" in assert_error(client.post("/invocations", json={"input": "x"}), 400)["message"]
    assert_error(client.post("/invocations", content=b"{not json", headers={"content-type": "application/json"}),
                 400)
    assert_error(client.post("/invocations", json={"prompt": "a", "max_tokens": -1}), 400, "max_tokens")


@pytest.mark.parametrize("path", ["/v1/embeddings", "/pooling", "/score", "/v1/rerank"])
def test_pooling_routes_say_why_they_fail(client, path):
    err = assert_error(client.post(path, json={"input": "x"}), 400)
    assert "generative models only" in err["message"] and path in err["message"]


def test_chat_logprobs(client):
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, "logprobs": True,
                                                  "top_logprobs": 3})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 2
    for item in content:
        assert set(item) >= {"token", "logprob", "bytes", "top_logprobs"}
        assert len(item["top_logprobs"]) == 3
        assert item["bytes"] == list(item["token"].encode())
    assert_error(client.post("/v1/chat/completions", json={"messages": MSGS, "top_logprobs": 2}), 400)
    assert_error(client.post("/v1/chat/completions", json={"messages": MSGS, "logprobs": True,
                                                          "top_logprobs": 21}), 400, "top_logprobs")


def test_chat_template_options(make_client, smollm2_tokenizer):
    c, engine = make_client(default_chat_template_kwargs={"greeting": "HELLO"},
                            chat_template="{{ greeting }}{% for m in messages %}[{{ m.role }}]{{ m.content }}"
                                          "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    r = c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert engine.calls[-1][0]["prompt"] == "HELLO[system]You are terse.[user]Say hi[assistant]"
    c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1,
                                         "chat_template_kwargs": {"greeting": "YO"}})
    assert engine.calls[-1][0]["prompt"].startswith("YO[system]")
    r = c.post("/v1/chat/completions", json={"messages": MSGS, "chat_template": "{{ 'x' }}"})
    assert_error(r, 400, "chat_template")
    c2, engine2 = make_client(trust_request_chat_template=True)
    r = c2.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1, "chat_template": "PLAIN"})
    assert r.status_code == 200 and engine2.calls[-1][0]["prompt"] == "PLAIN"


def test_reasoning_effort_reaches_the_chat_template(make_client):
    """As vLLM: reasoning_effort is the template variable of that name; chat_template_kwargs wins over it; a value
    OpenAI does not define is a 400 naming the field."""
    c, engine = make_client(chat_template="{{ reasoning_effort | default('unset') }}{% for m in messages %}"
                                          "[{{ m.role }}]{{ m.content }}{% endfor %}")
    for body, head in (({}, "unset"), ({"reasoning_effort": "low"}, "low"),
                       ({"reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "medium"}},
                        "medium")):
        r = c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1, **body})
        assert r.status_code == 200, r.text
        assert engine.calls[-1][0]["prompt"].startswith(head + "[system]")
    assert_error(c.post("/v1/chat/completions", json={"messages": MSGS, "reasoning_effort": "ultra"}), 400,
                 "reasoning_effort")


def test_chat_continue_final_and_echo(make_client):
    c, engine = make_client()
    msgs = MSGS + [{"role": "assistant", "content": "Hi the"}]
    r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "add_generation_prompt": False,
                                             "continue_final_message": True, "echo": True})
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg["content"].startswith("Hi the") and msg["role"] == "assistant"
    assert engine.calls[-1][0]["prompt"].rstrip().endswith("Hi the")
    r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "add_generation_prompt": False,
                                             "continue_final_message": True, "echo": True, "stream": True})
    events = sse_events(r.text)
    assert events[1]["choices"][0]["delta"]["content"] == "Hi the"
    assert_error(c.post("/v1/chat/completions", json={"messages": msgs, "continue_final_message": True}), 400)


def test_chat_response_role(make_client):
    c, _ = make_client(response_role="bot")
    r = c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1})
    assert r.json()["choices"][0]["message"]["role"] == "bot"


def test_chat_tools_and_unsupported(make_client):
    c, engine = make_client()
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    # tools without tool_choice mean "auto" (OpenAI's and vLLM's default), which needs a tool-call parser
    err = assert_error(c.post("/v1/chat/completions", json={"messages": MSGS, "tools": [tool], "max_tokens": 1}),
                       400, "tool_choice")
    assert "--enable-auto-tool-choice" in err["message"] and "defaults" in err["message"]
    r = c.post("/v1/chat/completions", json={"messages": MSGS, "tools": [tool], "tool_choice": "none",
                                             "max_tokens": 1})
    assert r.status_code == 200, r.text
    err = assert_error(c.post("/v1/chat/completions", json={"messages": MSGS, "tools": [tool],
                                                            "tool_choice": "auto"}), 400, "tool_choice")
    assert "--enable-auto-tool-choice" in err["message"]
    assert c.post("/v1/chat/completions", json={"messages": MSGS, "tools": [tool], "tool_choice": "required",
                                                "max_tokens": 1}).status_code == 200
    for choice in ("required", "auto", {"type": "function", "function": {"name": "f"}}):  # a choice among no tools
        err = assert_error(c.post("/v1/chat/completions", json={"messages": MSGS, "tool_choice": choice}), 400,
                           "tool_choice")
        assert "needs `tools`" in err["message"], choice
    assert c.post("/v1/chat/completions", json={"messages": MSGS, "tool_choice": "none",
                                                "max_tokens": 1}).status_code == 200
    assert_error(c.post("/v1/chat/completions", json={"messages": MSGS, "tools": [tool], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}), 400, "tool_choice")
    for extra in ({"logits_processors": ["my.Processor"]}, {"vllm_xargs": {"a": 1}}):
        err = assert_error(c.post("/v1/chat/completions", json={"messages": MSGS, "tools": [tool], **extra}), 400)
        assert "not supported yet" in err["message"]
    r = c.post("/v1/chat/completions", json={"messages": MSGS, "response_format": {"type": "text"},
                                             "max_tokens": 1})
    assert r.status_code == 200
    # Structured outputs are checked before the engine sees them.
    for ok in ({"response_format": {"type": "json_object"}}, {"guided_json": {"type": "object"}},
               {"structured_outputs": {"regex": "[0-9]+"}},
               {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}):
        assert c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1, **ok}).status_code == 200, ok
    for bad in ({"structured_outputs": {"regex": "[unclosed"}}, {"response_format": {"type": "json_schema"}},
                {"guided_regex": "a", "response_format": {"type": "json_object"}},
                {"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}):
        assert_error(c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1, **bad}), 400)
    assert_error(c.post("/v1/completions", json={"prompt": "a", "suffix": "b"}), 400, "suffix")


# ----- errors -----
@pytest.mark.parametrize("body,param", [
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "a", "temperature": 2.5}, "temperature"),
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "top_p": 1.5}, "top_p"),
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "logprobs": 21}, "logprobs"),
    ({"prompt": "a", "max_tokens": "many"}, "max_tokens"),
    ({}, "prompt"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, None),
    ({"prompt": "a", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"prompt": "a", "logit_bias": {"x": 1}}, None),
])
def test_bad_params_are_400(client, body, param):
    assert_error(client.post("/v1/completions", json=body), 400, param)
    assert client.get("/health").status_code == 200


def test_malformed_bodies(client):
    h = {"content-type": "application/json"}
    assert_error(client.post("/v1/completions", content=b"{not json", headers=h), 400)
    assert_error(client.post("/v1/completions", content=b'{"prompt": "\xff\xfe"}', headers=h), 400)
    assert_error(client.post("/v1/completions", content=b"[1, 2]", headers=h), 400)
    assert_error(client.post("/v1/chat/completions", json={"messages": []}), 400)
    assert_error(client.post("/v1/chat/completions", json={"messages": [{"content": "no role"}]}), 400)
    assert_error(client.post("/v1/chat/completions", json={"messages": "hello"}), 400)
    # no content-type at all: still parsed as JSON
    r = client.post("/v1/completions", content=b'{"prompt": "a", "max_tokens": 1}')
    assert r.status_code == 200, r.text
    assert_error(client.get("/no/such/route"), 404)




@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "a"}], "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "a"}], "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": True,
      "continue_final_message": True}, "continue_final_message"),
])
def test_cross_field_errors_name_their_param(client, body, param):
    """Checks that span fields (model validators, later conversions) still report the offending field."""
    assert_error(client.post("/v1/chat/completions", json={"max_tokens": 1, **body}), 400, param)


def test_unknown_fields_are_ignored_with_warning(client, tm_log):
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "frobnicate": 3})
    assert r.status_code == 200
    assert "frobnicate" in tm_log.text and "ignored" in tm_log.text


def test_response_format_fields_are_not_reported_ignored(tm_log):
    """json_schema (and structural_tag's fields) live in ResponseFormat's extras and are read by the structured
    outputs code: no "ignored" warning for them, while a stray top-level field still gets one."""
    from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], response_format=rf)
    assert req.structured_params() is not None
    assert "ignored" not in tm_log.text
    ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], response_format=rf, frobnicate=1)
    assert "frobnicate" in tm_log.text and "json_schema" not in tm_log.text


def test_context_length_messages(make_client, smollm2_tokenizer):
    c, _ = make_client(FakeEngine(smollm2_tokenizer, max_model_len=20))
    long_ids = [5] * 15
    err = assert_error(c.post("/v1/completions", json={"prompt": long_ids, "max_tokens": 10}), 400)
    assert "20" in err["message"] and "25" in err["message"] and "15" in err["message"]
    err = assert_error(c.post("/v1/completions", json={"prompt": [5] * 20, "max_tokens": None}), 400)
    assert "20" in err["message"] and "maximum context length" in err["message"]
    r = c.post("/v1/completions", json={"prompt": long_ids, "max_tokens": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    err = assert_error(c.post("/v1/chat/completions", json={"messages": MSGS * 10}), 400)
    assert "20" in err["message"]
    r = c.post("/v1/completions", json={"prompt": [5] * 30, "max_tokens": 2, "truncate_prompt_tokens": 10})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 10


def test_priority_request_id_and_headers(make_client):
    c, engine = make_client(enable_request_id_headers=True)
    r = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "priority": 3, "request_id": "abc"})
    assert r.json()["id"] == "cmpl-abc" and engine.calls[-1][3] == 3
    assert r.headers["x-request-id"]
    r = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}, headers={"X-Request-Id": "xyz"})
    assert r.headers["x-request-id"] == "xyz" and r.json()["id"] == "cmpl-xyz"
    assert c.get("/health").headers["x-request-id"]


# ----- tokenize -----
def test_tokenize_detokenize(client, smollm2_tokenizer):
    r = client.post("/tokenize", json={"prompt": "Hello world"})
    body = r.json()
    assert body["tokens"] == smollm2_tokenizer.encode("Hello world")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 256 and body["token_strs"] is None
    r = client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
    assert len(r.json()["token_strs"]) == r.json()["count"]
    r = client.post("/tokenize", json={"messages": MSGS, "add_generation_prompt": True})
    assert r.status_code == 200 and r.json()["count"] > 5
    r = client.post("/detokenize", json={"tokens": body["tokens"]})
    assert r.json() == {"prompt": "Hello world"}
    assert_error(client.post("/detokenize", json={"tokens": [-1]}), 400)
    assert_error(client.post("/tokenize", json={"model": "nope", "prompt": "x"}), 404)


# ----- operations -----
def test_api_key(make_client):
    c, _ = make_client(api_key=["k1", "k2"])
    assert_error(c.get("/v1/models"), 401)
    assert_error(c.get("/v1/models", headers={"Authorization": "Bearer bad"}), 401)
    assert c.get("/v1/models", headers={"Authorization": "Bearer k2"}).status_code == 200
    assert c.get("/health").status_code == 200  # only /v1 is guarded
    assert c.post("/tokenize", json={"prompt": "a"}).status_code == 200
    with envs.override(TOKENMILL_API_KEY="envkey", VLLM_API_KEY="vkey"):
        c2, _ = make_client()
    assert c2.get("/v1/models").status_code == 401
    assert c2.get("/v1/models", headers={"Authorization": "Bearer envkey"}).status_code == 200
    assert c2.get("/v1/models", headers={"Authorization": "Bearer vkey"}).status_code == 401  # ours first
    with envs.override(TOKENMILL_API_KEY=None, VLLM_API_KEY="vkey"):
        c3, _ = make_client()
    assert c3.get("/v1/models", headers={"Authorization": "Bearer vkey"}).status_code == 200


def test_cors(make_client):
    c, _ = make_client(allowed_origins=["https://ok.example"], api_key=["k"])
    r = c.options("/v1/models", headers={"Origin": "https://ok.example", "Access-Control-Request-Method": "GET"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "https://ok.example"
    r = c.options("/v1/models", headers={"Origin": "https://bad.example", "Access-Control-Request-Method": "GET"})
    assert "access-control-allow-origin" not in r.headers


async def tag_middleware(request, call_next):
    response = await call_next(request)
    response.headers["x-tagged"] = "1"
    return response


class TagClassMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        async def s(message):
            if message["type"] == "http.response.start":
                message.setdefault("headers", []).append((b"x-class", b"1"))
            await send(message)
        await self.app(scope, receive, s)


def test_user_middleware_and_root_path(make_client):
    mod = __name__
    c, _ = make_client(middleware=[f"{mod}.tag_middleware", f"{mod}.TagClassMiddleware"], root_path="/api")
    r = c.get("/api/v1/models")
    assert r.status_code == 200 and r.headers["x-tagged"] == "1" and r.headers["x-class"] == "1"
    with pytest.raises(ValueError):
        make_client(middleware=["no.such.module.thing"])


def test_header_count_limit(make_client):
    c, _ = make_client(h11_max_header_count=10)
    r = c.get("/health", headers={f"x-h{i}": "1" for i in range(20)})
    assert_error(r, 431)


def test_max_log_len_logging(make_client, tm_log):
    c, _ = make_client(enable_log_requests=True, max_log_len=5)
    c.post("/v1/completions", json={"prompt": "abcdefghijklmnop", "max_tokens": 1})
    text = tm_log.text
    assert "Received request" in text and "'abcde'" in text and "abcdef" not in text


def test_unsupported_frontend_options_fail_at_build(smollm2_tokenizer):
    from tokenmill.config.frontend import FrontendConfig
    from tokenmill.entrypoints.openai.app import build_app
    with pytest.raises(ValueError, match="not supported yet"):
        build_app(FakeEngine(smollm2_tokenizer), FrontendConfig(structured_outputs_config={"backend": "outlines"}))
    with pytest.raises(ValueError, match="not supported yet"):
        build_app(FakeEngine(smollm2_tokenizer), FrontendConfig(structured_outputs_config={"reasoning_parser": "x"}))
    build_app(FakeEngine(smollm2_tokenizer), FrontendConfig(structured_outputs_config={"backend": "xgrammar"}))


def test_disconnect_aborts_non_streaming(smollm2_tokenizer):
    """A client that goes away mid-request has its engine request closed (aborted)."""
    from tokenmill.config.frontend import FrontendConfig
    from tokenmill.entrypoints.openai.app import build_app

    engine = FakeEngine(smollm2_tokenizer, step_delay=0.05)
    app = build_app(engine, FrontendConfig())

    def run(stream: bool, prompt="a b c"):
        return post_then_disconnect(app, "/v1/completions", {"prompt": prompt, "max_tokens": 200, "stream": stream})

    run(False)
    assert len(engine.aborted) == 1 and not engine.running
    run(True)
    assert len(engine.aborted) == 2 and not engine.running
    for stream in (False, True):  # a batch of prompts: every engine request is aborted
        before = len(engine.aborted)
        run(stream, ["a b", "c d", "e f"])
        assert len(engine.aborted) == before + 3 and not engine.running


def test_long_prompts_are_tokenized_off_the_event_loop():
    """A long text's encode runs in a worker thread (the streams keep the event loop); a short one inline."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from tokenmill.entrypoints.openai.serving_engine import OpenAIServing
    threads = []

    def tokenize(text, add_special_tokens):
        threads.append(threading.current_thread())
        return [len(text), int(add_special_tokens)]

    fake = SimpleNamespace(tokenize=tokenize)

    async def both():
        return (await OpenAIServing.tokenize_async(fake, "x" * 10_000, True),
                await OpenAIServing.tokenize_async(fake, "short", False))
    assert asyncio.run(both()) == ([10_000, 1], [5, 0])
    assert threads[0] is not threading.main_thread() and threads[1] is threading.main_thread()
