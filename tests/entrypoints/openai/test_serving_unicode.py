"""Multi-byte (Chinese, emoji) text through the OpenAI routes, on conftest's DetokEngine (the real OutputProcessor
and serving code, a scripted engine): token-id prompts that end inside a character, and chat logprobs with
return_tokens_as_token_ids."""
from __future__ import annotations

import openai
import pytest

from tests.entrypoints.openai.conftest import DetokEngine

TEXT = "答案：机器学习很有趣。😀"


def _client(make_client, tok, scripts):
    c, _ = make_client(DetokEngine(tok, scripts))
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=c, max_retries=0)


@pytest.mark.parametrize("logprobs", [None, 0])
def test_token_id_prompt_cut_inside_a_character_is_continued_whole(make_client, smollm2_tokenizer, logprobs):
    """A client continues an output that max_tokens cut inside a character: it sends prompt + output ids, and the
    new output's text starts with that character, whole (vLLM too), in the stream and the one-shot response."""
    tok = smollm2_tokenizer
    ids = tok.encode(TEXT)
    cut = next(c for c in range(len(ids) - 1, 0, -1) if tok.decode(ids[:c]).endswith("有\ufffd"))
    prompt, rest = ids[:cut], ids[cut:]
    want = TEXT[TEXT.index("趣"):]
    oai = _client(make_client, tok, [rest + [2]])
    kw = dict(model="fake-model", prompt=prompt, max_tokens=40, logprobs=logprobs)
    one = oai.completions.create(**kw).choices[0]
    assert one.text == want and one.finish_reason == "stop"
    streamed = ""
    offsets: list[int] = []
    for chunk in oai.completions.create(stream=True, **kw):
        for c in chunk.choices:
            assert "\ufffd" not in c.text
            streamed += c.text
            offsets += c.logprobs.text_offset if c.logprobs else []
    assert streamed == want
    if logprobs is not None:
        assert offsets == one.logprobs.text_offset
        assert one.logprobs.text_offset[0] == 0  # the first token's bytes belong to 趣, the text's first character
        assert one.logprobs.text_offset == sorted(one.logprobs.text_offset)


def test_chat_logprobs_bytes_are_the_tokens_bytes_with_token_ids_shown(detok_client):
    oai = detok_client([TEXT])
    kw = dict(model="fake-model", messages=[{"role": "user", "content": "你好"}], logprobs=True, top_logprobs=2,
              max_tokens=40)
    plain = oai.chat.completions.create(**kw).choices[0].logprobs.content
    for stream in (False, True):
        if stream:
            content = [e for c in oai.chat.completions.create(stream=True, extra_body={
                "return_tokens_as_token_ids": True}, **kw) for ch in c.choices if ch.logprobs
                for e in ch.logprobs.content]
        else:
            content = oai.chat.completions.create(extra_body={"return_tokens_as_token_ids": True},
                                                  **kw).choices[0].logprobs.content
        assert len(content) == len(plain)
        for e, p in zip(content, plain):
            assert e.token.startswith("token_id:") and e.bytes == p.bytes
            assert [t.bytes for t in e.top_logprobs] == [t.bytes for t in p.top_logprobs]
            assert all(t.token.startswith("token_id:") for t in e.top_logprobs)
        text_entries = [e for e in content if e.token != "token_id:2"]  # the EOS that ended the text
        assert bytes(b for e in text_entries for b in e.bytes).decode("utf-8") == TEXT
