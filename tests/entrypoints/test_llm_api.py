"""The offline LLM's Python surface as vLLM scripts use it: argument checks that name the argument, and the engine
and config attributes scripts read (llm.llm_engine.model_config, collective_rpc, apply_model)."""
from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(tiny_model_factory("llama"), max_model_len=128, num_gpu_blocks_override=64)


GREEDY = SamplingParams(temperature=0, max_tokens=2)


@pytest.mark.parametrize("sp,match", [
    ({"max_tokens": 3}, "sampling_params must be a SamplingParams or a list"),
    ([GREEDY, None], r"sampling_params must hold SamplingParams; got \[1\]: NoneType"),
])
def test_wrong_sampling_params_type_names_the_argument(llm, sp, match):
    with pytest.raises(TypeError, match=match):
        llm.generate(["a", "b"], sp, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("messages,match", [
    ("hello", "messages must be a conversation"),
    (["hello"], r"messages\[0\] must be a non-empty list of message dicts"),
    ([[{"role": "user", "content": "hi"}], []], r"messages\[1\] must be a non-empty list"),
])
def test_chat_messages_of_the_wrong_shape(llm, messages, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, GREEDY, use_tqdm=False)


def test_truncate_prompt_tokens_above_max_model_len_is_refused(llm):
    """vLLM refuses a truncation size above max_model_len whatever the prompt's length (-1 means max_model_len)."""
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens \(1000\) is larger than the maximum model length "
                                         r"\(128\)"):
        llm.generate("a b", SamplingParams(truncate_prompt_tokens=1000), use_tqdm=False)
    out = llm.generate("one two three", SamplingParams(truncate_prompt_tokens=-1, max_tokens=1), use_tqdm=False)[0]
    assert len(out.prompt_token_ids) == 3


def test_engine_and_config_attributes_scripts_read(llm):
    engine = llm.llm_engine
    assert llm.model_config is engine.model_config is engine.vllm_config.model_config
    assert engine.model_config.max_model_len == 128
    assert engine.model_config.get_vocab_size() == len(llm.get_tokenizer())
    assert engine.model_config.get_hidden_size() == engine.model_config.hf_text_config.hidden_size == 64
    assert engine.cache_config is engine.vllm_config.cache_config
    assert engine.scheduler_config.max_num_seqs >= 1 and engine.parallel_config.tensor_parallel_size == 1


def test_collective_rpc_and_apply_model(llm):
    import torch
    assert llm.collective_rpc(lambda worker, x: (worker.rank, x), args=(5,)) == [(0, 5)]
    assert llm.collective_rpc("determine_num_blocks") == [llm.llm_engine.engine_core.executor.worker
                                                          .determine_num_blocks()]
    [n] = llm.apply_model(lambda model: sum(p.numel() for p in model.parameters()))
    assert isinstance(n, int) and n > 0
    [cls] = llm.apply_model(lambda model: isinstance(model, torch.nn.Module))
    assert cls is True


def test_use_tqdm_may_be_the_progress_bar_factory(llm):
    """vLLM: use_tqdm takes a callable that makes the bar (a tqdm subclass, functools.partial(tqdm, ...))."""
    made = []

    def factory(*args, **kwargs):
        import io

        from tqdm import tqdm
        bar = tqdm(*args, file=io.StringIO(), **kwargs)
        made.append(bar)
        return bar
    outs = llm.generate(["a", "b"], GREEDY, use_tqdm=factory)
    assert len(outs) == 2 and len(made) == 1 and made[0].n == 2
    assert len(llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=factory)) == 1 and len(made) == 2


def test_world_size_and_mm_cache_reset(llm):
    """vLLM's LLM.get_world_size(include_dp) and reset_mm_cache() (a no-op: tokenmill keeps no multimodal cache)."""
    assert llm.get_world_size() == llm.get_world_size(include_dp=False) == 1
    assert llm.reset_mm_cache() is None


def test_chat_takes_vllms_positional_order_and_refuses_mm_processor_kwargs(llm):
    """vLLM's chat(messages, sampling_params, use_tqdm, lora_request, chat_template, ...) is not keyword-only;
    mm_processor_kwargs is accepted when empty and refused by name otherwise (no multimodal processor here)."""
    conv = [{"role": "user", "content": "hi"}]
    out = llm.chat(conv, GREEDY, False, None, "{% for m in messages %}[{{ m.content }}]{% endfor %}")[0]
    assert out.prompt == "[hi]"
    assert llm.chat(conv, GREEDY, use_tqdm=False, mm_processor_kwargs={})[0].finished
    with pytest.raises(ValueError, match="mm_processor_kwargs"):
        llm.chat(conv, GREEDY, use_tqdm=False, mm_processor_kwargs={"num_crops": 4})


@pytest.mark.parametrize("priority,match", [
    (1, "priority must be a list with one integer per prompt, got int"),
    ([0], "priority has 1 entries for 2 prompts"),
    ([0, "x"], r"priority must hold integers \(lower runs first\); got \[1\]: 'x'"),
    ([0.5, None], r"got \[0\]: 0.5, \[1\]: None"),
])
def test_priority_of_the_wrong_shape_is_named(llm, priority, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=priority)
    assert not llm.llm_engine.has_unfinished_requests()


def test_token_id_prompts_of_numpy_integers(llm):
    """One prompt given as numpy integers (a list of them, or an array in a TokensPrompt) is one prompt."""
    import numpy as np
    want = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    for prompt in ([np.int64(5), np.int64(6), np.int64(7)], {"prompt_token_ids": np.array([5, 6, 7])}):
        [out] = llm.generate(prompt, GREEDY, use_tqdm=False)
        assert out.prompt_token_ids == [5, 6, 7] and out.outputs[0].token_ids == want


def test_an_empty_batch_has_no_outputs(llm):
    """vLLM returns [] for an empty list of prompts or conversations (a batch that was filtered down to nothing)
    instead of raising."""
    from tokenmill.sampling_params import BeamSearchParams
    assert llm.generate([], GREEDY, use_tqdm=True) == []
    assert llm.generate([], [], use_tqdm=False) == []
    assert llm.chat([], GREEDY, use_tqdm=False) == []
    assert llm.beam_search([], BeamSearchParams(beam_width=2, max_tokens=2)) == []
    with pytest.raises(ValueError, match=r"Got 1 SamplingParams for 0 prompts"):
        llm.generate([], [GREEDY], use_tqdm=False)
