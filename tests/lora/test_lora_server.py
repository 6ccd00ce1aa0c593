"""The OpenAI server with adapters: /v1/models lists them (parent = the base model), "model": "<adapter>" runs a
request under it (its greedy tokens are peft's), an unknown name is OpenAI's 404, and with
VLLM_ALLOW_RUNTIME_LORA_UPDATING adapters load and unload at runtime (bad ones refused with 400, named)."""
from __future__ import annotations

import json

import pytest

from tests.entrypoints.openai.server_utils import RemoteServer

N = 6


@pytest.fixture(scope="module")
def server(lora_base, lora_adapters, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("lora-server") / "server.log")
    mods = ["all=" + lora_adapters["all"],
            json.dumps({"name": "qv", "path": lora_adapters["qv_rslora"], "base_model_name": "tiny"})]
    srv = RemoteServer([lora_base, "--served-model-name", "tiny", "--max-model-len", "256", "--enable-lora",
                        "--max-loras", "2", "--max-lora-rank", "16", "--lora-modules", *mods, "--seed", "0"], log,
                       env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    srv.wait_healthy(120)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with server.client(timeout=60) as c:
        yield c


def _complete(http, model: str, prompt: str) -> tuple[int, dict]:
    r = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": N, "temperature": 0,
                                           "ignore_eos": True, "return_tokens_as_token_ids": True, "logprobs": 0})
    return r.status_code, r.json()


def _token_ids(body: dict) -> list[int]:
    return [int(t.split(":")[1]) for t in body["choices"][0]["logprobs"]["tokens"]]


def test_models_list_adapters_with_their_parent(http, lora_adapters):
    cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
    assert set(cards) == {"tiny", "all", "qv"}
    assert cards["all"]["parent"] == "tiny" and cards["qv"]["parent"] == "tiny"
    assert cards["all"]["root"] == lora_adapters["all"] and cards["tiny"]["parent"] is None


def test_model_field_picks_the_adapter(http, lora_adapters, peft_greedy, smollm2_tokenizer):
    prompt = "The quick brown fox jumps over the lazy dog because it"
    ids = smollm2_tokenizer(prompt).input_ids
    for model, adapter in (("tiny", None), ("all", lora_adapters["all"]), ("qv", lora_adapters["qv_rslora"])):
        status, body = _complete(http, model, prompt)
        assert status == 200, body
        assert _token_ids(body) == peft_greedy(adapter, ids, N), model
        assert body["model"] == model
    chat = http.post("/v1/chat/completions", json={"model": "qv", "max_tokens": 2,
                                                   "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["model"] == "qv"


def test_the_lora_info_metric(http):
    lines = [ln for ln in http.get("/metrics").text.splitlines() if ln.startswith("vllm:lora_requests_info{")]
    assert len(lines) == 1 and 'max_lora="2"' in lines[0] and 'running_lora_adapters=""' in lines[0]


def test_unknown_model_is_openais_404(http):
    status, body = _complete(http, "nope", "hi")
    assert status == 404
    assert body["error"]["type"] == "NotFoundError" and "`nope` does not exist" in body["error"]["message"]


def test_runtime_load_and_unload(http, lora_adapters, tmp_path):
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": lora_adapters["mlp"]})
    assert r.status_code == 200, r.text
    assert "mlp" in {c["id"] for c in http.get("/v1/models").json()["data"]}
    assert _complete(http, "mlp", "hello")[0] == 200
    again = http.post("/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": lora_adapters["mlp"]})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    (tmp_path / "broken").mkdir()
    bad = http.post("/v1/load_lora_adapter", json={"lora_name": "broken", "lora_path": str(tmp_path / "broken")})
    assert bad.status_code == 400 and "'broken'" in bad.json()["error"]["message"]
    big = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": lora_adapters["mlp"],
                                                   "base_model_name": "other-model"})
    assert big.status_code == 400 and "base model 'other-model'" in big.json()["error"]["message"]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"}).status_code == 200
    assert _complete(http, "mlp", "hello")[0] == 404
    gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"})
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "NotFoundError"
    assert _complete(http, "all", "hello")[0] == 200  # the server kept serving


def test_unloading_an_adapter_in_use_lets_its_requests_finish(http, lora_adapters):
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "busy", "lora_path": lora_adapters["mlp"]}
                     ).status_code == 200
    body = {"model": "busy", "prompt": "hello", "max_tokens": 60, "ignore_eos": True, "stream": True}
    chunks = 0
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks += 1
                if chunks == 2:  # running: unload it now
                    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "busy"}).status_code == 200
            if line:
                last = line
    assert last == "data: [DONE]" and chunks >= 60
    assert _complete(http, "busy", "hello")[0] == 404
