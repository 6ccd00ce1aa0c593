"""Prompt and request validation in the Processor (no model)."""
from types import SimpleNamespace

import pytest

from tokenmill.engine.processor import Processor
from tokenmill.sampling_params import SamplingParams


@pytest.fixture()
def processor():
    cfg = SimpleNamespace(model_config=SimpleNamespace(max_model_len=64, max_logprobs=5, vocab_size=100),
                          cache_config=SimpleNamespace(block_size=4),
                          scheduler_config=SimpleNamespace(scheduling_policy="fcfs"))
    return Processor(cfg, tokenizer=None, eos_token_ids=[2])


def test_cache_salt_reaches_every_request(processor):
    _, reqs = processor.process("r", {"prompt_token_ids": [5, 6, 7], "cache_salt": "tenant"},
                                SamplingParams(n=2, max_tokens=3))
    assert [r.cache_salt for r in reqs] == ["tenant", "tenant"]
    _, reqs = processor.process("r", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3))
    assert reqs[0].cache_salt is None


@pytest.mark.parametrize("salt", ["", 3, ["a"]])
def test_bad_cache_salt_is_rejected(processor, salt):
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        processor.process("r", {"prompt_token_ids": [5], "cache_salt": salt}, SamplingParams())


def test_unknown_prompt_keys_are_rejected_not_ignored(processor):
    with pytest.raises(ValueError, match=r"\['multi_modal_data'\].*text-only"):
        processor.process("r", {"prompt_token_ids": [5], "multi_modal_data": {"image": None}}, SamplingParams())
    with pytest.raises(ValueError, match=r"\['promt'\]"):
        processor.process("r", {"promt": "typo", "prompt_token_ids": [5]}, SamplingParams())
