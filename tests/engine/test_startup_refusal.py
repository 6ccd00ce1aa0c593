"""An engine core that refuses the user's model or options at start-up (here: a KV cache too small for
max_model_len) surfaces as one ValueError whose message says what to change, with no traceback on stderr; the
API server prints it as one "Cannot start the engine" line."""
from __future__ import annotations

import pytest


def test_kv_cache_too_small_is_one_message_without_traceback(tiny_model_factory, capfd):
    from tokenmill.engine.async_llm import AsyncLLM
    from tokenmill.engine.launcher import EngineRefusedError
    capfd.readouterr()
    with pytest.raises(EngineRefusedError) as e:
        AsyncLLM.from_engine_args(model=tiny_model_factory("llama"), max_model_len=512, block_size=16,
                                  kv_cache_memory_bytes=16 * 1024, log_stats=False)
    assert isinstance(e.value, ValueError)  # what the entry points catch to print the message alone
    assert str(e.value).startswith("engine core 0 failed to start: The KV cache holds")
    assert "Lower max_model_len" in str(e.value)
    assert "Traceback" not in capfd.readouterr().err
