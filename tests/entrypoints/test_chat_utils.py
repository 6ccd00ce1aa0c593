"""Chat rendering: tool calls and tool results go through the template with their arguments as objects."""
from __future__ import annotations

import pytest

from tokenmill.entrypoints.chat_utils import render_chat

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
            "{% for tc in m.tool_calls or [] %}[call {{ tc.function.name }} {{ tc.function.arguments.city }}]"
            "{% endfor %}{% if m.tool_call_id %}(for {{ m.tool_call_id }}){% endif %}{% endfor %}"
            "{% if tools %}TOOLS={{ tools | length }}{% endif %}")


def test_tool_messages_render(smollm2_tokenizer):
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    out = render_chat(smollm2_tokenizer, msgs, chat_template=TEMPLATE, add_generation_prompt=False,
                      tools=[{"type": "function", "function": {"name": "get_weather"}}])
    assert out == "<user>Weather?<assistant>[call get_weather Paris]<tool>sunny(for call_1)TOOLS=1"


def test_bad_inputs(smollm2_tokenizer):
    with pytest.raises(ValueError, match="both"):
        render_chat(smollm2_tokenizer, [{"role": "user", "content": "x"}], add_generation_prompt=True,
                    continue_final_message=True)
    with pytest.raises(ValueError, match="role"):
        render_chat(smollm2_tokenizer, [{"content": "x"}])


@pytest.mark.parametrize("content,match", [
    (5, r"messages\[1\]\.content must be a string or a list"),
    ({"type": "text", "text": "hi"}, r"messages\[1\]\.content must be a string or a list"),
    ([{"type": "text"}], r"messages\[1\]\.content\[0\] of type 'text' needs a string 'text'"),
    ([{"type": "text", "text": "a"}, 7], r"messages\[1\]\.content\[1\] must be a content part"),
])
def test_malformed_content_names_the_message_and_part(smollm2_tokenizer, content, match):
    """A wrong content type is a ValueError (the server's 400) that names where it is, not a Jinja error."""
    msgs = [{"role": "system", "content": [{"type": "text", "text": "ok"}]}, {"role": "user", "content": content}]
    with pytest.raises(ValueError, match=match):
        render_chat(smollm2_tokenizer, msgs, chat_template=TEMPLATE)


def test_text_and_refusal_parts_join(smollm2_tokenizer):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, "b", {"type": "input_text", "text": "c"}]},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}]
    assert render_chat(smollm2_tokenizer, msgs, chat_template=TEMPLATE, add_generation_prompt=False) == \
        "<user>a\nb\nc<assistant>no"


@pytest.mark.parametrize("kw,match", [
    (dict(chat_template_kwargs="enable_thinking"), "chat_template_kwargs must be a dict"),
    (dict(chat_template_kwargs=[("a", 1)]), "chat_template_kwargs must be a dict"),
    (dict(tools="get_weather"), "tools must be a list of tool definitions"),
    (dict(tools=["get_weather"]), "tools must be a list of tool definitions"),
    (dict(tools={"type": "function"}), "tools must be a list of tool definitions"),
])
def test_llm_chat_arguments_of_the_wrong_type_are_named(smollm2_tokenizer, kw, match):
    """LLM.chat passes these straight in: without the check they failed inside dict() or transformers with a
    message naming neither."""
    with pytest.raises(ValueError, match=match):
        render_chat(smollm2_tokenizer, [{"role": "user", "content": "x"}], **kw)
    with pytest.raises(ValueError, match=r"messages\[1\]: each chat message needs a 'role'"):
        render_chat(smollm2_tokenizer, [{"role": "user", "content": "x"}, {"content": "y"}])
