"""ModelConfig.seed as vLLM scripts pass it: None (e.g. an unset --seed argument) is vLLM V1's default 0; a
non-integer is a ValueError naming seed (it failed inside torch.manual_seed with a bare TypeError)."""
from __future__ import annotations

import pytest

from tokenmill.config.model import ModelConfig


def test_seed_none_is_zero_and_a_non_integer_is_named(tiny_model_factory):
    model = tiny_model_factory("llama")
    assert ModelConfig(model=model, seed=None).seed == 0
    assert ModelConfig(model=model, seed=7).seed == 7
    for bad in ("1", 1.5, True):
        with pytest.raises(ValueError, match="`seed`"):
            ModelConfig(model=model, seed=bad)
