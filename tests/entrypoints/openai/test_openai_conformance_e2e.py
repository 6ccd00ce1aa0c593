"""OpenAI-API conformance end to end: the real server on a tiny random Llama, driven by the official `openai`
client, checking the response shapes and error classes clients rely on."""
from __future__ import annotations

import openai
import pytest

from tests.entrypoints.openai.server_utils import RemoteServer

MSGS = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("conformance") / "server.log")
    srv = RemoteServer([tiny_model_factory("llama"), "--served-model-name", "tiny", "alias", "--max-model-len",
                        "256", "--disable-uvicorn-access-log", "--seed", "0"], log)
    srv.wait_healthy(120)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_completion_shape_and_logprobs(oai):
    r = oai.completions.create(model="alias", prompt="The quick brown", max_tokens=5, logprobs=3, temperature=0)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and isinstance(r.created, int)
    assert r.model == "tiny"  # the first served name, whichever one the request used (as vLLM)
    (ch,) = r.choices
    assert ch.index == 0 and ch.finish_reason == "length"
    lp = ch.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == ch.text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for tok, lpv, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and top[tok] == lpv
        assert lpv == max(top.values())  # greedy: the chosen token is the most likely one
    assert r.usage.completion_tokens == 5 and r.usage.total_tokens == r.usage.prompt_tokens + 5


def test_chat_shape_and_logprobs(oai):
    r = oai.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, logprobs=True, top_logprobs=2,
                                    temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and isinstance(r.created, int)
    (ch,) = r.choices
    assert ch.message.role == "assistant" and ch.finish_reason == "length"
    content = ch.logprobs.content
    assert len(content) == 4 and "".join(c.token for c in content) == ch.message.content
    for c in content:
        assert c.bytes == list(c.token.encode())
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob
    assert r.usage.completion_tokens == 4


def test_chat_stream_n2_with_usage(oai):
    chunks = list(oai.chat.completions.create(model="tiny", messages=MSGS, max_tokens=3, n=2, stream=True,
                                              stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    per_index: dict[int, list] = {0: [], 1: []}
    for c in chunks[:-1]:
        (choice,) = c.choices
        per_index[choice.index].append(choice)
    for choices in per_index.values():
        assert choices[0].delta.role == "assistant"
        assert [c.finish_reason for c in choices[:-1]] == [None] * (len(choices) - 1)
        assert choices[-1].finish_reason == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 6
    assert last.usage.total_tokens == last.usage.prompt_tokens + 6


def test_errors_raise_the_right_client_exceptions(oai, server):
    for call in (lambda: oai.completions.create(model="nope", prompt="a", max_tokens=1),
                 lambda: oai.chat.completions.create(model="nope", messages=MSGS, max_tokens=1),
                 lambda: oai.models.retrieve("nope")):
        with pytest.raises(openai.NotFoundError, match="nope"):
            call()
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        oai.completions.create(model="tiny", prompt="a", max_tokens=1, logprobs=21)
    with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
        oai.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}])
    with server.client() as http:
        assert http.get("/health").status_code == 200


def test_echo_max_tokens_zero_scores_the_prompt(oai):
    """The prompt's logprobs from echo + max_tokens 0 are the ones a generating echo request reports."""
    prompt = "The quick brown fox jumps"
    score = oai.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    gen = oai.completions.create(model="tiny", prompt=prompt, max_tokens=1, echo=True, logprobs=1, temperature=0)
    s, g = score.choices[0], gen.choices[0]
    assert s.text == prompt and score.usage.completion_tokens == 0
    n = len(s.logprobs.tokens)
    assert n == score.usage.prompt_tokens and s.logprobs.tokens == g.logprobs.tokens[:n]
    assert s.logprobs.token_logprobs[0] is None
    assert s.logprobs.token_logprobs[1:] == pytest.approx(g.logprobs.token_logprobs[1:n], abs=1e-4)


def test_best_of_returns_the_most_likely_candidates(oai, server):
    """best_of=4, n=2 returns the two of the four seeded candidates with the highest total logprob (vLLM V0's
    ranking); the candidates are the ones an n=4 request with the same seed samples. best_of == n with n > 1 used
    to kill the engine core (its n=1 children kept best_of=2); every request here must leave the server healthy."""
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=11)
    pool = oai.completions.create(n=4, logprobs=1, **kw)
    ranked = sorted(pool.choices, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    best = oai.completions.create(n=2, best_of=4, **kw)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1] and all(c.logprobs is None for c in best.choices)
    assert best.usage.completion_tokens == 12  # the returned choices' tokens
    same = oai.completions.create(n=2, best_of=2, **kw)
    assert [c.text for c in same.choices] == [c.text for c in pool.choices[:2]]
    streamed = list(oai.completions.create(n=2, best_of=2, stream=True, **kw))
    assert {c.choices[0].index for c in streamed} == {0, 1}
    chat = oai.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2, n=2, extra_body={"best_of": 2})
    assert len(chat.choices) == 2
    with pytest.raises(openai.BadRequestError, match="cannot be streamed") as e:
        oai.completions.create(n=1, best_of=2, stream=True, **kw)
    assert e.value.body["param"] == "best_of"
    with pytest.raises(openai.BadRequestError, match="best_of"):
        oai.completions.create(n=3, best_of=2, **kw)
    with server.client() as http:
        assert http.get("/health").status_code == 200


def test_system_fingerprint_on_every_response_and_chunk(oai):
    """A stable `tokenmill-<version>-<hash>` string, as OpenAI and current vLLM send (clients log it)."""
    r = oai.completions.create(model="tiny", prompt="a", max_tokens=2)
    fp = r.system_fingerprint
    assert isinstance(fp, str) and fp.startswith("tokenmill-")
    assert oai.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2).system_fingerprint == fp
    for stream in (oai.completions.create(model="tiny", prompt="a", max_tokens=2, stream=True,
                                          stream_options={"include_usage": True}),
                   oai.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2, stream=True,
                                               stream_options={"include_usage": True})):
        assert {c.system_fingerprint for c in stream} == {fp}
