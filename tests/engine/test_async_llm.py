"""AsyncLLM over a real engine-core process: streams, concurrency, cancellation, engine death."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tokenmill.engine.protocol import EngineDeadError
from tokenmill.sampling_params import RequestOutputKind, SamplingParams


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


async def collect(eng, prompt, rid, kind, max_tokens=16, **kw):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=kind, **kw)
    text, ids, last = "", [], None
    async for out in eng.generate(prompt, sp, rid):
        c = out.outputs[0]
        if kind == RequestOutputKind.DELTA:
            text += c.text
            ids += c.token_ids
        last = out
    if kind != RequestOutputKind.DELTA:
        text, ids = last.outputs[0].text, last.outputs[0].token_ids
    return text, ids, last


def test_stream_equals_final_and_concurrency(model_dir):
    from tokenmill.engine.async_llm import AsyncLLM

    async def main():
        eng = AsyncLLM.from_engine_args(model=model_dir, max_model_len=256, log_stats=False)
        try:
            prompts = [f"Request number {i} says" for i in range(12)]
            seq = [await collect(eng, p, f"s{i}", RequestOutputKind.FINAL_ONLY) for i, p in enumerate(prompts)]
            par = await asyncio.gather(*[collect(eng, p, f"p{i}", RequestOutputKind.DELTA)
                                         for i, p in enumerate(prompts)])
            assert [s[:2] for s in seq] == [p[:2] for p in par]
            assert all(p[2].finished for p in par)
            # Cancelling a consumer aborts the request and frees its blocks.
            sp = SamplingParams(max_tokens=500, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
            agen = eng.generate("cancel me", sp, "c1")
            async for _ in agen:
                break
            await agen.aclose()
            task = asyncio.create_task(collect(eng, "cancel me too", "c2", RequestOutputKind.FINAL_ONLY,
                                                max_tokens=240))
            while not (eng.last_stats() and eng.last_stats().num_running_reqs):  # cancel while it runs
                await asyncio.sleep(0.002)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                st = eng.last_stats()
                if st is not None and st.kv_cache_usage == 0 and st.num_running_reqs == 0:
                    break
                await asyncio.sleep(0.1)
            assert eng.last_stats().kv_cache_usage == 0
            with pytest.raises(ValueError, match="maximum model length"):
                await collect(eng, {"prompt_token_ids": [1] * 300}, "too-long", RequestOutputKind.FINAL_ONLY)
            assert await eng.reset_prefix_cache() in (True, False)
            # A consumer that falls behind gets the steps it missed merged into one output, nothing lost.
            sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1,
                                output_kind=RequestOutputKind.DELTA)
            n_outputs, text, ids, n_lps = 0, "", [], 0
            async for o in eng.generate("slow reader", sp, "slow"):
                n_outputs += 1
                text, ids = text + o.outputs[0].text, ids + o.outputs[0].token_ids
                n_lps += len(o.outputs[0].logprobs)
                await asyncio.sleep(0.2)
            ref = await collect(eng, "slow reader", "slow-ref", RequestOutputKind.FINAL_ONLY, max_tokens=40)
            assert (text, ids) == ref[:2] and n_lps == 40
            assert n_outputs < 20, n_outputs
        finally:
            eng.shutdown()

    run(main())


def test_engine_death_is_reported(model_dir):
    from tokenmill.engine.async_llm import AsyncLLM

    async def main():
        eng = AsyncLLM.from_engine_args(model=model_dir, max_model_len=256, log_stats=False)
        try:
            sp = SamplingParams(max_tokens=10_000 // 50, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
            agen = eng.generate("doomed", sp, "d1")
            await agen.__anext__()
            os.kill(eng.engine_core_pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                async for _ in agen:
                    pass
            assert eng.errored
            with pytest.raises(EngineDeadError):
                await eng.check_health()
        finally:
            eng.shutdown()

    run(main())


def test_utility_before_any_request(model_dir):
    """A utility call (reset_prefix_cache) on an engine that has served nothing yet returns: its result arrives on
    the output socket, which is read from start-up, not from the first request on."""
    from tokenmill.engine.async_llm import AsyncLLM

    async def main():
        eng = AsyncLLM.from_engine_args(model=model_dir, max_model_len=256, log_stats=False)
        try:
            assert await asyncio.wait_for(eng.reset_prefix_cache(), 60) is True
        finally:
            eng.shutdown()
    run(main())


def test_client_aborts_are_counted_in_metrics(model_dir):
    """A consumer that stops reading and an explicit abort() both count as finished with reason "abort" in
    vllm:request_success_total and the per-request histograms (vLLM counts neither)."""
    from prometheus_client import REGISTRY

    from tokenmill.engine.async_llm import AsyncLLM

    def sample(name: str, model: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, {"model_name": model, "engine": "0", **labels}) or 0.0

    async def main():
        eng = AsyncLLM.from_engine_args(model=model_dir, max_model_len=256)
        model = eng.config.model_config.served_model_name[0]
        names = [("vllm:request_success_total", {"finished_reason": "abort"}),
                 ("vllm:e2e_request_latency_seconds_count", {}), ("vllm:request_params_n_count", {})]
        before = [sample(n, model, **lb) for n, lb in names]
        try:
            sp = SamplingParams(max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
            agen = eng.generate("stop reading me", sp, "a1")
            async for _ in agen:
                break
            await agen.aclose()
            agen2 = eng.generate("abort me", sp, "a2")
            async for _ in agen2:
                await eng.abort("a2")
            await eng.abort("never-added")                  # unknown ids are ignored, not counted
        finally:
            eng.shutdown()
        return [sample(n, model, **lb) - b for (n, lb), b in zip(names, before)]
    assert run(main()) == [2.0, 2.0, 2.0]
