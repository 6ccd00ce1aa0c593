"""A draft model under tensor parallelism on CPU (gloo, 2 ranks): the draft shards like the target (its single KV
head replicated on both ranks), every rank drafts the same tokens, and TP=2 gives TP=1's outputs."""
from __future__ import annotations

import pytest

from tests.distributed.engine_outputs import ENGINE, assert_matches_reference, generate, shutdown
from tokenmill import LLM

pytestmark = pytest.mark.timeout(180)

PROMPTS = ["Hello, my name is", "The quick brown fox jumps over the lazy dog because it", "深度学习的优势是什么？"]


def test_tp2_with_a_draft_model_matches_tp1(tiny_model_factory, tiny_qwen3_1kv):
    target = tiny_model_factory("llama")
    spec = {"model": tiny_qwen3_1kv, "num_speculative_tokens": 3, "step_aside": False}
    ref = generate(LLM(target, **ENGINE), PROMPTS, 12)
    llm = LLM(target, tensor_parallel_size=2, speculative_config=spec, **ENGINE)
    try:
        runner = llm.llm_engine.engine_core.executor.driver.runner
        assert runner.proposer.num_kv_heads == 1 and runner.proposer.model is not None
        assert_matches_reference(generate(llm, PROMPTS, 12), ref)
        m = {x.name: x for x in llm.get_metrics()}
        assert m["vllm:spec_decode_num_draft_tokens"].value > 0
    finally:
        shutdown(llm)
