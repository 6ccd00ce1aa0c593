"""Sleep mode with LoRA: the slot buffers are released with the weights (both levels) and come back empty; requests
under an adapter after waking give the adapter's own tokens again (its weights are written into slots anew)."""
from __future__ import annotations

import os

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.lora.request import LoRARequest

PROMPTS = ["Hello, my name is", "a b c d e f g"]
N = 8


@pytest.fixture(scope="module")
def llm(lora_base):
    return LLM(lora_base, max_model_len=128, num_gpu_blocks_override=64, max_num_seqs=4, enable_lora=True,
               max_loras=2, max_lora_rank=16, enable_sleep_mode=True)


def _tokens(llm, lora):
    sp = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False, lora_request=lora)]


def test_slots_are_released_asleep_and_adapters_written_again_after_waking(llm, lora_base, lora_adapters,
                                                                           peft_greedy):
    from safetensors.torch import load_file
    lora = LoRARequest("all", 1, lora_adapters["all"])
    manager = llm.llm_engine.engine_core.executor.worker.runner.lora
    before = _tokens(llm, lora)
    ids = [o.prompt_token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=1), use_tqdm=False)]
    assert before == [peft_greedy(lora_adapters["all"], i, N) for i in ids]
    assert 1 in manager.slots
    for level in (1, 2):
        llm.sleep(level=level)
        assert all(ls.a.numel() == 0 and ls.b.numel() == 0 for ls in manager.layers.values())
        assert manager.slots == [None, None]
        llm.wake_up(tags=["weights"])
        if level == 2:
            state = load_file(os.path.join(lora_base, "model.safetensors"))
            llm.apply_model(lambda m: m.load_weights(iter(state.items())))
        llm.wake_up(tags=["kv_cache"])
        assert all(ls.a.abs().sum() == 0 for ls in manager.layers.values())     # empty until a step writes them
        assert _tokens(llm, lora) == before, level
        assert _tokens(llm, None) != before                                      # the base model differs
