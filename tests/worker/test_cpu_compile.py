"""-O3 on the CPU: decode steps run through torch.compile (worker/cpu_compile.py), exact against HF transformers."""
from __future__ import annotations

import pytest
import torch

from tests.models.oracle import assert_greedy_matches_hf
from tokenmill import LLM, SamplingParams
from tokenmill.config.compilation import CompilationConfig

_PROMPTS = [[5, 17, 42, 99, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [11, 12]]


def _runner(llm):
    return llm.llm_engine.engine_core.executor.worker.runner


@pytest.mark.parametrize("arch", ["qwen3", "llama"])  # q/k norms and tied embeddings; llama3 RoPE scaling
def test_compiled_decode_matches_hf(tiny_model_factory, arch):
    from transformers import AutoModelForCausalLM
    d = tiny_model_factory(arch)
    llm = LLM(model=d, max_model_len=128, max_num_seqs=2, compilation_config=3, enable_prefix_caching=False)
    compiled = _runner(llm).compiled
    assert compiled is not None
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    # three prompts through two rows: batches of two, then one, each decoding through its own graph
    outs = llm.generate([{"prompt_token_ids": p} for p in _PROMPTS], sp, use_tqdm=False)
    steps = compiled.steps
    assert steps >= 11 + 2  # the warm-up's two steps, then at least one batch's decodes
    hf = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
    assert_greedy_matches_hf(hf, outs)
    eager = _runner(llm).compiled = None
    del eager
    again = llm.generate([{"prompt_token_ids": p} for p in _PROMPTS], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]


def test_ngram_speculation_verifies_through_the_graphs(tiny_model_factory):
    from transformers import AutoModelForCausalLM
    d = tiny_model_factory("qwen3")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "step_aside": False}
    llm = LLM(model=d, max_model_len=128, max_num_seqs=2, compilation_config=3, speculative_config=spec)
    compiled = _runner(llm).compiled
    assert compiled is not None
    # the model's own greedy reply quoted back after its prompt: the lookup finds the prompt's last token earlier in
    # the context and proposes what followed it, so verify steps run four tokens a row
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    p = [5, 17, 42]
    reply = llm.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False)[0].outputs[0].token_ids
    before = compiled.steps
    out = llm.generate([{"prompt_token_ids": p + list(reply) + p}], greedy, use_tqdm=False)
    assert compiled.steps > before
    assert {m.name: m for m in llm.get_metrics()}["vllm:spec_decode_num_drafts"].value > 0
    hf = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
    assert_greedy_matches_hf(hf, out)


def test_enforce_eager_and_lora_keep_the_eager_step(tiny_model_factory, tm_log):
    d = tiny_model_factory("qwen2")
    llm = LLM(model=d, max_model_len=64, max_num_seqs=2, compilation_config=3, enforce_eager=True)
    assert _runner(llm).compiled is None
    assert "steps run eagerly, as enforce_eager asks" in tm_log.text
    # no compilation asked: nothing compiles and nothing is said
    llm = LLM(model=d, max_model_len=64, max_num_seqs=2)
    assert _runner(llm).compiled is None


@pytest.mark.parametrize("kwargs, on", [
    ({}, False), ({"optimization_level": 3}, True), ({"optimization_level": 2}, False),
    ({"compilation_config": 3}, True), ({"compilation_config": {"mode": "VLLM_COMPILE"}}, True),
    ({"compilation_config": {"level": 0}, "optimization_level": 3}, False),
    ({"compilation_config": {"mode": "NONE"}}, False), ({"compilation_config": {"cudagraph_mode": "NONE"}}, False),
])
def test_which_settings_compile(kwargs, on):
    assert CompilationConfig(**kwargs).torch_compile is on
