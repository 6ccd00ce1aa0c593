"""Tool parsers llama3_json, mistral, deepseek_v3, pythonic: extraction, and streaming == extraction for any split."""
from __future__ import annotations

import json
import random
import re

import pytest

from tokenmill.parsers.tool import ExtractedToolCalls, ToolStreamDelta, tool_parsers
from tokenmill.parsers.tool.deepseek_v3 import DeepSeekV3ToolParser
from tokenmill.parsers.tool.llama3_json import Llama3JsonToolParser
from tokenmill.parsers.tool.mistral import MistralToolParser
from tokenmill.parsers.tool.pythonic import PythonicToolParser

CB, CE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
B, E, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def ds_call(name: str, args: str) -> str:
    return f"{B}function{SEP}{name}\n```json\n{args}\n```{E}"


WEATHER = {"city": "北京", "unit": "celsius"}
NESTED = {"filter": {"tags": ["a", "b"], "range": {"min": -1.5, "max": None}}, "ok": True, "n": 3}
# (parser name, text, expected [(name, args)], expected content)
CASES = [
    # llama3_json
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "北京", "unit": "celsius"}}',
     [("get_weather", WEATHER)], None),
    ("llama3_json", '<|python_tag|>{"name": "search", "arguments": ' + json.dumps(NESTED) + "}",
     [("search", NESTED)], None),
    ("llama3_json", ' \n{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}};\n{"name": "c"}',
     [("a", {"x": 1}), ("b", {}), ("c", {})], None),
    ("llama3_json", '{"name": "a", "parameters": "{\\"q\\": \\"é\\"}"} Done, calling a.', [("a", {"q": "é"})],
     "Done, calling a."),
    ("llama3_json", '{"name": "a", "parameters": {}}; {"oops": 1}', [("a", {})], '{"oops": 1}'),
    ("llama3_json", 'The weather in Paris is sunny {"name": "x"}.', [], 'The weather in Paris is sunny {"name": "x"}.'),
    ("llama3_json", '{"result": 42}', [], '{"result": 42}'),
    ("llama3_json", '{"name": "a", "parameters": {"x": 1}', [], '{"name": "a", "parameters": {"x": 1}'),
    ("llama3_json", '{"name": "a", "parameters": [1, 2]}', [], '{"name": "a", "parameters": [1, 2]}'),
    ("llama3_json", "<|python_tag|>print('hi')", [], "<|python_tag|>print('hi')"),
    ("llama3_json", "  ", [], "  "),
    # mistral, JSON-array form
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "北京", "unit": "celsius"}}]',
     [("get_weather", WEATHER)], None),
    ("mistral", 'Let me look that up.\n[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "search", '
     '"arguments": ' + json.dumps(json.dumps(NESTED)) + "}]", [("a", {"x": 1}), ("search", NESTED)],
     "Let me look that up.\n"),
    ("mistral", '[TOOL_CALLS] [{"name": "a", "arguments": {"x": [1, {"y": "]"}]}}]\n\nAnything else?',
     [("a", {"x": [1, {"y": "]"}]})], "Anything else?"),
    ("mistral", '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}', [],
     '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}'),
    ("mistral", 'ok [TOOL_CALLS] [{"nom": "a"}] rest', [], 'ok [TOOL_CALLS] [{"nom": "a"}] rest'),
    # mistral, [ARGS] form
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]" + json.dumps(WEATHER, ensure_ascii=False), [("get_weather", WEATHER)],
     None),
    ("mistral", "Checking.[TOOL_CALLS]get_weather[ARGS]{\"city\": \"北京\", \"unit\": \"celsius\"}[TOOL_CALLS]"
     "search[ARGS]" + json.dumps(NESTED), [("get_weather", WEATHER), ("search", NESTED)], "Checking."),
    ("mistral", "[TOOL_CALLS]a[ARGS]{}\n[TOOL_CALLS]bad name[ARGS]{}", [("a", {})], "[TOOL_CALLS]bad name[ARGS]{}"),
    ("mistral", "[TOOL_CALLS]a[ARGS]not json", [], "[TOOL_CALLS]a[ARGS]not json"),
    ("mistral", "No tools needed: the answer is [42].", [], "No tools needed: the answer is [42]."),
    ("mistral", "ends with [TOOL_CALL", [], "ends with [TOOL_CALL"),
    # deepseek_v3
    ("deepseek_v3", CB + ds_call("get_weather", '{"city": "北京", "unit": "celsius"}') + CE, [("get_weather", WEATHER)],
     None),
    ("deepseek_v3", "我来查一下。\n\n" + CB + ds_call("a", '{"x": 1}') + "\n" + ds_call("search", json.dumps(NESTED))
     + CE, [("a", {"x": 1}), ("search", NESTED)], "我来查一下。\n\n"),
    ("deepseek_v3", CB + B + "get_weather" + SEP + '{"city": "Paris"}' + E + CE + " Done.", [("get_weather",
     {"city": "Paris"})], "Done."),
    ("deepseek_v3", CB + ds_call("a", "{}"), [("a", {})], None),
    ("deepseek_v3", "x" + CB + ds_call("a", "{bad json}") + CE, [], "x" + CB + ds_call("a", "{bad json}") + CE),
    ("deepseek_v3", CB + ds_call("a", "{}") + ds_call("b", "[1]") + CE, [("a", {})], ds_call("b", "[1]") + CE),
    ("deepseek_v3", CB + B + "function" + SEP + "a\n```json\n{\"x\": ", [],
     CB + B + "function" + SEP + "a\n```json\n{\"x\": "),
    ("deepseek_v3", "Plain answer with a < sign and ｜ bar.", [], "Plain answer with a < sign and ｜ bar."),
    # pythonic
    ("pythonic", '[get_weather(city="北京", unit="celsius")]', [("get_weather", WEATHER)], None),
    ("pythonic", "[a(x=1), search(filter={'tags': ['a', 'b'], 'range': {'min': -1.5, 'max': None}}, ok=True, n=3)]",
     [("a", {"x": 1}), ("search", NESTED)], None),
    ("pythonic", ' <|python_start|>[f(s="a]b\\"c)", t=\'\'\'x\ny\'\'\', u=(1, 2), v=null)]<|python_end|>\nok',
     [("f", {"s": 'a]b"c)', "t": "x\ny", "u": [1, 2], "v": None})], "ok"),
    ("pythonic", "[brave_search.call(query=\"tokenmill\")]", [("brave_search.call", {"query": "tokenmill"})], None),
    ("pythonic", "[f(x=os.system('ls'))]", [], "[f(x=os.system('ls'))]"),
    ("pythonic", "[f(1, 2)]", [], "[f(1, 2)]"),
    ("pythonic", "[1] Smith et al., 2020.", [], "[1] Smith et al., 2020."),
    ("pythonic", "[Note: it's unclosed", [], "[Note: it's unclosed"),
    ("pythonic", "[f(a='x\n')]", [], "[f(a='x\n')]"),
    ("pythonic", "[f(a=1)", [], "[f(a=1)"),
    ("pythonic", "[]", [], "[]"),
    ("pythonic", "The answer is get_weather(city='Paris').", [], "The answer is get_weather(city='Paris')."),
]
PARSERS = {"llama3_json": Llama3JsonToolParser, "mistral": MistralToolParser, "deepseek_v3": DeepSeekV3ToolParser,
           "pythonic": PythonicToolParser}


def stream(parser, chunks: list[str]) -> tuple[str, list[tuple[str, str, str]]]:
    """Concatenated content and [(id, name, arguments)] per index, checking the delta contract on the way."""
    s = parser.new_stream(None)
    deltas: list[ToolStreamDelta] = [s.feed(c) for c in chunks] + [s.finish()]
    calls: dict[int, list] = {}
    for d in deltas:
        for tc in d.tool_calls:
            if tc.index not in calls:
                assert tc.index == len(calls) and tc.id and tc.name, tc
                calls[tc.index] = [tc.id, tc.name, ""]
            else:
                assert tc.id in (None, calls[tc.index][0]) and tc.name in (None, calls[tc.index][1])
            calls[tc.index][2] += tc.arguments
    return "".join(d.content for d in deltas), [tuple(calls[i]) for i in sorted(calls)]


def splits(text: str) -> list[list[str]]:
    out = [[text[i:i + n] for i in range(0, len(text), n)] for n in range(1, len(text) + 1)]
    rng = random.Random(len(text))
    for _ in range(10):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
        out.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    return out


@pytest.mark.parametrize("name,text,calls,content", CASES)
def test_extract(name, text, calls, content):
    r = PARSERS[name](None).extract(text)
    assert isinstance(r, ExtractedToolCalls)
    assert r.content == content
    assert r.tools_called == bool(calls)
    assert [(c.name, json.loads(c.arguments)) for c in r.tool_calls] == calls
    assert [c.arguments for c in r.tool_calls] == [json.dumps(a, ensure_ascii=False) for _, a in calls]
    assert len({c.id for c in r.tool_calls}) == len(calls)


@pytest.mark.parametrize("name,text,calls,content", CASES)
def test_stream_equals_extract_for_any_split(name, text, calls, content):
    parser = PARSERS[name](None)
    ref = parser.extract(text)
    for chunks in splits(text):
        got_content, got_calls = stream(parser, chunks)
        assert got_content == (ref.content or ""), chunks
        assert [(n, a) for _, n, a in got_calls] == [(c.name, c.arguments) for c in ref.tool_calls], chunks
        assert len({i for i, _, _ in got_calls}) == len(got_calls)


def test_content_streams_before_calls_and_calls_before_finish():
    s = MistralToolParser(None).new_stream()
    assert s.feed("Let me check").content == "Let me check"
    assert s.feed(" [TOOL_").content == " "
    d = s.feed('CALLS]get_weather[ARGS]{"city": "Paris"}')
    assert d.content == "" and [(c.name, c.arguments) for c in d.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    assert s.finish() == ToolStreamDelta()

    s = PythonicToolParser(None).new_stream()
    assert s.feed("Hello").content == "Hello"
    s = PythonicToolParser(None).new_stream()
    assert s.feed("[1").content == "[1"  # cannot be a call list: released at once
    s = PythonicToolParser(None).new_stream()
    assert s.feed('[f(a="]")').tool_calls == [] and len(s.feed("]").tool_calls) == 1

    s = DeepSeekV3ToolParser(None).new_stream()
    assert s.feed("Sure<｜tool▁calls").content == "Sure"
    d = s.feed("▁begin｜>" + ds_call("a", '{"k": "v"}'))
    assert [(c.name, c.arguments) for c in d.tool_calls] == [("a", '{"k": "v"}')]

    s = Llama3JsonToolParser(None).new_stream()
    assert s.feed("Hi").content == "Hi"
    s = Llama3JsonToolParser(None).new_stream()
    assert s.feed('{"name": "a", "parameters": {}}').tool_calls[0].name == "a"
    assert s.feed("; ").content == "" and s.finish().content == ""


def test_mistral_ids_are_nine_alphanumerics():
    parser = MistralToolParser(None)
    text = '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}][TOOL_CALLS]c[ARGS]{}'
    ids = [c.id for c in parser.extract(text).tool_calls]
    ids += [i for i, _, _ in stream(parser, [text[:20], text[20:]])[1]]
    assert len(ids) == 6 and len(set(ids)) == 6
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids), ids
    kept = parser.extract('[TOOL_CALLS]f[CALL_ID]abcDEF123[ARGS]{"x": 1}').tool_calls
    assert [(c.id, c.name, c.arguments) for c in kept] == [("abcDEF123", "f", '{"x": 1}')]


def test_stream_finish_is_idempotent_and_empty_text():
    for cls in PARSERS.values():
        r = cls(None).extract("")
        assert r == ExtractedToolCalls(tools_called=False, tool_calls=[], content=None)
        s = cls(None).new_stream()
        s.feed('{"name": "a"')
        s.finish()
        assert s.finish() == ToolStreamDelta() and s.feed("more") == ToolStreamDelta()


def test_registry_returns_each_class():
    for name, cls in PARSERS.items():
        assert tool_parsers.get(name) is cls
        assert name in tool_parsers.names()


def test_mutated_outputs_never_crash_and_stream_equals_extract():
    rng = random.Random(1234)
    pieces = list("{}[]()\"'\\;:, \n") + ["[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", B, E, CB, CE, SEP, "```", "x"]
    for _ in range(400):
        name, text, _, _ = rng.choice(CASES)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(text) + 1)
            if rng.random() < 0.5:
                text = text[:i] + text[i + rng.randint(1, 5):]
            else:
                text = text[:i] + rng.choice(pieces) + text[i:]
        parser = PARSERS[name](None)
        ref = parser.extract(text)
        if not ref.tools_called:
            assert ref.content == (text or None)
        for chunks in rng.sample(splits(text), 5) if len(text) > 1 else [[text]]:
            got_content, got_calls = stream(parser, chunks)
            assert got_content == (ref.content or ""), (name, chunks)
            assert [(n, a) for _, n, a in got_calls] == [(c.name, c.arguments) for c in ref.tool_calls], chunks


@pytest.mark.parametrize("name", list(PARSERS))
def test_long_call_streamed_char_by_char(name):
    code = "def f(x):\n    return [x[i] for i in range(3)] + {'a': (1, \"2\")}['a']  # \\ ]\n" * 80
    args = {"path": "a.py", "content": code}
    text = {"llama3_json": json.dumps({"name": "write", "parameters": args}),
            "mistral": "[TOOL_CALLS]write[ARGS]" + json.dumps(args),
            "deepseek_v3": CB + ds_call("write", json.dumps(args)) + CE,
            "pythonic": f"[write(path='a.py', content={code!r})]"}[name]
    content, calls = stream(PARSERS[name](None), list(text))
    assert content == "" and [(n, json.loads(a)) for _, n, a in calls] == [("write", args)]
