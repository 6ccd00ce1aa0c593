"""The vLLM import paths and object forms a user's script reaches for: `from vllm import EngineArgs, LLMEngine,
TokensPrompt, TextPrompt`, `vllm.engine.arg_utils`, `LLMEngine.from_engine_args(EngineArgs(...))`."""
from __future__ import annotations

import pytest

import tokenmill
from tokenmill import EngineArgs, LLMEngine, SamplingParams, TextPrompt, TokensPrompt


def test_top_level_names():
    from tokenmill.engine.arg_utils import AsyncEngineArgs
    from tokenmill.engine.async_llm import AsyncLLM
    assert tokenmill.AsyncLLMEngine is AsyncLLM and tokenmill.AsyncEngineArgs is AsyncEngineArgs
    for name in tokenmill.__all__:
        assert getattr(tokenmill, name) is not None


def _run(engine, prompts, sp):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sp)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[str(i)] for i in range(len(prompts))]


def test_engine_from_engine_args_with_typed_prompts(tiny_model_factory):
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_model_factory("llama"), max_model_len=128,
                                                   num_gpu_blocks_override=64))
    tok = engine.get_tokenizer()
    ids = tok.encode("The quick brown fox", add_special_tokens=False)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    typed = _run(engine, [TextPrompt(prompt="The quick brown fox"), TokensPrompt(prompt_token_ids=ids)], sp)
    plain = _run(engine, ["The quick brown fox", ids], sp)
    assert typed == plain and len(typed[0]) == 6
    with pytest.raises(ValueError, match="multi_modal_data"):
        engine.add_request("x", {"prompt": "a", "multi_modal_data": {}}, sp)
