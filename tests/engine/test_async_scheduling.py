"""Async scheduling (step N+1 scheduled and launched before step N's tokens reach the host) must give exactly what
synchronous stepping gives, whatever stops, preempts, aborts or constrains a request. It runs on the CPU too (with
no overlap there), so these tests guard its bookkeeping in CI."""
from __future__ import annotations

import re

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams

PROMPTS = [
    "Hello, my name is",
    "The quick brown fox jumps over the lazy dog because it wanted to see what was on the other side of",
    "深度学习的优势是什么？",
    "x " * 30,
]


def make(d, async_scheduling, **kw):
    kw.setdefault("max_model_len", 256)
    kw.setdefault("num_gpu_blocks_override", 256)
    return LLM(d, async_scheduling=async_scheduling, **kw)


def outputs(llm, params):
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in o.outputs] for o in outs]


def assert_clean(llm):
    core = llm.llm_engine.engine_core
    assert not core.has_unfinished_requests()
    kv = core.scheduler.kv
    assert kv.num_free_blocks() == kv.num_blocks
    assert all(r.num_output_placeholders == 0 for r in core.scheduler.requests.values())


@pytest.fixture(scope="module")
def llama_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def engines(llama_dir):
    return make(llama_dir, False), make(llama_dir, True)


def test_default_is_off_on_cpu(engines):
    sync, asyn = engines
    assert sync.llm_engine.engine_core.async_scheduling is False
    assert asyn.llm_engine.engine_core.async_scheduling is True
    assert sync.llm_engine.config.scheduler_config.async_scheduling is False


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=1),                                   # stops in its prefill step
    SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[5, 17, 42, 99]),  # stops at unknown steps
    SamplingParams(temperature=0.9, top_p=0.8, seed=7, max_tokens=16, n=2),
    SamplingParams(temperature=1.0, max_tokens=12, frequency_penalty=1.5, repetition_penalty=1.3, seed=3),
    SamplingParams(temperature=0, max_tokens=10, logprobs=3, prompt_logprobs=2),
    SamplingParams(temperature=0, max_tokens=12, min_tokens=6, bad_words=["the"]),
], ids=["greedy", "max1", "stop_ids", "seeded_n2", "penalties", "logprobs", "min_tokens_bad_words"])
def test_async_equals_sync(engines, params):
    sync, asyn = engines
    ref = outputs(sync, params)
    assert outputs(asyn, params) == ref
    assert_clean(asyn)
    if params.logprobs:
        a = asyn.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].logprobs
        s = sync.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].logprobs
        assert [sorted(d) for d in a] == [sorted(d) for d in s]


@pytest.mark.parametrize("kw", [
    dict(num_gpu_blocks_override=20, block_size=8, max_model_len=96),   # forces preemption with tokens in flight
    dict(max_num_batched_tokens=16, enable_prefix_caching=True, block_size=4),
    dict(max_num_seqs=2),
], ids=["preemption", "tiny_budget_prefix_cache", "max_num_seqs_2"])
def test_async_variants_equal_sync(llama_dir, engines, kw):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = outputs(engines[0], params)
    llm = make(llama_dir, True, **kw)
    assert outputs(llm, params) == ref
    assert outputs(llm, params) == ref  # second pass: prefix hits
    assert_clean(llm)
    if "num_gpu_blocks_override" in kw:
        assert llm.llm_engine.last_stats.num_preemptions > 0


def test_max_model_len_stop_with_tokens_in_flight(llama_dir):
    params = SamplingParams(temperature=0, ignore_eos=True)  # runs to max_model_len
    ref = outputs(make(llama_dir, False, max_model_len=48), params)
    llm = make(llama_dir, True, max_model_len=48)
    got = outputs(llm, params)
    assert got == ref
    assert all(len(c[0][0]) + len(llm.get_tokenizer()(p).input_ids) <= 48 for c, p in zip(got, PROMPTS))
    assert_clean(llm)


def test_abort_with_a_step_in_flight(engines):
    _, asyn = engines
    eng = asyn.llm_engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"a{i}", p, params)
    for _ in range(4):
        eng.step()
    assert eng.engine_core._in_flight is not None
    eng.abort_request(["a0", "a2"])
    finished = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = len(out.outputs[0].token_ids)
    assert finished == {"a1": 50, "a3": 50}
    assert_clean(asyn)


def test_structured_outputs_under_async(engines):
    # The bitmask of step N+1 is made after step N's token advanced the matcher; outputs must match sync exactly.
    choice = SamplingParams(temperature=0.8, seed=1, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe later"]))
    regex = SamplingParams(temperature=0.8, seed=2, max_tokens=20,
                           structured_outputs=StructuredOutputsParams(regex=r"[0-9]{2,4}-(ab|cd)"))
    free = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    sync, asyn = engines
    prompts = PROMPTS * 3
    params = [choice, regex, free] * len(PROMPTS)
    ref = [o.outputs[0].text for o in sync.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].text for o in asyn.generate(prompts, params, use_tqdm=False)]
    assert got == ref
    assert all(t in ("yes", "no", "maybe later") for t in got[::3])
    assert all(re.fullmatch(r"[0-9]{2,4}-(ab|cd)", t) for t in got[1::3])
    assert_clean(asyn)


def test_reused_request_id_never_gets_the_aborted_requests_token(engines, llama_dir):
    # Abort "x" while its step is in flight and re-add "x" at once with another prompt: the in-flight token of the
    # old "x" must not be appended to the new one (it would be scheduled before that output is applied).
    _, asyn = engines
    eng = asyn.llm_engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in make(llama_dir, False).generate([PROMPTS[1]], params, use_tqdm=False)]
    eng.add_request("x", PROMPTS[0], params)
    for _ in range(3):
        eng.step()
    assert eng.engine_core._in_flight is not None
    eng.abort_request("x")
    eng.add_request("x", PROMPTS[1], params)
    got = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                got = out.outputs[0].token_ids
    assert [got] == want
    assert_clean(asyn)
