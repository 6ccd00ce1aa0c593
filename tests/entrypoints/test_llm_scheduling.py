"""Scheduling variants must not change greedy outputs; every block comes back; bad inputs fail clearly."""
from __future__ import annotations

import json
import shutil

import pytest

from tokenmill import LLM, SamplingParams

PROMPTS = [
    "Hello, my name is",
    "The quick brown fox jumps over the lazy dog because it wanted to see what was on the other side of",
    "Hello, my name is John and I",
    "深度学习的优势是什么？请详细说明。",
    "The quick brown fox jumps over the lazy dog because it",
    "x " * 40,
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def make(d, **kw):
    kw.setdefault("max_model_len", 256)
    kw.setdefault("num_gpu_blocks_override", 256)
    return LLM(d, **kw)


def assert_all_blocks_free(llm):
    sched = llm.llm_engine.engine_core.scheduler
    assert not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks() == sched.kv.num_blocks
    assert all(b.ref_cnt == 0 for b in sched.kv.pool.blocks)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llama_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def reference(llama_dir):
    llm = make(llama_dir, enable_prefix_caching=False)
    return tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("kw", [
    dict(enable_prefix_caching=True),
    dict(max_num_batched_tokens=16),
    dict(max_num_batched_tokens=16, enable_prefix_caching=True, block_size=4),
    dict(num_gpu_blocks_override=20, block_size=8, max_model_len=96),  # forces preemption
    dict(max_num_seqs=1),
    dict(long_prefill_token_threshold=8),
    dict(enable_chunked_prefill=False),
    dict(prefix_caching_hash_algo="xxhash"),
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_variants_give_identical_greedy_outputs(llama_dir, reference, kw):
    llm = make(llama_dir, **kw)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    # A second pass reuses cached prefixes (when enabled) and must still agree.
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    assert_all_blocks_free(llm)
    if kw.get("num_gpu_blocks_override") == 20:
        assert llm.llm_engine.last_stats.num_preemptions > 0


def test_prefix_hits_are_counted(llama_dir):
    llm = make(llama_dir, block_size=4)
    llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)
    out = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0]
    stats = llm.llm_engine.last_stats
    assert stats.prefix_cache_hits > 0
    assert out.num_cached_tokens > 0


def test_n_samples_and_seed_reproducible_whatever_the_batch(llama_dir):
    llm = make(llama_dir)
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=42, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)] * 3
    mixed = llm.generate([PROMPTS[2], PROMPTS[0], PROMPTS[1], PROMPTS[3]],
                         [others[0], sp, others[1], others[2]], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    multi = llm.generate(PROMPTS[0], SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=7, ignore_eos=True),
                         use_tqdm=False)[0]
    assert [c.index for c in multi.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in multi.outputs}) > 1
    assert_all_blocks_free(llm)


def test_stop_strings_and_stop_tokens(llama_dir):
    llm = make(llama_dir)
    full = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop = full.text[5:9]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, stop=[stop]), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == full.text[:full.text.index(stop)]
    tid = full.token_ids[3]
    c = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[tid]),
                     use_tqdm=False)[0].outputs[0]
    assert c.token_ids == full.token_ids[:full.token_ids.index(tid) + 1] and c.stop_reason == tid
    assert_all_blocks_free(llm)


def test_abort_frees_blocks(llama_dir):
    llm = make(llama_dir)
    eng = llm.llm_engine
    eng.add_request("a", PROMPTS[1], SamplingParams(max_tokens=100, ignore_eos=True))
    eng.add_request("b", PROMPTS[0], SamplingParams(max_tokens=100, ignore_eos=True))
    eng.step()
    eng.step()
    eng.abort_request(["a", "b"])
    assert not eng.has_unfinished_requests()
    eng.step()  # let the runner forget them
    assert_all_blocks_free(llm)


def test_bad_requests_raise_clear_errors(llama_dir):
    llm = make(llama_dir, max_model_len=64)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match=r"70 tokens.*64"):
        llm.generate({"prompt_token_ids": [5] * 70}, use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate("hi", SamplingParams(logprobs=1000), use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate({"prompt_token_ids": [10**9]}, use_tqdm=False)
    # The engine is still usable after the errors.
    assert llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
    assert_all_blocks_free(llm)


def test_bad_engine_arguments(llama_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(llama_dir, max_num_seq=4)
    with pytest.raises(ValueError, match="dtype"):
        LLM(llama_dir, dtype="float8")
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        LLM(llama_dir, pipeline_parallel_size=64)  # more stages than layers
    bad = tmp_path / "foo"
    shutil.copytree(llama_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FooForCausalLM.*LlamaForCausalLM"):
        LLM(str(bad))


def test_token_ids_only_without_tokenizer(llama_dir):
    llm = make(llama_dir, skip_tokenizer_init=True)
    out = llm.generate({"prompt_token_ids": [1, 2, 3, 4]}, SamplingParams(temperature=0, max_tokens=5, detokenize=False),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].text == ""
    with pytest.raises(ValueError, match="token ids"):
        llm.generate("text", use_tqdm=False)
    # vLLM's LLM.get_tokenizer() raises here too, rather than returning None for a later AttributeError.
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm.get_tokenizer()
    with pytest.raises(ValueError, match="Chat needs a tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
