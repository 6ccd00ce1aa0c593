"""Adapters under tensor parallelism (CPU, gloo, 2 ranks): column-parallel layers hold B's rows of their output
slice, row-parallel ones A's columns of their input slice, and each request's greedy tokens are still peft's."""
from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.lora.request import LoRARequest

pytestmark = pytest.mark.timeout(180)
N = 6


def test_tp2_mixed_batch_matches_peft(lora_base, lora_adapters, peft_greedy):
    llm = LLM(lora_base, tensor_parallel_size=2, max_model_len=256, num_gpu_blocks_override=64, max_num_seqs=8,
              enable_lora=True, max_loras=2)
    try:
        loras = [None, LoRARequest("all", 1, lora_adapters["all"]), LoRARequest("mlp", 2, lora_adapters["mlp"]),
                 LoRARequest("qv", 3, lora_adapters["qv_rslora"])]
        prompt = "The quick brown fox jumps over the lazy dog because it"
        outs = llm.generate([prompt] * len(loras), SamplingParams(temperature=0, max_tokens=N, ignore_eos=True),
                            use_tqdm=False, lora_request=loras)
        for r, out in zip(loras, outs):
            assert out.outputs[0].token_ids == peft_greedy(r.lora_path if r else None, out.prompt_token_ids, N), r
    finally:
        llm.llm_engine.engine_core.executor.shutdown()
