"""An in-process fake OpenAI-compatible server (FastAPI + uvicorn, loopback) for the `bench serve` tests.

The fake tokenizer maps id i <-> word "w{i}", so /tokenize and /detokenize round-trip exactly and prompt lengths are
checkable; free completions stream one word per token with small sleeps. A request with an output constraint
(structured_outputs or response_format json_schema) streams an answer that obeys it, three characters per "token",
and more slowly than a free one, so that the structured/free TPOT split has something to measure; answers to the
first JSON schema of the pool are cut short (finish_reason length), so they are invalid on purpose.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from contextlib import contextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.benchmarks import serve
from tokenmill.benchmarks import structured_dataset as sd

MODEL = "fake/tiny-model"
FREE_TOKEN_S = 0.002
STRUCTURED_TOKEN_S = 0.01

PATTERN_SAMPLES = {"^[A-Z]{3}-[0-9]{4}$": "ABC-1234", "^2026-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])$": "2026-05-17",
                   "^TCK-[0-9]{5}$": "TCK-00042"}
REGEX_SAMPLES = {
    r"[A-Z]{3}-[0-9]{4}": "XYZ-0001", r"[0-9]{3}-[0-9]{3}-[0-9]{4}": "555-123-4567",
    r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])": "2024-02-29",
    r"[a-z]{3,10}@[a-z]{3,8}\.(com|org|net)": "ada@example.org", r"#[0-9a-f]{6}": "#00ff7f",
    r"(GET|POST|PUT|DELETE) /[a-z]{2,8}(/[a-z0-9]{1,6}){0,3}": "GET /users/42/posts",
    r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])": "192.168.0.255",
    r"[A-Z][a-z]{2,9} [A-Z][a-z]{2,11}": "Ada Lovelace",
}


def example(schema: dict[str, Any]) -> Any:
    """A value that fits `schema` (the keywords structured_dataset's schemas use)."""
    if "enum" in schema:
        return schema["enum"][-1]
    t = schema["type"]
    if t == "integer":
        return (schema["minimum"] + schema["maximum"]) // 2
    if t == "boolean":
        return True
    if t == "string":
        return PATTERN_SAMPLES[schema["pattern"]] if "pattern" in schema else "x" * max(schema.get("minLength", 0), 1)
    if t == "array":
        return [example(schema["items"])] * max(schema.get("minItems", 0), 1)
    if t == "object":
        return {k: example(v) for k, v in schema["properties"].items()}
    raise ValueError(t)


def constraint_of(body: dict) -> tuple[str, Any] | None:
    so = body.get("structured_outputs")
    if so:
        kind = next(k for k in sd.KINDS if k in so)
        return kind, so[kind]
    rf = body.get("response_format")
    if rf and rf.get("type") == "json_schema":
        return "json", rf["json_schema"]["schema"]
    return None


def answer_for(kind: str, spec: Any) -> tuple[str, str]:
    """(text, finish_reason) of the fake's answer to a constrained request."""
    if kind == "choice":
        return spec[0], "stop"
    if kind == "regex":
        return REGEX_SAMPLES[spec], "stop"
    text = json.dumps(example(spec), separators=(",", ":"))
    return (text[:len(text) // 2], "length") if spec == sd.JSON_SCHEMAS[0] else (text, "stop")


class FakeServer:
    """Records every payload; `fail` makes requests 500; tracks the peak number of requests in flight."""

    def __init__(self):
        self.fail = False
        self.in_flight = 0
        self.peak = 0
        self.payloads: list[dict] = []
        self.auth: set[str | None] = set()
        self.lock = threading.Lock()
        self.app = self._build_app()
        self.port = 0

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
            constraint = constraint_of(body)
            if constraint is None:
                pieces, finish, delay = [f" w{i}" for i in range(n)], "length", FREE_TOKEN_S
            else:
                text, finish = answer_for(*constraint)
                pieces, delay = [text[i:i + 3] for i in range(0, len(text), 3)], STRUCTURED_TOKEN_S
            return StreamingResponse(self._stream(pieces, finish, delay, len(prompt.split()), chat),
                                     media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(req: Request):
            return await handle(req, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(req: Request):
            return await handle(req, chat=True)

        return app

    async def _stream(self, pieces: list[str], finish: str, delay: float, prompt_tokens: int, chat: bool):
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
            for i, piece in enumerate(pieces):
                yield chunk(piece, finish if i == len(pieces) - 1 else None)
                await asyncio.sleep(delay)
            n = len(pieces)
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
            yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            with self.lock:
                self.in_flight -= 1


@contextmanager
def running_fake_server():
    """A FakeServer listening on a free loopback port (`.port`) for the duration of the block."""
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
    try:
        yield fake
    finally:
        srv.should_exit = True
        thread.join(timeout=5)


def run_bench(fake: FakeServer, *argv: str) -> dict:
    """`bench serve` against `fake`: 20 prompts of 16 tokens, 8 output tokens, unless argv says otherwise."""
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    args = parser.parse_args(["--port", str(fake.port), "--num-prompts", "20", "--random-input-len", "16",
                              "--random-output-len", "8", "--disable-tqdm", *argv])
    return serve.main(args)
