"""/v1/chat/completions through the real OutputProcessor (conftest's DetokEngine), driven by the `openai` client:
streams with n > 1 and logprobs give what the one-shot response gives, multi-byte text included."""
from __future__ import annotations

import pytest

M = [{"role": "user", "content": "hi"}]
TEXTS = ["Hello 世界 ok, 你好吗？🎉👍🏽 再见", " second 第二 こんにちは"]


@pytest.mark.parametrize("chunk", [1, 3])
def test_logprobs_bytes_rebuild_the_text_in_stream_and_one_shot(detok_client, chunk):
    oai = detok_client(TEXTS, chunk=chunk)
    kw = dict(model="fake-model", messages=M, n=2, logprobs=True, top_logprobs=2, max_tokens=40)
    one = oai.chat.completions.create(**kw)
    acc = {}
    for c in oai.chat.completions.create(stream=True, **kw):
        for ch in c.choices:
            a = acc.setdefault(ch.index, ["", [], None])
            assert "\ufffd" not in (ch.delta.content or "")
            a[0] += ch.delta.content or ""
            a[1] += ch.logprobs.content if ch.logprobs and ch.logprobs.content else []
            a[2] = ch.finish_reason or a[2]
    assert sorted(acc) == [0, 1]
    for ch in one.choices:
        content = ch.logprobs.content
        assert acc[ch.index][0] == ch.message.content == TEXTS[ch.index]
        assert acc[ch.index][2] == ch.finish_reason
        assert [e.model_dump() for e in acc[ch.index][1]] == [e.model_dump() for e in content]
        # OpenAI: the bytes of the tokens (a character split across tokens included) concatenate to the text.
        text_entries = [e for e in content if e.token != "<|im_end|>"]
        assert bytes(b for e in text_entries for b in e.bytes).decode("utf-8") == TEXTS[ch.index]
        assert any(e.token == "\ufffd" for e in text_entries)  # the pieces still show vLLM's token text
        for e in content:
            assert len(e.top_logprobs) == 2
            assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].bytes == e.bytes


def test_echo_repeats_the_last_messages_text_parts(detok_client):
    """echo: the last message (of the role being generated) comes back before the answer, its text parts joined as
    the template received them, input_text parts included; whole and streamed."""
    oai = detok_client(TEXTS)
    msgs = M + [{"role": "assistant", "content": [{"type": "input_text", "text": "Sure: "},
                                                 {"type": "text", "text": "好的"}]}]
    kw = dict(model="fake-model", messages=msgs, max_tokens=40, extra_body={"echo": True})
    one = oai.chat.completions.create(**kw)
    assert one.choices[0].message.content == "Sure: \n好的" + TEXTS[0]
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == one.choices[0].message.content
