"""Tool parsers hermes and qwen3_coder: whole-output results, streaming in every chunking equals them, registry."""
from __future__ import annotations

import json
import random
import textwrap

import pytest

from tokenmill.parsers.tool import tool_parsers
from tokenmill.parsers.tool.hermes import HermesToolParser
from tokenmill.parsers.tool.qwen3_coder import Qwen3CoderToolParser, convert_value

HERMES, CODER = HermesToolParser(None), Qwen3CoderToolParser(None)


def splits(text: str):
    for size in range(1, max(len(text), 1) + 1):
        yield [text[i:i + size] for i in range(0, len(text), size)]
    rng = random.Random(len(text))
    for _ in range(20):
        n = min(len(text) - 1, rng.randint(1, 10))
        cuts = sorted(rng.sample(range(1, len(text)), n)) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


def run_stream(parser, chunks, tools=None):
    """(content or None, [(id, name, arguments)]) from a stream, checking the delta protocol on the way."""
    s = parser.new_stream(tools)
    content, calls = [], {}
    for d in [s.feed(c) for c in chunks] + [s.finish()]:
        content.append(d.content)
        for tc in d.tool_calls:
            if tc.index not in calls:
                assert tc.id and tc.id.startswith("call_") and tc.name, "first delta carries id and name"
                assert tc.index == len(calls), "indices are consecutive"
                calls[tc.index] = [tc.id, tc.name, ""]
            else:
                assert tc.id in (None, calls[tc.index][0]), "id is stable"
                assert tc.name is None, "name is sent once"
            calls[tc.index][2] += tc.arguments
    return "".join(content) or None, [tuple(calls[i]) for i in range(len(calls))]


def check(parser, text, tools=None, splits_=None):
    """Extract, then stream every split and compare; returns the extraction."""
    ex = parser.extract(text, tools)
    assert ex.tools_called == bool(ex.tool_calls)
    for call in ex.tool_calls:
        assert isinstance(json.loads(call.arguments), dict)
    for chunks in splits_ or splits(text):
        content, calls = run_stream(parser, chunks, tools)
        assert content == ex.content, chunks
        assert [(n, a) for _, n, a in calls] == [(c.name, c.arguments) for c in ex.tool_calls], chunks
    return ex


def calls_of(ex):
    return [(c.name, json.loads(c.arguments)) for c in ex.tool_calls]


# ---------------------------------------------------------------- hermes

def test_hermes_one_call():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    ex = check(HERMES, text)
    assert ex.tools_called and ex.content is None
    assert calls_of(ex) == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert ex.tool_calls[0].arguments == '{"city": "Paris", "unit": "celsius"}'
    assert ex.tool_calls[0].id.startswith("call_")


def test_hermes_two_calls_text_before_and_between():
    text = ('I\'ll check both cities.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京"}}\n</tool_call>\nDone.')
    ex = check(HERMES, text)
    assert ex.content == "I'll check both cities.\n\n"  # text after the first call is dropped, as vLLM
    assert calls_of(ex) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "東京"})]
    assert ex.tool_calls[0].id != ex.tool_calls[1].id


def test_hermes_unicode_and_nested():
    args = {"query": "café ☕ 日本語 — \"quoted\"", "emoji": "🎉",
            "filters": {"tags": ["a", "b"], "range": {"min": 1, "max": 2.5}, "active": True, "none": None}}
    text = f"<tool_call>\n{json.dumps({'name': 'search', 'arguments': args}, ensure_ascii=True)}\n</tool_call>"
    ex = check(HERMES, text)
    assert calls_of(ex) == [("search", args)]
    assert ex.tool_calls[0].arguments == json.dumps(args, ensure_ascii=False)  # re-serialized, no \u escapes
    assert "日本語" in ex.tool_calls[0].arguments


def test_hermes_invalid_json_is_content():
    text = 'Let me try.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>'
    ex = check(HERMES, text)
    assert not ex.tools_called and ex.content == text


def test_hermes_invalid_then_valid():
    bad = '<tool_call>\n{"name": broken}\n</tool_call>'
    good = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    ex = check(HERMES, "A" + bad + "B" + good + "C" + bad)
    assert calls_of(ex) == [("f", {})]
    assert ex.content == "A" + bad + "B" + bad  # invalid blocks stay visible as content


@pytest.mark.parametrize("body,expected", [
    ('{"name": "f"}', [("f", {})]),
    ('{"name": "f", "parameters": {"x": 1}}', [("f", {"x": 1})]),
    ('{"name": "f", "arguments": "{\\"x\\": 1}"}', [("f", {"x": 1})]),
    ('[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"y": [1]}}]', [("f", {}), ("g", {"y": [1]})]),
    ('{"arguments": {}}', []), ('{"name": "", "arguments": {}}', []), ('{"name": "f", "arguments": [1]}', []),
    ('"just a string"', []), ('', []), ('[]', []), ('{"name": "f", "arguments": "not json"}', []),
])
def test_hermes_block_shapes(body, expected):
    text = f"<tool_call>\n{body}\n</tool_call>"
    ex = check(HERMES, text)
    assert calls_of(ex) == expected
    if not expected:
        assert ex.content == text


def test_hermes_truncated_and_unclosed():
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n'  # closing tag never came, JSON complete
    assert calls_of(check(HERMES, text)) == [("f", {"a": 1})]
    text = '<tool_call>\n{"name": "f", "argum'  # max_tokens mid-call
    ex = check(HERMES, text)
    assert not ex.tools_called and ex.content == text


def test_hermes_no_calls_and_partial_tags():
    for text in ["Plain answer with <b>html</b> and a < sign.", "ends with <tool_ca", "", "<tool_call>"]:
        ex = check(HERMES, text)
        assert not ex.tools_called and ex.content == (text or None)


def test_hermes_stream_shape():
    s = HERMES.new_stream()
    assert s.feed("Hi <tool").content == "Hi "  # partial tag held back, nothing else
    d = s.feed('_call>{"name": "f", "arguments": {"x": 1}}')
    assert d.content == "" and d.tool_calls == []
    d = s.feed("</tool_call>")
    assert [(t.index, t.name, t.arguments) for t in d.tool_calls] == [(0, "f", ""), (0, None, '{"x": 1}')]


# ---------------------------------------------------------------- qwen3_coder

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
        "metric": {"type": "boolean"}, "opts": {"type": "object"}, "hours": {"type": "array"},
        "note": {"type": ["string", "null"]}, "maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}}},
    {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "content": {"type": "string"}}}}},
]


def coder_call(name, **params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_coder_typed_params():
    text = coder_call("get_weather", city="Paris", days="3", temp="21.5", metric="true",
                      opts='{"lang": "fr", "detail": [1, 2]}', hours="[6, 12, 18]", note="null", maybe="7")
    ex = check(CODER, text, TOOLS)
    assert ex.content is None
    assert calls_of(ex) == [("get_weather", {"city": "Paris", "days": 3, "temp": 21.5, "metric": True,
                                             "opts": {"lang": "fr", "detail": [1, 2]}, "hours": [6, 12, 18],
                                             "note": None, "maybe": 7})]


def test_coder_multiline_string_and_two_functions():
    code = 'def main():\n    print("héllo")\n\n\nmain()\n'
    text = ("I'll write the file and check the weather.\n" + coder_call("write_file", path="/tmp/a.py", content=code)
            + "\n" + coder_call("get_weather", city="New York", days="2"))
    ex = check(CODER, text, TOOLS)
    assert ex.content == "I'll write the file and check the weather.\n"
    assert calls_of(ex) == [("write_file", {"path": "/tmp/a.py", "content": code}),
                            ("get_weather", {"city": "New York", "days": 2})]


def test_coder_no_schema():
    text = coder_call("unknown_tool", n="42", f="1.5", b="false", obj='{"a": [1, null]}', s="hello world",
                      zip="007", q='"quoted"')
    for tools in (None, TOOLS):
        ex = check(CODER, text, tools)
        assert calls_of(ex) == [("unknown_tool", {"n": 42, "f": 1.5, "b": False, "obj": {"a": [1, None]},
                                                  "s": "hello world", "zip": "007", "q": "quoted"})]


def test_coder_schema_mismatch_and_python_literals():
    text = coder_call("get_weather", days="three", metric="yes", opts="{'a': True, 'b': None}", city="42",
                      temp="NaN", hours="not a list")
    ex = check(CODER, text, TOOLS)
    assert calls_of(ex) == [("get_weather", {"days": "three", "metric": "yes", "opts": {"a": True, "b": None},
                                             "city": "42", "temp": "NaN", "hours": "not a list"})]


def test_coder_tolerant_layouts():
    # several functions in one block, missing </parameter> and </function>, inline values, bare <function=...>
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>Oslo<parameter=days>\n5\n</function>\n"
            "<function=write_file>\n<parameter=path>\nx.txt\n</parameter>\n</tool_call>\n"
            "<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>")
    ex = check(CODER, text, TOOLS)
    assert calls_of(ex) == [("get_weather", {"city": "Oslo", "days": 5}), ("write_file", {"path": "x.txt"}),
                            ("get_weather", {"city": "Rome"})]
    assert ex.content is None


def test_coder_duplicate_param_first_wins_and_empty_args():
    text = coder_call("get_weather", city="A").replace("</function>", "<parameter=city>\nB\n</parameter>\n</function>")
    assert calls_of(check(CODER, text, TOOLS)) == [("get_weather", {"city": "A"})]
    ex = check(CODER, "<tool_call>\n<function=ping>\n</function>\n</tool_call>")
    assert calls_of(ex) == [("ping", {})] and ex.tool_calls[0].arguments == "{}"


def test_coder_invalid_and_truncated():
    for text in ["<tool_call>\n{\"name\": \"f\"}\n</tool_call>",           # hermes JSON is not this format
                 "<tool_call>\n<function=bad name>\n</function>\n</tool_call>",
                 "Sure.\n<tool_call>\n<function=get_wea"]:             # truncated before the name ended
        ex = check(CODER, text, TOOLS)
        assert not ex.tools_called and ex.content == text
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"  # truncated in a value: still a call
    assert calls_of(check(CODER, text, TOOLS)) == [("get_weather", {"city": "Par"})]


def test_coder_streams_incrementally():
    s = CODER.new_stream(TOOLS)
    assert s.feed("Ok <tool_call>\n<function=get_wea").content == "Ok "
    d = s.feed("ther>\n<parameter=city>\nPa")
    assert [(t.name, t.arguments) for t in d.tool_calls] == [("get_weather", "")]  # name as soon as known
    d = s.feed("ris\n</parameter>\n<parameter=days>\n3\n</para")
    assert [t.arguments for t in d.tool_calls] == ['{"city": "Paris"']
    d = s.feed("meter>\n</function>\n</tool_call>")
    assert [t.arguments for t in d.tool_calls] == [', "days": 3}']


def test_convert_value_direct():
    assert convert_value("\n  spaced  \n", {"type": "string"}) == "  spaced  "
    assert convert_value("\n\nx\n\n", {"type": "string"}) == "\nx\n"  # one newline each side only
    assert convert_value("3.0", {"type": "integer"}) == 3
    assert convert_value("1e3", {"type": "number"}) == 1000.0
    assert convert_value("-4", {"type": "number"}) == -4
    assert convert_value("null", {"type": "string"}) == "null"
    assert convert_value("None", {"type": ["object", "null"]}) is None
    assert convert_value("Infinity", None) == "Infinity"


def test_random_texts_stream_equals_extract():
    rng = random.Random(1)
    pieces = ["<tool_call>", "</tool_call>", "<function=f>", "<function=", "</function>", "<parameter=a>",
              "<parameter=", "</parameter>", "\n", "x", "1", '{"name": "g", "arguments": {"k": "v"}}', "<", ">",
              "<tool_c", "</par", "é"]
    for _ in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 10)))
        for parser in (HERMES, CODER):
            check(parser, text, TOOLS, splits_=list(splits(text))[:5] + [list(text)] + list(splits(text))[-3:])


# ---------------------------------------------------------------- registry

def test_registry_and_plugins(tmp_path):
    assert tool_parsers.get("hermes") is HermesToolParser
    assert tool_parsers.get("qwen3_coder") is Qwen3CoderToolParser
    with pytest.raises(ValueError) as err:
        tool_parsers.get("does_not_exist")
    assert "hermes" in str(err.value) and "qwen3_coder" in str(err.value)

    plugin = tmp_path / "my_parser.py"
    plugin.write_text(textwrap.dedent("""
        from tokenmill.parsers.tool import tool_parsers
        from tokenmill.parsers.tool.hermes import HermesToolParser

        @tool_parsers.register("test_plugin_hermes_variant")
        class MyParser(HermesToolParser):
            pass
    """))
    tool_parsers.load_plugin(str(plugin))
    cls = tool_parsers.get("test_plugin_hermes_variant")
    assert cls.__name__ == "MyParser" and "test_plugin_hermes_variant" in tool_parsers.names()
    ex = cls(None).extract('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert calls_of(ex) == [("f", {})]

    with pytest.raises(ValueError, match="does not exist"):
        tool_parsers.load_plugin(str(tmp_path / "missing.py"))
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ValueError, match="boom"):
        tool_parsers.load_plugin(str(broken))
