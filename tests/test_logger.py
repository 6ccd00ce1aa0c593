"""The log level comes from TOKENMILL_LOGGING_LEVEL, else vLLM's VLLM_LOGGING_LEVEL, and a bad value is named."""
from __future__ import annotations

import pytest

from tokenmill import envs
from tokenmill.logger import log_level


@pytest.mark.parametrize("ours, vllms, want", [(None, None, "INFO"), (None, "debug", "DEBUG"),
                                               ("warning", "DEBUG", "WARNING"), ("ERROR", None, "ERROR")])
def test_vllm_logging_level_is_read_second(ours, vllms, want):
    with envs.override(TOKENMILL_LOGGING_LEVEL=ours, VLLM_LOGGING_LEVEL=vllms):
        assert log_level() == want


@pytest.mark.parametrize("name", ["TOKENMILL_LOGGING_LEVEL", "VLLM_LOGGING_LEVEL"])
def test_an_unknown_level_names_the_variable(name):
    with envs.override(**{name: "loud"}), pytest.raises(ValueError, match=f"^{name}='loud': choose one of"):
        log_level()
