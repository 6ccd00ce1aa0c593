"""vLLM options that turn multimodal inputs off describe what tokenmill does anyway (it serves the text part of
Gemma 3 / Qwen3.5 multimodal checkpoints): accepted, while any real multimodal limit stays refused by name."""
from __future__ import annotations

import pytest

from tokenmill.config.unsupported import check_not_yet_supported


@pytest.mark.parametrize("value", [{}, {"image": 0}, {"image": {"count": 0}, "video": 0}])
def test_zero_multimodal_items_are_accepted(value):
    check_not_yet_supported("limit_mm_per_prompt", value)


@pytest.mark.parametrize("value", [{"image": 1}, {"image": {"count": 2}}, {"image": 0, "video": 3}, "image=0"])
def test_any_multimodal_item_is_refused_by_name(value):
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        check_not_yet_supported("limit_mm_per_prompt", value)


def test_language_model_only():
    check_not_yet_supported("language_model_only", True)
    check_not_yet_supported("language_model_only", False)


def test_the_offline_llm_takes_them(tiny_model_factory):
    from tokenmill import LLM
    llm = LLM(tiny_model_factory("llama"), max_model_len=64, num_gpu_blocks_override=16,
              limit_mm_per_prompt={"image": 0, "video": 0}, language_model_only=True)
    assert llm.llm_engine.model_config.max_model_len == 64
