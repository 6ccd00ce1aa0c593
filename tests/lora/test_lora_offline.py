"""Batched multi-LoRA on the CPU against HF transformers + peft: each request's greedy tokens are its own adapter's,
in batches that mix the base model with more distinct adapters than --max-loras (slots and the host LRU swap),
with prefix caching on (the same prompt under different adapters)."""
from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.lora.request import LoRARequest

PROMPTS = ["Hello, my name is", "The quick brown fox jumps over the lazy dog because it", "a b c d e f g",
           # Several full KV blocks: the prefix cache would hand them across adapters if its keys ignored them.
           "In 1492, Columbus sailed across the Atlantic Ocean and reached the islands of the Caribbean, where he "
           "met the people who had lived there for thousands of years before any ship from Europe came"]
N = 8


@pytest.fixture(scope="module")
def llm(lora_base):
    # Two device slots and two host adapters for three adapters: every round trip swaps both.
    return LLM(lora_base, max_model_len=256, num_gpu_blocks_override=128, max_num_seqs=16, enable_lora=True,
               max_loras=2, max_cpu_loras=2, max_lora_rank=16, enable_prefix_caching=True)


def _requests(lora_adapters):
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(lora_adapters.items())}


def test_mixed_batch_matches_peft_per_request(llm, lora_adapters, peft_greedy):
    loras = _requests(lora_adapters)
    choice = [None, *loras]  # base, then each adapter, round robin over prompts x choices
    prompts, reqs = [], []
    for p in PROMPTS:
        for c in choice:
            prompts.append(p)
            reqs.append(loras[c] if c else None)
    manager = llm.llm_engine.engine_core.executor.worker.runner.lora
    steps, activate = [], manager.activate

    def counting(req_ids, n_sched):  # distinct adapters of each step
        steps.append(len({manager.req_lora[r].lora_int_id for r in req_ids if r in manager.req_lora}))
        return activate(req_ids, n_sched)
    manager.activate = counting
    sp = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=reqs)
    got = {}
    for p, r, out in zip(prompts, reqs, outs):
        want = peft_greedy(r.lora_path if r else None, out.prompt_token_ids, N)
        assert out.outputs[0].token_ids == want, (p, r and r.lora_name)
        got.setdefault(p, set()).add(tuple(want))
    assert all(len(v) > 1 for v in got.values())  # the adapters change the output (the test can fail)
    assert max(steps) == 2  # adapters shared steps, never more of them than slots
    # A second pass: prefix-cache hits now, and every adapter reloaded into slots it was evicted from.
    outs2 = llm.generate(prompts, sp, use_tqdm=False, lora_request=reqs)
    assert [o.outputs[0].token_ids for o in outs2] == [o.outputs[0].token_ids for o in outs]
    assert manager.loads > len(loras)  # the host LRU (2 of 3) read evicted adapters again
    manager.activate = activate


def test_one_lora_request_for_every_prompt_and_chat(llm, lora_adapters, peft_greedy):
    r = _requests(lora_adapters)["all"]
    sp = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    outs = llm.generate(PROMPTS[:2], sp, use_tqdm=False, lora_request=r)
    for out in outs:
        assert out.outputs[0].token_ids == peft_greedy(r.lora_path, out.prompt_token_ids, N)
    chat = llm.chat([{"role": "user", "content": "hi"}], sp, use_tqdm=False, lora_request=r)[0]
    assert chat.outputs[0].token_ids == peft_greedy(r.lora_path, chat.prompt_token_ids, N)


def test_bad_lora_requests_are_refused_by_name(llm, lora_adapters, tmp_path):
    sp = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="lora_request has 1 entries for 2 prompts"):
        llm.generate(["a", "b"], sp, use_tqdm=False, lora_request=[None])
    broken = tmp_path / "broken"
    broken.mkdir()
    with pytest.raises(ValueError, match="'broken'.*no adapter_config.json"):
        llm.generate("a", sp, use_tqdm=False, lora_request=LoRARequest("broken", 50, str(broken)))
    with pytest.raises(ValueError, match="lora_int_id 1 already names adapter 'all'"):
        path = next(iter(lora_adapters.values()))
        llm.generate("a", sp, use_tqdm=False, lora_request=LoRARequest("all", 1, path))
        llm.generate("a", sp, use_tqdm=False, lora_request=LoRARequest("other", 1, path + "/"))
    assert llm.generate("a", sp, use_tqdm=False)[0].outputs[0].token_ids  # the engine keeps serving


def test_the_triton_kernels_in_the_engine_match_peft(llm, lora_adapters, peft_greedy):
    """The CUDA path's deltas (Triton, here interpreted) inside the whole engine."""
    manager = llm.llm_engine.engine_core.executor.worker.runner.lora
    loras = _requests(lora_adapters)
    reqs = [loras["all"], None, loras["qv_rslora"]]
    manager.set_kernels(True)
    try:
        sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        outs = llm.generate([PROMPTS[1]] * 3, sp, use_tqdm=False, lora_request=reqs)
        # A step without adapters publishes an empty map: the kernels (still attached) change nothing.
        base = llm.generate([PROMPTS[1]], sp, use_tqdm=False)
    finally:
        manager.set_kernels(False)
    for r, out in zip(reqs, outs):
        assert out.outputs[0].token_ids == peft_greedy(r.lora_path if r else None, out.prompt_token_ids, 4)
    assert base[0].outputs[0].token_ids == peft_greedy(None, base[0].prompt_token_ids, 4)


def test_scheduler_stats_count_adapters_for_the_metric(llm, lora_adapters):
    engine = llm.llm_engine
    r = _requests(lora_adapters)["all"]
    engine.add_request("lora-stats", "hello", SamplingParams(max_tokens=50, ignore_eos=True), lora_request=r)
    sched = engine.engine_core.scheduler
    try:
        assert sched.make_stats().waiting_lora_adapters == {"all": 1}
        engine.step()
        stats = sched.make_stats()
        assert stats.running_lora_adapters == {"all": 1} and stats.waiting_lora_adapters == {}
    finally:
        engine.abort_request("lora-stats")
    assert sched.make_stats().running_lora_adapters == {}


def test_a_new_adapter_is_read_off_the_step_loop(llm, lora_adapters, peft_greedy):
    engine = llm.llm_engine
    manager = engine.engine_core.executor.worker.runner.lora
    r = LoRARequest("mlp-again", 9, lora_adapters["mlp"])
    sp = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    engine.add_request("prefetched", PROMPTS[0], sp, lora_request=r)
    assert 9 in manager._pending  # the read started when the request arrived, before any step
    loads = manager.loads
    out = []
    while engine.has_unfinished_requests():
        out += [o for o in engine.step() if o.finished]
    assert 9 not in manager._pending and manager.loads == loads + 1 and 9 in manager.host
    assert out[0].outputs[0].token_ids == peft_greedy(lora_adapters["mlp"], out[0].prompt_token_ids, N)
