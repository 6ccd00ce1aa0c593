"""OpenAI-API conformance as clients see it, against the fake engine: the official `openai` client talks to the
app through the TestClient's transport (no model, no engine process)."""
from __future__ import annotations

import json

import openai
import pytest

from tests.entrypoints.openai.test_chat_parsing import ScriptedEngine
from tests.entrypoints.openai.test_openai_protocol_unit import assert_error, sse_events

MSGS = [{"role": "user", "content": "What is the weather in Paris and Oslo?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TWO_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')


def oai(test_client) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=test_client, max_retries=0)


@pytest.fixture
def scripted(fake_engine, smollm2_tokenizer):
    cls = type("Scripted", (ScriptedEngine, type(fake_engine)), {})
    return lambda text: cls(smollm2_tokenizer, text)


# ----- tools -----
def test_tools_without_tool_choice_mean_auto(make_client):
    """OpenAI and vLLM default tool_choice to "auto" once tools are given; without a tool-call parser that is a
    400 naming the flags, not the model's raw call text returned as content."""
    c, _ = make_client()
    client = oai(c)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake-model", messages=MSGS, tools=TOOLS, max_tokens=2)
    assert "--enable-auto-tool-choice" in str(e.value) and "defaults" in str(e.value)
    err = e.value.body
    assert err["param"] == "tool_choice" and err["code"] == 400
    # "none" or an explicit null (vLLM: no parsing) still works, and the server keeps serving
    for choice in ("none", None):
        r = c.post("/v1/chat/completions", json={"messages": MSGS, "tools": TOOLS, "tool_choice": choice,
                                                 "max_tokens": 2})
        assert r.status_code == 200, r.text


def _stream_calls(c, body) -> tuple[dict, str | None]:
    r = c.post("/v1/chat/completions", json={**body, "stream": True})
    calls, finish = {}, None
    for ev in sse_events(r.text):
        if ev == "[DONE]" or not ev["choices"]:
            continue
        ch = ev["choices"][0]
        for tc in ch["delta"].get("tool_calls") or []:
            entry = calls.setdefault(tc["index"], "")
            calls[tc["index"]] = entry + tc.get("function", {}).get("arguments", "")
        finish = ch.get("finish_reason") or finish
    return calls, finish


@pytest.mark.parametrize("parallel", [None, True, False])
def test_parallel_tool_calls_false_returns_one_call(make_client, scripted, parallel):
    c, _ = make_client(scripted(TWO_CALLS), enable_auto_tool_choice=True, tool_call_parser="hermes")
    body = {"messages": MSGS, "tools": TOOLS, "max_tokens": 80}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    r = oai(c).chat.completions.create(model="fake-model", **body)
    cities = [json.loads(tc.function.arguments)["city"] for tc in r.choices[0].message.tool_calls]
    expected = ["Paris"] if parallel is False else ["Paris", "Oslo"]
    assert cities == expected and r.choices[0].finish_reason == "tool_calls"
    calls, finish = _stream_calls(c, body)
    assert [json.loads(a)["city"] for _, a in sorted(calls.items())] == expected and finish == "tool_calls"


def test_streamed_deltas_under_a_tool_parser_carry_only_what_they_have(make_client, scripted):
    """Text deltas have no `tool_calls` key and call deltas no `content: null`: clients test
    `delta.tool_calls is not None` and then index it."""
    c, _ = make_client(scripted("Hi there. " + TWO_CALLS), enable_auto_tool_choice=True, tool_call_parser="hermes")
    r = c.post("/v1/chat/completions", json={"messages": MSGS, "tools": TOOLS, "max_tokens": 80, "stream": True})
    deltas = [ev["choices"][0]["delta"] for ev in sse_events(r.text) if ev != "[DONE]" and ev["choices"]]
    assert any("content" in d and "tool_calls" not in d for d in deltas[1:])
    assert any(d.get("tool_calls") for d in deltas)
    for d in deltas:
        assert d.get("tool_calls", [None]) != [] and all(v is not None for v in d.values()), d


def test_parallel_tool_calls_false_limits_required_to_one_call(make_client):
    c, engine = make_client()
    r = c.post("/v1/chat/completions", json={"messages": MSGS, "tools": TOOLS, "tool_choice": "required",
                                             "parallel_tool_calls": False, "max_tokens": 2})
    assert r.status_code == 200, r.text
    schema = engine.calls[-1][1].structured_outputs.json
    schema = json.loads(schema) if isinstance(schema, str) else schema
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    c.post("/v1/chat/completions", json={"messages": MSGS, "tools": TOOLS, "tool_choice": "required",
                                         "max_tokens": 2})
    schema = engine.calls[-1][1].structured_outputs.json
    schema = json.loads(schema) if isinstance(schema, str) else schema
    assert "maxItems" not in schema


# ----- completions: echo with max_tokens 0 (prompt scoring) -----
def test_echo_with_max_tokens_zero_returns_the_prompt_only(make_client, smollm2_tokenizer):
    c, engine = make_client()
    client = oai(c)
    prompt = "Hello there world"
    n_prompt = len(smollm2_tokenizer.encode(prompt))
    r = client.completions.create(model="fake-model", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    ch = r.choices[0]
    assert ch.text == prompt and ch.finish_reason == "length"
    assert len(ch.logprobs.tokens) == n_prompt and "".join(ch.logprobs.tokens) == prompt
    assert ch.logprobs.token_logprobs[0] is None and all(x is not None for x in ch.logprobs.token_logprobs[1:])
    assert ch.logprobs.text_offset[0] == 0
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == 0
    assert r.usage.total_tokens == n_prompt
    assert engine.calls[-1][1].prompt_logprobs == 1 and engine.calls[-1][1].max_tokens == 1
    # streamed: one chunk with the prompt, then the usage chunk
    chunks = list(client.completions.create(model="fake-model", prompt=prompt, max_tokens=0, echo=True,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == prompt
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 0
    # without echo, 0 stays an error that says when it is allowed
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model="fake-model", prompt=prompt, max_tokens=0)


# ----- request bodies and error messages -----
def test_json_body_sent_with_a_form_or_text_content_type(client):
    """curl -d without -H sends application/x-www-form-urlencoded; the body is still JSON (vLLM answers 400 there).
    A form or text body that is not JSON gets the JSON parse error."""
    body = json.dumps({"prompt": "Hello", "max_tokens": 2}).encode()
    for path in ("/v1/completions", "/tokenize"):
        for ctype in ("application/x-www-form-urlencoded", "text/plain; charset=utf-8", "Application/JSON; charset=utf-8"):
            r = client.post(path, content=body, headers={"content-type": ctype})
            assert r.status_code == 200, r.text
    err = assert_error(client.post("/v1/completions", content=b"prompt=Hello",
                                   headers={"content-type": "application/x-www-form-urlencoded"}), 400)
    assert "Invalid JSON body" in err["message"]
    assert client.post("/ping").status_code == 200  # a POST without a body is not affected


def test_validation_messages_read_cleanly(client):
    err = assert_error(client.post("/v1/chat/completions", json={"messages": []}), 400)
    assert err["message"] == "messages must contain at least one message."
    err = assert_error(client.post("/v1/completions", json=[{"prompt": "a"}]), 400)
    assert err["message"] == "The request body must be a JSON object."
    assert client.get("/health").status_code == 200


def test_assistant_refusal_parts_are_text(make_client):
    c, engine = make_client()
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot help with that."}]},
            {"role": "user", "content": [{"type": "text", "text": "why?"}]}]
    r = oai(c).chat.completions.create(model="fake-model", messages=msgs, max_tokens=1)
    assert r.choices[0].message.role == "assistant"
    prompt_ids = engine.calls[-1][0]["prompt_token_ids"]
    assert "I cannot help with that." in engine.tokenizer.decode(prompt_ids)


def test_stored_responses_are_a_clear_404(client):
    client_ = oai(client)
    with pytest.raises(openai.NotFoundError, match="stores no responses"):
        client_.responses.retrieve("resp_123")
    assert_error(client.post("/v1/responses/resp_123/cancel"), 404, "response_id")


# ----- vLLM's older structured-output fields -----
def test_guided_fields_reach_the_engine_and_errors_name_the_field(make_client):
    c, engine = make_client()
    base = {"prompt": "Hello", "max_tokens": 2}
    for field, value, kind in (("guided_json", {"type": "object"}, "json"), ("guided_regex", "[0-9]+", "regex"),
                               ("guided_choice", ["yes", "no"], "choice"),
                               ("guided_grammar", 'root ::= "a" | "b"', "grammar")):
        r = c.post("/v1/completions", json={**base, field: value, "guided_decoding_backend": "xgrammar"})
        assert r.status_code == 200, r.text
        assert engine.calls[-1][1].structured_outputs.kind == kind
    # two constraints at once, in either spelling, is a 400 naming the second field
    for bad, param in (({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
                       ({"structured_outputs": {"regex": "b"}, "guided_regex": "a"}, "guided_regex"),
                       ({"guided_regex": "(("}, "guided_regex"),
                       ({"structured_outputs": {"regexp": "a"}}, "structured_outputs"),
                       ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend")):
        err = assert_error(c.post("/v1/completions", json={**base, **bad}), 400, param)
        assert param.split("_")[0] in err["message"]
    assert c.get("/health").status_code == 200


# ----- values JSON allows but OpenAI does not -----
def test_non_finite_logit_bias_is_a_400(client):
    """Python's JSON reader takes NaN / Infinity; a NaN bias used to be clamped to +100 and silently applied."""
    for value in (b"NaN", b"Infinity", b"-Infinity"):
        body = b'{"prompt": "Hello", "max_tokens": 2, "logit_bias": {"5": ' + value + b"}}"
        err = assert_error(client.post("/v1/completions", content=body,
                                       headers={"content-type": "application/json"}), 400, "logit_bias")
        assert "finite" in err["message"]
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "logit_bias": {"5": 500}})
    assert r.status_code == 200  # out of range but finite: clamped to [-100, 100], as vLLM does


def test_prompt_longer_than_the_context_names_the_input_and_the_limit(client, smollm2_tokenizer):
    long = "hello " * 300  # the fake engine's max_model_len is 256
    n = len(smollm2_tokenizer.encode(long))
    for body, path, param in (({"prompt": long, "max_tokens": 2}, "/v1/completions", "prompt"),
                              ({"prompt": [[1, 2], [5] * 300]}, "/v1/completions", "prompt"),
                              ({"messages": [{"role": "user", "content": long}], "max_tokens": 2},
                               "/v1/chat/completions", "messages")):
        err = assert_error(client.post(path, json=body), 400, param)
        assert "maximum context length is 256 tokens" in err["message"]
    err = assert_error(client.post("/v1/completions", json={"prompt": long, "max_tokens": 2}), 400, "prompt")
    assert f"{n} input tokens" in err["message"]
    # a prompt that fits, with too many tokens asked for, blames max_tokens
    err = assert_error(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 300}), 400, "max_tokens")
    assert "256" in err["message"]


def test_best_of_asks_the_engine_for_the_candidates(make_client):
    """best_of > n: the engine samples best_of sequences with their chosen-token logprobs (the ranking needs them);
    the client gets n choices and no logprobs it did not ask for."""
    c, engine = make_client()
    r = c.post("/v1/completions", json={"prompt": "Hello world", "max_tokens": 2, "n": 2, "best_of": 3})
    assert r.status_code == 200, r.text
    params = engine.calls[-1][1]
    assert (params.n, params.best_of, params.logprobs) == (3, None, 0)
    choices = r.json()["choices"]
    assert [ch["index"] for ch in choices] == [0, 1] and all(ch["logprobs"] is None for ch in choices)
    assert r.json()["usage"]["completion_tokens"] == 4
    r = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "n": 2, "best_of": 3, "logprobs": 2})
    assert engine.calls[-1][1].logprobs == 2 and all(ch["logprobs"] for ch in r.json()["choices"])


def test_tokenize_errors_name_the_field_of_the_form_sent(client):
    """/tokenize takes a completion form (prompt) or a chat form (messages); a bad body used to be reported against
    both union members, with pydantic's internal validator names as the `param`."""
    for body, param, message in (({"prompt": 5}, "prompt", "prompt: Input should be a valid string"),
                                 ({}, "prompt", "prompt: Field required"),
                                 ({"messages": "hi"}, "messages", "messages: Input should be a valid list")):
        assert assert_error(client.post("/tokenize", json=body), 400, param)["message"] == message
    assert client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()["count"] > 0
    assert client.get("/openapi.json").json()["paths"]["/tokenize"]


@pytest.mark.parametrize("tools, choice, param", [
    ([{"type": "function"}], "required", "tools"),
    ([{"type": "function", "function": {}}], "required", "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "none", "tools"),
    ([{"type": "custom", "custom": {"name": "f"}}], "none", "tools"),
    (TOOLS, {"type": "function"}, "tool_choice"),
    (TOOLS, {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}, "tool_choice"),
    (TOOLS, "bogus", "tool_choice"),
])
def test_malformed_tools_and_tool_choice_are_400s(make_client, tools, choice, param):
    """vLLM's models refuse these shapes; a nameless tool was forced into calls with no name (200, empty calls)."""
    c, _ = make_client()
    r = c.post("/v1/chat/completions", json={"messages": MSGS, "tools": tools, "tool_choice": choice,
                                             "max_tokens": 2})
    assert_error(r, 400, param)
    # a tool without "type" means a function, as in vLLM
    r = c.post("/v1/chat/completions", json={"messages": MSGS, "tools": [{"function": TOOLS[0]["function"]}],
                                             "tool_choice": "required", "max_tokens": 30})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "hi", "n": 10 ** 12}),
    ("/v1/completions", {"prompt": "hi", "best_of": 10 ** 12}),
    ("/v1/chat/completions", {"messages": MSGS, "n": 10 ** 12}),
])
def test_huge_n_is_a_400_not_a_hung_server(make_client, route, body):
    c, engine = make_client()
    param = "best_of" if "best_of" in body else "n"
    err = assert_error(c.post(route, json={**body, "max_tokens": 1}), 400, param)
    assert "VLLM_MAX_N_SEQUENCES" in err["message"] and not engine.calls


# ----- OpenAI chat fields: accepted no-ops vs 400s, and stored-object routes -----
def test_openai_chat_hints_are_accepted_and_unhonourable_fields_are_400s(make_client, tm_log):
    c, engine = make_client()
    base = {"messages": MSGS, "max_tokens": 2}
    hints = {"metadata": {"k": "v"}, "store": True, "service_tier": "auto", "user": "u1", "modalities": ["text"],
             "prediction": {"type": "content", "content": "sunny"}, "prompt_cache_key": "k",
             "safety_identifier": "s", "verbosity": "medium"}
    r = c.post("/v1/chat/completions", json={**base, **hints})
    assert r.status_code == 200, r.text
    assert "ignored" not in tm_log.text
    calls = len(engine.calls)
    for field, value in (("modalities", ["text", "audio"]), ("audio", {"voice": "alloy", "format": "wav"}),
                         ("web_search_options", {}), ("verbosity", "low")):
        err = assert_error(c.post("/v1/chat/completions", json={**base, field: value}), 400, field)
        assert field in err["message"] and "not supported" in err["message"]
    assert len(engine.calls) == calls


def test_stored_chat_completions_and_responses_routes_are_clear_404s(client):
    client_ = oai(client)
    for call in (lambda: client_.chat.completions.retrieve("chatcmpl-1"),
                 lambda: client_.chat.completions.delete("chatcmpl-1"),
                 lambda: client_.chat.completions.update("chatcmpl-1", metadata={"a": "b"}),
                 lambda: client_.chat.completions.list(),
                 lambda: client_.chat.completions.messages.list("chatcmpl-1")):
        with pytest.raises(openai.NotFoundError, match="stores no chat completions"):
            call()
    for call in (lambda: client_.responses.delete("resp_1"), lambda: client_.responses.input_items.list("resp_1")):
        with pytest.raises(openai.NotFoundError, match="stores no"):
            call()
    assert client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1}).status_code == 200


def test_priority_without_priority_scheduling_is_a_400_naming_priority(make_client, smollm2_tokenizer):
    from types import SimpleNamespace

    from tests.entrypoints.openai.conftest import FakeEngine
    engine = FakeEngine(smollm2_tokenizer)
    engine.config.scheduler_config = SimpleNamespace(scheduling_policy="fcfs")
    c, _ = make_client(engine)
    for path, body in (("/v1/completions", {"prompt": "a", "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 1}),
                       ("/v1/completions", {"prompt": "a", "max_tokens": 1, "use_beam_search": True, "n": 2})):
        for stream in (False, True) if "use_beam_search" not in body else (False,):
            err = assert_error(c.post(path, json={**body, "priority": 2, "stream": stream}), 400, "priority")
            assert "--scheduling-policy priority" in err["message"]
        assert c.post(path, json={**body, "priority": 0}).status_code == 200
    assert not engine.calls or all(call[3] == 0 for call in engine.calls)


# ----- bodies that parse as JSON but hold values no request can use -----
@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", '{"prompt": "hi \\ud800 there", "max_tokens": 1}', "prompt"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 1, "stop": ["\\udc00"]}', "stop"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud83d"}], "max_tokens": 1}', "messages"),
    ("/v1/responses", '{"input": "\\ud800", "max_output_tokens": 1}', "input"),
    ("/tokenize", '{"prompt": "\\udfff"}', "prompt")])
def test_unpaired_surrogates_are_a_400_naming_the_field(client, path, body, param):
    err = assert_error(client.post(path, content=body, headers={"content-type": "application/json"}), 400, param)
    assert "surrogate" in err["message"]
    # A surrogate pair is one valid character (U+1F600).
    ok = client.post("/v1/completions", content='{"prompt": "hi \\ud83d\\ude00", "max_tokens": 1}',
                     headers={"content-type": "application/json"})
    assert ok.status_code == 200, ok.text


def test_non_finite_temperature_and_length_penalty_are_400s(client):
    hdr = {"content-type": "application/json"}
    for path, body in (("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, '
                                                '"temperature": NaN}'),
                       ("/v1/responses", '{"input": "hi", "max_output_tokens": 1, "temperature": Infinity}')):
        err = assert_error(client.post(path, content=body, headers=hdr), 400, "temperature")
        assert "finite" in err["message"]
    body = '{"prompt": "hi", "max_tokens": 1, "n": 2, "use_beam_search": true, "length_penalty": NaN}'
    err = assert_error(client.post("/v1/completions", content=body, headers=hdr), 400, "length_penalty")
    assert "finite" in err["message"]


def test_an_empty_body_says_so(client):
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize"):
        for headers in ({}, {"content-type": "application/json"}):
            err = assert_error(client.post(path, content=b"", headers=headers), 400)
            assert err["message"] == "The request body is empty; send a JSON object.", (path, err)


def test_tokenize_with_both_prompt_and_messages_is_a_400(client, tm_log):
    err = assert_error(client.post("/tokenize", json={"prompt": "hi", "messages": MSGS}), 400, "prompt")
    assert "not both" in err["message"]
    assert "ignored" not in tm_log.text  # refused, not first logged as an ignored field


def test_an_empty_suffix_is_no_suffix_and_a_real_one_is_a_400(client):
    assert client.post("/v1/completions", json={"prompt": "def f(", "max_tokens": 2, "suffix": ""}).status_code == 200
    err = assert_error(client.post("/v1/completions", json={"prompt": "def f(", "max_tokens": 2, "suffix": "x"}), 400,
                       "suffix")
    assert "suffix" in err["message"]


def test_reasoning_effort_for_a_template_without_it_is_a_400(make_client):
    """OpenAI answers 400 for reasoning_effort on a model that does not reason; here a chat template that has no
    reasoning_effort variable would drop it, so it is refused rather than ignored."""
    c, engine = make_client()  # SmolLM2's template: no reasoning_effort
    calls = len(engine.calls)
    err = assert_error(c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1,
                                                            "reasoning_effort": "low"}), 400, "reasoning_effort")
    assert "chat_template_kwargs" in err["message"] and len(engine.calls) == calls
    assert c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1}).status_code == 200


def test_documents_need_a_template_that_reads_them(make_client):
    docs = [{"title": "Paris", "text": "Paris is in France."}]
    c, engine = make_client()  # SmolLM2's template: no documents
    for path, body in (("/v1/chat/completions", {"messages": MSGS, "max_tokens": 1, "documents": docs}),
                       ("/tokenize", {"messages": MSGS, "documents": docs})):
        err = assert_error(c.post(path, json=body), 400, "documents")
        assert "chat template" in err["message"]
    c, engine = make_client(chat_template="{% for d in documents %}<{{ d.title }}>{% endfor %}"
                                          "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    r = c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1, "documents": docs})
    assert r.status_code == 200, r.text
    assert engine.calls[-1][0]["prompt"].startswith("<Paris>[")


def test_service_tier_takes_openais_values(client):
    for path, body in (("/v1/chat/completions", {"messages": MSGS, "max_tokens": 1}),
                       ("/v1/responses", {"input": "hi", "max_output_tokens": 1})):
        assert client.post(path, json={**body, "service_tier": "flex"}).status_code == 200
        err = assert_error(client.post(path, json={**body, "service_tier": "fastest"}), 400, "service_tier")
        assert "'auto'" in err["message"]
