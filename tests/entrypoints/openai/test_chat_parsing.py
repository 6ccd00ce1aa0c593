"""--reasoning-parser and --enable-auto-tool-choice --tool-call-parser through /v1/chat/completions: the one-shot
response and the concatenated stream agree, for scripted model outputs."""
from __future__ import annotations

import json

import pytest

from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import RequestOutputKind

MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]


class ScriptedEngine:
    """Emits the token ids of a fixed text, one token per step, whatever the prompt (mixed into conftest's
    FakeEngine by the `scripted` fixture, which owns the rest of the EngineClient surface)."""

    def __init__(self, tokenizer, text: str):
        super().__init__(tokenizer)
        self.script = tokenizer.encode(text, add_special_tokens=False)

    async def generate(self, prompt, sampling_params, request_id, priority=0):
        self.calls.append((prompt, sampling_params, request_id, priority))
        ids, tok = self.script, self.tokenizer
        if sampling_params.output_kind == RequestOutputKind.DELTA:
            prev = ""
            for k in range(1, len(ids) + 1):
                text = tok.decode(ids[:k])
                done = "stop" if k == len(ids) else None
                out = CompletionOutput(0, text[len(prev):], [ids[k - 1]], None, None, finish_reason=done)
                prev = text
                yield RequestOutput(request_id, None, prompt["prompt_token_ids"], None, [out], done is not None)
        else:
            out = CompletionOutput(0, tok.decode(ids), list(ids), None, None, finish_reason="stop")
            yield RequestOutput(request_id, None, prompt["prompt_token_ids"], None, [out], True)


@pytest.fixture
def scripted(fake_engine, think_tokenizer):
    """Scripted engines over a tokenizer with <think> / </think> tokens (the reasoning parsers require them)."""
    cls = type("Scripted", (ScriptedEngine, type(fake_engine)), {})
    return lambda text: cls(think_tokenizer, text)


def run_both(make_client, scripted, text, body, **frontend):
    c, _ = make_client(scripted(text), **frontend)
    one = c.post("/v1/chat/completions", json={"messages": MSGS, **body})
    assert one.status_code == 200, one.text
    msg = one.json()["choices"][0]
    r = c.post("/v1/chat/completions", json={"messages": MSGS, "stream": True, **body})
    content, reasoning, calls, finish = "", "", {}, None
    for line in r.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ch = json.loads(line[6:])["choices"]
        if not ch:
            continue
        d = ch[0]["delta"]
        content += d.get("content") or ""
        reasoning += d.get("reasoning_content") or ""
        indices = [tc["index"] for tc in d.get("tool_calls") or []]
        assert len(indices) == len(set(indices)), d  # one entry per call in a chunk, as OpenAI streams them
        for tc in d.get("tool_calls") or []:
            if tc["index"] not in calls:  # a call's first delta names it, as clients expect
                assert tc.get("id") and tc.get("type") == "function" and tc["function"].get("name"), tc
            entry = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            entry["id"] = entry["id"] or tc.get("id")
            entry["name"] = entry["name"] or tc.get("function", {}).get("name")
            entry["arguments"] += tc.get("function", {}).get("arguments", "")
        finish = ch[0].get("finish_reason") or finish
    return msg, content, reasoning, calls, finish


def test_reasoning_split_whole_and_streamed(make_client, scripted):
    text = "Let me think about Paris.\nIt is in France.</think>\n\nThe capital of France is Paris."
    msg, content, reasoning, _, _ = run_both(make_client, scripted, text, {"max_tokens": 50},
                                             reasoning_parser="deepseek_r1")
    m = msg["message"]
    assert m["reasoning_content"] == "Let me think about Paris.\nIt is in France."
    assert m["content"] == "The capital of France is Paris."
    assert (reasoning, content) == (m["reasoning_content"], m["content"])


def test_qwen3_thinking_disabled_is_all_content(make_client, scripted):
    text = "Plain answer, no thinking."
    msg, content, reasoning, _, _ = run_both(make_client, scripted, text,
                                             {"chat_template_kwargs": {"enable_thinking": False}},
                                             reasoning_parser="qwen3")
    assert msg["message"]["content"] == text and not msg["message"]["reasoning_content"]
    assert content == text and reasoning == ""


def test_tool_calls_whole_and_streamed(make_client, scripted):
    text = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    msg, content, _, calls, finish = run_both(make_client, scripted, text, {"tools": TOOLS},
                                              enable_auto_tool_choice=True, tool_call_parser="hermes")
    m = msg["message"]
    assert msg["finish_reason"] == "tool_calls" and finish == "tool_calls"
    assert m["content"] == "Sure." and content == "Sure."
    (tc,) = m["tool_calls"]
    assert tc["type"] == "function" and tc["function"]["name"] == "get_weather"
    assert json.loads(tc["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert calls[0]["name"] == "get_weather" and calls[0]["id"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 3}


def test_qwen3_5_call_inside_an_unclosed_think_block_is_a_tool_call(make_client, scripted):
    """Qwen3.5 calls a tool before closing its reasoning: with --reasoning-parser qwen3 and --tool-call-parser
    qwen3_coder the call is a tool call (not reasoning text), whole and streamed."""
    text = ("<think>The user wants the weather; I will call the tool.\n<tool_call>\n<function=get_weather>\n"
            "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>")
    msg, content, reasoning, calls, finish = run_both(
        make_client, scripted, text, {"tools": TOOLS}, reasoning_parser="qwen3", enable_auto_tool_choice=True,
        tool_call_parser="qwen3_coder")
    m = msg["message"]
    assert m["reasoning_content"] == reasoning == "The user wants the weather; I will call the tool.\n"
    assert msg["finish_reason"] == "tool_calls" and finish == "tool_calls"
    assert not m["content"] and not content
    (tc,) = m["tool_calls"]
    assert tc["function"]["name"] == "get_weather" and json.loads(tc["function"]["arguments"]) == {"city": "Paris"}
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Paris"}


def test_tools_without_parser_or_with_tool_choice_none_are_not_parsed(make_client, scripted):
    text = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    msg, _, _, calls, _ = run_both(make_client, scripted, text, {"tools": TOOLS, "tool_choice": "none"},
                                   enable_auto_tool_choice=True, tool_call_parser="hermes")
    assert msg["message"]["content"] == text and not msg["message"]["tool_calls"] and not calls


def test_unknown_parser_fails_at_start(make_client, scripted):
    with pytest.raises(ValueError, match="available"):
        make_client(scripted("x"), reasoning_parser="nope")


def test_parser_whose_tags_the_tokenizer_lacks_fails_at_start(make_client):
    # The default fake engine carries the embedded SmolLM2's tokenizer, which has no think tokens.
    with pytest.raises(ValueError, match="--reasoning-parser deepseek_r1: the tokenizer has no '<think>' or "
                                         "'</think>' token"):
        make_client(reasoning_parser="deepseek_r1")


def test_null_fields_and_tool_loop_messages(make_client):
    """Clients that send every field as null, and the usual tool loop (assistant content null + tool result)."""
    c, _ = make_client()
    msgs = [{"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "22C"}]
    r = c.post("/v1/chat/completions", json={"messages": msgs, "tools": TOOLS, "tool_choice": None,
                                             "max_tokens": 2, "n": None,
                                             "stream": None, "echo": None, "ignore_eos": None, "priority": None})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1


@pytest.mark.parametrize("in_reasoning", [False, True])
def test_structured_outputs_start_after_reasoning_unless_enable_in_reasoning(make_client, scripted, think_tokenizer,
                                                                             in_reasoning):
    """With a reasoning parser the grammar constrains only the answer (it starts after the end-of-reasoning token);
    --structured-outputs-config enable_in_reasoning makes it constrain the reasoning too, as in vLLM."""
    end_id = think_tokenizer.convert_tokens_to_ids("</think>")
    engine = scripted("{}")
    c, _ = make_client(engine, reasoning_parser="deepseek_r1",
                       structured_outputs_config={"enable_in_reasoning": in_reasoning})
    r = c.post("/v1/chat/completions", json={"messages": MSGS, "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    params = engine.calls[-1][1]
    assert params.structured_outputs is not None
    assert params._grammar_after_token_id == (None if in_reasoning else end_id)


REQUIRED_OUT = ('[{"name": "get_weather", "parameters": {"city": "Pa}ris \\"[x]\\"", "days": 3}}, '
                '{"name": "get_weather", "parameters": {"city": "Oslo {"}}]')


def test_required_tool_calls_stream_each_call_when_its_item_closes():
    from tokenmill.entrypoints.openai.chat_parsing import ForcedToolStream, parse_required_calls
    cut = REQUIRED_OUT.index("}}, ") + 2                       # just past the first item's closing brace
    st = ForcedToolStream(None)
    # Braces and quotes inside strings do not close the item: nothing comes out before its last brace.
    assert not any(st.feed(ch).tool_calls for ch in REQUIRED_OUT[:cut - 1])
    one = st.feed(REQUIRED_OUT[cut - 1])
    assert [(c["index"], c["type"], c["function"]["name"]) for c in one.tool_calls] == [(0, "function",
                                                                                         "get_weather")]
    assert one.tool_calls[0]["id"]
    assert json.loads(one.tool_calls[0]["function"]["arguments"]) == {"city": 'Pa}ris "[x]"', "days": 3}
    two = st.feed(REQUIRED_OUT[cut:])
    assert [c["index"] for c in two.tool_calls] == [1]
    assert json.loads(two.tool_calls[0]["function"]["arguments"]) == {"city": "Oslo {"}
    assert not st.finish().tool_calls
    # Cut short (max_tokens): the complete item is kept, whole and streamed alike.
    short = REQUIRED_OUT[:cut + 20]
    assert [json.loads(c["function"]["arguments"]) for c in parse_required_calls(short)] == [
        {"city": 'Pa}ris "[x]"', "days": 3}]
    assert len(ForcedToolStream(None).feed(short).tool_calls) == 1
    # Cut inside the second call's arguments: that call comes too, with the raw arguments generated so far.
    at = REQUIRED_OUT.index("Oslo") + 2
    whole = parse_required_calls(REQUIRED_OUT[:at])
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole[1:]] == [
        ("get_weather", '{"city": "Os')]
    st = ForcedToolStream(None)
    streamed = st.feed(REQUIRED_OUT[:at]).tool_calls + st.finish().tool_calls
    assert [c["index"] for c in streamed] == [0, 1]
    assert [c["function"] for c in streamed] == [c["function"] for c in whole]
    # Cut before the parameters begin: no call to return yet; cut just before the item's last brace: the call is
    # whole and its arguments parse.
    assert parse_required_calls(REQUIRED_OUT[:at - 20])[1:] == []
    last = parse_required_calls(REQUIRED_OUT[:-2])[1]["function"]
    assert json.loads(last["arguments"]) == {"city": "Oslo {"}


def test_required_tool_calls_whole_and_streamed(make_client, scripted):
    msg, content, _, calls, finish = run_both(make_client, scripted, REQUIRED_OUT,
                                              {"tools": TOOLS, "tool_choice": "required"})
    assert msg["finish_reason"] == "tool_calls" and finish == "tool_calls"
    whole = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["message"]["tool_calls"]]
    assert whole == [("get_weather", {"city": 'Pa}ris "[x]"', "days": 3}), ("get_weather", {"city": "Oslo {"})]
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == whole
    assert all(calls[i]["id"] for i in calls) and content == ""


@pytest.mark.parametrize("choice, answer", [
    ("required", '[{"name":"get_weather","parameters":{"city":"Paris","days":3}}]'),
    ({"type": "function", "function": {"name": "get_weather"}}, '{"city":"Paris","days":3}')])
def test_forced_tool_call_cut_by_max_tokens_returns_what_was_generated(detok_client, smollm2_tokenizer, choice,
                                                                       answer):
    """A forced call cut off by max_tokens comes back as OpenAI returns it: the call with its incomplete
    arguments and finish_reason "length" (it was no content, tool_calls [] for "required"); streamed alike."""
    oai = detok_client([answer])
    kw = dict(model="fake-model", messages=MSGS, tools=TOOLS, tool_choice=choice)
    cut = answer.index("Paris") + 3
    max_tokens = len(smollm2_tokenizer.encode(answer[:cut], add_special_tokens=False))
    one = oai.chat.completions.create(max_tokens=max_tokens, **kw).choices[0]
    assert one.finish_reason == "length" and not one.message.content
    (tc,) = one.message.tool_calls
    text = smollm2_tokenizer.decode(smollm2_tokenizer.encode(answer, add_special_tokens=False)[:max_tokens])
    want_args = text[text.index('"parameters":') + len('"parameters":'):] if choice == "required" else text
    assert tc.function.name == "get_weather" and tc.id and tc.function.arguments == want_args
    assert want_args.startswith('{"city":"Pa') and not want_args.endswith("}")
    name, args, ids, finish = "", "", set(), None
    for chunk in oai.chat.completions.create(stream=True, max_tokens=max_tokens, **kw):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                assert d.index == 0
                ids |= {d.id} if d.id else set()
                name += d.function.name or ""
                args += d.function.arguments or ""
            finish = ch.finish_reason or finish
    assert (name, args, finish, len(ids)) == ("get_weather", want_args, "length", 1)
    # Not cut: the complete call, finish_reason as before.
    done = oai.chat.completions.create(max_tokens=100, **kw).choices[0]
    assert done.finish_reason == ("tool_calls" if choice == "required" else "stop")
    assert json.loads(done.message.tool_calls[0].function.arguments) == {"city": "Paris", "days": 3}


@pytest.fixture(scope="module")
def special_tags_tokenizer(smollm2_tokenizer):
    """<tool_call> / </tool_call> as SPECIAL tokens, as some Hermes-format models' tokenizers mark them."""
    import copy
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    return tok


@pytest.mark.parametrize("chunk", [1, 4])
def test_hermes_sees_tool_call_tags_that_are_special_tokens(detok_client, special_tags_tokenizer, chunk):
    """Like vLLM's hermes parser, a request with tools is detokenized with skip_special_tokens off, else the tags
    vanish before the parser sees them and the call comes back as content. Chinese and escaped quotes included."""
    text = '查一下。<tool_call>\n{"name": "get_weather", "arguments": {"city": "北京 \\"朝阳\\""}}\n</tool_call>'
    oai = detok_client([text], chunk=chunk, tokenizer=special_tags_tokenizer, enable_auto_tool_choice=True,
                       tool_call_parser="hermes")
    kw = dict(model="fake-model", messages=MSGS, tools=TOOLS)
    one = oai.chat.completions.create(**kw).choices[0]
    assert one.finish_reason == "tool_calls" and one.message.content == "查一下。"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in one.message.tool_calls] == [
        ("get_weather", {"city": '北京 "朝阳"'})]
    content, args, names, finish = "", "", [], None
    for chunk_ in oai.chat.completions.create(stream=True, **kw):
        for ch in chunk_.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                names += [tc.function.name] if tc.function.name else []
                args += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    assert (content, names, args, finish) == ("查一下。", ["get_weather"], one.message.tool_calls[0].function.arguments,
                                              "tool_calls")


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_after_reasoning(make_client, think_tokenizer, parser, choice):
    """tool_choice "required" / a named function with --reasoning-parser: the reasoning is reasoning (streamed as
    such) and only the answer after it is the call, as in vLLM; the grammar starts after the end of reasoning."""
    import openai

    from tests.entrypoints.openai.conftest import DetokEngine
    args = '{"city": "北京 \\"朝阳\\"", "days": 3}'
    answer = f'[{{"name": "get_weather", "parameters": {args}}}]' if choice == "required" else args
    text = f"<think>先想一想：用户问天气。</think>\n\n{answer}"
    engine = DetokEngine(think_tokenizer, [think_tokenizer.encode(text) + [2]])
    http, _ = make_client(engine, reasoning_parser=parser)
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
    kw = dict(model="fake-model", messages=MSGS, tools=TOOLS, tool_choice=choice)
    one = oai.chat.completions.create(**kw).choices[0]
    assert engine.calls[-1][1]._grammar_after_token_id == think_tokenizer.convert_tokens_to_ids("</think>")
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            reasoning += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, ["", ""])
                entry[0] += tc.function.name or ""
                entry[1] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    want_finish = "tool_calls" if choice == "required" else "stop"
    assert one.finish_reason == finish == want_finish
    assert one.message.model_extra["reasoning_content"] == reasoning == "先想一想：用户问天气。"
    assert not one.message.content and content == ""
    whole = [(t.function.name, json.loads(t.function.arguments)) for t in one.message.tool_calls]
    assert whole == [("get_weather", {"city": '北京 "朝阳"', "days": 3})]
    assert [(calls[i][0], json.loads(calls[i][1])) for i in sorted(calls)] == whole


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
@pytest.mark.parametrize("parameters", [None, {}])
def test_forced_call_to_a_function_without_parameters_gets_empty_arguments(make_client, smollm2_tokenizer, choice,
                                                                          parameters):
    """OpenAI: omitting parameters defines a function with an empty parameter list, so the grammar must refuse
    invented arguments (a client calls get_time(**arguments))."""
    from tokenmill.structured.backend_xgrammar import GrammarCompiler, RequestGrammar
    fn = {"name": "get_time"} if parameters is None else {"name": "get_time", "parameters": parameters}
    c, engine = make_client()
    r = c.post("/v1/chat/completions", json={"messages": MSGS, "tools": [{"type": "function", "function": fn}],
                                             "tool_choice": choice, "max_tokens": 4})
    assert r.status_code == 200, r.text
    so = engine.calls[-1][1].structured_outputs
    required = choice == "required"
    ok, invented = ('[{"name":"get_time","parameters":{}}]', '[{"name":"get_time","parameters":{"tz"') if required \
        else ("{}", '{"tz"')
    gc = GrammarCompiler(smollm2_tokenizer, vocab_size=len(smollm2_tokenizer))
    try:
        assert RequestGrammar(gc.compile_sync(so)).matcher.accept_string(ok)
        assert not RequestGrammar(gc.compile_sync(so)).matcher.accept_string(invented)
    finally:
        gc.shutdown()
