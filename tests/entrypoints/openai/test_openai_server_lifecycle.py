"""Process-level behaviour: `tokenmill serve` on the embedded model (over TLS), SIGTERM with --shutdown-timeout 0,
a dead engine making the server exit non-zero, a Unix socket with an API key."""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import httpx
import openai
import pytest

from tests.entrypoints.openai.server_utils import RemoteServer, engine_core_pid


def test_tokenmill_serve_embedded_model_tls_and_sigterm(tmp_path, tls_pair):
    key, cert = tls_pair
    tokenmill_cmd = [sys.executable, "-c", "from tokenmill.entrypoints.cli.main import main; main()", "serve"]
    srv = RemoteServer(["--ssl-keyfile", key, "--ssl-certfile", cert, "--default-chat-template-kwargs",
                        '{"enable_thinking": false}'], str(tmp_path / "serve.log"), cmd=tokenmill_cmd)
    try:
        url = f"https://127.0.0.1:{srv.port}"
        t0 = time.monotonic()
        with httpx.Client(base_url=url, verify=False, timeout=5) as c:
            while True:
                assert srv.proc.poll() is None, srv.log()
                try:
                    if c.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() - t0 < 60, f"not healthy within 60 s:\n{srv.log()}"
                time.sleep(0.2)
        # One start-up line from the server's own start; the engine core was the process `serve` started ahead
        # of its config (engine/standby.py).
        ready = [line for line in srv.log().splitlines() if "Server ready in " in line]
        assert len(ready) == 1, srv.log()
        for phase in ("interpreter and imports", "engine config", "tokenizer and engine core", "API start",
                      "waited for its config", "workers and weights", "KV cache and CUDA graphs"):
            assert phase in ready[0], ready[0]
        oai = openai.OpenAI(base_url=url + "/v1", api_key="x", http_client=httpx.Client(verify=False),
                            max_retries=0)
        model = oai.models.list().data[0].id
        assert model == "SmolLM2-135M-Instruct"
        chat = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is 2+2?"}],
                                           max_tokens=8, temperature=0)
        assert chat.choices[0].message.content

        # SIGTERM with --shutdown-timeout 0 (the default), sent to the whole process group as systemd or
        # `kill -- -PGID` do: the running request is aborted, the engine core waits for the server's shutdown
        # instead of dying under it (no "engine core is dead" error), and the exit code is 0.
        result: dict = {}

        def run():
            with httpx.Client(base_url=url, verify=False, timeout=60) as c:
                body = {"prompt": "Count forever:", "max_tokens": 2000, "ignore_eos": True, "stream": True}
                with c.stream("POST", "/v1/completions", json=body) as r:
                    events = [json.loads(line[6:]) for line in r.iter_lines()
                              if line.startswith("data: ") and line != "data: [DONE]"]
            result["finish"] = [e["choices"][0]["finish_reason"] for e in events if e.get("choices")][-1]

        t = threading.Thread(target=run)
        t.start()
        time.sleep(1.0)
        os.killpg(srv.proc.pid, signal.SIGTERM)
        t.join(30)
        assert srv.proc.wait(30) == 0, srv.log()
        assert result.get("finish") == "abort"
        assert "is dead" not in srv.log() and "SIGTERM and no shutdown" not in srv.log(), srv.log()
    finally:
        srv.stop()


def test_dead_engine_exits_nonzero_uds_api_key(tmp_path, tiny_model_factory):
    uds = str(tmp_path / "tm.sock")
    srv = RemoteServer([tiny_model_factory("llama"), "--api-key", "s3cret", "--enable-request-id-headers",
                        "--override-generation-config", '{"max_new_tokens": 3, "temperature": 0}'],
                       str(tmp_path / "serve.log"), uds=uds, api_key="s3cret")
    try:
        srv.wait_healthy(120)
        with httpx.Client(base_url="http://localhost", transport=httpx.HTTPTransport(uds=uds), timeout=30) as c:
            assert c.get("/v1/models").status_code == 401
            assert c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
            r = c.get("/v1/models", headers={"Authorization": "Bearer s3cret", "X-Request-Id": "rid-1"})
            assert r.status_code == 200 and r.headers["x-request-id"] == "rid-1"
            assert c.get("/health").status_code == 200  # /health is not guarded
            # generation-config defaults: max_new_tokens caps max_tokens, temperature applies when unset
            body = {"prompt": "defaults", "max_tokens": 10, "ignore_eos": True}
            auth = {"Authorization": "Bearer s3cret"}
            r1 = c.post("/v1/completions", json=body, headers=auth).json()
            r2 = c.post("/v1/completions", json=body, headers=auth).json()
            assert r1["usage"]["completion_tokens"] == 3 and r1["choices"][0]["text"] == r2["choices"][0]["text"]
            os.kill(engine_core_pid(srv.proc.pid), signal.SIGKILL)
            t0 = time.monotonic()
            saw_503 = False
            while srv.proc.poll() is None and time.monotonic() - t0 < 15:
                try:
                    saw_503 |= c.get("/health").status_code == 503
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
        code = srv.proc.wait(15)
        assert code != 0, srv.log()
        assert time.monotonic() - t0 < 15
        assert "engine" in srv.log().lower()
    finally:
        srv.stop()
