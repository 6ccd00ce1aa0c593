"""Data parallelism over two real engine-core processes (CPU, tiny model): both replicas serve, greedy tokens equal
one engine's, metrics per replica, aborts reach the owning engine, offline LLM, a dead replica stops everything."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tokenmill.engine.protocol import EngineDeadError
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

MAX_LEN = 512
PROMPTS = [f"Replica test prompt {i} goes" for i in range(8)]
GREEDY = dict(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def reference(model_dir):
    """Greedy tokens of one in-process engine (data_parallel_size=1)."""
    from tokenmill import LLM
    llm = LLM(model_dir, max_model_len=MAX_LEN)
    outs = llm.generate(PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def dp2(model_dir):
    from tokenmill.engine.async_llm import AsyncLLM
    loop = asyncio.new_event_loop()

    async def make():
        return AsyncLLM.from_engine_args(model=model_dir, max_model_len=MAX_LEN, data_parallel_size=2,
                                         log_stats=False)
    eng = loop.run_until_complete(make())
    yield eng, loop
    eng.shutdown()
    loop.run_until_complete(asyncio.sleep(0.01))  # let the cancelled output task finish
    loop.close()


def metric(name: str, engine: int, model: str, **labels: str) -> float:
    from prometheus_client import REGISTRY
    return REGISTRY.get_sample_value(name, {"model_name": model, "engine": str(engine), **labels}) or 0.0


async def final_tokens(eng, prompt: str, rid: str) -> list[int]:
    sp = SamplingParams(**GREEDY, output_kind=RequestOutputKind.FINAL_ONLY)
    async for out in eng.generate(prompt, sp, rid):
        last = out
    return last.outputs[0].token_ids


def test_both_replicas_serve_concurrent_requests_with_dp1_greedy_tokens(dp2, reference):
    eng, loop = dp2
    model = eng.config.model_config.served_model_name[0]
    per_request = ("vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count",
                   "vllm:request_decode_time_seconds_count", "vllm:request_params_n_count")
    before = [metric("vllm:generation_tokens_total", e, model) for e in (0, 1)]
    done_before = [metric("vllm:request_success_total", e, model, finished_reason="length") for e in (0, 1)]
    hist_before = {(h, e): metric(h, e, model) for h in per_request for e in (0, 1)}
    itl_before = sum(metric("vllm:inter_token_latency_seconds_count", e, model) for e in (0, 1))

    async def run_all():
        return await asyncio.gather(*[final_tokens(eng, p, f"c{i}") for i, p in enumerate(PROMPTS)])
    got = loop.run_until_complete(run_all())
    assert got == reference
    gen = [metric("vllm:generation_tokens_total", e, model) - before[e] for e in (0, 1)]
    done = [metric("vllm:request_success_total", e, model, finished_reason="length") - done_before[e] for e in (0, 1)]
    assert gen[0] > 0 and gen[1] > 0, gen  # each replica's metrics show its share
    assert sum(gen) == len(PROMPTS) * GREEDY["max_tokens"] and sum(done) == len(PROMPTS)
    for h in per_request:  # the per-request histograms follow each replica's own finished requests
        assert [metric(h, e, model) - hist_before[h, e] for e in (0, 1)] == done, h
    itl = sum(metric("vllm:inter_token_latency_seconds_count", e, model) for e in (0, 1)) - itl_before
    assert itl == len(PROMPTS) * (GREEDY["max_tokens"] - 1)
    assert eng.stat_logger.engine_stats(0) is not None and eng.stat_logger.engine_stats(1) is not None
    assert loop.run_until_complete(eng.reset_prefix_cache()) is True


def test_abort_reaches_the_engine_that_owns_the_request(dp2):
    eng, loop = dp2

    async def main():
        # A goes to engine 0, B (longer) to engine 1. Aborting B must stop engine 1 while A still runs on engine 0;
        # had the abort gone elsewhere, engine 1 would stay busy until after A finished.
        a = eng.generate("request A", SamplingParams(max_tokens=300, ignore_eos=True,
                                                     output_kind=RequestOutputKind.DELTA), "A")
        await a.__anext__()
        b = eng.generate("request B", SamplingParams(max_tokens=480, ignore_eos=True,
                                                     output_kind=RequestOutputKind.DELTA), "B")
        await b.__anext__()
        assert (eng.client.owner("A"), eng.client.owner("B")) == (0, 1)
        await eng.abort("B")
        async for out in b:
            last = out
        assert last.finished and last.outputs[0].finish_reason == "abort"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            s1 = eng.stat_logger.engine_stats(1)
            if s1.num_running_reqs == 0 and s1.kv_cache_usage == 0:
                break
            await asyncio.sleep(0.01)
        assert s1.num_running_reqs == 0 and s1.kv_cache_usage == 0
        assert eng.client.owner("A") == 0  # A is still running on engine 0
        # Dropping a stream aborts its request too (the synchronous path), on its own engine.
        await a.aclose()
        while time.monotonic() < deadline:
            s0 = eng.stat_logger.engine_stats(0)
            if s0.num_running_reqs == 0 and s0.kv_cache_usage == 0:
                break
            await asyncio.sleep(0.01)
        assert s0.num_running_reqs == 0 and s0.kv_cache_usage == 0
        assert eng.client.num_unfinished == 0

    loop.run_until_complete(main())


def test_offline_llm_with_two_replicas_matches_one(model_dir, reference):
    from tokenmill import LLM
    llm = LLM(model_dir, max_model_len=MAX_LEN, data_parallel_size=2)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference
        # n > 1 needs sampling (vLLM refuses greedy n > 1): top_k=1 samples the greedy token
        top1 = SamplingParams(**{**GREEDY, "temperature": 1.0}, top_k=1, n=2)
        two = llm.generate(PROMPTS[0], top1, use_tqdm=False)[0]
        assert [c.token_ids for c in two.outputs] == [reference[0]] * 2
        assert llm.reset_prefix_cache() is True
        assert llm.llm_engine.last_stats.num_running_reqs == 0
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_a_dead_replica_stops_the_engine_with_a_clear_error(dp2):
    eng, loop = dp2

    async def main():
        sp = SamplingParams(max_tokens=400, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        agen = eng.generate("doomed", sp, "d1")
        await agen.__anext__()
        os.kill(eng.engine_core_pids[1], signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="engine core 1 .*exited unexpectedly|engine core"):
            async for _ in agen:
                pass
        assert eng.errored
        with pytest.raises(EngineDeadError, match="engine core"):
            await eng.check_health()
        with pytest.raises(EngineDeadError):
            await final_tokens(eng, "after death", "late")

    loop.run_until_complete(main())
