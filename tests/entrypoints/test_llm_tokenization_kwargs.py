"""LLM.generate / LLM.chat's tokenization_kwargs (vLLM's): passed to the tokenizer call for text prompts;
truncation keeps the prompt's end; unknown or malformed keys are refused by name."""
from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams

ONE = SamplingParams(temperature=0, max_tokens=1)
TEXT = "one two three four five six seven"


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(tiny_model_factory("llama"), max_model_len=64, num_gpu_blocks_override=32)


def test_truncation_keeps_the_prompt_end(llm):
    full = llm.get_tokenizer().encode(TEXT)
    out = llm.generate(TEXT, ONE, use_tqdm=False, tokenization_kwargs={"truncation": True, "max_length": 3})[0]
    assert out.prompt_token_ids == full[-3:]
    # Token-id prompts are not tokenized: the arguments do not touch them.
    out = llm.generate([{"prompt_token_ids": full}], ONE, use_tqdm=False,
                       tokenization_kwargs={"truncation": True, "max_length": 3})[0]
    assert out.prompt_token_ids == full


def test_chat_passes_them_on(llm):
    conv = [{"role": "user", "content": TEXT}]
    full = llm.chat(conv, ONE, use_tqdm=False)[0].prompt_token_ids
    cut = llm.chat(conv, ONE, use_tqdm=False, tokenization_kwargs={"truncation": True, "max_length": 4})[0]
    assert cut.prompt_token_ids == full[-4:]


@pytest.mark.parametrize("kwargs,match", [
    ({"truncation": True, "max_length": 3, "padding_side": "left", "stride": 2},
     r"unknown key\(s\) \['padding_side', 'stride'\]"),
    ({"max_length": 0}, r"tokenization_kwargs\['max_length'\] must be an integer >= 1"),
    ({"truncation": "yes", "max_length": 3}, r"tokenization_kwargs\['truncation'\] must be a bool"),
    ({"truncation": True}, "truncation=True needs max_length"),
    ("truncation", "tokenization_kwargs must be a dict"),
])
def test_bad_kwargs_are_refused_by_name(llm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(TEXT, ONE, use_tqdm=False, tokenization_kwargs=kwargs)
    assert not llm.llm_engine.has_unfinished_requests()
