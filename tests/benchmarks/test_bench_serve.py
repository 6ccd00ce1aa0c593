"""`tokenmill bench serve` against an in-process fake OpenAI-compatible server (FastAPI + uvicorn, loopback).

The fake tokenizer maps id i <-> word "w{i}", so /tokenize and /detokenize round-trip exactly and prompt
lengths are checkable; completions stream one word per token with small sleeps.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.benchmarks import serve

MODEL = "fake/tiny-model"


class FakeServer:
    def __init__(self):
        self.fail = False
        self.in_flight = 0
        self.peak = 0
        self.payloads: list[dict] = []
        self.auth: set[str | None] = set()
        self.lock = threading.Lock()
        self.app = self._build_app()

    def reset(self):
        with self.lock:
            self.fail, self.in_flight, self.peak = False, 0, 0
            self.payloads.clear()
            self.auth.clear()

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

        @app.post("/tokenize")
        async def tokenize(req: Request):
            body = await req.json()
            ids = [int(w[1:]) if w[1:].isdigit() else 0 for w in body["prompt"].split()]
            return {"count": len(ids), "tokens": ids, "max_model_len": 4096}

        @app.post("/detokenize")
        async def detokenize(req: Request):
            body = await req.json()
            return {"prompt": " ".join(f"w{i}" for i in body["tokens"])}

        async def handle(req: Request, chat: bool):
            body = await req.json()
            with self.lock:
                self.payloads.append(body)
                self.auth.add(req.headers.get("authorization"))
                if self.fail:
                    return JSONResponse({"error": {"message": "boom"}}, status_code=500)
                self.in_flight += 1
                self.peak = max(self.peak, self.in_flight)
            n = body["max_completion_tokens" if chat else "max_tokens"]
            prompt = body["messages"][0]["content"] if chat else body["prompt"]
            return StreamingResponse(self._stream(n, len(prompt.split()), chat), media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(req: Request):
            return await handle(req, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(req: Request):
            return await handle(req, chat=True)

        return app

    async def _stream(self, n: int, prompt_tokens: int, chat: bool):
        def chunk(text, finish=None):
            choice = {"index": 0, "finish_reason": finish}
            if chat:
                choice["delta"] = {"content": text}
            else:
                choice["text"] = text
            return f"data: {json.dumps({'id': 'x', 'choices': [choice]})}\n\n"
        try:
            if chat:  # chat streams start with a content-less role delta, which must not count as TTFT
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'role': 'assistant'}}]})}\n\n"
            await asyncio.sleep(0.005)  # "prefill"
            for i in range(n):
                yield chunk(f" w{i}", "length" if i == n - 1 else None)
                await asyncio.sleep(0.002)
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
            yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            with self.lock:
                self.in_flight -= 1


@pytest.fixture(scope="module")
def server():
    fake = FakeServer()
    config = uvicorn.Config(fake.app, host="127.0.0.1", port=0, log_level="error", lifespan="off")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not srv.started:
        assert time.time() < deadline, "fake server did not start"
        time.sleep(0.01)
    fake.port = srv.servers[0].sockets[0].getsockname()[1]
    yield fake
    srv.should_exit = True
    thread.join(timeout=5)


@pytest.fixture
def fake(server):
    server.reset()
    return server


def run_bench(fake, *argv: str) -> dict:
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    args = parser.parse_args(["--port", str(fake.port), "--num-prompts", "20", "--random-input-len", "16",
                              "--random-output-len", "8", "--disable-tqdm", *argv])
    return serve.main(args)


EXPECTED_LINES = ["============ Serving Benchmark Result ============", "Successful requests:",
                  "Benchmark duration (s):", "Total input tokens:", "Total generated tokens:",
                  "Request throughput (req/s):", "Output token throughput (tok/s):",
                  "Peak output token throughput (tok/s):", "Peak concurrent requests:",
                  "Total token throughput (tok/s):", "---------------Time to First Token----------------",
                  "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):",
                  "-----Time per Output Token (excl. 1st token)------", "Mean TPOT (ms):",
                  "---------------Inter-token Latency----------------", "Mean ITL (ms):", "P99 ITL (ms):",
                  "=================================================="]


def test_max_concurrency_metrics_and_saved_result(fake, tmp_path, capsys):
    res = run_bench(fake, "--max-concurrency", "4", "--save-result", "--result-dir", str(tmp_path),
                    "--metadata", "gpu=h200", "run=1", "--api-key", "sekret",
                    "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99")
    out = capsys.readouterr().out
    assert res["completed"] == 20 and res["failed"] == 0
    assert res["total_input_tokens"] == 20 * 16 and res["total_output_tokens"] == 20 * 8
    assert all(0 < t < e for t, e in zip(res["ttfts"], res["e2els"]))
    assert res["mean_ttft_ms"] < res["mean_e2el_ms"] and res["mean_tpot_ms"] > 0 and res["mean_itl_ms"] > 0
    assert all(len(itl) == 7 for itl in res["itls"])
    assert fake.peak == 4 and res["max_concurrent_requests"] <= 4
    assert fake.auth == {"Bearer sekret"}
    # Model discovered through /v1/models; random dataset sends ignore_eos, greedy, streaming with usage.
    p = fake.payloads[0]
    assert p["model"] == MODEL and p["ignore_eos"] is True and p["temperature"] == 0.0 and p["stream"] is True
    assert p["stream_options"] == {"include_usage": True} and p["max_tokens"] == 8
    for line in EXPECTED_LINES + ["Maximum request concurrency:", "End-to-end Latency", "P50 E2EL (ms):"]:
        assert line in out, line
    assert "Request rate configured (RPS):" not in out
    assert "{:<40} {:<10}".format("Successful requests:", 20) in out
    assert "{:<40} {:<10}".format("Maximum request concurrency:", 4) in out
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].name.startswith("openai-infqps-concurrency4-tiny-model-")
    saved = json.loads(files[0].read_text())
    for key in ("date", "model_id", "num_prompts", "request_rate", "max_concurrency", "completed", "failed",
                "duration", "request_throughput", "output_throughput", "total_token_throughput",
                "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "p50_e2el_ms", "mean_tpot_ms", "p99_itl_ms",
                "input_lens", "output_lens", "ttfts", "itls", "errors", "max_output_tokens_per_s"):
        assert key in saved, key
    assert saved["request_rate"] == "inf" and saved["max_concurrency"] == 4 and saved["num_prompts"] == 20
    assert saved["model_id"] == MODEL and saved["gpu"] == "h200" and saved["run"] == "1"
    assert saved["completed"] == 20 and len(saved["ttfts"]) == 20


def test_request_rate_poisson(fake, capsys, tmp_path):
    res = run_bench(fake, "--request-rate", "50", "--save-result", "--result-dir", str(tmp_path),
                    "--result-filename", "r.json")
    out = capsys.readouterr().out
    assert res["completed"] == 20 and res["failed"] == 0
    expected = serve.arrival_offsets(20, 50.0, 1.0, 0)[-1]
    assert res["duration"] >= expected  # the last request cannot start before its arrival time
    assert "{:<40} {:<10.2f}".format("Request rate configured (RPS):", 50.0) in out
    assert "Maximum request concurrency:" not in out.split("=====")[-2]  # not in the block when unset
    for line in EXPECTED_LINES:
        assert line in out, line
    assert json.loads((tmp_path / "r.json").read_text())["request_rate"] == 50.0


def test_failing_server_counts_failures(fake, capsys):
    fake.fail = True
    res = run_bench(fake, "--max-concurrency", "4")
    cap = capsys.readouterr()
    assert res["completed"] == 0 and res["failed"] == 20 and res["total_output_tokens"] == 0
    assert res["mean_ttft_ms"] == 0.0
    assert "{:<40} {:<10}".format("Failed requests:", 20) in cap.out
    assert "HTTP 500" in cap.err and "boom" in cap.err
    assert all(e.startswith("HTTP 500") for e in res["errors"])


def test_chat_backend(fake):
    res = run_bench(fake, "--backend", "openai-chat", "--max-concurrency", "8", "--model", MODEL)
    assert res["completed"] == 20 and res["total_output_tokens"] == 160
    p = fake.payloads[0]
    assert p["messages"][0]["role"] == "user" and p["max_completion_tokens"] == 8 and "prompt" not in p
    # The role-only first delta is not a token: each request has 8 content chunks -> 7 gaps.
    assert all(len(itl) == 7 for itl in res["itls"])


def test_local_tokenizer(fake, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 300)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    res = run_bench(fake, "--tokenizer", str(tmp_path / "tok"), "--max-concurrency", "4")
    assert res["completed"] == 20 and res["total_input_tokens"] == 20 * 16
    assert res["tokenizer_id"] == str(tmp_path / "tok")
    assert "[UNK]" not in fake.payloads[0]["prompt"]  # special tokens are never sampled


class WordTokenizer:
    pool = np.arange(1, 500)

    def encode(self, text):
        return [int(w[1:]) for w in text.split()]

    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)


def test_random_lengths_prefix_and_seed():
    reqs = serve.sample_random_requests(WordTokenizer(), 200, 100, 50, 0.5, 10, seed=3)
    assert all(10 + 50 <= r.prompt_len <= 10 + 150 for r in reqs)
    assert all(25 <= r.output_len <= 75 for r in reqs)
    assert all(len(r.prompt.split()) == r.prompt_len for r in reqs)
    assert len({" ".join(r.prompt.split()[:10]) for r in reqs}) == 1  # shared prefix
    assert len({r.prompt_len for r in reqs}) > 10
    again = serve.sample_random_requests(WordTokenizer(), 200, 100, 50, 0.5, 10, seed=3)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]


def test_arrival_offsets():
    assert not serve.arrival_offsets(5, float("inf"), 1.0, 0).any()
    for burstiness in (1.0, 0.5, 4.0):
        offs = serve.arrival_offsets(20001, 100.0, burstiness, 0)
        assert offs[0] == 0 and np.all(np.diff(offs) >= 0)
        assert abs(offs[-1] / 20000 - 0.01) < 0.0005  # mean gap = 1 / rate whatever the burstiness
    cv = lambda b: (lambda g: g.std() / g.mean())(np.diff(serve.arrival_offsets(20001, 100.0, b, 0)))
    assert cv(0.5) > cv(1.0) > cv(4.0)


def test_rejects_bad_arguments(fake):
    with pytest.raises(ValueError, match="only 'random'"):
        run_bench(fake, "--dataset-name", "sharegpt")
    with pytest.raises(ValueError, match="range-ratio"):
        run_bench(fake, "--random-range-ratio", "1.5")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        run_bench(fake, "--metadata", "novalue")
