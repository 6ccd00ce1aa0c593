"""A fake EngineClient for protocol tests: it "generates" the prompt's tokens again, cyclically, one per step."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from tokenmill.core.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, LogprobsLists
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.protocol import EngineClient, EngineDeadError
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams


class FakeEngine(EngineClient):
    """Sequence j of a request emits prompt_ids[(k + j) % len] at step k; finishes with "length" at max_tokens, or
    "stop" when the token is in stop_token_ids. Logprobs: the chosen token -0.5 (rank 1) plus ids 1..N at -1-i."""

    def __init__(self, tokenizer: Any, max_model_len: int = 256, max_logprobs: int = 20,
                 names: list[str] | None = None, defaults: dict | None = None, step_delay: float = 0.0):
        self.config = SimpleNamespace(model_config=SimpleNamespace(
            max_model_len=max_model_len, served_model_name=names or ["fake-model", "fake-alias"],
            max_logprobs=max_logprobs, model="/models/fake", vocab_size=len(tokenizer)))
        self.tokenizer = tokenizer
        self.defaults = defaults or {}
        self.step_delay = step_delay
        self.dead = False
        self.calls: list[tuple[dict, SamplingParams, str, int]] = []
        self.running: set[str] = set()
        self.closed: list[str] = []
        self.aborted: list[str] = []

    def _text(self, tid: int) -> str:
        return self.tokenizer.decode([tid])

    def _logprobs(self, tid: int, n: int) -> dict[int, Logprob]:
        d = {tid: Logprob(-0.5, 1, self._text(tid))}
        for i in range(n):
            if i + 1 not in d:
                d[i + 1] = Logprob(-1.0 - i, i + 2, self._text(i + 1))
        return d

    async def generate(self, prompt, sampling_params, request_id, priority=0):
        if self.dead:
            raise EngineDeadError("fake engine is dead")
        ids = list(prompt["prompt_token_ids"])
        if any(t >= self.config.model_config.vocab_size for t in ids):
            raise ValueError("Token id out of vocabulary")
        if len(ids) > self.config.model_config.max_model_len:
            raise ValueError("prompt too long")
        p = sampling_params
        self.calls.append((prompt, p, request_id, priority))
        self.running.add(request_id)
        finished_ok = False
        try:
            n, max_tokens = p.n, p.max_tokens
            gen = [[] for _ in range(n)]
            done = [None] * n
            stop_reason: list[Any] = [None] * n
            prompt_lps = None
            if p.prompt_logprobs is not None:
                prompt_lps = [None] + [self._logprobs(t, p.prompt_logprobs) for t in ids[1:]]
            sent = [0] * n
            reported = [False] * n
            k = 0
            while not all(done):
                if self.step_delay:
                    await asyncio.sleep(self.step_delay)
                else:
                    await asyncio.sleep(0)
                if self.dead:
                    raise EngineDeadError("fake engine died")
                for j in range(n):
                    if done[j]:
                        continue
                    tid = ids[(k + j) % len(ids)]
                    gen[j].append(tid)
                    if tid in p.stop_token_ids:
                        done[j], stop_reason[j] = "stop", tid
                    elif len(gen[j]) >= max_tokens:
                        done[j] = "length"
                k += 1
                if p.output_kind == RequestOutputKind.DELTA:
                    outs = []
                    for j in range(n):
                        new = gen[j][sent[j]:]
                        if reported[j] or (not new and not done[j]):
                            continue
                        sent[j] = len(gen[j])
                        reported[j] = done[j] is not None
                        outs.append(self._out(j, new, p, done[j], stop_reason[j]))
                    yield RequestOutput(request_id, prompt.get("prompt"), ids, prompt_lps if k == 1 else None, outs,
                                        all(done), num_cached_tokens=0)
            if p.output_kind != RequestOutputKind.DELTA:
                outs = [self._out(j, gen[j], p, done[j], stop_reason[j]) for j in range(n)]
                yield RequestOutput(request_id, prompt.get("prompt"), ids, prompt_lps, outs, True,
                                    num_cached_tokens=0)
            finished_ok = True
        finally:
            self.running.discard(request_id)
            self.closed.append(request_id)
            if not finished_ok:
                self.aborted.append(request_id)

    def _out(self, j, tokens, p, done, stop_reason):
        lps = [self._logprobs(t, p.logprobs) for t in tokens] if p.logprobs is not None else None
        return CompletionOutput(index=j, text=self.tokenizer.decode(tokens), token_ids=list(tokens),
                                cumulative_logprob=None, logprobs=lps, finish_reason=done,
                                stop_reason=stop_reason)

    async def abort(self, request_id):
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.aborted.extend(ids)

    @property
    def errored(self) -> bool:
        return self.dead

    async def check_health(self) -> None:
        if self.dead:
            raise EngineDeadError("dead")

    def get_default_sampling_params(self) -> dict:
        return dict(self.defaults)

    def last_stats(self):
        return None

    async def reset_prefix_cache(self) -> bool:
        return True

    sleeping = False

    async def sleep(self, level: int = 1) -> None:
        self.sleeping = True

    async def wake_up(self, tags: list[str] | None = None) -> None:
        self.sleeping = False

    async def is_sleeping(self) -> bool:
        return self.sleeping

    async def start_profile(self) -> None:
        raise RuntimeError("The fake engine has no profiler.")

    async def stop_profile(self) -> None:
        raise RuntimeError("The fake engine has no profiler.")

    def shutdown(self) -> None:
        pass


class DetokEngine(FakeEngine):
    """Sequence j emits the token ids scripts[j % len(scripts)], `chunk` ids per step, through the real
    OutputProcessor (incremental detokenization, stop strings, logprobs shapes, n > 1 fan-in), as AsyncLLM does.
    A sequence ends with "stop" at the EOS id (`eos`), else "length" at its script's end or max_tokens. Logprob rows:
    the chosen token at -0.25 (rank 1), then ids chosen+1.. at -1, -2, ...; prompt logprobs -0.5 each."""

    def __init__(self, tokenizer: Any, scripts: list[list[int]], chunk: int = 1, eos: int = 2, **kw):
        super().__init__(tokenizer, **kw)
        self.scripts, self.chunk, self.eos = scripts, chunk, eos

    @staticmethod
    def _rows(ids: list[int], k: int, chosen_lp: float) -> LogprobsLists:
        return LogprobsLists([[t] + ([t] + [t + m for m in range(1, k)] if k else []) for t in ids],
                             [[chosen_lp] + ([chosen_lp] + [-float(m) for m in range(1, k)] if k else [])
                              for _ in ids], [1] * len(ids))

    async def generate(self, prompt, sampling_params, request_id, priority=0):
        p = sampling_params
        self.calls.append((prompt, p, request_id, priority))
        ids = list(prompt["prompt_token_ids"])
        op = OutputProcessor(self.tokenizer)
        n = p.n
        kids = [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]
        for i, kid in enumerate(kids):
            child = p.clone()
            child.n = 1
            op.add_request(EngineCoreRequest(kid, ids, child, 0.0), prompt.get("prompt"), request_id, i, n)
        pos, done, first = [0] * n, [False] * n, True
        while not all(done):
            await asyncio.sleep(0)
            ecos = []
            for j in range(n):
                if done[j]:
                    continue
                script = self.scripts[j % len(self.scripts)]
                new = script[pos[j]:pos[j] + self.chunk][:max(p.max_tokens - pos[j], 0)]
                pos[j] += len(new)
                finish = None
                if self.eos in new and not p.ignore_eos:
                    new, finish = new[:new.index(self.eos) + 1], FinishReason.STOP
                elif pos[j] >= min(len(script), p.max_tokens):
                    finish = FinishReason.LENGTH
                lps = self._rows(new, p.logprobs, -0.25) if p.logprobs is not None else None
                plps = self._rows(ids[1:], 0, -0.5) if first and p.prompt_logprobs is not None else None
                ecos.append(EngineCoreOutput(kids[j], new, new_logprobs=lps, new_prompt_logprobs=plps,
                                             finish_reason=finish,
                                             stop_reason=self.eos if finish == FinishReason.STOP else None))
                done[j] = finish is not None
            first = False
            res = op.process_outputs(ecos)
            for kid in res.reqs_to_abort:  # a stop string ended it
                done[kids.index(kid)] = True
            for out in res.request_outputs:
                yield out


def post_then_disconnect(app, path: str, body: dict) -> list[dict]:
    """POST `body` to `path` straight through the ASGI app, with a client that disconnects 0.3 s later; returns
    the ASGI messages the app sent. (TestClient cannot disconnect mid-request.)"""
    raw = json.dumps(body).encode()
    sent, messages = [], []

    async def receive():
        if not sent:
            sent.append(True)
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.sleep(0.3)
        return {"type": "http.disconnect"}

    async def send(message):
        messages.append(message)

    async def run():
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
                 "query_string": b"", "headers": [(b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
        await asyncio.wait_for(app(scope, receive, send), 10)
        await asyncio.sleep(0.2)  # let the aborts the disconnect caused run
    asyncio.run(run())
    return messages


@pytest.fixture
def fake_engine(smollm2_tokenizer):
    return FakeEngine(smollm2_tokenizer)


@pytest.fixture
def make_client(smollm2_tokenizer):
    """(engine kwargs, FrontendConfig kwargs) -> (TestClient, FakeEngine)."""
    from fastapi.testclient import TestClient

    from tokenmill.config.frontend import FrontendConfig
    from tokenmill.entrypoints.openai.app import build_app

    clients = []

    def make(engine: FakeEngine | None = None, **frontend_kwargs):
        engine = engine or FakeEngine(smollm2_tokenizer)
        app = build_app(engine, FrontendConfig(**frontend_kwargs))
        client = TestClient(app, raise_server_exceptions=False)
        clients.append(client)
        return client, engine

    yield make
    for c in clients:
        c.close()


@pytest.fixture
def detok_client(make_client, smollm2_tokenizer):
    """(texts, chunk=1, **FrontendConfig kwargs) -> an `openai.OpenAI` client on a server whose engine writes each
    text (one per choice, cycled; EOS after it) through the real OutputProcessor, `chunk` tokens per step."""
    import openai

    def make(texts: list[str], chunk: int = 1, tokenizer: Any = None, **frontend_kwargs):
        tok = tokenizer or smollm2_tokenizer
        scripts = [tok.encode(t, add_special_tokens=False) + [2] for t in texts]
        c, _ = make_client(DetokEngine(tok, scripts, chunk=chunk), **frontend_kwargs)
        return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=c, max_retries=0)
    return make


@pytest.fixture
def client(make_client):
    c, _ = make_client()
    return c
