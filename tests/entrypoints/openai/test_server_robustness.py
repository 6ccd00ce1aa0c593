"""Bad bodies as real clients send them: each gets a 4xx whose message says what to change, and the server keeps
serving; many concurrent requests (streamed, plain, cancelled) lose or duplicate nothing and report usage that adds
up."""
from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest

from tests.entrypoints.openai.conftest import DetokEngine

BODY = {"prompt": "hi", "max_tokens": 2}


def _still_serves(client) -> None:
    r = client.post("/v1/completions", json=BODY)
    assert r.status_code == 200, r.text
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_non_utf8_body_names_the_byte(make_client, path):
    client, _ = make_client()
    raw = b'{"model": "fake-model", "prompt": "hi \xff\xfe", "max_tokens": 2}'
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "not valid UTF-8" in err["message"] and "0xff" in err["message"], err
    assert err["type"] == "BadRequestError"
    _still_serves(client)


def test_too_deeply_nested_json(make_client):
    client, _ = make_client()
    raw = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert "nested too deeply" in r.json()["error"]["message"]
    _still_serves(client)


@pytest.mark.parametrize("content_type", ["application/xml", "multipart/form-data; boundary=x",
                                          "application/octet-stream"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_non_json_content_type_is_415(make_client, path, content_type):
    client, _ = make_client()
    body = dict(BODY, messages=[{"role": "user", "content": "hi"}]) if "chat" in path else BODY
    r = client.post(path, content=json.dumps(body), headers={"content-type": content_type})
    assert r.status_code == 415, r.text
    err = r.json()["error"]
    assert content_type.split(";")[0] in err["message"] and "application/json" in err["message"], err
    _still_serves(client)


@pytest.mark.parametrize("content_type", [None, "application/json; charset=utf-8", "text/plain",
                                          "application/x-www-form-urlencoded"])
def test_json_sent_under_common_content_types_still_works(make_client, content_type):
    client, _ = make_client()
    headers = {"content-type": content_type} if content_type else {}
    r = client.post("/v1/completions", content=json.dumps(BODY), headers=headers)
    assert r.status_code == 200, r.text
    # a bad field under such a type is still named (not blamed on the content type)
    r = client.post("/v1/completions", content=json.dumps(dict(BODY, max_tokens="x")), headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_concurrent_mixed_requests_lose_nothing(make_client, smollm2_tokenizer):
    """48 requests at once through the real OutputProcessor: streamed (with usage), plain, and some cancelled by
    their clients. Every completed one has its own id, all n choices, and usage that matches what was sent."""
    tok = smollm2_tokenizer
    texts = ["The quick brown fox jumps", "over the lazy dog again and again", "Hello world"]
    scripts = [tok.encode(t, add_special_tokens=False) + [2] for t in texts]
    engine = DetokEngine(tok, scripts)
    client, _ = make_client(engine)
    app = client.app
    results: dict[int, tuple] = {}

    async def streamed(c, i, path, body):
        counts: dict[int, int] = {}
        usage, ids, finish = None, set(), {}
        async with c.stream("POST", path, json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                ids.add(ev["id"])
                usage = ev.get("usage") or usage
                for ch in ev["choices"]:
                    lp = ch.get("logprobs") or {}
                    counts[ch["index"]] = counts.get(ch["index"], 0) + len(lp.get("tokens") or lp.get("content") or [])
                    if ch.get("finish_reason"):
                        finish[ch["index"]] = ch["finish_reason"]
        results[i] = ("stream", body, counts, usage, ids, finish)

    async def plain(c, i, path, body):
        r = await c.post(path, json=body)
        assert r.status_code == 200, r.text
        results[i] = ("plain", body, r.json())

    async def cancelled(c, i, path, body):
        async def go():
            async with c.stream("POST", path, json=dict(body, stream=True)) as r:
                await r.aread()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(go(), 0.001)
        results[i] = ("cancelled",)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=30) as c:
            jobs = []
            for i in range(48):
                chat = i % 2 == 0
                path = "/v1/chat/completions" if chat else "/v1/completions"
                body = {"max_tokens": 3 + i % 5, "n": 1 + i % 3, "temperature": 1.0}
                if chat:
                    body.update(messages=[{"role": "user", "content": f"q{i}"}], logprobs=True)
                else:
                    body.update(prompt=f"q{i}", logprobs=0)
                kind = (i // 2) % 3
                if kind == 0:
                    body.update(stream=True, stream_options={"include_usage": True})
                    jobs.append(streamed(c, i, path, body))
                elif kind == 1:
                    jobs.append(plain(c, i, path, body))
                else:
                    jobs.append(cancelled(c, i, path, body))
            await asyncio.gather(*jobs)
            await asyncio.sleep(0.1)

    asyncio.run(main())
    assert sorted(results) == list(range(48))
    seen_ids = []
    for i, res in results.items():
        if res[0] == "stream":
            _, body, counts, usage, ids, finish = res
            assert len(ids) == 1, ids
            seen_ids += list(ids)
            assert sorted(finish) == list(range(body["n"])), finish
            assert usage["prompt_tokens"] + usage["completion_tokens"] == usage["total_tokens"], usage
            assert usage["completion_tokens"] == sum(counts.values()), (counts, usage)
        elif res[0] == "plain":
            _, body, out = res
            seen_ids.append(out["id"])
            usage = out["usage"]
            assert sorted(ch["index"] for ch in out["choices"]) == list(range(body["n"]))
            lps = [ch["logprobs"] for ch in out["choices"]]
            n_tokens = sum(len(lp.get("tokens") or lp.get("content") or []) for lp in lps)
            assert usage["prompt_tokens"] + usage["completion_tokens"] == usage["total_tokens"], usage
            assert usage["completion_tokens"] == n_tokens, (n_tokens, usage)
    assert len(seen_ids) == len(set(seen_ids))
