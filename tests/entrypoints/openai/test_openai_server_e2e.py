"""End to end: the real server (AsyncLLM + engine-core process) on a tiny random Llama, driven by the official
`openai` client and httpx. One server for the module; the last test stops it gracefully with a SIGTERM."""
from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.entrypoints.openai.server_utils import RemoteServer

MODEL = "tiny"
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    model = tiny_model_factory("llama")
    log = str(tmp_path_factory.mktemp("server") / "server.log")
    srv = RemoteServer([model, "--served-model-name", MODEL, "alias", "--max-model-len", str(MAX_MODEL_LEN),
                        "--max-logprobs", "5", "--enable-prompt-tokens-details", "--enable-log-requests",
                        "--max-log-len", "12", "--disable-uvicorn-access-log", "--shutdown-timeout", "30",
                        "--seed", "0"], log)
    srv.wait_healthy(120)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def metric(http: httpx.Client, name: str) -> float:
    text = http.get("/metrics").text
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"{name} not in /metrics"
    return total


def wait_idle(http: httpx.Client, timeout: float = 15.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if metric(http, "vllm:num_requests_running") == 0 and metric(http, "vllm:kv_cache_usage_perc") == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"engine not idle: running={metric(http, 'vllm:num_requests_running')} "
                         f"kv={metric(http, 'vllm:kv_cache_usage_perc')}")


# ----- routes -----
def test_simple_routes(http):
    assert http.get("/health").status_code == 200
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
    import tokenmill
    assert http.get("/version").json() == {"version": tokenmill.__version__}
    models = http.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == [MODEL, "alias"]
    assert models[0]["max_model_len"] == MAX_MODEL_LEN and models[0]["owned_by"] == "tokenmill"
    assert http.get("/v1/models/alias").json()["id"] == "alias"           # openai's models.retrieve
    err = http.get("/v1/models/org/none").json()["error"]
    assert err["code"] == 404 and "org/none" in err["message"]
    assert http.get("/openapi.json").json()["paths"]["/v1/completions"]
    assert http.get("/docs").status_code == 200 and http.get("/redoc").status_code == 200
    text = http.get("/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert name in text


def test_tokenize_roundtrip(http):
    r = http.post("/tokenize", json={"prompt": "Hello tokenmill", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] == MAX_MODEL_LEN
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "Hello tokenmill"}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > 3


def test_openai_client_completion_and_chat(oai):
    c = oai.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=8, temperature=0)
    assert c.object == "text_completion" and c.model == MODEL and c.id.startswith("cmpl-")
    assert c.usage.completion_tokens == 8 and c.choices[0].finish_reason == "length"
    assert c.usage.prompt_tokens_details.cached_tokens >= 0
    chat = oai.chat.completions.create(model="alias", messages=[{"role": "user", "content": "Hello!"}],
                                       max_completion_tokens=6, temperature=0)
    assert chat.model == MODEL and chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 6


def test_stream_equals_non_stream(oai):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = oai.completions.create(**kw)
    chunks = list(oai.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []
    msgs = [{"role": "user", "content": "Tell me a story"}]
    full = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    chunks = list(oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0,
                                              stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_sampling_features(oai, http):
    c = oai.completions.create(model=MODEL, prompt=["a b", "c d"], n=2, max_tokens=4, temperature=0.8, seed=5,
                               logprobs=3, echo=True, extra_body={"ignore_eos": True, "top_k": 10})
    assert sorted(ch.index for ch in c.choices) == [0, 1, 2, 3]
    for ch in c.choices:
        assert ch.text.startswith(("a b", "c d"))
        assert ch.logprobs.token_logprobs[0] is None and len(ch.logprobs.top_logprobs[1]) >= 1
    c2 = oai.completions.create(model=MODEL, prompt=["a b", "c d"], n=2, max_tokens=4, temperature=0.8, seed=5,
                                logprobs=3, echo=True, extra_body={"ignore_eos": True, "top_k": 10})
    assert [ch.text for ch in c.choices] == [ch.text for ch in c2.choices]  # seeded sampling is reproducible
    ids = http.post("/tokenize", json={"prompt": "token ids prompt"}).json()["tokens"]
    r = oai.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0)
    assert r.usage.prompt_tokens == len(ids)
    greedy = oai.completions.create(model=MODEL, prompt="stop test", max_tokens=20, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].text
    stop = greedy.strip().split(" ")[1] if len(greedy.strip().split(" ")) > 1 else greedy[3:6]
    r = oai.completions.create(model=MODEL, prompt="stop test", max_tokens=20, temperature=0, stop=[stop],
                               extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    assert r.choices[0].model_extra.get("stop_reason") == stop
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4,
                                           "allowed_token_ids": [42], "return_token_ids": True,
                                           "prompt_logprobs": 1, "ignore_eos": True}).json()
    ch = r["choices"][0]
    assert ch["token_ids"] == [42] * 4 and ch["prompt_token_ids"] == [5, 6, 7]
    assert ch["prompt_logprobs"][0] is None and len(ch["prompt_logprobs"]) == 3
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                "max_tokens": 2, "prompt_logprobs": 0}).json()
    assert r["prompt_logprobs"][0] is None and len(r["prompt_logprobs"]) == r["usage"]["prompt_tokens"]
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)


def test_concurrent_equals_sequential(server):
    prompts = [f"Request number {i} says" for i in range(32)]
    body = dict(model=MODEL, max_tokens=16, temperature=0, ignore_eos=True)

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            seq = []
            for p in prompts:
                seq.append((await c.post("/v1/completions", json=dict(body, prompt=p))).json())
            conc = await asyncio.gather(*(c.post("/v1/completions", json=dict(body, prompt=p)) for p in prompts))
            return seq, [r.json() for r in conc]

    seq, conc = asyncio.run(run())
    assert [r["choices"][0]["text"] for r in seq] == [r["choices"][0]["text"] for r in conc]


BAD = [
    ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 0}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "temperature": 3}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "top_p": 0}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "n": 0}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "logprobs": 6}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": [999999999]}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "a " * 600}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": MAX_MODEL_LEN}, 400),
    ("/v1/completions", {"model": "nope", "prompt": "a"}, 404),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "min_tokens": 9, "max_tokens": 2}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "stop_token_ids": [-1]}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "allowed_token_ids": [10 ** 8]}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "priority": 5}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "cache_salt": ""}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "cache_salt": 7}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tool_choice": "auto", "tools": []}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema"}}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "chat_template": "{{ 'hi' }}"}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400),
]


def test_cache_salt_isolates_prefix_cache(http):
    """A salted prompt hits the prefix cache only under the same salt (seen in the usage's cached_tokens)."""
    prompt = "Salted prompt: the quick brown fox jumps over the lazy dog, again and again. " * 4

    def cached(salt, path="/v1/completions"):
        body = {"model": MODEL, "max_tokens": 1, "cache_salt": salt}
        if path == "/v1/completions":
            body["prompt"] = prompt
        else:
            body["messages"] = [{"role": "user", "content": prompt}]
        r = http.post(path, json=body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached("tenant-1") == 0
    assert cached("tenant-2") == 0
    assert cached("tenant-1") > 0
    assert cached("tenant-3", "/v1/chat/completions") == 0
    assert cached("tenant-3", "/v1/chat/completions") > 0


def test_beam_search(http):
    """use_beam_search: n beams, best first; one beam without EOS is greedy; what it cannot honour is a 400."""
    def post(path, **kw):
        body = {"model": MODEL, "max_tokens": 6, **kw}
        if path == "/v1/completions":
            body.setdefault("prompt", "Beam me up")
        else:
            body.setdefault("messages", [{"role": "user", "content": "Beam me up"}])
        return http.post(path, json=body)
    greedy = post("/v1/completions", temperature=0, ignore_eos=True).json()
    beam = post("/v1/completions", use_beam_search=True, n=1, ignore_eos=True, temperature=0).json()
    assert beam["choices"][0]["text"] == greedy["choices"][0]["text"]
    r = post("/v1/completions", use_beam_search=True, n=2, temperature=0, length_penalty=0.8)  # --max-logprobs 5
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1] and len({c["text"] for c in choices}) == 2
    assert all(c["finish_reason"] in ("stop", "length") for c in choices)
    r = post("/v1/chat/completions", use_beam_search=True, n=2, temperature=0)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2 and r.json()["usage"]["completion_tokens"] > 0
    for kw, field in (({"stream": True}, "stream"), ({"top_p": 0.5}, "top_p"), ({"logprobs": 2}, "logprobs"),
                      ({"n": 3}, "n")):
        r = post("/v1/completions", use_beam_search=True, **kw)
        assert r.status_code == 400 and field in r.json()["error"]["message"], (kw, r.text)
    r = post("/v1/completions", length_penalty=0.5)
    assert r.status_code == 400 and "use_beam_search" in r.json()["error"]["message"]
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize("path,body,status", BAD)
def test_bad_input_gets_4xx_and_server_keeps_serving(http, path, body, status):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["message"] and "type" in err
    assert http.get("/health").status_code == 200


def test_context_length_message_names_both_numbers(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": MAX_MODEL_LEN})
    msg = r.json()["error"]["message"]
    assert str(MAX_MODEL_LEN) in msg and str(MAX_MODEL_LEN + 1) in msg


def test_malformed_bodies(http):
    for raw in (b"{bad json", b'{"prompt": "\xff"}', b"[]", b"null"):
        r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == 400
    assert http.get("/health").status_code == 200


def test_stream_disconnect_frees_blocks(server, http):
    wait_idle(http)
    before = metric(http, "vllm:generation_tokens_total")
    body = {"model": MODEL, "prompt": "keep going", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines += 1
                if lines >= 3:
                    break
    # the connection is closed: the request must be aborted and its blocks freed
    wait_idle(http)
    generated = metric(http, "vllm:generation_tokens_total") - before
    assert generated < 480, "the request ran to completion: it was not aborted"


def test_non_stream_disconnect_frees_blocks(server, http):
    wait_idle(http)
    before = metric(http, "vllm:generation_tokens_total")
    body = {"model": MODEL, "prompt": "keep going", "max_tokens": 480, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=0.3) as c:
        with pytest.raises(httpx.TimeoutException):
            c.post("/v1/completions", json=body)
    wait_idle(http)
    assert metric(http, "vllm:generation_tokens_total") - before < 480


def samples(http: httpx.Client) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(http.get("/metrics").text) for s in fam.samples}


def total(snap: dict, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in snap.items() if n == name and want <= ls)


def test_vllm_metric_set(http):
    """vLLM's V1 metrics after 3 requests (4 sequences: one request has n=2): per-sequence counts and sums match
    what was sent, per-request ones count requests, phase times are consistent, every series has vLLM's labels."""
    wait_idle(http)
    before = samples(http)
    bodies = [{"model": MODEL, "prompt": f"metrics probe {i} " * (i + 3), "max_tokens": 5, "ignore_eos": True,
               "temperature": 1.0 if i == 2 else 0, "n": 2 if i == 2 else 1} for i in range(3)]  # n > 1 samples
    prompt_tokens = 0
    for b in bodies:
        r = http.post("/v1/completions", json=b).json()
        prompt_tokens += r["usage"]["prompt_tokens"] * b["n"]
        assert r["usage"]["completion_tokens"] == 5 * b["n"]
    wait_idle(http)
    after = samples(http)

    def d(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)
    seqs, gen = 4, 20
    assert d("vllm:request_success_total", finished_reason="length") == seqs
    for h in ("e2e_request_latency", "time_to_first_token", "request_queue_time", "request_prefill_time",
              "request_decode_time", "request_inference_time", "request_time_per_output_token"):
        assert d(f"vllm:{h}_seconds_count") == seqs, h
    for h in ("request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens",
              "request_prefill_kv_computed_tokens"):
        assert d(f"vllm:{h}_count") == seqs, h
    assert d("vllm:request_params_n_count") == 3 and d("vllm:request_params_n_sum") == seqs
    assert d("vllm:request_max_num_generation_tokens_count") == 3
    assert d("vllm:request_max_num_generation_tokens_sum") == 15
    assert d("vllm:request_params_max_tokens_sum") == d("vllm:request_generation_tokens_sum") == gen
    assert d("vllm:generation_tokens_total") == gen
    # One token per step: gen - 1 inter-token gaps per sequence (the deprecated alias sees the same).
    assert d("vllm:inter_token_latency_seconds_count") == d("vllm:time_per_output_token_seconds_count") == gen - seqs
    assert d("vllm:prompt_tokens_total") == d("vllm:request_prompt_tokens_sum") == prompt_tokens
    cached, recomputed = d("vllm:prompt_tokens_cached_total"), d("vllm:prompt_tokens_recomputed_total")
    computed = d("vllm:prompt_tokens_by_source_total", source="local_compute")
    assert computed + cached == prompt_tokens == d("vllm:request_prefill_kv_computed_tokens_sum") + cached
    assert d("vllm:prompt_tokens_by_source_total", source="local_cache_hit") == cached + recomputed
    assert d("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
    # Tokens scheduled over the steps: every uncached prompt token, then one per generated token but the last.
    assert d("vllm:iteration_tokens_total_sum") == computed + gen - seqs
    assert d("vllm:iteration_tokens_total_count") >= 5
    queue, prefill = d("vllm:request_queue_time_seconds_sum"), d("vllm:request_prefill_time_seconds_sum")
    decode, inference = d("vllm:request_decode_time_seconds_sum"), d("vllm:request_inference_time_seconds_sum")
    assert queue >= 0 and prefill > 0 and decode > 0 and abs(prefill + decode - inference) < 1e-6
    assert queue + inference <= d("vllm:e2e_request_latency_seconds_sum") + 1e-3
    assert d("vllm:time_to_first_token_seconds_sum") >= prefill
    labels = {"model_name": MODEL, "engine": "0"}
    assert total(after, "vllm:num_requests_waiting_by_reason", reason="capacity", **labels) == 0
    assert total(after, "vllm:num_requests_waiting_by_reason", reason="deferred", **labels) == 0
    assert total(after, "vllm:engine_sleep_state", sleep_state="awake", **labels) == 1
    (info,) = [dict(ls) for (n, ls) in after if n == "vllm:cache_config_info"]
    assert info["engine"] == "0" and info["block_size"] == "16" and int(info["num_gpu_blocks"]) > 0
    # The capacity per KV layer group (one group, full attention, for this model): blocks and how many
    # max_model_len requests they hold.
    blocks = total(after, "tokenmill:kv_cache_group_blocks", group="full_attention", **labels)
    assert blocks == int(info["num_gpu_blocks"])
    assert total(after, "tokenmill:kv_cache_group_max_requests", group="full_attention", **labels) > 0
    for (n, ls) in after:  # every vllm: series but the config info carries model_name and engine
        if n.startswith("vllm:") and n != "vllm:cache_config_info":
            assert labels.items() <= dict(ls).items(), (n, ls)


def test_request_logging(server, http):
    http.post("/v1/completions", json={"model": MODEL, "prompt": "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "max_tokens": 1})
    time.sleep(0.3)
    log = server.log()
    assert "'ABCDEFGHIJKL'" in log and "ABCDEFGHIJKLM" not in log
    assert '"GET /health' not in log  # --disable-uvicorn-access-log


def test_sigterm_lets_running_requests_finish_and_exits_0(server):
    """--shutdown-timeout 30: a request in flight when SIGTERM arrives still completes; the exit code is 0."""
    result: dict = {}
    started = threading.Event()
    body = {"model": MODEL, "prompt": "finish me", "max_tokens": 150, "ignore_eos": True, "stream": True}

    def run():
        events = []
        with httpx.Client(base_url=server.url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
                        started.set()
        result["finish"] = [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1]
        result["tokens"] = len(events)

    t = threading.Thread(target=run)
    t.start()
    assert started.wait(30)
    server.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert server.proc.wait(30) == 0, server.log()
    assert result.get("finish") == "length", server.log()[-3000:]
    assert re.search(r"Shutting down", server.log())
