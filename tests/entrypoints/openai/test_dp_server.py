"""Multi-node data parallelism over ZMQ/TCP on localhost: a head node (`-dp 2 -dpl 1 --api-server-count 2`) and a
`--headless` node running rank 1 serve together; a node claiming a taken rank is turned away; SIGTERM on the head
stops the headless node's engine too."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.entrypoints.openai.server_utils import RemoteServer, free_port

pytestmark = pytest.mark.slow
SERVER = [sys.executable, "-m", "tokenmill.entrypoints.openai.api_server"]


def metrics_by_engine(http, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + "{"):
            labels = line[line.index("{") + 1:line.index("}")]
            engine = [kv.split("=")[1].strip('"') for kv in labels.split(",") if kv.startswith("engine=")][0]
            out[engine] = out.get(engine, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_head_and_headless_node_serve_together(tmp_path, tiny_model_factory):
    model = tiny_model_factory("llama")
    rpc = free_port()
    common = [model, "--max-model-len", "256", "-dp", "2", "-dpl", "1", "-dpa", "127.0.0.1", "-dpp", str(rpc)]
    env = dict(os.environ, TOKENMILL_CPU_KVCACHE_SPACE_GIB="1", TOKENMILL_CPU_NUM_THREADS="1")
    node_log = open(tmp_path / "node.log", "wb")
    # The headless node starts first: it waits for the head.
    node = subprocess.Popen(SERVER + common + ["--headless", "-dpr", "1"], stdout=node_log,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    head = RemoteServer(common + ["--api-server-count", "2"], str(tmp_path / "head.log"),
                        env={"TOKENMILL_CPU_NUM_THREADS": "1"})
    intruder = None
    try:
        head.wait_healthy(240)
        # A second node claiming rank 1 is turned away (checked at the end; it runs meanwhile).
        intruder = subprocess.Popen(SERVER + common + ["--headless", "-dpr", "1"], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
        with head.client() as http:
            body = {"prompt": "Same prompt on both replicas", "max_tokens": 12, "temperature": 0,
                    "ignore_eos": True}
            with ThreadPoolExecutor(8) as pool:
                texts = list(pool.map(lambda _: http.post("/v1/completions", json=body).json(), range(8)))
            assert all(t["usage"]["completion_tokens"] == 12 for t in texts), texts[0]
            assert len({t["choices"][0]["text"] for t in texts}) == 1  # both replicas give the same greedy text
            # /metrics of either API server process shows both replicas' work (prometheus multiprocess mode).
            gen = metrics_by_engine(http, "vllm:generation_tokens_total")
            assert set(gen) == {"0", "1"} and gen["0"] > 0 and gen["1"] > 0, gen
            assert sum(gen.values()) == 8 * 12
            assert set(metrics_by_engine(http, "vllm:num_requests_running")) == {"0", "1"}
            # Per-request metrics: each request counted once, by the API server process that served it.
            for name, want in (("vllm:e2e_request_latency_seconds_count", 8), ("vllm:request_params_n_count", 8),
                               ("vllm:inter_token_latency_seconds_count", 8 * 11)):
                got = metrics_by_engine(http, name)
                assert set(got) == {"0", "1"} and sum(got.values()) == want, (name, got)
            # Per-step metrics come from the engines' stats, which reach both API servers: one records them, and it
            # may do so after the responses went out (seen once under a loaded full suite: all still 0), so poll.
            # The steps scheduled every uncached prompt token, then one per generated token but the last.
            deadline = time.monotonic() + 20
            while True:
                steps = metrics_by_engine(http, "vllm:iteration_tokens_total_sum")
                computed = metrics_by_engine(http, "vllm:request_prefill_kv_computed_tokens_sum")
                if sum(steps.values()) == sum(computed.values()) + 8 * 11 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert sum(steps.values()) == sum(computed.values()) + 8 * 11, (steps, computed)
        out, _ = intruder.communicate(timeout=120)
        assert intruder.returncode == 1 and b"turned this node away: ranks [1] already run elsewhere" in out
        assert head.stop(signal.SIGTERM) == 0, head.log()
        assert node.wait(30) == 0  # the head's shutdown stops the remote engine, and the node exits cleanly
    finally:
        head.stop(signal.SIGKILL)
        for proc in (node, intruder):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        node_log.close()
    log = (tmp_path / "node.log").read_text()
    assert "Headless node: data-parallel ranks [1]" in log and "The head node stopped" in log

