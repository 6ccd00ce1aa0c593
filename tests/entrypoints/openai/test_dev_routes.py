"""The development routes (VLLM_SERVER_DEV_MODE=1) on the real server: sleep, wake_up, is_sleeping and
reset_prefix_cache as RL frameworks call them between rollouts, with generation refused (503) while asleep and the
same greedy tokens after waking; without the variable the routes do not exist."""
from __future__ import annotations

import pytest

from tests.entrypoints.openai.server_utils import RemoteServer

BODY = {"model": "tiny", "prompt": "one two three four five six", "max_tokens": 8, "temperature": 0,
        "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    model = tiny_model_factory("llama")
    log = str(tmp_path_factory.mktemp("dev-server") / "server.log")
    srv = RemoteServer([model, "--served-model-name", "tiny", "--max-model-len", "256", "--enable-sleep-mode"], log,
                       env={"VLLM_SERVER_DEV_MODE": "1"})
    try:
        srv.wait_healthy(120)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with server.client() as c:
        yield c


def _complete(http) -> list:
    r = http.post("/v1/completions", json={**BODY, "logprobs": 1})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def _sleep_gauge(http, state: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("vllm:engine_sleep_state{") and f'sleep_state="{state}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no vllm:engine_sleep_state series for {state}")


def _refused(http) -> None:
    for path, body in (("/v1/completions", BODY),
                       ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 4, "stream": True})):
        r = http.post(path, json=body)
        assert r.status_code == 503, r.text
        assert "sleeping" in r.json()["error"]["message"] and "/wake_up" in r.json()["error"]["message"]


def test_level_1_refuses_generation_and_wakes_to_the_same_tokens(http):
    before = _complete(http)
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert http.post("/sleep", params={"level": 1}).status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    assert _sleep_gauge(http, "weights_offloaded") == 1 and _sleep_gauge(http, "awake") == 0
    _refused(http)
    assert http.post("/wake_up").status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert _sleep_gauge(http, "awake") == 1 and _sleep_gauge(http, "weights_offloaded") == 0
    assert _complete(http) == before


def test_bad_levels_and_tags_are_400s_naming_them(http):
    r = http.post("/sleep", params={"level": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "level"
    r = http.post("/wake_up", params={"tags": "weight"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tags" and "'weight'" in r.text
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert http.post("/v1/completions", json=BODY).status_code == 200


def test_reset_prefix_cache(http):
    assert http.post("/reset_prefix_cache").status_code == 200
    assert http.post("/v1/completions", json=BODY).status_code == 200


def test_level_2_wakes_part_by_part(http):
    """Last on this server: level 2 discards the weights, which come back uninitialised (an RL loop syncs them
    before waking the KV cache; LLM.sleep's tests cover the reload)."""
    assert http.post("/sleep", params={"level": 2}).status_code == 200
    assert _sleep_gauge(http, "discard_all") == 1
    _refused(http)
    assert http.post("/wake_up", params={"tags": "weights"}).status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}  # the KV cache still sleeps
    _refused(http)
    assert http.post("/wake_up", params={"tags": "kv_cache"}).status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert _sleep_gauge(http, "awake") == 1


def test_routes_absent_without_dev_mode(tiny_model_factory, tmp_path):
    srv = RemoteServer([tiny_model_factory("llama"), "--max-model-len", "128"], str(tmp_path / "server.log"),
                       env={"VLLM_SERVER_DEV_MODE": "0"})
    try:
        srv.wait_healthy(120)
        with srv.client() as c:
            assert c.post("/sleep").status_code == 404
            assert c.get("/is_sleeping").status_code == 404
    finally:
        srv.stop()


def test_an_engine_refusal_is_a_400_with_its_message(make_client, tmp_path):
    """The engine's own error text comes back, not its repr (here the fake engine has no profiler)."""
    from tokenmill import envs
    with envs.override(VLLM_SERVER_DEV_MODE=True, VLLM_TORCH_PROFILER_DIR=str(tmp_path)):
        client, engine = make_client()
    r = client.post("/start_profile")
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "start_profile: The fake engine has no profiler."
    assert client.post("/sleep").status_code == 200 and engine.sleeping
    assert client.post("/v1/completions", json={"model": "fake-model", "prompt": "a"}).status_code == 503
