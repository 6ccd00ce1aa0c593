"""Until the engine proposes and verifies drafts, a parsed speculative config stops engine start-up by name (it is
never accepted and then ignored)."""
from __future__ import annotations

import pytest

from tokenmill import LLM


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_a_parsed_speculative_config_is_refused_at_engine_start(tiny_model_factory, method):
    with pytest.raises(ValueError, match=r"speculative_config=.*not supported yet.*speculative decoding step"):
        LLM(tiny_model_factory("llama"), max_model_len=64,
            speculative_config={"method": method, "num_speculative_tokens": 3})
