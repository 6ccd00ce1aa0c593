"""A parsed speculative config whose drafter is not built stops engine start-up by name (it is never accepted and
then ignored)."""
from __future__ import annotations

import pytest

from tokenmill import LLM


def test_an_unbuilt_drafter_is_refused_at_engine_start(tiny_model_factory):
    with pytest.raises(ValueError, match=r"speculative_config=.*suffix.*not supported yet"):
        LLM(tiny_model_factory("llama"), max_model_len=64,
            speculative_config={"method": "suffix", "num_speculative_tokens": 3})
