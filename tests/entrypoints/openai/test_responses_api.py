"""POST /v1/responses against the fake engine (no model): the Response object and the SSE events parse with the
installed `openai` package's models and client, requests map onto the chat machinery, and unsupported fields are
400s naming them.

No end-to-end test with the real model here: the e2e server fixture is module-scoped (one server per test module),
so reusing it would start a second server."""
from __future__ import annotations

import json

import openai
import pytest
from openai.types.responses import Response, ResponseCompletedEvent, ResponseIncompleteEvent

from tests.entrypoints.openai.conftest import FakeEngine, post_then_disconnect
from tests.entrypoints.openai.test_chat_parsing import ScriptedEngine


class StoppingEngine(FakeEngine):
    """Ends every answer with "stop" on its third token, so responses come out `completed`."""

    def generate(self, prompt, sampling_params, request_id, priority=0):
        sampling_params.stop_token_ids = [prompt["prompt_token_ids"][2]]
        return super().generate(prompt, sampling_params, request_id, priority)


def assert_error(resp, status: int, param: str) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status and err["message"]
    assert err["param"] == param, err
    return err


def sse(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of every event; the event line must name the data's type."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        head, data = block.split("\n", 1)
        assert head.startswith("event: ") and data.startswith("data: "), block
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == head[len("event: "):]
        events.append((payload["type"], payload))
    return events


def sdk(client) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)


def test_basic_parses_and_matches_chat(make_client, smollm2_tokenizer):
    c, engine = make_client(StoppingEngine(smollm2_tokenizer))
    r = c.post("/v1/responses", json={"model": "fake-model", "input": "Hello there", "user": "u1",
                                      "metadata": {"k": "v"}, "store": False, "seed": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    resp = Response.model_validate(body)
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.status == "completed"
    assert resp.incomplete_details is None and resp.error is None and resp.metadata == {"k": "v"}
    msg = resp.output[0]
    assert len(resp.output) == 1 and msg.type == "message" and msg.role == "assistant"
    assert msg.id.startswith("msg_") and msg.status == "completed" and msg.content[0].annotations == []
    assert engine.calls[-1][1].seed == 3
    chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hello there"}]}).json()
    assert resp.output_text == chat["choices"][0]["message"]["content"] and resp.output_text
    u = resp.usage
    assert (u.input_tokens, u.output_tokens) == (chat["usage"]["prompt_tokens"], chat["usage"]["completion_tokens"])
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.input_tokens_details.cached_tokens == 0
    assert u.output_tokens_details.reasoning_tokens == 0
    # and through the client
    out = sdk(c).responses.create(model="fake-model", input="Hello there", temperature=0.5, top_p=0.9)
    assert out.output_text == resp.output_text and (out.temperature, out.top_p) == (0.5, 0.9)
    p = engine.calls[-1][1]
    assert (p.temperature, p.top_p) == (0.5, 0.9)


def test_instructions_and_list_input(make_client):
    c, engine = make_client()
    body = {"instructions": "Be brief.", "max_output_tokens": 2, "input": [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": [{"type": "input_text", "text": "What is 2+2?"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Four.", "annotations": []}]},
        {"role": "user", "content": "And 3+3?"}]}
    r = c.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["instructions"] == "Be brief."
    prompt = engine.calls[-1][0]["prompt"]
    order = [prompt.index(s) for s in ("Be brief.", "Answer in French.", "What is 2+2?", "Four.", "And 3+3?")]
    assert order == sorted(order)
    assert "developer" not in prompt  # rendered as a system message
    chat = {"max_tokens": 2, "messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "system", "content": "Answer in French."},
                                          {"role": "user", "content": "What is 2+2?"},
                                          {"role": "assistant", "content": "Four."},
                                          {"role": "user", "content": "And 3+3?"}]}
    c.post("/v1/chat/completions", json=chat)
    assert engine.calls[-1][0]["prompt"] == prompt


def test_max_output_tokens_incomplete(make_client):
    c, engine = make_client()
    r = c.post("/v1/responses", json={"input": "Hello there", "max_output_tokens": 3})
    resp = Response.model_validate(r.json())
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output[0].status == "incomplete" and resp.max_output_tokens == 3
    assert resp.usage.output_tokens == 3 and engine.calls[-1][1].max_tokens == 3
    err = assert_error(c.post("/v1/responses", json={"input": "x", "max_output_tokens": 0}), 400, "max_output_tokens")
    assert "max_output_tokens" in err["message"] and "max_completion_tokens" not in err["message"]
    err = assert_error(c.post("/v1/responses", json={"input": "x", "max_output_tokens": 1000}), 400,
                       "max_output_tokens")
    assert "256" in err["message"]


STREAM_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added"]
STREAM_END = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.mark.parametrize("stopping", [True, False])
def test_stream_events(make_client, smollm2_tokenizer, stopping):
    c, engine = make_client(StoppingEngine(smollm2_tokenizer) if stopping else None)
    r = c.post("/v1/responses", json={"input": "Hello there", "stream": True, "max_output_tokens": 6})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    kinds = [k for k, _ in events]
    n_delta = kinds.count("response.output_text.delta")
    final = "response.completed" if stopping else "response.incomplete"
    assert kinds == STREAM_ORDER + ["response.output_text.delta"] * n_delta + STREAM_END + [final]
    assert n_delta >= 2
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    resp_id = events[0][1]["response"]["id"]
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["output"] == []
    item_id = events[2][1]["item"]["id"]
    deltas = [e for k, e in events if k == "response.output_text.delta"]
    assert all(d["item_id"] == item_id and d["output_index"] == 0 and d["content_index"] == 0
               and d["logprobs"] == [] for d in deltas)
    text = "".join(d["delta"] for d in deltas)
    assert events[-4][1]["text"] == text and events[-2][1]["item"]["content"][0]["text"] == text
    done = (ResponseCompletedEvent if stopping else ResponseIncompleteEvent).model_validate(events[-1][1])
    assert done.response.id == resp_id and done.response.output_text == text
    assert done.response.usage.output_tokens == (3 if stopping else 6)
    assert done.response.status == ("completed" if stopping else "incomplete")
    # the same text as the non-streamed response
    assert c.post("/v1/responses", json={"input": "Hello there", "max_output_tokens": 6}).json()[
        "output"][0]["content"][0]["text"] == text
    assert not engine.running


def test_stream_failure_mid_way(make_client, smollm2_tokenizer):
    from openai.types.responses import ResponseErrorEvent, ResponseFailedEvent

    from tokenmill.engine.protocol import EngineDeadError

    class DyingEngine(FakeEngine):
        async def generate(self, prompt, sampling_params, request_id, priority=0):
            outputs = 0
            async for out in super().generate(prompt, sampling_params, request_id, priority):
                yield out
                outputs += 1
                if outputs == 2:
                    raise EngineDeadError("fake engine died")

    c, _ = make_client(DyingEngine(smollm2_tokenizer))
    events = sse(c.post("/v1/responses", json={"input": "Hello there", "stream": True}).text)
    kinds = [k for k, _ in events]
    assert kinds == STREAM_ORDER + ["response.output_text.delta"] * 2 + ["error", "response.failed"]
    err = ResponseErrorEvent.model_validate(events[-2][1])
    assert err.code == "503" and "died" in err.message
    failed = ResponseFailedEvent.model_validate(events[-1][1]).response
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert failed.output_text == events[4][1]["delta"] + events[5][1]["delta"]


def test_stream_with_sdk(make_client, smollm2_tokenizer):
    c, _ = make_client(StoppingEngine(smollm2_tokenizer))
    client = sdk(c)
    events = list(client.responses.create(model="fake-model", input="Hello there", stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == text
    with client.responses.stream(model="fake-model", input="Hello there") as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.output_text == text and final.status == "completed"


def test_reasoning_item_whole_and_streamed(make_client, think_tokenizer):
    script = "Let me think about Paris.\nIt is in France.</think>\n\nThe capital of France is Paris."
    engine = type("Scripted", (ScriptedEngine, FakeEngine), {})(think_tokenizer, script)
    c, _ = make_client(engine, reasoning_parser="deepseek_r1")
    resp = Response.model_validate(c.post("/v1/responses", json={"input": "Where is Paris?"}).json())
    reasoning, message = resp.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
    assert reasoning.content[0].text == "Let me think about Paris.\nIt is in France."
    assert message.type == "message" and resp.output_text == "The capital of France is Paris."
    events = sse(c.post("/v1/responses", json={"input": "Where is Paris?", "stream": True}).text)
    kinds = [k for k, _ in events if not k.endswith(".delta")]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added", "response.reasoning_text.done",
                     "response.content_part.done", "response.output_item.done"] + STREAM_ORDER[2:] + STREAM_END + [
                     "response.completed"]
    assert [e["output_index"] for k, e in events if k.endswith(".delta")][0] == 0
    thought = "".join(e["delta"] for k, e in events if k == "response.reasoning_text.delta")
    assert thought == reasoning.content[0].text
    final = ResponseCompletedEvent.model_validate(events[-1][1]).response
    assert final.output_text == resp.output_text and [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[1].id == events[-2][1]["item"]["id"] and events[-2][1]["output_index"] == 1
    with sdk(c).responses.stream(model="fake-model", input="Where is Paris?") as stream:
        assert stream.get_final_response().output_text == resp.output_text


def test_text_formats_reach_sampling_params(make_client):
    c, engine = make_client()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    r = c.post("/v1/responses", json={"input": "x", "max_output_tokens": 2, "text": {"format": fmt}})
    assert r.status_code == 200, r.text
    so = engine.calls[-1][1].structured_outputs
    assert so is not None and so.json == schema
    resp = Response.model_validate(r.json())
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "thing"
    c.post("/v1/responses", json={"input": "x", "max_output_tokens": 2, "text": {"format": {"type": "json_object"}}})
    assert engine.calls[-1][1].structured_outputs.json_object
    c.post("/v1/responses", json={"input": "x", "max_output_tokens": 2, "text": {"format": {"type": "text"}}})
    assert engine.calls[-1][1].structured_outputs is None
    for text, param in (({"format": {"type": "json_schema", "schema": schema}}, "text.format.name"),
                        ({"format": {"type": "json_schema", "name": "n"}}, "text.format.schema"),
                        ({"format": {"type": "grammar"}}, "text.format.type"),
                        ({"verbosity": "low"}, "text.verbosity")):
        assert_error(c.post("/v1/responses", json={"input": "x", "text": text}), 400, param)


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "tools[0].parameters"),
    # tools without tool_choice mean "auto", which needs --enable-auto-tool-choice --tool-call-parser (as on chat)
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is this?"},
        {"type": "input_image", "image_url": "https://example.com/a.png"}]}]}, "input[0].content[1].type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "output": "42"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f"}]}, "input[0].arguments"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": []}, "input"),
])
def test_rejected_fields(make_client, extra, param):
    c, engine = make_client()
    err = assert_error(c.post("/v1/responses", json={"input": "hi", **extra}), 400, param)
    assert param.split("[")[0].split(".")[0] in err["message"]
    assert not engine.calls


def test_accepted_noops_unknown_model_and_extras(make_client):
    c, engine = make_client()
    ok = {"input": "hi", "max_output_tokens": 1, "tools": [], "tool_choice": "auto", "store": True,
          "reasoning": {"effort": None}, "parallel_tool_calls": False, "stream_options": None,
          "prompt_cache_key": "k", "frobnicate": 1}
    r = c.post("/v1/responses", json=ok)
    assert r.status_code == 200, r.text
    assert r.json()["parallel_tool_calls"] is False
    err = assert_error(c.post("/v1/responses", json={"model": "nope", "input": "hi"}), 404, "model")
    assert err["type"] == "NotFoundError"
    assert_error(c.post("/v1/responses", json={"input": "hi", "temperature": 3}), 400, "temperature")
    assert_error(c.post("/v1/responses", json={"max_output_tokens": 3}), 400, "input")


def test_request_id_header_names_the_response(make_client):
    c, _ = make_client()
    r = c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 1}, headers={"X-Request-Id": "abc"})
    assert r.json()["id"] == "resp_abc" and r.json()["output"][0]["id"] == "msg_abc"


def test_disconnect_aborts(smollm2_tokenizer):
    from tokenmill.config.frontend import FrontendConfig
    from tokenmill.entrypoints.openai.app import build_app
    engine = FakeEngine(smollm2_tokenizer, step_delay=0.05)
    app = build_app(engine, FrontendConfig())

    for i, stream in enumerate((False, True)):
        post_then_disconnect(app, "/v1/responses", {"input": "a b c", "max_output_tokens": 100, "stream": stream})
        assert len(engine.aborted) == i + 1 and not engine.running


# ----- function tools -----
FN_TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def _events(stream) -> tuple[list, dict]:
    """The SDK's events (sequence numbers checked) and, per function_call item id, its concatenated deltas."""
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas: dict[str, str] = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            deltas[e.item_id] = deltas.get(e.item_id, "") + e.delta
    return events, deltas


def test_auto_tool_call_through_the_servers_parser(detok_client):
    """tools + the server's --tool-call-parser: the text is a message item, the call a function_call item, whole
    and streamed (output_item.added, function_call_arguments.delta / .done, output_item.done) alike."""
    text = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    oai = detok_client([text], enable_auto_tool_choice=True, tool_call_parser="hermes")
    r = oai.responses.create(model="fake-model", input="Weather in Paris?", tools=FN_TOOLS)
    assert r.status == "completed" and [o.type for o in r.output] == ["message", "function_call"]
    assert r.output[0].content[0].text == "Sure." and r.tools[0].name == "get_weather"
    call = r.output[1]
    assert (call.name, json.loads(call.arguments), call.status) == ("get_weather", {"city": "Paris"}, "completed")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    events, deltas = _events(oai.responses.create(model="fake-model", input="Weather in Paris?", tools=FN_TOOLS,
                                                  stream=True))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == ["message", "function_call"] and added[1].name == "get_weather"
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == deltas[done.item_id] == call.arguments and done.output_index == 1
    final = events[-1]
    assert final.type == "response.completed"
    assert [(o.type, getattr(o, "arguments", None)) for o in final.response.output] == [
        ("message", None), ("function_call", call.arguments)]
    kinds = [e.type for e in events]
    assert kinds.index("response.function_call_arguments.done") < len(kinds) - 2
    assert kinds[-2] == "response.output_item.done"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_forced_tool_choice_uses_the_call_grammar(make_client, smollm2_tokenizer, choice):
    from tests.entrypoints.openai.conftest import DetokEngine
    answer = '{"city":"Paris"}' if isinstance(choice, dict) else '[{"name":"get_weather","parameters":{"city":"Paris"}}]'
    engine = DetokEngine(smollm2_tokenizer, [smollm2_tokenizer.encode(answer, add_special_tokens=False) + [2]])
    c, _ = make_client(engine)
    oai = sdk(c)
    r = oai.responses.create(model="fake-model", input="Weather?", tools=FN_TOOLS, tool_choice=choice)
    assert engine.calls[-1][1].structured_outputs.json is not None  # the chat route's forced-call grammar
    assert [(o.type, o.name, json.loads(o.arguments)) for o in r.output] == [
        ("function_call", "get_weather", {"city": "Paris"})]
    assert r.status == "completed"
    assert (r.tool_choice if isinstance(choice, str) else r.tool_choice.model_dump(exclude_none=True)) == choice
    events, deltas = _events(oai.responses.create(model="fake-model", input="Weather?", tools=FN_TOOLS,
                                                  tool_choice=choice, stream=True))
    assert json.loads("".join(deltas.values())) == {"city": "Paris"}
    assert events[-1].response.output[0].arguments == "".join(deltas.values())
    # cut off by max_output_tokens: incomplete, with the call's partial arguments (as on chat)
    r = oai.responses.create(model="fake-model", input="Weather?", tools=FN_TOOLS, tool_choice=choice,
                             max_output_tokens=len(smollm2_tokenizer.encode(answer[:-4], add_special_tokens=False)))
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (item,) = r.output
    assert item.type == "function_call" and item.status == "incomplete" and item.arguments.startswith('{"city":"P')
    assert not item.arguments.endswith("}")


def test_tool_choice_none_and_function_call_output_round_trip(make_client, smollm2_tokenizer):
    """A follow-up request sends the call and its result back: they render as the assistant's tool call and a tool
    message (the call's name found by call_id)."""
    from tokenmill.entrypoints.openai.protocol_responses import ResponsesRequest
    from tokenmill.entrypoints.openai.serving_responses import input_messages
    req = ResponsesRequest(input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}',
         "id": "fc_1", "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "22 C and sunny"}])
    msgs = input_messages(req)
    assert msgs[1:] == [
        {"role": "assistant", "content": [{"type": "text", "text": "Let me check."}], "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C and sunny", "name": "get_weather"}]
    template = ("{% for m in messages %}{{ m.role }}:{{ m.content or '' }}{% for t in m.tool_calls or [] %}"
                "[{{ t.id }} {{ t.function.name }} {{ t.function.arguments.city }}]{% endfor %}"
                "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}|{% endfor %}")
    c, engine = make_client(StoppingEngine(smollm2_tokenizer), chat_template=template)
    r = sdk(c).responses.create(model="fake-model", input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "22 C and sunny"}],
        tools=FN_TOOLS, tool_choice="none")
    assert r.status == "completed" and r.output[0].type == "message"
    prompt = engine.calls[-1][0]["prompt"]
    assert prompt == "user:Weather in Paris?|assistant:[call_1 get_weather Paris]|tool:22 C and sunny(call_1)|"


def test_reasoning_items_sent_back_are_the_assistant_turns_reasoning(make_client, think_tokenizer):
    """A client that keeps the conversation itself sends the previous output back, reasoning item included (as
    OpenAI documents for store=false): it becomes the reasoning of the assistant turn its message completes."""
    script = "Let me think about Paris.\nIt is in France.</think>\n\nThe capital of France is Paris."
    engine = type("Scripted", (ScriptedEngine, FakeEngine), {})(think_tokenizer, script)
    c, _ = make_client(engine, reasoning_parser="deepseek_r1")
    first = c.post("/v1/responses", json={"input": "Where is Paris?"}).json()
    assert [o["type"] for o in first["output"]] == ["reasoning", "message"]
    history = [{"role": "user", "content": "Where is Paris?"}, *first["output"], {"role": "user", "content": "And?"}]
    from tokenmill.entrypoints.openai.protocol_responses import ResponsesRequest
    from tokenmill.entrypoints.openai.serving_responses import input_messages
    msgs = input_messages(ResponsesRequest(input=history))
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
    assert msgs[1]["reasoning_content"] == "Let me think about Paris.\nIt is in France."
    assert msgs[1]["content"] == [{"type": "text", "text": "The capital of France is Paris."}]
    r = c.post("/v1/responses", json={"input": history, "max_output_tokens": 3})
    assert r.status_code == 200, r.text
    # A summary-only item, a reasoning item before a function call, and encrypted reasoning.
    summary = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "short"}]}
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    msgs = input_messages(ResponsesRequest(input=[{"role": "user", "content": "q"}, summary, call,
                                                  {"type": "function_call_output", "call_id": "c1", "output": "x"}]))
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool"]
    assert msgs[1]["reasoning_content"] == "short" and msgs[1]["tool_calls"][0]["id"] == "c1"
    bad = {"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}
    assert_error(c.post("/v1/responses", json={"input": [{"role": "user", "content": "q"}, bad]}), 400,
                 "input[1].encrypted_content")
    bad = {"type": "reasoning", "summary": "not a list"}
    assert_error(c.post("/v1/responses", json={"input": [bad]}), 400, "input[0].summary")


def test_reasoning_effort_is_the_chat_templates_reasoning_effort(make_client):
    c, engine = make_client(chat_template="{{ reasoning_effort | default('unset') }}{% for m in messages %}"
                                          "[{{ m.role }}]{{ m.content }}{% endfor %}")
    r = c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 1, "reasoning": {"effort": "low"}})
    assert r.status_code == 200, r.text
    assert engine.calls[-1][0]["prompt"].startswith("low[user]") and r.json()["reasoning"] == {"effort": "low"}
    err = assert_error(c.post("/v1/responses", json={"input": "hi", "reasoning": {"effort": "ultra"}}), 400,
                       "reasoning")
    assert "reasoning_effort must be one of" in err["message"]
    assert_error(c.post("/v1/responses", json={"input": "hi", "reasoning": {"summary": "auto"}}), 400, "reasoning")
    c, _ = make_client()  # a template without reasoning_effort: refused, not ignored
    err = assert_error(c.post("/v1/responses", json={"input": "hi", "reasoning": {"effort": "high"}}), 400,
                       "reasoning")
    assert "reasoning.effort='high'" in err["message"]
