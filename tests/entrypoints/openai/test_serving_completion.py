"""/v1/completions through the real OutputProcessor (conftest's DetokEngine), driven by the `openai` client: a
stream with n > 1, echo and logprobs gives what the one-shot response gives, multi-byte text included."""
from __future__ import annotations

import pytest

TEXTS = ["Hello 世界 ok, 你好吗？🎉👍🏽 再见", " second 第二 こんにちは"]


def collect(stream):
    """index -> (text, tokens, token_logprobs, text_offset, finish_reason) from a stream's chunks."""
    acc = {}
    for chunk in stream:
        for c in chunk.choices:
            a = acc.setdefault(c.index, ["", [], [], [], None])
            assert "\ufffd" not in c.text, c.text
            a[0] += c.text
            if c.logprobs is not None:
                a[1] += c.logprobs.tokens
                a[2] += c.logprobs.token_logprobs
                a[3] += c.logprobs.text_offset
            a[4] = c.finish_reason or a[4]
    return {i: tuple(a) for i, a in acc.items()}


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("echo", [False, True])
def test_text_offsets_point_at_each_token_in_stream_and_one_shot(detok_client, smollm2_tokenizer, chunk, echo):
    oai = detok_client(TEXTS, chunk=chunk)
    kw = dict(model="fake-model", prompt=["说 你好", "Two"], n=2, logprobs=1, echo=echo, max_tokens=40)
    one = oai.completions.create(**kw)
    streamed = collect(oai.completions.create(stream=True, **kw))
    assert sorted(streamed) == [0, 1, 2, 3]
    for c in one.choices:
        lp = c.logprobs
        assert streamed[c.index] == (c.text, lp.tokens, lp.token_logprobs, lp.text_offset, c.finish_reason)
        assert c.text.endswith(TEXTS[c.index % 2])
        assert lp.text_offset == sorted(lp.text_offset) and all(o <= len(c.text) for o in lp.text_offset)
        for token, offset in zip(lp.tokens, lp.text_offset):
            if token == "<|im_end|>":  # the EOS that ended the text, not part of it
                assert offset == len(c.text)
            elif "\ufffd" in token:  # ends in a piece of a multi-byte character: that character comes next
                head = token[:token.index("\ufffd")]
                assert c.text[offset:].startswith(head) and ord(c.text[offset + len(head)]) > 0x2000, (token, offset)
            else:
                assert c.text[offset:].startswith(token), (token, offset, c.text)


def test_text_offsets_of_a_stop_string_cut_stay_inside_the_text(detok_client):
    oai = detok_client([TEXTS[0]], chunk=4)
    kw = dict(model="fake-model", prompt="x", logprobs=0, max_tokens=40, stop=["吗"])
    one = oai.completions.create(**kw).choices[0]
    streamed = collect(oai.completions.create(stream=True, **kw))[0]
    assert one.text == "Hello 世界 ok, 你好" and one.finish_reason == "stop"
    assert streamed == (one.text, one.logprobs.tokens, one.logprobs.token_logprobs, one.logprobs.text_offset, "stop")
    assert all(o <= len(one.text) for o in one.logprobs.text_offset)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_of_a_truncated_prompt_shows_the_tokens_the_model_saw(make_client, smollm2_tokenizer, stream):
    import openai
    c, engine = make_client()
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=c, max_retries=0)
    prompt = "one two three four five six"
    kept = smollm2_tokenizer.encode(prompt)[-3:]
    kw = dict(model="fake-model", prompt=prompt, max_tokens=2, echo=True, logprobs=0,
              extra_body={"truncate_prompt_tokens": 3})
    if stream:
        got = collect(oai.completions.create(stream=True, **kw))[0]
        text, tokens, offsets = got[0], got[1], got[3]
    else:
        r = oai.completions.create(**kw)
        text, tokens, offsets = r.choices[0].text, r.choices[0].logprobs.tokens, r.choices[0].logprobs.text_offset
        assert r.usage.prompt_tokens == 3
    assert engine.calls[-1][0]["prompt_token_ids"] == kept
    assert text.startswith(smollm2_tokenizer.decode(kept)) and not text.startswith("one")
    assert tokens[:3] == [smollm2_tokenizer.decode([t]) for t in kept]
    for token, offset in zip(tokens, offsets):
        assert text[offset:].startswith(token), (token, offset, text)
